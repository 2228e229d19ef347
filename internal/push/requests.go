package push

import (
	"errors"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// This file holds a request's lifecycle: startWork turns a ready pod into a request (reserving
// a push's version in the ledger first) and finishWork applies its outcome.

type workKind int

const (
	kindNone  workKind = iota
	kindProbe          // GET /v1/state of a pod the engine does not know yet
	kindPush           // PUT /v1/assignment: a change, a retry or a renewal
	kindPoll           // GET /v1/state of a pod that is draining calls above its permits
)

func (k workKind) String() string {
	switch k {
	case kindProbe:
		return "probe"
	case kindPush:
		return "push"
	case kindPoll:
		return "poll"
	}
	return "none"
}

// work is one request to one agent.
type work struct {
	pod        *podState
	kind       workKind
	assignment *assignment.Assignment // kindPush: the snapshot sent
	version    *version               // kindPush
	// body is assignment's JSON when the version already has it for the assignment's instance
	// (a renewal): the engine encodes a push once per version and agent process, and reuses it
	// (work.encoded).
	body   []byte
	sentAt time.Time
	// to (the pod's endpoint then) and epoch are what the request is addressed to and signed
	// for (read under the engine's lock); out is the push when it was signed in a batch before
	// it was sent, and deadline (real time, socketDeadline) when it ends: PushTimeout after it
	// was started.
	to       assignment.Endpoint
	epoch    int64
	out      *assignment.Outgoing
	deadline time.Time
	// unproven: the request was queued in bandUnproven; it counts against the bounds of
	// unproven requests of its flow (readyQueue) until finishWork.
	unproven bool
}

// startWork turns a ready pod (scheduler.popReady) into a request. For a push it reserves the version in
// the ledger before anything is sent: from here on the agent may hold it. The request is held by
// the pod's flow (readyQueue.acquire) until finishWork. nil for nil.
func (c *core) startWork(p *podState, now time.Time) *work {
	if p == nil {
		return nil
	}
	p.queued = false
	at, kind := c.sched.due(p, now)
	if kind == kindNone || at.After(now) {
		c.sched.schedule(p, now)
		return nil
	}
	w := &work{pod: p, kind: kind, sentAt: now, epoch: c.ledger.epoch, unproven: p.band == bandUnproven,
		to: assignment.Endpoint{URL: p.endpoint, Pod: p.namespace + "/" + p.name}}
	if kind == kindPush && p.failures == 0 && p.content.Generation == p.okGen && !p.renewAt.IsZero() {
		c.renewalStarted(p, now.Sub(p.renewAt))
	}
	if kind == kindPush {
		v := p.version(p.content.Generation)
		if v == nil {
			v = newVersion(p.content)
			p.versions = append(p.versions, v)
		}
		v.sendEnd = now.Add(c.opts.leaseWindow())
		// Address the push to the agent process last seen, so that a restarted one refuses it
		// (409) and reports itself before it is granted anything; see assignment.Assignment.Instance.
		a := *p.content
		a.Instance = p.instance
		w.assignment, w.version = &a, v
		if v.body != nil && v.bodyInstance == a.Instance {
			w.body = v.body
		}
	}
	p.busy = w
	c.sched.ready.acquire(p.namespace, w.unproven)
	return w
}

// renewalStarted notes how long after it was due a renewal started (the renewal delay metric;
// the hostile-pods test reads it through onRenewal).
func (c *core) renewalStarted(p *podState, late time.Duration) {
	late = max(late, 0)
	if c.metrics != nil {
		c.metrics.renewalDelay.Observe(late.Seconds())
	}
	if c.onRenewal != nil {
		c.onRenewal(p, late)
	}
}

// batchable says whether a started request may be signed in a batch with others: a renewal
// (renewing) that re-sends bytes already sent to this agent process.
func batchable(w *work) bool {
	return w.kind == kindPush && w.body != nil && renewing(w.pod)
}

// renewing says whether the pod's next push is a renewal that may be signed in a batch: its
// content is acknowledged, its agent advertised batch signatures and answered the last request.
// After a failure the next request is signed alone, as every agent verifies it: the agent may
// have been replaced by one without them.
func renewing(p *podState) bool {
	return p.batchSig && p.failures == 0 && p.content != nil && p.content.Generation == p.okGen
}

// startRenewals starts up to limit of the ready renewals that batchable would allow, taken in
// the fair queue's order (readyQueue.popRenewal: the flow holding the fewest requests first), and
// leaves the other ready requests queued in theirs.
func (c *core) startRenewals(limit int, now time.Time) []*work {
	var out []*work
	ok := func(p *podState) bool { return c.sched.renewalReady(p, now) }
	for len(out) < limit {
		p := c.sched.ready.popRenewal(ok)
		if p == nil {
			break
		}
		if w := c.startWork(p, now); w != nil {
			out = append(out, w)
		}
	}
	return out
}

// renewalReady says whether a ready pod's request would be batchable once started.
func (s *scheduler) renewalReady(p *podState, now time.Time) bool {
	if !renewing(p) {
		return false
	}
	if v := p.version(p.content.Generation); v == nil || v.body == nil || v.bodyInstance != p.instance {
		return false
	}
	_, kind := s.due(p, now)
	return kind == kindPush
}

// landed says whether a failed request may still have been accepted by the agent: only a
// definite refusal (a 4xx answer, or an assignment the client refused to send) may not.
func landed(err error) bool {
	var se *assignment.StatusError
	if errors.As(err, &se) && se.StatusCode >= 400 && se.StatusCode < 500 {
		return false
	}
	return len(assignment.FieldErrors(err)) == 0
}

// finishWork applies a request's outcome: st on success, err otherwise. The pod's quotas are
// replanned at the next flush.
func (c *core) finishWork(w *work, st *assignment.State, err error, now time.Time) {
	p := w.pod
	p.busy = nil
	c.sched.ready.release(p.namespace, w.unproven)
	if w.version != nil {
		w.version.sendEnd = time.Time{}
	}
	if p.removed || c.ledger.fenced {
		return
	}
	var stale *assignment.StaleError
	if !errors.As(err, &stale) {
		stale = nil
	}
	if epoch := claimed(c.ledger.epoch, st, stale); epoch > 0 && (err == nil || stale != nil) {
		// Not believed until the epoch record says so (claims.go), whatever the answer's shape.
		if c.claims.claim(w, epoch, now) {
			c.removePod(w.pod)
		}
		return
	}
	switch {
	case err == nil && st != nil && quietRenewal(c.ledger.epoch, w, st):
		c.renewQuietly(w, st, now)
		return
	case err == nil && st != nil:
		if w.kind == kindPush {
			w.version.okEnd = maxTime(w.version.okEnd, now.Add(c.opts.LeaseTTL))
			p.renewAt = c.sched.nextRenewal(w.sentAt)
			if st.Epoch == c.ledger.epoch && st.Generation == w.version.gen {
				p.okGen = w.version.gen
			}
		}
		p.failures, p.retryAt = 0, time.Time{}
		c.applyState(p, st, now)
		if w.kind == kindPush && len(p.entries) == 0 && p.finalPush && p.okGen == p.gen {
			c.removePod(p)
			return
		}
	case stale != nil:
		p.failures, p.retryAt = 0, time.Time{}
		c.applyState(p, &stale.State, now)
	default:
		if w.version != nil && landed(err) {
			w.version.failEnd = maxTime(w.version.failEnd, w.sentAt.Add(c.opts.leaseWindow()))
		}
		p.failures++
		p.retryAt = now.Add(c.sched.backoff(p.failures))
		lvl := 1
		if p.failures == c.opts.UnreachableAfter {
			lvl = 0
		}
		c.log.V(lvl).Info("agent request failed", "pod", p.namespace+"/"+p.name, "endpoint", w.to.URL,
			"request", w.kind.String(), "failures", p.failures, "error", err.Error())
		if len(p.entries) == 0 && c.ledger.unreachable(p) {
			c.removePod(p)
			return
		}
	}
	if c.ledger.fenced {
		return
	}
	for _, e := range p.entries {
		c.marks.markQuota(e.quota)
	}
	c.marks.markDirty(p)
}

// encoded notes the JSON the request sent (encoded outside the lock, by the Engine's worker) so
// that the version's next send to the same agent process reuses it.
func (w *work) encoded(body []byte) {
	if w.version != nil && body != nil {
		w.version.body, w.version.bodyInstance = body, w.assignment.Instance
	}
}

// quietRenewal says whether an answered push is a renewal that tells the engine nothing new
// (docs/protocol.md §4, "Quiet renewals"): the same agent process acknowledged again the
// generation it had acknowledged, which is the pod's current content and the only version left
// (nothing to retire), the pod was not failing (its reachability does not change), no foreign
// holding is involved, and every calls-in-flight figure, the last one and this one, is within
// the pod's grant for its quota. Such an answer changes no input of a plan: the in-flight term
// of held never exceeds the grant, and counted = carry + max(held, phantom, grant) takes the
// larger, so it stays what it was; the lease bound of the version only moves later, which can
// only keep what the ledger counts. So the answer needs no replan of the pod's quotas and no
// rebuild of its content; renewQuietly notes it.
func quietRenewal(epoch int64, w *work, st *assignment.State) bool {
	p := w.pod
	if w.kind != kindPush || w.version == nil || !p.known || p.dirty || p.failures > 0 || p.foreign != nil || p.content == nil {
		return false
	}
	g := w.version.gen
	if st.Epoch != epoch || st.Generation != g || p.ackedGen != g || p.okGen != g || p.content.Generation != g ||
		p.lastEpoch != epoch || p.lastGen != g {
		return false
	}
	if st.Instance == "" || st.Instance != p.instance || !st.Configured || !p.configured {
		return false
	}
	if len(p.versions) != 1 || p.versions[0] != w.version {
		return false
	}
	for k, e := range p.entries {
		if e.inflight > e.grant {
			return false
		}
		var in int32
		for _, d := range st.Downstreams {
			if d.Name == k.Name {
				if d.Requests < e.requests {
					return false // a counter went backwards: another process (restarted)
				}
				in = max(d.InFlight, 0)
				break
			}
		}
		if in > e.grant {
			return false
		}
	}
	return true
}

// renewQuietly applies a quiet renewal's answer (quietRenewal): the version's lease bound, the
// next renewal, the report's time and what the agent's state says of each entry (calls in
// flight, waiting, refused, lanes). The pod's quotas keep their plan and
// their timers: the next one that fires replans them with the later lease bound.
func (c *core) renewQuietly(w *work, st *assignment.State, now time.Time) {
	p := w.pod
	var before []int32
	if c.onQuiet != nil {
		before = c.ledger.quietCounts(p, now)
	}
	w.version.okEnd = maxTime(w.version.okEnd, now.Add(c.opts.LeaseTTL))
	p.renewAt = c.sched.nextRenewal(w.sentAt)
	p.retryAt = time.Time{}
	p.reportAt = now
	p.pollAt = now.Add(c.opts.DrainPoll)
	// The same observation as a full answer's: demand-aware sharing and the lanes' status read
	// the waiting, refused and lane figures of every answer, quiet or not.
	observeEntries(p, st, now)
	if c.metrics != nil {
		c.metrics.quietRenewals.Inc()
	}
	if c.onQuiet != nil {
		c.onQuiet(p, before, c.ledger.quietCounts(p, now))
	}
	c.sched.schedule(p, now)
}

// quietCounts is, for tests of quiet renewals, what each of the pod's entries is counted at and
// would be granted by a plan of its quota now, in the order of the pod's entry list.
func (l *ledger) quietCounts(p *podState, now time.Time) []int32 {
	var out []int32
	for _, e := range p.entryList() {
		entries := e.quota.entryList()
		pe := l.planInput(entries, now)
		grants := plan(e.quota.desired.Limit, l.recovering(e.quota, now), pe)
		for i, x := range entries {
			if x == e {
				out = append(out, l.counted(e, now), grants[i])
			}
		}
	}
	return out
}
