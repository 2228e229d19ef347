package push

import (
	"fmt"
	"time"

	"github.com/go-logr/logr"

	"github.com/apportion/apportion/internal/assignment"
)

// This file holds what the engine does with an answer claiming an epoch above its own: not
// evidence of anything until the manager's own epoch record says so (docs/protocol.md §9, "Who
// decides fencing"). The core notes the claim and stops sending the pod anything; the Engine
// reads the record (EpochRecord), outside its lock, at most once per Options.EpochCheckEvery
// however many pods claim; recordRead applies what it read: a newer record fences the engine,
// any other refutes every claim made before the read, and a read error decides nothing.

// claims are the answers claiming an epoch above the engine's that wait for the epoch record,
// and what the record decided. Its invariants (docs/protocol.md §9, §11 Lemma 7): a claim is
// never believed by itself — the claimant's answer enters nothing of the ledger, the pod is
// unreachable at once and gets no request while its claim waits (scheduler.due); only a read of
// the record started after a claim decides it: a record above the engine's epoch fences the
// engine (ledger.fenced: nobody is raised, nothing is sent), any other refutes every claim made
// before the read (the pod misbehaves until it answers truly); a failed read decides nothing.
type claims struct {
	opts    *Options
	log     logr.Logger
	metrics *metrics // nil in pure tests
	ledger  *ledger
	sched   *scheduler
	marks   *marks
	reports *reports

	claimSeq  uint64      // numbers the claims made
	claimants []*podState // the pods whose claim waits
	fencedBy  int64       // the epoch record that fenced the engine
}

// claimEventEvery bounds the Warning Events raised about one pod's false claims.
const claimEventEvery = 10 * time.Minute

// claim handles an answer to w that claims epoch, above the engine's. Nothing of the answer is
// believed: it is a failed request that may have landed (a push is counted until its lease
// window has passed, like one that timed out), the pod is unreachable at once (its target is
// its fallback, so it is only ever lowered), and it gets no request until the epoch record has
// been read. It returns true when the pod left every quota: the caller removes it.
func (cl *claims) claim(w *work, epoch int64, now time.Time) (remove bool) {
	p := w.pod
	if w.version != nil {
		w.version.failEnd = maxTime(w.version.failEnd, w.sentAt.Add(cl.opts.leaseWindow()))
	}
	p.failures = max(p.failures+1, cl.opts.UnreachableAfter)
	p.retryAt = now.Add(cl.sched.backoff(p.failures))
	p.claimedEpoch = epoch
	if p.claimSeq == 0 {
		cl.claimants = append(cl.claimants, p)
	}
	cl.claimSeq++
	p.claimSeq = cl.claimSeq
	if cl.metrics != nil {
		cl.metrics.epochClaims.Inc()
	}
	cl.log.V(1).Info("an agent claims a newer epoch; checking the epoch record", "pod", p.namespace+"/"+p.name,
		"endpoint", w.to.URL, "claimedEpoch", epoch, "epoch", cl.ledger.epoch)
	if len(p.entries) == 0 {
		return true
	}
	for _, e := range p.entries {
		cl.marks.markQuota(e.quota)
	}
	cl.marks.markDirty(p)
	return false
}

// pendingClaim says whether a claim waits for the epoch record, and the number of the last
// claim made: a read started now decides every claim up to it (recordRead).
func (cl *claims) pendingClaim() (upTo uint64, ok bool) {
	return cl.claimSeq, len(cl.claimants) > 0 && !cl.ledger.fenced
}

// recordRead applies a read of the epoch record started after claim upTo was made: record is
// the highest epoch any manager has taken, err a failed read.
//
//   - err: nothing is decided. The claims stay waiting (their pods get nothing) and the Engine
//     reads again later; a read error never fences.
//   - record > the engine's epoch: a newer manager took an epoch; this engine is stale and stops
//     (fenced), as a newer manager must have written the record before any agent could hold its
//     epoch.
//   - otherwise no manager holds the epochs claimed up to upTo: those pods answered falsely.
//     Each is misbehaving: it stays unreachable, is named in its quotas' Reports and in a
//     Warning Event (at most one per pod per claimEventEvery), and is asked again (a probe)
//     after its backoff.
func (cl *claims) recordRead(upTo uint64, record int64, err error, now time.Time) {
	if cl.ledger.fenced {
		return
	}
	if err != nil {
		cl.log.Error(err, "reading the epoch record to check agents' claims of a newer epoch; not fencing, retrying",
			"claims", len(cl.claimants), "epoch", cl.ledger.epoch)
		return
	}
	if record > cl.ledger.epoch {
		cl.ledger.fenced, cl.fencedBy = true, record
		cl.log.Error(nil, "fenced: an agent holds a newer epoch and the epoch record confirms it; stopping",
			"record", record, "epoch", cl.ledger.epoch)
		return
	}
	keep := cl.claimants[:0]
	for _, p := range cl.claimants {
		switch {
		case p.removed || p.claimSeq == 0:
		case p.claimSeq > upTo:
			keep = append(keep, p)
		default:
			cl.refute(p, record, now)
		}
	}
	clear(cl.claimants[len(keep):])
	cl.claimants = keep
}

// refute marks a pod whose claim the record refuted as misbehaving.
func (cl *claims) refute(p *podState, record int64, now time.Time) {
	p.claimSeq = 0
	p.misbehaving = true
	if cl.metrics != nil {
		cl.metrics.epochRefuted.Inc()
	}
	if p.claimEventAt.IsZero() || now.Sub(p.claimEventAt) >= claimEventEvery {
		p.claimEventAt = now
		cl.log.Info("an agent claimed an epoch no manager holds; treating its pod as unreachable", "pod", p.namespace+"/"+p.name,
			"claimedEpoch", p.claimedEpoch, "record", record, "epoch", cl.ledger.epoch)
		for _, e := range p.entryList() {
			cl.reports.events = append(cl.reports.events, Event{Quota: e.quota.key, UID: e.quota.uid, Warning: true, Reason: ReasonAgentClaimsNewerEpoch,
				Message: fmt.Sprintf("the agent of pod %s answered with epoch %d, but no manager holds an epoch above %d (the manager's epoch record); "+
					"its answers are not believed: it is treated as unreachable, counted at what it may hold from this manager's pushes, and asked again later",
					p.name, p.claimedEpoch, record)})
		}
	}
	for _, e := range p.entries {
		cl.marks.markQuota(e.quota)
	}
	cl.marks.markDirty(p)
}

// claimed returns the epoch an answer claims above the engine's (epoch), 0 if it claims none: a
// State (200) or the State of a refusal (assignment.StaleError: a 409, a 403 wrong-instance).
func claimed(epoch int64, st *assignment.State, stale *assignment.StaleError) int64 {
	switch {
	case st != nil && st.Epoch > epoch:
		return st.Epoch
	case stale != nil && stale.State.Epoch > epoch:
		return stale.State.Epoch
	}
	return 0
}
