package push

import (
	"cmp"
	"slices"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/apportion/apportion/internal/assignment"
)

// This file holds the ledger: its records (quotaState, entry, podState, version) and the type
// whose methods turn them into what a pod may be using (held, counted) and into grants
// (regrant). The argument for why held is an upper bound is in docs/protocol.md ("Why Σ ≤ limit
// holds"); the comments here point at its steps.

// ledger is, per quota, what every pod may be using and what it is granted. Its invariant is
// docs/protocol.md §11's theorem: for every quota, Σ over its entries of counted ≤ the quota's
// Limit whenever a plan raised anyone (plans raise only into room the ledger shows free; time and
// reports only lower what is counted), so the permits live pods really hold never sum above the
// limit. counted = carry + max(held, phantom, grant) bounds what one pod may be using for the
// quota, now or later unless the engine sends it something new (§4, Lemma 3): the calls it
// reported in flight for a request timeout, every version it may hold until its lease bound plus
// a request timeout and then its fallback, another manager's or a forgotten generation's holdings,
// the safe default of a pod that may run on one unseen (phantom), the calls a restarted agent's
// previous process may still run (carry), and the grant decided for it but perhaps not sent yet
// (Lemma 4: nothing is sent before its grant is counted).
//
// The ledger does no I/O and reads no clock; the core calls it under the engine's lock. The
// records it reads are the core's (quotas, pods); the ledger holds what its bounds depend on
// besides them: when this engine started (the windows of a previous manager's pushes) and
// whether it was fenced (then it raises nobody).
type ledger struct {
	opts *Options

	epoch     int64     // the epoch this engine pushes (begin): the ledger's versions are its generations
	started   bool      // the engine knows its epoch (begin); before, nothing is raised
	startedAt time.Time // when it began: a previous manager stopped pushing before
	fenced    bool      // a newer manager holds the epoch record (claims.go): raise nobody

	// afterPlan, when set (tests), sees every plan: its input and the grants it decided.
	afterPlan func(key types.NamespacedName, limit int32, recovering bool, in []planEntry, grants []int32)
}

// begin fixes the epoch and starts the ledger's recovery: no quota raises anyone above what it is
// counted at until recoverUntil, and pods seen before now may hold a previous manager's pushes.
func (l *ledger) begin(epoch int64, now time.Time) {
	l.epoch, l.started, l.startedAt = epoch, true, now
}

// recoverUntil is when a quota's recovery window ends at the latest: a lease the previous
// manager started just before this one started has lapsed and its calls have ended.
func (l *ledger) recoverUntil(q *quotaState) time.Time {
	return l.foreignLeaseEnd().Add(q.maxRequestTimeout)
}

// recovering says whether q is in its recovery window: nobody is raised above what it surely
// holds. The window closes at recoverUntil, or earlier once the ledger knows every holding of
// the quota a previous manager may have left (settled, docs/protocol.md §8, Lemma 8).
func (l *ledger) recovering(q *quotaState, now time.Time) bool {
	if !l.started {
		return true
	}
	if !now.Before(l.recoverUntil(q)) {
		return false
	}
	settled, _ := l.settled(q, now)
	return !settled
}

// settled says whether the ledger of q bounds, now and later, everything a previous manager may
// have left at the quota's pods, so that its recovery window may close before recoverUntil
// (docs/protocol.md §8, "Closing early", and Lemma 8). That holds once
//
//   - the calls of every pod deleted before this engine first listed the quota have ended:
//     a pod is deleted only after its processes stopped (a force-deleted pod whose process lives
//     on is outside the model, §12), so by listedAt + the quota's longest request timeout;
//   - no released entry left a bound behind (blockUntil, set by regrant);
//   - every entry is settled (entrySettled);
//   - and Σ counted, after the plan's lowerings, fits in the limit (else nobody could be raised).
//
// When it is not, it returns the earliest later time at which a timed condition may change
// (zero if none does by itself: the rest changes with an agent's answer, which replans).
func (l *ledger) settled(q *quotaState, now time.Time) (bool, time.Time) {
	var wake time.Time
	if end := q.listedAt.Add(q.maxRequestTimeout); now.Before(end) {
		wake = end
	}
	if now.Before(q.blockUntil) {
		wake = maxTime(wake, q.blockUntil)
	}
	if !wake.IsZero() {
		return false, wake
	}
	var sum int64
	for _, e := range q.entryList() {
		if ok, at := l.entrySettled(e, now); !ok {
			return false, at
		}
		// What the entry counts once the plan has made its lowerings (planner.go).
		h, ph, carry, _ := l.held(e, now)
		sum += int64(carry) + int64(max(h, ph, min(e.grant, max(l.target(e), 0))))
	}
	// A ledger above the limit (what it still counts of the previous manager as a bound) leaves no
	// room to raise anyone anyway; the window stays open until it fits, so that a quota out of
	// recovery always shows Σ counted ≤ limit (its status, the end-to-end monitor), as at the full
	// window's end. held's timers replan the quota when its bounds drop.
	if sum > int64(q.desired.Limit) {
		return false, time.Time{}
	}
	return true, time.Time{}
}

// entrySettled says whether what the entry counts bounds everything a previous manager may have
// left at its pod, now and later, and if not, when that may change by time alone (zero: only
// with an answer). The pod is settled when
//
//   - its agent reported holding this engine's epoch (an acknowledged push or a re-learned
//     generation): from then on fencing refuses every push of an older epoch, and a push of the
//     previous manager, sent before it stopped on a connection to the process that was running
//     then, can never reach a later process of the pod (each one listens anew);
//   - or its last answer came after foreignLandEnd: every push of the previous manager had landed
//     or never would, so what it held of one is in that answer (foreignHold, counted until
//     foreignLeaseEnd plus a request timeout, then its fallback);
//   - or it never answered and no previous manager can have configured it (no endpoint, or its
//     first one after foreignLandEnd: mayPredate); with --bootstrap it runs on its safe default,
//     which the ledger counts;
//   - or it is gone (no quota lists it) and a request timeout has passed since: its calls ended.
//
// A pod that answered before foreignLandEnd and has not acknowledged this epoch is probed again
// at foreignLandEnd (scheduler), so it settles by then unless it cannot be reached; an unreachable
// pod that never answered keeps the quota in recovery until recoverUntil.
func (l *ledger) entrySettled(e *entry, now time.Time) (bool, time.Time) {
	p := e.pod
	if p.known && (p.lastEpoch == l.epoch || !p.reportAt.Before(l.foreignLandEnd())) {
		return true, time.Time{}
	}
	if !p.known && (!p.hadEndpoint() || !l.mayPredate(p)) {
		return true, time.Time{}
	}
	if !p.goneAt.IsZero() && !p.orphaned {
		end := p.goneAt.Add(e.maxRequestTimeout)
		if !now.Before(end) {
			return true, time.Time{}
		}
		return false, end
	}
	return false, time.Time{}
}

// hold is what one version of a pod's assignment gives one downstream.
type hold struct {
	permits        int32         // the limit while the lease holds
	fallback       int32         // the limit once the lease lapsed: assignment.LapsedLimit
	requestTimeout time.Duration // the request timeout: how long a call started under this version may last
}

// version is one assignment the engine sent to a pod, which the agent may hold now or accept
// later. Versions older than the generation an agent reported holding are dropped (fencing: the
// agent refuses them from then on).
type version struct {
	gen        int64
	assignment *assignment.Assignment // immutable snapshot, shared with the request that sends it
	// holds is per downstream (quota) name, in the assignment's order: a slice, not a map — a
	// pod has a version or two per agent and mostly one downstream, and at 10,000 pods a map
	// each is megabytes; look one up with hold.
	holds []namedHold

	// The lease this version may have started ends by the latest of:
	okEnd   time.Time // every answered send: answer received + LeaseTTL
	failEnd time.Time // every unanswered send: sentAt + leaseWindow (PushTimeout + AcceptGrace + LeaseTTL)
	sendEnd time.Time // the send in flight, counted like an unanswered one until it is answered

	// body is the JSON of a addressed to the agent process bodyInstance, once encoded: a
	// renewal sends the same bytes again (signed anew).
	body         []byte
	bodyInstance string
}

func (v *version) leaseEnd() time.Time { return maxTime(v.okEnd, v.failEnd, v.sendEnd) }

type namedHold struct {
	name string
	hold
}

// hold is what the version gives downstream name, and whether it names it at all.
func (v *version) hold(name string) (hold, bool) {
	for i := range v.holds {
		if v.holds[i].name == name {
			return v.holds[i].hold, true
		}
	}
	return hold{}, false
}

func newVersion(a *assignment.Assignment) *version {
	v := &version{gen: a.Generation, assignment: a, holds: make([]namedHold, 0, len(a.Downstreams))}
	for _, d := range a.Downstreams {
		// Validate refuses an assignment that names a downstream twice: the names are unique.
		v.holds = append(v.holds, namedHold{d.Name, hold{permits: d.Permits, fallback: d.LapsedLimit(), requestTimeout: d.RequestTimeout.D()}})
	}
	return v
}

// foreignHold is what an agent reported holding from another manager incarnation (an older
// epoch) or from its bootstrap file (epoch 0), before it accepted anything from this one.
type foreignHold struct {
	epoch     int64
	bootstrap bool
	// leaseEnd bounds when the holding's last lease may end: for another manager, which stopped
	// pushing before this engine started (leader election), foreignLeaseEnd; for a generation
	// this engine forgot (relearn), a leaseWindow from when it met the agent again.
	leaseEnd time.Time
	holds    map[string]foreignDS
}

type foreignDS struct {
	permits   int32 // assigned
	effective int32 // in force when reported (the bootstrap runs on safe defaults)
}

// quotaState is one DownstreamQuota's desired state and ledger.
type quotaState struct {
	key               types.NamespacedName
	uid               types.UID     // of the DownstreamQuota object last set; "" when not given
	deleted           bool          // the object was deleted; the ledger lives on until it counts nothing
	desired           DesiredQuota  // deep copy; Pods is not kept
	maxRequestTimeout time.Duration // the longest the quota was ever given: recovery waits it out
	entries           map[types.UID]*entry
	resort            bool // entries changed since sorted was built

	// listedAt is when this engine first got the quota's pods: a pod deleted before then is not
	// in its ledger, and its calls end a request timeout later (ledger.settled).
	listedAt time.Time
	// blockUntil: the recovery window stays open until then at least; an entry released while
	// it was not settled left its bound here (releaseUnsettled).
	blockUntil time.Time
	sorted     []*entry

	changeAt      time.Time // when the desired permits last changed
	rebalancing   bool
	lastRebalance time.Duration

	wakeAt  time.Time // next time the ledger's counts may change by themselves
	dirty   bool      // marked for a replan at the next flush
	summary uint64    // hash of what Report shows, to detect changes
}

func (q *quotaState) entryList() []*entry {
	if q.resort || q.sorted == nil {
		q.sorted = q.sorted[:0]
		for _, e := range q.entries {
			q.sorted = append(q.sorted, e)
		}
		sortEntries(q.sorted)
		q.resort = false
	}
	return q.sorted
}

// entryList is the pod's entries by quota name.
func (p *podState) entryList() []*entry {
	es := make([]*entry, 0, len(p.entries))
	for _, e := range p.entries {
		es = append(es, e)
	}
	slices.SortFunc(es, func(a, b *entry) int { return cmp.Compare(a.quota.key.Name, b.quota.key.Name) })
	return es
}

func sortEntries(es []*entry) {
	slices.SortFunc(es, func(a, b *entry) int {
		if c := cmp.Compare(a.pod.name, b.pod.name); c != 0 {
			return c
		}
		return cmp.Compare(a.pod.uid, b.pod.uid)
	})
}

// entry is one pod's line in one quota's ledger.
type entry struct {
	quota *quotaState
	pod   *podState

	present           bool // listed in the quota's desired pods
	desired           DesiredPod
	target            string // workload name
	terminating       bool
	safeDefault       int32         // desired safe default
	maxRequestTimeout time.Duration // the longest request timeout this pod was ever given for the quota

	grant int32 // permits decided for the pod (in its content), reserved in the ledger

	inflight   int32 // calls in flight for this downstream at the last report
	inflightAt time.Time
	// observing: the last report said the downstream is under Observe (its calls are admitted
	// beyond the permits; see held and docs/protocol.md §11b).
	observing bool
	requests  int64 // the agent's request counter at the last report (it only grows within a process)
	// demand: what the agent last reported queued and refused for lack of a permit (its counter
	// since it started), and its lanes; for demand-aware sharing and status only, never counted.
	waiting int32
	refused int64
	lanes   []assignment.LaneState
	// secondsEnd, seconds: the per-second call counts last reported, for status only.
	secondsEnd int64
	seconds    []int32

	// carry is what the pod's previous agent process may still have running after the agent
	// restarted (its state went backwards): counted on top of everything else until carryUntil.
	carry      int32
	carryUntil time.Time
}

// podState is one pod's agent as the engine knows it, across quotas.
type podState struct {
	uid           types.UID
	name          string
	namespace     string
	endpoint      string
	endpointSince time.Time // when this engine first saw it with an endpoint (DesiredPod.Since if earlier); zero if never
	bootstrap     bool      // DesiredPod.Bootstrap
	entries       map[types.NamespacedName]*entry
	goneAt        time.Time // when the pod stopped being listed by any quota; zero while listed
	finalPush     bool      // every quota of the pod was deleted: push it an empty assignment, then forget it
	// orphaned: the pod left every quota only because they were deleted, not because the
	// controller stopped listing it: it is alive as far as the engine knows, and its agent keeps
	// what it holds (its fallback included) until it acknowledges something lower. Not gone.
	orphaned bool
	removed  bool

	gen     int64                  // generation of content
	content *assignment.Assignment // what the pod should hold now; nil before the epoch is known
	dirty   bool

	// What the agent reported.
	known      bool // answered at least once
	configured bool
	instance   string // the agent process of the last report (assignment.State.Instance)
	// batchSig: the last report advertised assignment.CapabilityBatchSignatures (its requests
	// may be signed in a batch with others).
	batchSig bool
	// observe: the last report advertised assignment.CapabilityObserve: the pod may be sent
	// Downstream.Observe and dry-run switches (an older agent's strict decoding refuses them).
	observe bool
	// rampRaise: the last report advertised assignment.CapabilityRampRaise: the pod may be sent
	// Downstream.RampRaise (an older agent's strict decoding refuses it).
	rampRaise bool
	lastEpoch int64 // the (epoch, generation) of the last report, to notice a restarted agent
	lastGen   int64
	reportAt  time.Time // when the last report arrived
	ackedGen  int64     // this epoch's generation the agent held at its last report; 0 if none
	okGen     int64     // generation of the last successful PUT (0: content must be pushed)
	versions  []*version
	foreign   *foreignHold

	// An answer claiming an epoch above the engine's (claims.go). claimSeq numbers the claim
	// while it waits for the epoch record (0: none waiting); claimedEpoch is the epoch claimed;
	// misbehaving is set once the record refuted it, until the agent answers with an epoch that
	// is not above the engine's; claimEventAt is when the last Event about it was raised.
	claimSeq     uint64
	claimedEpoch int64
	misbehaving  bool
	claimEventAt time.Time

	// Requests.
	busy     *work
	queued   bool
	band     int // the band it was last queued in (readyQueue)
	failures int
	retryAt  time.Time
	renewAt  time.Time
	pollAt   time.Time
	wakeAt   time.Time
}

// hadEndpoint says whether the pod had an endpoint once (it may be calling).
func (p *podState) hadEndpoint() bool { return !p.endpointSince.IsZero() }

func (p *podState) present() bool {
	for _, e := range p.entries {
		if e.present {
			return true
		}
	}
	return false
}

func (p *podState) version(gen int64) *version {
	for _, v := range p.versions {
		if v.gen == gen {
			return v
		}
	}
	return nil
}

// held bounds the permits the entry's pod may be using for the quota, now or at any later time
// unless the engine sends it something new, leaving aside the entry's grant: the pod counts
// carry + max(n, phantom, grant), where n bounds what it surely may hold and phantom what it
// may hold unseen. It also returns the earliest later time at which that may drop (zero if
// never).
//
//   - Calls reported in flight at the last report stay counted for a request timeout
//     (a call that started before the report ends by then).
//   - Every version the agent may hold (sent and not retired by a report of a newer generation)
//     counts its permits until its lease may have ended plus a request timeout, then its
//     fallback while the pod exists, and for a request timeout after the pod is gone.
//   - Holdings of another manager count like a version whose lease ends a lease window
//     (leaseWindow: PushTimeout + AcceptGrace + LeaseTTL) after this engine started: what the agent enforced
//     when it answered surely, its permits as a phantom bound (its lease may have lapsed). A
//     bootstrap file never raises, so it counts at what it enforced.
//   - A pod that has had an IP but never answered may run on a bootstrap file (when it has one)
//     or on the fallback of a previous manager's assignment (when it had its IP before that
//     manager's last push could land, mayPredate): its safe default as a phantom, until a lease
//     window plus a request timeout after it is gone. So may a pod whose last report came before
//     a previous manager's last push could land (mayHoldLateForeign). A pod without a bootstrap
//     file that got its IP later holds nothing before it answers: only this engine configures
//     it, and it never pushes a pod that has not answered.
//   - When an agent restarted, the calls of its previous process may still run for a request
//     timeout, on top of what the new process admits: the bound before the restart is carried
//     and added.
func (l *ledger) held(e *entry, now time.Time) (n, phantom, carry int32, next time.Time) {
	p := e.pod
	name := e.quota.key.Name
	gone := !p.goneAt.IsZero() && !p.orphaned
	window := l.opts.leaseWindow()
	// count adds val while now < end (forever when end is zero) and notes when it drops.
	count := func(val int32, end time.Time) {
		if val <= 0 {
			return
		}
		if end.IsZero() {
			n = max(n, val)
			return
		}
		if now.Before(end) {
			n = max(n, val)
			next = minTime(next, end)
		}
	}
	// lease counts permits until leaseEnd + rt, then fallback while the pod exists and until
	// rt after it is gone (a call started just before it went may still run).
	lease := func(permits int32, leaseEnd time.Time, rt time.Duration, fallback int32) {
		count(permits, leaseEnd.Add(rt))
		if gone {
			count(fallback, p.goneAt.Add(rt))
		} else {
			count(fallback, time.Time{})
		}
	}
	// The in-flight term bounds the calls the agent's semaphore admitted (Lemma 1). Calls admitted
	// under Observe are bounded by nothing: while the quota is Observe and the agent says it
	// observes, they are not counted, so that what they run beyond the grant neither shows as an
	// oversubscribed ledger nor holds back other pods' permits (the grant stays reserved: counted
	// is at least it). Once the quota is Enforce they are counted again at once, on the last
	// report, and the Enforce acknowledgement reports them all (§11b).
	if !e.inflightAt.IsZero() && (!e.observing || !e.quota.desired.Downstream.Observe) {
		count(e.inflight, e.inflightAt.Add(e.maxRequestTimeout))
	}
	for _, v := range p.versions {
		if h, ok := v.hold(name); ok {
			lease(h.permits, v.leaseEnd(), max(h.requestTimeout, e.maxRequestTimeout), h.fallback)
		}
	}
	if f := p.foreign; f != nil {
		if h, ok := f.holds[name]; ok {
			switch {
			case f.bootstrap && gone:
				count(h.effective, p.goneAt.Add(window+e.maxRequestTimeout))
			case f.bootstrap:
				count(h.effective, time.Time{})
			default:
				// What it enforced when it answered is surely held; its permits are only a bound
				// (its lease may have lapsed already, or lapse before that of another manager).
				// Whether its downstream failed closed is not reported: count it open (the larger).
				fb := assignment.LapsedLimit(h.permits, e.safeDefault, false)
				lease(h.effective, f.leaseEnd, e.maxRequestTimeout, fb)
				if end := f.leaseEnd.Add(e.maxRequestTimeout); now.Before(end) && h.permits > h.effective {
					phantom = max(phantom, h.permits)
					next = minTime(next, end)
				}
			}
		}
	}
	if (!p.known && p.hadEndpoint() && (p.bootstrap || l.mayPredate(p))) || l.mayHoldLateForeign(p) {
		if !gone {
			phantom = max(phantom, e.safeDefault)
		} else if end := p.goneAt.Add(window + e.maxRequestTimeout); now.Before(end) {
			phantom = max(phantom, e.safeDefault)
			next = minTime(next, end)
		}
	}
	if e.carry > 0 && now.Before(e.carryUntil) {
		carry = e.carry
		next = minTime(next, e.carryUntil)
	}
	return n, phantom, carry, next
}

// foreignLandEnd is when the last push of a previous manager may land by: it stopped pushing
// before this engine started (leader election), so engine start + landWindow.
func (l *ledger) foreignLandEnd() time.Time { return l.startedAt.Add(l.opts.landWindow()) }

// foreignLeaseEnd is when the last lease of a previous manager may end by: engine start +
// leaseWindow.
func (l *ledger) foreignLeaseEnd() time.Time { return l.startedAt.Add(l.opts.leaseWindow()) }

// mayHoldLateForeign says whether the pod may hold an assignment of a previous manager that the
// engine has not seen: its last report came before foreignLandEnd (engine start + landWindow: a
// push the previous manager sent before this engine started may land until then) and it has not
// acknowledged this epoch (which would fence such a push off). Its lease has lapsed by the end of
// recovery; then it runs on a fallback, at most its safe default.
func (l *ledger) mayHoldLateForeign(p *podState) bool {
	return l.started && p.known && p.ackedGen == 0 && p.reportAt.Before(l.foreignLandEnd())
}

// mayPredate says whether a previous manager may have configured the pod: the engine saw it
// with an endpoint before foreignLandEnd (or has not started).
func (l *ledger) mayPredate(p *podState) bool {
	return !l.started || p.endpointSince.Before(l.foreignLandEnd())
}

// counted is what the ledger counts for the entry now.
func (l *ledger) counted(e *entry, now time.Time) int32 {
	n, phantom, carry, _ := l.held(e, now)
	return carry + max(n, phantom, e.grant)
}

func minTime(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

func maxTime(ts ...time.Time) time.Time {
	var m time.Time
	for _, t := range ts {
		if t.After(m) {
			m = t
		}
	}
	return m
}
