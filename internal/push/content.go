package push

import (
	"cmp"
	"encoding/json"
	"reflect"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/types"

	"github.com/apportion/apportion/internal/assignment"
)

// This file holds content building: a pod's Assignment assembled from the grants, downstreams
// and switches of every quota it belongs to, numbered with a new generation when it changed.

// rebuild assembles a pod's assignment from every quota it belongs to and bumps its generation
// when anything changed. It compares with the last content once (and once more only after
// dropping invalid switches, which may leave what is already sent) and validates only content
// that changed, once.
func (c *core) rebuild(p *podState) {
	if p.removed {
		return
	}
	if len(p.entries) == 0 {
		if !p.finalPush || p.endpoint == "" || (!p.configured && len(p.versions) == 0) || c.ledger.fenced {
			c.removePod(p)
			return
		}
	}
	if !c.ledger.started {
		return
	}
	a := &assignment.Assignment{
		Epoch:       c.ledger.epoch,
		LeaseTTL:    assignment.Duration(c.opts.LeaseTTL),
		Downstreams: []assignment.Downstream{},
	}
	keys := make([]types.NamespacedName, 0, len(p.entries))
	for k := range p.entries {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b types.NamespacedName) int { return cmp.Compare(a.Name, b.Name) })
	for _, k := range keys {
		e := p.entries[k]
		d := cloneJSON(e.quota.desired.Downstream)
		d.Permits = e.grant
		d.SafeDefaultPermits = min(e.safeDefault, e.grant)
		d.Rate = nil
		if e.desired.RatePerSecond > 0 {
			mode := assignment.ModeTokenBucket
			if r := e.quota.desired.Downstream.Rate; r != nil && r.Mode != "" {
				mode = r.Mode
			}
			// Burst 0 is the pod's share when the pods outnumber the burst: the agent paces it.
			d.Rate = &assignment.Rate{PerSecond: e.desired.RatePerSecond, Burst: max(e.desired.RateBurst, 0), Mode: mode}
		}
		// Observe only to an agent that knows it; an agent not heard from yet enforces. Enforcing
		// is the safe side: it admits within the permits the ledger counts.
		d.Observe = d.Observe && p.observe
		// RampRaise only to an agent that knows it; without it a raise applies at once, as it
		// always did: the flag only ever narrows, so leaving it out is never unsafe.
		d.RampRaise = d.RampRaise && p.rampRaise
		e.maxRequestTimeout = max(e.maxRequestTimeout, d.RequestTimeout.D())
		a.Downstreams = append(a.Downstreams, d)
		if !e.present {
			continue
		}
		for _, ts := range e.quota.desired.Switches {
			if ts.Target != "" && ts.Target != e.target {
				continue
			}
			sw := ts.Switch
			if sw.DryRun && !p.observe {
				continue // an older agent would refuse it, or (without the member) enforce it
			}
			sw.Downstream = d.Name
			if !slices.ContainsFunc(a.Switches, func(s assignment.Switch) bool { return s.Name == sw.Name }) {
				a.Switches = append(a.Switches, sw)
			}
		}
	}
	slices.SortFunc(a.Switches, func(x, y assignment.Switch) int { return cmp.Compare(x.Name, y.Name) })
	if p.isContent(a) {
		return // the common case (a renewal, an answer): nothing to validate
	}
	a.Generation = p.gen + 1 // Validate wants one
	if err := a.Validate(); err != nil {
		if !onlySwitchErrors(err) {
			// The controller handed over something the agents would refuse; keep the last content.
			// The ledger still counts the new grants, which only errs on the safe side.
			c.log.Error(err, "not pushing an invalid assignment", "pod", p.namespace+"/"+p.name)
			return
		}
		// A switch the agents would refuse must not hold up the permits: push without switches.
		// What Validate checks of the rest does not depend on the switches, so the rest is valid.
		c.log.Error(err, "dropping degrade switches from an invalid assignment", "pod", p.namespace+"/"+p.name)
		a.Switches = nil
		if p.isContent(a) {
			return // the content already went without them
		}
	}
	p.gen++
	a.Generation = p.gen
	p.content = a
}

// isContent says whether a is the pod's content; it numbers a like the content to compare.
func (p *podState) isContent(a *assignment.Assignment) bool {
	if p.content == nil {
		return false
	}
	a.Generation = p.content.Generation
	return reflect.DeepEqual(p.content, a)
}

func (c *core) removePod(p *podState) {
	p.removed = true
	if c.pods[p.uid] == p {
		delete(c.pods, p.uid)
	}
}

// cloneJSON deep-copies a wire value so that the controller may reuse what it handed over.
func cloneJSON[T any](v T) T {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	var out T
	if err := json.Unmarshal(b, &out); err != nil {
		panic(err)
	}
	return out
}

// onlySwitchErrors says whether every problem Validate found is in a switch.
func onlySwitchErrors(err error) bool {
	fes := assignment.FieldErrors(err)
	if len(fes) == 0 {
		return false
	}
	for _, fe := range fes {
		if !strings.HasPrefix(fe.Path, "switches[") {
			return false
		}
	}
	return true
}
