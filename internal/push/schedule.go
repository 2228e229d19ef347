package push

import (
	"container/heap"
	"math/rand/v2"
	"time"
)

// This file holds scheduling: which request each pod needs next and when (push, probe, poll),
// the ready queues by priority, the timer heap, renewal jitter and retry backoff.

// pushWanted says whether the pod's content should be sent. An agent that holds nothing gets
// its first assignment only once each downstream it should call has a permit (until then its
// /readyz is false and it gets no traffic), and nothing at all if it is only leaving.
func (c *core) pushWanted(p *podState) bool {
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
		if c.ledger.target(e) > 0 && e.grant == 0 {
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
func (c *core) due(p *podState, now time.Time) (time.Time, workKind) {
	if p.removed || p.busy != nil || !c.ledger.started || c.ledger.fenced || p.endpoint == "" {
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
	if c.pushWanted(p) {
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
	if kind == kindNone && c.ledger.mayHoldLateForeign(p) {
		// Ask again once no push of the previous manager can land any more.
		at, kind = maxTime(c.ledger.foreignLandEnd(), p.retryAt), kindProbe
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
func (c *core) band(p *podState, kind workKind) int {
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

func (c *core) schedule(p *podState, now time.Time) {
	if p.queued || p.busy != nil || p.removed {
		return
	}
	at, kind := c.due(p, now)
	if kind == kindNone {
		p.wakeAt = time.Time{}
		return
	}
	if !at.After(now) {
		p.queued = true
		p.band = c.band(p, kind)
		c.ready.push(p.namespace, p.band, p)
		return
	}
	if !p.wakeAt.Equal(at) {
		p.wakeAt = at
		heap.Push(&c.timers, timerItem{at: at, pod: p})
	}
}

// advance fires every timer that is due: pods whose request is due, quotas whose ledger
// changed by itself (a lease lapsed, calls ended, recovery ended).
func (c *core) advance(now time.Time) {
	for c.timers.Len() > 0 && !c.timers[0].at.After(now) {
		it := heap.Pop(&c.timers).(timerItem)
		switch {
		case it.pod != nil:
			if it.pod.wakeAt.Equal(it.at) {
				it.pod.wakeAt = time.Time{}
				c.schedule(it.pod, now)
			}
		case it.quota != nil:
			if it.quota.wakeAt.Equal(it.at) {
				it.quota.wakeAt = time.Time{}
				c.markQuota(it.quota)
			}
		}
	}
	c.flush(now)
	if c.timers.Len() > 4*(len(c.pods)+len(c.quotas))+64 {
		c.compactTimers()
	}
}

func (c *core) compactTimers() {
	live := c.timers[:0]
	for _, it := range c.timers {
		if (it.pod != nil && it.pod.wakeAt.Equal(it.at) && !it.pod.removed) || (it.quota != nil && it.quota.wakeAt.Equal(it.at)) {
			live = append(live, it)
		}
	}
	c.timers = live
	heap.Init(&c.timers)
}

// nextWake is the time of the earliest timer; zero if none.
func (c *core) nextWake() time.Time {
	if c.timers.Len() == 0 {
		return time.Time{}
	}
	return c.timers[0].at
}

// hasReady says whether a worker may start a request now (popReady would return a pod).
func (c *core) hasReady() bool { return c.ready.ready() }

// hasUrgent says whether a request of a higher priority than a renewal or a poll may start now:
// a lowering, a change or a probe of a proven pod.
func (c *core) hasUrgent() bool { return c.ready.urgent() }

// popReady takes the pod whose turn it is (readyQueue.pop); nil when no flow may start a request.
func (c *core) popReady() *podState { return c.ready.pop() }

// renewDelay is the time to the next renewal: RenewEvery less up to a quarter, at random, so
// that pods pushed together (a rebalance) do not renew in one burst forever. Renewing early is
// always safe.
func (c *core) renewDelay() time.Duration {
	if c.opts.jitter != nil {
		return c.opts.RenewEvery // deterministic tests
	}
	return c.opts.RenewEvery - rand.N(c.opts.RenewEvery/4+1)
}

// nextRenewal is when a push sent at sentAt is renewed: renewDelay later, rounded down to the
// renewal grid (renewGrid, a multiple of it since the zero time), so that the renewals due within
// one step of the grid go out together. The scheduler then wakes once per step instead of once
// per pod, and the renewals are ready at the same moment, so that a worker signs them together
// (Engine.signTogether, docs/protocol.md §10). Rounding down only ever renews
// earlier, which is always safe, and by less than a step: never before sentAt, as a step is at
// most a sixteenth of RenewEvery and renewDelay at least three quarters of it.
func (c *core) nextRenewal(sentAt time.Time) time.Time {
	return sentAt.Add(c.renewDelay()).Truncate(renewGrid(c.opts.RenewEvery))
}

// renewGrid is the step of the renewal grid: 100 ms, or a sixteenth of RenewEvery if shorter.
func renewGrid(renewEvery time.Duration) time.Duration {
	return max(min(100*time.Millisecond, renewEvery/16), 1)
}

func (c *core) backoff(failures int) time.Duration {
	d := c.opts.RetryBase
	for i := 1; i < failures && d < c.opts.RetryMax; i++ {
		d *= 2
	}
	d = min(d, c.opts.RetryMax)
	if c.opts.jitter != nil {
		return c.opts.jitter(d)
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
