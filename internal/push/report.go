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

// reports is what the controllers read of the engine: a quota's Report (from the ledger), the
// quotas whose Report changed since the last takeChanged (noteReport detects a change by a hash
// of what Report shows, at every replan), the Events raised since the last takeEvents, in order,
// and how many pods acknowledged a degrade switch. It reads the core's records and the ledger and
// changes neither.
type reports struct {
	ledger  *ledger
	metrics *metrics                             // nil in pure tests
	quotas  map[types.NamespacedName]*quotaState // the core's
	pods    map[types.UID]*podState              // the core's

	// changed collects quotas whose Report changed, for OnChange.
	changed map[types.NamespacedName]struct{}
	// events collects Events for OnEvent, in order.
	events []Event
}

// report is what Report returns for one quota.
func (rs *reports) report(key types.NamespacedName, now time.Time) Report {
	q := rs.quotas[key]
	r := Report{Recovering: true}
	if q == nil {
		return r
	}
	r.Recovering = rs.ledger.recovering(q, now)
	r.Converged = rs.ledger.started && !rs.ledger.fenced
	for _, e := range q.entryList() {
		counted := rs.ledger.counted(e, now)
		if !rs.ledger.started {
			counted = 0
		}
		r.Ledger += counted
		s := synced(e)
		r.Holdings = append(r.Holdings, Holding{
			Pod: e.pod.name, Target: e.target, Granted: e.grant, Counted: counted,
			InFlight: e.inflight, Synced: s, Gone: !e.present,
			Waiting: e.waiting, RefusedNoPermit: e.refused, Lanes: e.lanes,
			SecondsEnd: e.secondsEnd, Seconds: e.seconds,
		})
		if rs.ledger.unreachable(e.pod) {
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
func (rs *reports) noteReport(q *quotaState, now time.Time, entries []*entry, counts []int32) {
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
		if rs.ledger.unreachable(e.pod) {
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
	if rs.ledger.recovering(q, now) {
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
		rs.changed[q.key] = struct{}{}
	}
	if rs.metrics != nil {
		rs.metrics.observe(q.key, ledger, int64(q.desired.Limit), unreachable)
	}
}

func (rs *reports) takeEvents() []Event {
	ev := rs.events
	rs.events = nil
	return ev
}

func (rs *reports) takeChanged() []types.NamespacedName {
	if len(rs.changed) == 0 {
		return nil
	}
	out := make([]types.NamespacedName, 0, len(rs.changed))
	for k := range rs.changed {
		out = append(out, k)
	}
	clear(rs.changed)
	return out
}

// switchApplied counts the pods whose content carries the switch and those whose agent
// acknowledged it in exactly that form.
func (rs *reports) switchApplied(name string) (applied, total int) {
	for _, p := range rs.pods {
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
