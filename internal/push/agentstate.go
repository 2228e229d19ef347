package push

import (
	"fmt"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// This file holds reading an agent's State: what it holds and has in flight, another manager's
// holdings, a restarted agent process (carried) and a generation the engine forgot (re-learned).

// applyState learns from an agent's State what it holds and has in flight. st's epoch is not
// above the engine's (finishWork hands such answers to claim).
func (c *core) applyState(p *podState, st *assignment.State, now time.Time) {
	p.misbehaving, p.claimedEpoch = false, 0
	if p.known && restarted(p, st) {
		c.forgetProcess(p, st, now)
	} else if !p.known {
		c.carryPredecessor(p, st, now)
	}
	p.known = true
	p.reportAt = now
	p.lastEpoch, p.lastGen = st.Epoch, st.Generation
	if st.Instance != "" {
		p.instance = st.Instance
	}
	p.batchSig = st.Has(assignment.CapabilityBatchSignatures)
	p.observe = st.Has(assignment.CapabilityObserve)
	p.rampRaise = st.Has(assignment.CapabilityRampRaise)
	p.configured = st.Configured
	p.pollAt = now.Add(c.opts.DrainPoll)
	switch {
	case st.Epoch > c.ledger.epoch:
		// finishWork hands such an answer to claim, never here: an agent's word alone fences
		// nothing (claims.go).
		panic("push: applyState given a State of a newer epoch")
	case st.Epoch == c.ledger.epoch && st.Generation > p.gen:
		// A generation of this epoch the engine does not know: it forgot the pod after pushing to
		// it (every quota of the pod was deleted, or the pod was given up as unreachable) and met
		// it again. Only this engine pushes this epoch, so nobody else is involved: re-learn what
		// the agent holds, count it like another manager's holding, and go on above it.
		c.relearn(p, st, now)
	case st.Epoch == c.ledger.epoch:
		keep := p.versions[:0]
		for _, v := range p.versions {
			if v.gen >= st.Generation {
				keep = append(keep, v)
			}
		}
		clear(p.versions[len(keep):])
		p.versions = keep
		p.ackedGen = st.Generation
		p.foreign = nil
	default:
		// The agent holds nothing of this epoch (it restarted, or this engine has not reached
		// it yet): our content must be pushed again; what it holds is someone else's.
		p.ackedGen, p.okGen = 0, 0
		p.foreign = nil
		if st.Configured {
			f := &foreignHold{
				epoch:     st.Epoch,
				bootstrap: st.Epoch == 0,
				leaseEnd:  c.ledger.foreignLeaseEnd(),
				holds:     make(map[string]foreignDS, len(st.Downstreams)),
			}
			for _, d := range st.Downstreams {
				f.holds[d.Name] = foreignDS{permits: d.Permits, effective: d.EffectivePermits}
			}
			p.foreign = f
		}
	}
	observeEntries(p, st, now)
}

// observeEntries notes what an agent's state says of each of the pod's entries: calls in flight
// (counted by the ledger) and, for demand-aware sharing and status only, calls waiting, refused
// for lack of a permit and the lanes. A downstream the state does not list has none of them.
func observeEntries(p *podState, st *assignment.State, now time.Time) {
	for k, e := range p.entries {
		e.inflight, e.inflightAt, e.requests = 0, now, 0
		e.waiting, e.refused, e.lanes = 0, 0, nil
		e.secondsEnd, e.seconds, e.observing = 0, nil, false
		for _, d := range st.Downstreams {
			if d.Name == k.Name {
				e.inflight, e.requests = max(d.InFlight, 0), d.Requests
				e.waiting, e.refused, e.lanes = max(d.Waiting, 0), d.Rejected["no-permit"], d.Lanes
				e.secondsEnd, e.seconds, e.observing = d.SecondsEnd, d.Seconds, d.Observe
				break
			}
		}
	}
}

// relearn handles an agent that holds a generation of this epoch above every one the engine
// has for the pod (see applyState). Nothing the engine has for the pod can land any more (the
// agent refuses a lower generation), so its versions go. What the agent holds is counted like a
// previous manager's holding: what it enforces surely and its permits as a bound until a lease
// window from now has passed (a push this engine sent before it forgot the pod was sent before
// now, so its lease ends by then) plus a request timeout, then its fallback. The pod's next
// content is numbered above the agent's generation, so the agent accepts it; once it
// acknowledges it the holding is replaced by what it reports.
func (c *core) relearn(p *podState, st *assignment.State, now time.Time) {
	c.log.Info("an agent holds a generation of this epoch the engine forgot; re-learning what it holds",
		"pod", p.namespace+"/"+p.name, "agentGeneration", st.Generation, "generation", p.gen, "epoch", c.ledger.epoch)
	for _, e := range p.entryList() {
		c.reports.events = append(c.reports.events, Event{Quota: e.quota.key, UID: e.quota.uid, Warning: true, Reason: ReasonAgentRelearned,
			Message: fmt.Sprintf("the agent of pod %s held generation %d of this manager's epoch, which the manager had forgotten "+
				"(the pod left every quota, e.g. the quota was deleted, and came back); counted at what it holds and pushed again",
				p.name, st.Generation)})
	}
	clear(p.versions)
	p.versions = p.versions[:0]
	p.gen, p.content = st.Generation, nil
	p.ackedGen, p.okGen = 0, 0
	p.foreign = nil
	if st.Configured {
		f := &foreignHold{
			epoch:    st.Epoch,
			leaseEnd: now.Add(c.opts.leaseWindow()),
			holds:    make(map[string]foreignDS, len(st.Downstreams)),
		}
		for _, d := range st.Downstreams {
			f.holds[d.Name] = foreignDS{permits: d.Permits, effective: d.EffectivePermits}
		}
		p.foreign = f
	}
	c.marks.markDirty(p)
}

// forgetProcess handles an agent that restarted (st comes from a new process). The old process's
// calls may still run at the downstream for a request timeout: what it may have held is carried
// on top of whatever the new process gets. The new process holds nothing of ours, so its grant
// starts again from 0 and it is raised only from room the ledger shows free; re-pushing the old
// grant would count the pod twice (carry + grant), above what it was counted at before.
//
// The versions the old process held are now stood for by the carry and are dropped: left in
// place, their fallbacks would count for as long as the pod exists, since the new process never
// reports a generation that retires them. Only a push that may still land at the new process is
// kept: none when the restart was told by the instance id (every push was addressed to the old
// instance, which the new process refuses); for an agent without one, a push in flight or one
// that failed without a definite refusal.
func (c *core) forgetProcess(p *podState, st *assignment.State, now time.Time) {
	c.log.Info("agent restarted", "pod", p.namespace+"/"+p.name)
	byInstance := p.instance != "" && st.Instance != "" && st.Instance != p.instance
	for _, e := range p.entries {
		c.ledger.carryCounted(e, now, now.Add(e.maxRequestTimeout))
		c.marks.markQuota(e.quota)
		e.grant = 0
	}
	keep := p.versions[:0]
	for _, v := range p.versions {
		if !byInstance && (!v.sendEnd.IsZero() || now.Before(v.failEnd)) {
			keep = append(keep, v)
		}
	}
	clear(p.versions[len(keep):])
	p.versions = keep
	c.marks.markDirty(p)
}

// carryPredecessor handles the first answer of an agent to this engine. When the pod already had
// an endpoint while a previous manager may still have been pushing (this engine's recovery
// window) and the agent process that answers is younger than a request timeout, an earlier
// process of the same pod may have held a previous manager's permits and may still have calls
// running at the downstream until the new process's start + RT. What the ledger counted for the
// unknown pod until now is carried until then. A pod this engine saw from its first endpoint on
// needs no carry: nobody but this engine configures it, and it never pushes an unknown pod.
func (c *core) carryPredecessor(p *podState, st *assignment.State, now time.Time) {
	if st.Uptime <= 0 || !c.ledger.started || !p.hadEndpoint() || !c.ledger.mayPredate(p) {
		return
	}
	began := now.Add(-st.Uptime.D())
	for _, e := range p.entries {
		until := began.Add(e.maxRequestTimeout)
		if !now.Before(until) {
			continue
		}
		c.ledger.carryCounted(e, now, until)
		c.marks.markQuota(e.quota)
	}
}

// carryCounted adds what the entry is counted at now, its grant aside (the bound of what the
// pod's previous process may still run), to its carry, kept until at least until. The caller
// replans the entry's quota.
func (l *ledger) carryCounted(e *entry, now, until time.Time) {
	h, ph, carry, _ := l.held(e, now)
	e.carry, e.carryUntil = carry+max(h, ph), maxTime(until, e.carryUntil)
}

// restarted says whether st comes from a new agent process: its state went backwards (a lower
// (epoch, generation), no longer configured), a request counter, which only grows within a
// process, dropped, or — the direct signal — the agent's instance id changed. The other signals
// cover agents that do not report an instance.
func restarted(p *podState, st *assignment.State) bool {
	if p.instance != "" && st.Instance != "" && st.Instance != p.instance {
		return true // a new process, whatever it accepted since
	}
	if st.Epoch < p.lastEpoch || (st.Epoch == p.lastEpoch && st.Generation < p.lastGen) || (p.configured && !st.Configured) {
		return true
	}
	for k, e := range p.entries {
		for _, d := range st.Downstreams {
			if d.Name == k.Name && d.Requests < e.requests {
				return true
			}
		}
	}
	return false
}
