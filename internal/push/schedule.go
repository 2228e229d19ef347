package push

import (
	"container/heap"
	"math/rand/v2"
	"time"
)

// This file holds the scheduler: which request each pod needs next and when (push, probe, poll),
// in which band it waits, the timer heap, the renewal grid and retry backoff.

// scheduler decides which request goes next and when. Its invariants:
//
//   - due: a pod has at most one request in flight (busy) and none while the engine has not begun
//     or was fenced, while its claim of a newer epoch waits for the epoch record, or without an
//     endpoint. An unknown or misbehaving pod is only probed (after its backoff); a pod gets a
//     push once pushWanted (its content differs from what it acknowledged: at once; after a
//     failure: at retryAt; else its renewal at renewAt), a poll while it drains calls above its
//     grant, and a probe once a previous manager's pushes can no longer land.
//   - when: a request due later waits in the timer heap (one live timer per pod and per quota:
//     wakeAt; stale ones are dropped lazily); renewals fall on the renewal grid, so that the ones
//     due together are ready together and signed in one batch; retries back off exponentially
//     from RetryBase to RetryMax, with jitter.
//   - which next: a ready request waits in the fair ready queue (readyQueue, fairqueue.go): by
//     namespace (flow) and band — for proven pods lowerings, then changes and probes, then
//     renewals and polls; every request to a pod not proven after those — with bounds on the
//     workers one namespace and the unproven pods may hold.
//
// It reads the ledger (what a pod is steered to, the previous manager's windows) and never
// changes it; the core starts the request it hands out (startWork). No I/O, no clock reads.
type scheduler struct {
	opts   *Options
	ledger *ledger
	timers timerHeap
	ready  *readyQueue // pods whose request is due, by namespace and band (fairqueue.go)
}

// pushWanted says whether the pod's content should be sent. An agent that holds nothing gets
// its first assignment only once each downstream it should call has a permit (until then its
// /readyz is false and it gets no traffic), and nothing at all if it is only leaving.
func (s *scheduler) pushWanted(p *podState) bool {
	if p.content == nil {
		return false
	}
	if p.configured || len(p.versions) > 0 {
		return true
	}
	if len(p.entries) == 0 {
		return false
	}
	live := false
	for _, e := range p.entries {
		if !e.present || e.terminating {
			continue
		}
		live = true
		if s.ledger.target(e) > 0 && e.grant == 0 {
			return false
		}
	}
	return live
}

func draining(p *podState) bool {
	for _, e := range p.entries {
		if e.inflight > e.grant {
			return true
		}
	}
	return false
}

// due is the pod's next request and when it is due; kindNone when there is nothing to do.
func (s *scheduler) due(p *podState, now time.Time) (time.Time, workKind) {
	if p.removed || p.busy != nil || !s.ledger.started || s.ledger.fenced || p.endpoint == "" {
		return time.Time{}, kindNone
	}
	if p.claimSeq != 0 {
		return time.Time{}, kindNone // its claim of a newer epoch waits for the epoch record (claims.go)
	}
	if !p.known || p.misbehaving {
		// A pod that misbehaved is only asked (GET), after its backoff, until it answers truly.
		return maxTime(now, p.retryAt), kindProbe
	}
	var at time.Time
	kind := kindNone
	if s.pushWanted(p) {
		kind = kindPush
		switch {
		case p.failures > 0:
			at = p.retryAt
		case p.content.Generation != p.okGen:
			at = now
		default:
			at = p.renewAt
		}
	}
	if draining(p) {
		pt := p.pollAt
		if p.failures > 0 {
			pt = maxTime(pt, p.retryAt)
		}
		if kind == kindNone || pt.Before(at) {
			at, kind = pt, kindPoll
		}
	}
	if kind == kindNone && s.ledger.mayHoldLateForeign(p) {
		// Ask again once no push of the previous manager can land any more.
		at, kind = maxTime(s.ledger.foreignLandEnd(), p.retryAt), kindProbe
	}
	return maxTime(at, now), kind
}

// proven says whether the pod's agent answered its last request, truthfully as far as the
// engine can tell: it is known, its last request did not fail, and it did not answer with an
// epoch no manager holds. Requests to other pods are the ones that may hang until PushTimeout:
// they wait in bandUnproven, after every request to a proven pod.
func proven(p *podState) bool {
	return p.known && p.failures == 0 && !p.misbehaving && p.claimSeq == 0
}

// band orders ready work (readyQueue): for proven pods, lowerings first (they free room for
// everyone), then probes and other changes, then renewals and polls; every request to a pod that
// is not proven after all of those.
func (s *scheduler) band(p *podState, kind workKind) int {
	switch {
	case !proven(p):
		return bandUnproven
	case kind == kindProbe:
		return bandChange
	case kind != kindPush || p.content.Generation == p.okGen:
		return bandRenew
	}
	if n := len(p.versions); n > 0 {
		last := p.versions[n-1]
		for _, e := range p.entries {
			if h, ok := last.hold(e.quota.key.Name); ok && e.grant < h.permits {
				return bandLower
			}
		}
	}
	return bandChange
}

func (s *scheduler) schedule(p *podState, now time.Time) {
	if p.queued || p.busy != nil || p.removed {
		return
	}
	at, kind := s.due(p, now)
	if kind == kindNone {
		p.wakeAt = time.Time{}
		return
	}
	if !at.After(now) {
		p.queued = true
		p.band = s.band(p, kind)
		s.ready.push(p.namespace, p.band, p)
		return
	}
	if !p.wakeAt.Equal(at) {
		p.wakeAt = at
		heap.Push(&s.timers, timerItem{at: at, pod: p})
	}
}

// advance fires every timer that is due: pods whose request is due, quotas whose ledger
// changed by itself (a lease lapsed, calls ended, recovery ended).
func (c *core) advance(now time.Time) {
	c.sched.fire(now, c.marks.markQuota)
	c.flush(now)
	if c.sched.timers.Len() > 4*(len(c.pods)+len(c.quotas))+64 {
		c.sched.compactTimers()
	}
}

// fire pops every timer due by now: a pod whose request is due is scheduled (queued when it is
// ready), a quota whose ledger may have changed by itself is handed to replan. Stale timers
// (their at no longer the pod's or quota's wakeAt) are dropped.
func (s *scheduler) fire(now time.Time, replan func(*quotaState)) {
	for s.timers.Len() > 0 && !s.timers[0].at.After(now) {
		it := heap.Pop(&s.timers).(timerItem)
		switch {
		case it.pod != nil:
			if it.pod.wakeAt.Equal(it.at) {
				it.pod.wakeAt = time.Time{}
				s.schedule(it.pod, now)
			}
		case it.quota != nil:
			if it.quota.wakeAt.Equal(it.at) {
				it.quota.wakeAt = time.Time{}
				replan(it.quota)
			}
		}
	}
}

// wakeQuota arms the quota's timer for next, when its ledger may change by itself (zero: never).
func (s *scheduler) wakeQuota(q *quotaState, next time.Time) {
	if !next.IsZero() && !next.Equal(q.wakeAt) {
		heap.Push(&s.timers, timerItem{at: next, quota: q})
	}
	q.wakeAt = next
}

func (s *scheduler) compactTimers() {
	live := s.timers[:0]
	for _, it := range s.timers {
		if (it.pod != nil && it.pod.wakeAt.Equal(it.at) && !it.pod.removed) || (it.quota != nil && it.quota.wakeAt.Equal(it.at)) {
			live = append(live, it)
		}
	}
	s.timers = live
	heap.Init(&s.timers)
}

// nextWake is the time of the earliest timer; zero if none.
func (s *scheduler) nextWake() time.Time {
	if s.timers.Len() == 0 {
		return time.Time{}
	}
	return s.timers[0].at
}

// hasReady says whether a worker may start a request now (popReady would return a pod).
func (s *scheduler) hasReady() bool { return s.ready.ready() }

// hasUrgent says whether a request of a higher priority than a renewal or a poll may start now:
// a lowering, a change or a probe of a proven pod.
func (s *scheduler) hasUrgent() bool { return s.ready.urgent() }

// popReady takes the pod whose turn it is (readyQueue.pop); nil when no flow may start a request.
func (s *scheduler) popReady() *podState { return s.ready.pop() }

// renewDelay is the time to the next renewal: RenewEvery less up to a quarter, at random, so
// that pods pushed together (a rebalance) do not renew in one burst forever. Renewing early is
// always safe.
func (s *scheduler) renewDelay() time.Duration {
	if s.opts.jitter != nil {
		return s.opts.RenewEvery // deterministic tests
	}
	return s.opts.RenewEvery - rand.N(s.opts.RenewEvery/4+1)
}

// nextRenewal is when a push sent at sentAt is renewed: renewDelay later, rounded down to the
// renewal grid (renewGrid, a multiple of it since the zero time), so that the renewals due within
// one step of the grid go out together. The scheduler then wakes once per step instead of once
// per pod, and the renewals are ready at the same moment, so that a worker signs them together
// (Engine.signTogether, docs/protocol.md §10). Rounding down only ever renews
// earlier, which is always safe, and by less than a step: never before sentAt, as a step is at
// most a sixteenth of RenewEvery and renewDelay at least three quarters of it.
func (s *scheduler) nextRenewal(sentAt time.Time) time.Time {
	return sentAt.Add(s.renewDelay()).Truncate(renewGrid(s.opts.RenewEvery))
}

// renewGrid is the step of the renewal grid: 100 ms, or a sixteenth of RenewEvery if shorter.
func renewGrid(renewEvery time.Duration) time.Duration {
	return max(min(100*time.Millisecond, renewEvery/16), 1)
}

func (s *scheduler) backoff(failures int) time.Duration {
	d := s.opts.RetryBase
	for i := 1; i < failures && d < s.opts.RetryMax; i++ {
		d *= 2
	}
	d = min(d, s.opts.RetryMax)
	if s.opts.jitter != nil {
		return s.opts.jitter(d)
	}
	return d/2 + rand.N(d/2+1)
}

// timerHeap orders the engine's timers; entries are invalidated lazily (their at no longer
// matches the pod's or quota's wakeAt).
type timerItem struct {
	at    time.Time
	pod   *podState
	quota *quotaState
}

type timerHeap []timerItem

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h timerHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *timerHeap) Push(x any)        { *h = append(*h, x.(timerItem)) }
func (h *timerHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	old[len(old)-1] = timerItem{}
	*h = old[:len(old)-1]
	return it
}
