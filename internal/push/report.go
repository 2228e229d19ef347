package push

import (
	"reflect"
	"slices"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/apportion/apportion/internal/assignment"
)

// This file holds reporting: Report for a quota's status, change detection for OnChange,
// Events, and how many pods acknowledged a degrade switch.

// report is what Report returns for one quota.
func (c *core) report(key types.NamespacedName, now time.Time) Report {
	q := c.quotas[key]
	r := Report{Recovering: true}
	if q == nil {
		return r
	}
	r.Recovering = c.ledger.recovering(q, now)
	r.Converged = c.ledger.started && !c.ledger.fenced
	for _, e := range q.entryList() {
		counted := c.ledger.counted(e, now)
		if !c.ledger.started {
			counted = 0
		}
		r.Ledger += counted
		s := synced(e)
		r.Holdings = append(r.Holdings, Holding{
			Pod: e.pod.name, Target: e.target, Granted: e.grant, Counted: counted,
			InFlight: e.inflight, Synced: s, Gone: !e.present,
			Waiting: e.waiting, RefusedNoPermit: e.refused, Lanes: e.lanes,
		})
		if c.ledger.unreachable(e.pod) {
			r.Unreachable = append(r.Unreachable, e.pod.name)
		}
		if e.pod.misbehaving {
			r.Misbehaving = append(r.Misbehaving, e.pod.name)
		}
		if e.present && e.pod.endpoint != "" && !s {
			r.Converged = false
		}
	}
	slices.Sort(r.Unreachable)
	slices.Sort(r.Misbehaving)
	if !q.rebalancing {
		r.LastRebalanceDuration = q.lastRebalance
	}
	return r
}

// noteReport marks the quota changed when what Report shows (in-flight counts aside) changed,
// and refreshes its metrics. counts[i] is what entries[i] counts now, -1 if it was released.
func (c *core) noteReport(q *quotaState, now time.Time, entries []*entry, counts []int32) {
	var sum uint64 = 14695981039346656037
	mix := func(v uint64) {
		sum ^= v
		sum *= 1099511628211
		sum ^= sum >> 29
	}
	var ledger int64
	unreachable := 0
	for i, e := range entries {
		if counts[i] < 0 {
			continue
		}
		ledger += int64(counts[i])
		var flags uint64
		if synced(e) {
			flags |= 1
		}
		if c.ledger.unreachable(e.pod) {
			flags |= 2
			unreachable++
		}
		if !e.present {
			flags |= 4
		}
		if e.pod.misbehaving {
			flags |= 8
		}
		mix(uint64(i))
		mix(uint64(uint32(e.grant))<<32 | uint64(uint32(counts[i])))
		mix(flags)
	}
	var flags uint64
	if c.ledger.recovering(q, now) {
		flags |= 1
	}
	if q.rebalancing {
		flags |= 2
	}
	mix(uint64(len(entries)))
	mix(flags)
	mix(uint64(q.lastRebalance))
	if sum != q.summary {
		q.summary = sum
		c.changed[q.key] = struct{}{}
	}
	if c.metrics != nil {
		c.metrics.observe(q.key, ledger, int64(q.desired.Limit), unreachable)
	}
}

func (c *core) takeEvents() []Event {
	ev := c.events
	c.events = nil
	return ev
}

func (c *core) takeChanged() []types.NamespacedName {
	if len(c.changed) == 0 {
		return nil
	}
	out := make([]types.NamespacedName, 0, len(c.changed))
	for k := range c.changed {
		out = append(out, k)
	}
	clear(c.changed)
	return out
}

// switchApplied counts the pods whose content carries the switch and those whose agent
// acknowledged it in exactly that form.
func (c *core) switchApplied(name string) (applied, total int) {
	for _, p := range c.pods {
		if p.content == nil || p.endpoint == "" {
			continue
		}
		i := slices.IndexFunc(p.content.Switches, func(s assignment.Switch) bool { return s.Name == name })
		if i < 0 {
			continue
		}
		total++
		v := p.version(p.ackedGen)
		if p.ackedGen == 0 || v == nil {
			continue
		}
		j := slices.IndexFunc(v.assignment.Switches, func(s assignment.Switch) bool { return s.Name == name })
		if j >= 0 && reflect.DeepEqual(v.assignment.Switches[j], p.content.Switches[i]) {
			applied++
		}
	}
	return applied, total
}
