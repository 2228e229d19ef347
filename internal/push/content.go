package push

import (
	"cmp"
	"encoding/json"
	"reflect"
	"slices"

	"k8s.io/apimachinery/pkg/types"

	"github.com/apportion/apportion/internal/assignment"
)

// This file holds content building: a pod's Assignment assembled from the grants, downstreams
// and switches of every quota it belongs to, numbered with a new generation when it changed.

// rebuild assembles a pod's assignment from every quota it belongs to and bumps its generation
// when anything changed.
func (c *core) rebuild(p *podState) {
	if p.removed {
		return
	}
	if len(p.entries) == 0 {
		if !p.finalPush || p.endpoint == "" || (!p.configured && len(p.versions) == 0) || c.fenced {
			c.removePod(p)
			return
		}
	}
	if !c.started {
		return
	}
	a := &assignment.Assignment{
		Epoch:       c.epoch,
		LeaseTTL:    assignment.Duration(c.o.LeaseTTL),
		Downstreams: []assignment.Downstream{},
	}
	keys := make([]types.NamespacedName, 0, len(p.entries))
	for k := range p.entries {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b types.NamespacedName) int { return cmp.Compare(a.Name, b.Name) })
	for _, k := range keys {
		e := p.entries[k]
		d := cloneJSON(e.q.desired.Downstream)
		d.Permits = e.grant
		d.SafeDefaultPermits = min(e.sd, e.grant)
		d.Rate = nil
		if e.desired.RatePerSecond > 0 {
			mode := assignment.ModeTokenBucket
			if r := e.q.desired.Downstream.Rate; r != nil && r.Mode != "" {
				mode = r.Mode
			}
			d.Rate = &assignment.Rate{PerSecond: e.desired.RatePerSecond, Burst: max(e.desired.RateBurst, 1), Mode: mode}
		}
		e.rt = max(e.rt, d.RequestTimeout.D())
		a.Downstreams = append(a.Downstreams, d)
		if !e.present {
			continue
		}
		for _, ts := range e.q.desired.Switches {
			if ts.Target != "" && ts.Target != e.target {
				continue
			}
			sw := ts.Switch
			sw.Downstream = d.Name
			if !slices.ContainsFunc(a.Switches, func(s assignment.Switch) bool { return s.Name == sw.Name }) {
				a.Switches = append(a.Switches, sw)
			}
		}
	}
	slices.SortFunc(a.Switches, func(x, y assignment.Switch) int { return cmp.Compare(x.Name, y.Name) })
	if p.content != nil {
		a.Generation = p.content.Generation
		if reflect.DeepEqual(p.content, a) {
			return
		}
	}
	a.Generation = p.gen + 1
	if err := a.Validate(); err != nil && len(a.Switches) > 0 {
		// A switch the agents would refuse must not hold up the permits: push without switches.
		c.log.Error(err, "dropping degrade switches from an invalid assignment", "pod", p.namespace+"/"+p.name)
		a.Switches = nil
	}
	if err := a.Validate(); err != nil {
		// The controller handed over something the agents would refuse; keep the last content.
		// The ledger still counts the new grants, which only errs on the safe side.
		c.log.Error(err, "not pushing an invalid assignment", "pod", p.namespace+"/"+p.name)
		return
	}
	if p.content != nil {
		a.Generation = p.content.Generation
		if reflect.DeepEqual(p.content, a) {
			return
		}
	}
	p.gen++
	a.Generation = p.gen
	p.content = a
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
