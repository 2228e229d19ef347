package push

import (
	"slices"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// This file holds the glue between the ledger and the planner: what each entry is steered to,
// whether it may be raised, replan (ledger → plan → grants) and when a rebalance is done.

func (l *ledger) unreachable(p *podState) bool { return p.failures >= l.opts.UnreachableAfter }

// target is what the planner steers an entry to.
func (l *ledger) target(e *entry) int32 {
	p := e.pod
	if !e.present || e.terminating || !p.known || p.endpoint == "" {
		return 0
	}
	if l.unreachable(p) {
		return assignment.LapsedLimit(e.grant, e.safeDefault, e.quota.desired.Downstream.FailClosed)
	}
	return max(e.desired.Permits, 0)
}

func (l *ledger) canRaise(e *entry) bool {
	p := e.pod
	return l.started && !l.fenced && e.present && !e.terminating && p.known && p.endpoint != "" && !l.unreachable(p)
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
	if c.ledger.started {
		next = c.ledger.regrant(q, entries, counts, now, c.marks.markDirty)
		if q.deleted && len(q.entries) == 0 {
			c.forgetQuota(q)
			return
		}
	}
	c.sched.wakeQuota(q, next)
	if q.rebalancing && c.ledger.started && c.ledger.rebalanceDone(q) {
		q.rebalancing = false
		q.lastRebalance = now.Sub(q.changeAt)
	}
	c.reports.noteReport(q, now, entries, counts)
}

// regrant plans q's grants from what its entries (q.entryList()) are counted at now and
// reserves them in the ledger: a raise only into room the plan found free (§5, Lemma 5), so Σ
// counted ≤ Limit after any raise. It releases the entries of pods that left the quota and count
// nothing any more, and calls touched for every pod whose grant changed or that was released
// (its content must be rebuilt). counts gets what each entry counts after planning (-1 if
// released); it returns the earliest later time at which a count may drop by itself (zero if
// none). Only once the ledger started.
func (l *ledger) regrant(q *quotaState, entries []*entry, counts []int32, now time.Time, touched func(*podState)) (next time.Time) {
	pe := make([]planEntry, len(entries))
	for i, e := range entries {
		h, ph, carry, nx := l.held(e, now)
		next = minTime(next, nx)
		pe[i] = l.planEntry(e, h, ph, carry)
	}
	recovering := l.recovering(q, now)
	if recovering {
		next = minTime(next, l.recoverUntil(q))
		if _, wake := l.settled(q, now); !wake.IsZero() {
			next = minTime(next, wake)
		}
	}
	grants := plan(q.desired.Limit, recovering, pe)
	if l.afterPlan != nil {
		l.afterPlan(q.key, q.desired.Limit, recovering, slices.Clone(pe), grants)
	}
	released := false
	for i, e := range entries {
		if grants[i] != e.grant {
			e.grant = grants[i]
			touched(e.pod)
		}
		pe[i].Grant = e.grant
		counts[i] = pe[i].counted()
		if !e.present && counts[i] == 0 {
			if recovering {
				l.releaseUnsettled(q, e, now)
			}
			delete(q.entries, e.pod.uid)
			delete(e.pod.entries, q.key)
			touched(e.pod)
			counts[i] = -1
			released = true
		}
	}
	if released {
		q.resort = true
	}
	return next
}

// releaseUnsettled keeps, while q recovers, the bound of an entry about to be released that is not
// settled (entrySettled): counting 0 does not show that the pod holds nothing of a previous
// manager. A gone pod's calls end a request timeout after it went; one alive (it left this quota
// only) may hold an unseen push of the previous manager until recoverUntil.
func (l *ledger) releaseUnsettled(q *quotaState, e *entry, now time.Time) {
	if ok, _ := l.entrySettled(e, now); ok {
		return
	}
	until := l.recoverUntil(q)
	if p := e.pod; !p.goneAt.IsZero() && !p.orphaned {
		until = p.goneAt.Add(e.maxRequestTimeout)
	}
	q.blockUntil = maxTime(q.blockUntil, until)
}

func (l *ledger) planEntry(e *entry, h, ph, carry int32) planEntry {
	return planEntry{Name: e.pod.name, Grant: e.grant, Target: l.target(e), Held: h, Phantom: ph, Carry: carry, CanRaise: l.canRaise(e)}
}

// planInput is what replan would hand the planner for entries (a quota's entry list) now.
func (l *ledger) planInput(entries []*entry, now time.Time) []planEntry {
	pe := make([]planEntry, len(entries))
	for i, e := range entries {
		h, ph, carry, _ := l.held(e, now)
		pe[i] = l.planEntry(e, h, ph, carry)
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

func (l *ledger) rebalanceDone(q *quotaState) bool {
	for _, e := range q.entries {
		if e.present && e.pod.endpoint != "" && !l.unreachable(e.pod) && !synced(e) {
			return false
		}
	}
	return true
}
