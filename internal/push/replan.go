package push

import (
	"container/heap"
	"slices"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// This file holds the glue between the ledger and the planner: what each entry is steered to,
// whether it may be raised, replan (ledger → plan → grants) and when a rebalance is done.

func (c *core) unreachable(p *podState) bool { return p.failures >= c.opts.UnreachableAfter }

// target is what the planner steers an entry to.
func (c *core) target(e *entry) int32 {
	p := e.pod
	if !e.present || e.terminating || !p.known || p.endpoint == "" {
		return 0
	}
	if c.unreachable(p) {
		return assignment.LapsedLimit(e.grant, e.safeDefault, e.quota.desired.Downstream.FailClosed)
	}
	return max(e.desired.Permits, 0)
}

func (c *core) canRaise(e *entry) bool {
	p := e.pod
	return c.started && !c.fenced && e.present && !e.terminating && p.known && p.endpoint != "" && !c.unreachable(p)
}

// replan recomputes one quota's grants from its ledger, releases the entries of pods that left
// the quota and count nothing any more, arms the timer for the ledger's next change and notes
// whether what Report shows changed. It is O(pods of the quota); the core batches it (markQuota,
// flush) so that many answers arriving together cost one replan.
func (c *core) replan(q *quotaState, now time.Time) {
	if c.quotas[q.key] != q {
		return
	}
	entries := q.entryList()
	var next time.Time
	counts := make([]int32, len(entries)) // what each entry counts after planning; -1 if released
	if c.started {
		pe := make([]planEntry, len(entries))
		for i, e := range entries {
			h, ph, carry, nx := c.held(e, now)
			next = minTime(next, nx)
			pe[i] = c.planEntry(e, h, ph, carry)
		}
		recovering := c.recovering(q, now)
		if recovering {
			next = minTime(next, c.recoverUntil(q))
		}
		grants := plan(q.desired.Limit, recovering, pe)
		if c.afterPlan != nil {
			c.afterPlan(q.key, q.desired.Limit, recovering, slices.Clone(pe), grants)
		}
		released := false
		for i, e := range entries {
			if grants[i] != e.grant {
				e.grant = grants[i]
				c.markDirty(e.pod)
			}
			pe[i].Grant = e.grant
			counts[i] = pe[i].counted()
			if !e.present && counts[i] == 0 {
				delete(q.entries, e.pod.uid)
				delete(e.pod.entries, q.key)
				c.markDirty(e.pod)
				counts[i] = -1
				released = true
			}
		}
		if released {
			q.resort = true
		}
		if q.deleted && len(q.entries) == 0 {
			c.forgetQuota(q)
			return
		}
	}
	if !next.IsZero() && !next.Equal(q.wakeAt) {
		heap.Push(&c.timers, timerItem{at: next, quota: q})
	}
	q.wakeAt = next
	if q.rebalancing && c.started && c.rebalanceDone(q) {
		q.rebalancing = false
		q.lastRebalance = now.Sub(q.changeAt)
	}
	c.noteReport(q, now, entries, counts)
}

func (c *core) planEntry(e *entry, h, ph, carry int32) planEntry {
	return planEntry{Name: e.pod.name, Grant: e.grant, Target: c.target(e), Held: h, Phantom: ph, Carry: carry, CanRaise: c.canRaise(e)}
}

// planInput is what replan would hand the planner for entries (a quota's entry list) now.
func (c *core) planInput(entries []*entry, now time.Time) []planEntry {
	pe := make([]planEntry, len(entries))
	for i, e := range entries {
		h, ph, carry, _ := c.held(e, now)
		pe[i] = c.planEntry(e, h, ph, carry)
	}
	return pe
}

// desiredTarget is what the controller wants the pod to hold.
func desiredTarget(e *entry) int32 {
	if !e.present || e.terminating {
		return 0
	}
	return max(e.desired.Permits, 0)
}

// ackedPermits is what the agent confirmed holding for the entry's downstream, or -1.
func ackedPermits(e *entry) int32 {
	p := e.pod
	if p.ackedGen == 0 {
		return -1
	}
	v := p.version(p.ackedGen)
	if v == nil {
		return -1
	}
	h, _ := v.hold(e.quota.key.Name)
	return h.permits
}

func synced(e *entry) bool {
	want := desiredTarget(e)
	if e.grant != want {
		return false
	}
	if a := ackedPermits(e); a >= 0 {
		return a == want
	}
	// An agent that holds nothing (and was sent nothing) is where a pod that should hold 0 is.
	p := e.pod
	return want == 0 && p.known && !p.configured && len(p.versions) == 0
}

func (c *core) rebalanceDone(q *quotaState) bool {
	for _, e := range q.entries {
		if e.present && e.pod.endpoint != "" && !c.unreachable(e.pod) && !synced(e) {
			return false
		}
	}
	return true
}
