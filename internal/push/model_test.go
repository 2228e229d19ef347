package push

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/builders"
)

// modelAgent is what an agent does, without HTTP: fencing by (epoch, generation), a lease from
// acceptance, the fallback when it lapses, and calls that hold permits.
type modelAgent struct {
	instance   string    // assignment.State.Instance
	started    time.Time // the process's start, for assignment.State.Uptime; zero: not reported
	epoch, gen int64
	configured bool
	a          *assignment.Assignment
	acceptedAt time.Time
	dead       bool
	// inflight is set by hand in scenario tests; calls is used by the property test.
	inflight map[string]int32
	calls    []modelCall
	requests map[string]int64 // calls started, per downstream, since this process started
	// inc counts, per downstream, how often an assignment removed it: a removed downstream's
	// calls run on at the downstream but are no longer reported, and one added again starts
	// from an empty semaphore and zero counters, as in package enforce.
	inc map[string]int
	// batch: the agent advertises assignment.CapabilityBatchSignatures, CapabilityObserve and
	// CapabilityRampRaise (every other one does).
	batch bool
	// claim, when set, is the epoch every answer claims (a lying pod); the agent behind it still
	// applies what it is sent.
	claim int64
	// secondsEnd and seconds, when set by a test, are the per-second counts every downstream
	// reports.
	secondsEnd int64
	seconds    []int32
}

type modelCall struct {
	ds  string
	end time.Time
}

func newModelAgent() *modelAgent {
	// Every model process has an instance id of its own, as real agents do; tests may clear it
	// to model agents that do not report one.
	n := modelInstances.Add(1)
	return &modelAgent{instance: fmt.Sprintf("m%d", n), inflight: map[string]int32{}, requests: map[string]int64{}, inc: map[string]int{}, batch: n%2 == 0}
}

var modelInstances atomic.Int64

func (m *modelAgent) leaseValid(now time.Time) bool {
	return m.a != nil && now.Before(m.acceptedAt.Add(m.a.LeaseTTL.D()))
}

// limit is the permits in force for a downstream now.
func (m *modelAgent) limit(ds string, now time.Time) int32 {
	if m.a == nil || m.dead {
		return 0
	}
	for _, d := range m.a.Downstreams {
		if d.Name != ds {
			continue
		}
		if m.leaseValid(now) {
			return d.Permits
		}
		return d.LapsedLimit()
	}
	return 0
}

func (m *modelAgent) inFlight(ds string, now time.Time) int32 {
	n := m.inflight[ds]
	for _, c := range m.calls {
		if c.ds == ds && now.Before(c.end) {
			n++
		}
	}
	return n
}

func (m *modelAgent) state(now time.Time) *assignment.State {
	st := &assignment.State{Instance: m.instance, Epoch: m.epoch, Generation: m.gen, Configured: m.configured, LeaseExpired: m.a != nil && !m.leaseValid(now)}
	if m.claim != 0 {
		st.Epoch = m.claim
	}
	if m.batch {
		st.Capabilities = []string{assignment.CapabilityBatchSignatures, assignment.CapabilityObserve,
			assignment.CapabilityRampRaise}
	}
	if !m.started.IsZero() {
		st.Uptime = assignment.Duration(max(now.Sub(m.started), time.Millisecond))
	}
	if m.a != nil {
		for _, d := range m.a.Downstreams {
			st.Downstreams = append(st.Downstreams, assignment.DownstreamState{
				Name: d.Name, Permits: d.Permits, EffectivePermits: m.limit(d.Name, now), InFlight: m.inFlight(d.Name, now),
				Requests: m.requests[d.Name], Observe: d.Observe, SecondsEnd: m.secondsEnd, Seconds: m.seconds,
			})
		}
	}
	return st
}

// put applies a push as the agent would.
func (m *modelAgent) put(a *assignment.Assignment, now time.Time) (*assignment.State, error) {
	if a.Epoch < m.epoch || (a.Epoch == m.epoch && a.Generation < m.gen) ||
		(a.Instance != "" && a.Instance != m.instance) {
		return nil, &assignment.StaleError{State: *m.state(now)}
	}
	if m.a != nil {
		for _, d := range m.a.Downstreams {
			if !slices.ContainsFunc(a.Downstreams, func(n assignment.Downstream) bool { return n.Name == d.Name }) {
				m.inc[d.Name]++
				m.calls = slices.DeleteFunc(m.calls, func(c modelCall) bool { return c.ds == d.Name })
				delete(m.inflight, d.Name)
				delete(m.requests, d.Name)
			}
		}
	}
	m.epoch, m.gen, m.configured, m.a, m.acceptedAt = a.Epoch, a.Generation, true, a, now
	return m.state(now), nil
}

// harness drives a core by hand with a fake time and model agents.
type harness struct {
	t      testing.TB
	o      Options
	c      *core
	now    time.Time
	agents map[string]*modelAgent // by endpoint
	// policy is how requests to an endpoint end in settle; ok when absent.
	policy map[string]outcome
	// sent records every request started, in order, and outcomes how each ended.
	sent     []*work
	outcomes map[*work]outcome
	// check runs after every step (Σ counted ≤ limit).
	check func()
}

const (
	hTTL  = 10 * time.Second
	hRT   = 30 * time.Second
	hPT   = time.Second
	hAG   = time.Second
	hWin  = hPT + hAG + hTTL // lease window of an unanswered push
	hPoll = 250 * time.Millisecond
)

func newHarness(t testing.TB, mut func(*Options)) *harness {
	o := Options{
		Client:      nopClient{},
		Epoch:       EpochFunc(nil),
		LeaseTTL:    hTTL,
		RenewEvery:  3 * time.Second,
		PushTimeout: hPT,
		AcceptGrace: hAG,
		RetryBase:   100 * time.Millisecond,
		RetryMax:    time.Second,
		DrainPoll:   hPoll,
		jitter:      func(d time.Duration) time.Duration { return d },
	}
	if mut != nil {
		mut(&o)
	}
	if err := o.setDefaults(); err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, o: o, now: time.Date(2026, 7, 1, 12, 0, 0, 0, time.UTC), agents: map[string]*modelAgent{}, policy: map[string]outcome{}, outcomes: map[*work]outcome{}}
	h.c = newCore(&h.o, nil)
	h.check = func() { h.checkLedger() }
	return h
}

type nopClient struct{}

func (nopClient) Push(context.Context, assignment.Endpoint, *assignment.Assignment) (*assignment.State, error) {
	return nil, fmt.Errorf("nop")
}

func (nopClient) State(context.Context, assignment.Endpoint, int64) (*assignment.State, error) {
	return nil, fmt.Errorf("nop")
}

func (h *harness) agent(endpoint string) *modelAgent {
	m := h.agents[endpoint]
	if m == nil {
		m = newModelAgent()
		h.agents[endpoint] = m
	}
	return m
}

func (h *harness) begin(epoch int64) {
	h.c.begin(epoch, h.now)
	h.check()
}

func (h *harness) set(d DesiredQuota) {
	h.c.setQuota(d, h.now)
	h.check()
}

// advance moves the clock and fires the core's timers.
func (h *harness) advance(d time.Duration) {
	h.now = h.now.Add(d)
	h.c.advance(h.now)
	h.check()
}

// start pops every ready pod and starts its request.
func (h *harness) start() []*work {
	var ws []*work
	for h.c.sched.hasReady() {
		if w := h.c.startWork(h.c.sched.popReady(), h.now); w != nil {
			ws = append(ws, w)
			h.sent = append(h.sent, w)
		}
	}
	h.check()
	return ws
}

type outcome int

const (
	ok      outcome = iota // delivered and answered
	lost                   // delivered (a push lands) but the answer is lost: a timeout
	dropped                // never arrived: a transport error
	refused                // a 4xx answer
)

// finish completes a request with an outcome against the model agent.
func (h *harness) finish(w *work, how outcome) {
	h.outcomes[w] = how
	m := h.agent(w.to.URL)
	var st *assignment.State
	var err error
	switch how {
	case ok, lost:
		if m.dead {
			err = fmt.Errorf("connection refused")
			break
		}
		if w.kind == kindPush {
			st, err = m.put(w.assignment, h.now)
		} else {
			st = m.state(h.now)
		}
		if how == lost {
			st, err = nil, fmt.Errorf("context deadline exceeded")
		}
	case dropped:
		err = fmt.Errorf("connection refused")
	case refused:
		err = &assignment.StatusError{StatusCode: 403}
	}
	h.c.finishWork(w, st, err, h.now)
	h.c.flush(h.now)
	h.check()
}

// settle runs every ready request, ending as h.policy says, until nothing is ready (bounded).
func (h *harness) settle() {
	for i := 0; i < 100; i++ {
		ws := h.start()
		if len(ws) == 0 {
			return
		}
		for _, w := range ws {
			h.finish(w, h.policy[w.to.URL])
		}
	}
	h.t.Fatalf("did not settle")
}

// runFor advances the clock by d in steps of 50ms, settling after each.
func (h *harness) runFor(d time.Duration) {
	end := h.now.Add(d)
	for h.now.Before(end) {
		h.advance(min(50*time.Millisecond, end.Sub(h.now)))
		h.settle()
	}
}

// requestsTo lists every request started to endpoint, in order.
func (h *harness) requestsTo(endpoint string) []*work {
	var out []*work
	for _, w := range h.sent {
		if w.to.URL == endpoint {
			out = append(out, w)
		}
	}
	return out
}

// pushesTo lists the permits of downstream "q" in every push started to endpoint, in order.
func (h *harness) pushesTo(endpoint string) []int32 {
	var out []int32
	for _, w := range h.sent {
		if w.to.URL != endpoint || w.kind != kindPush {
			continue
		}
		for _, d := range w.assignment.Downstreams {
			if d.Name == "q" {
				out = append(out, d.Permits)
			}
		}
	}
	return out
}

func (h *harness) report(ns, name string) Report {
	return h.c.reports.report(types.NamespacedName{Namespace: ns, Name: name}, h.now)
}

// checkLedger asserts Σ counted ≤ limit for every quota, leaving out what the engine does not
// grant and cannot prevent: holdings it cannot see (pods that never answered, counted at their
// safe default in case a bootstrap file runs them) and the calls a restarted agent's old process
// may still run.
// Tests that lower a limit replace it.
func (h *harness) checkLedger() {
	h.t.Helper()
	for key, q := range h.c.quotas {
		var sum int64
		for _, e := range q.entries {
			hd, _, _, _ := h.c.ledger.held(e, h.now)
			sum += int64(max(hd, e.grant))
		}
		if sum > int64(q.desired.Limit) {
			h.t.Fatalf("%s: ledger %d > limit %d at %s: %+v", key, sum, q.desired.Limit, h.now.Format("15:04:05.000"), h.c.reports.report(key, h.now).Holdings)
		}
	}
}

// leaseBound is when the last lease a push of permits to endpoint may have started surely
// lapsed plus a request timeout: answered pushes hold from the answer, unanswered ones from
// their acceptance bound.
func (h *harness) leaseBound(endpoint string, permits int32) time.Time {
	var end time.Time
	for _, w := range h.sent {
		if w.to.URL != endpoint || w.kind != kindPush || w.assignment.Downstreams[0].Permits != permits {
			continue
		}
		switch h.outcomes[w] {
		case ok:
			end = maxTime(end, w.sentAt.Add(hTTL))
		case lost, dropped:
			end = maxTime(end, w.sentAt.Add(hWin))
		}
	}
	return end.Add(hRT)
}

func (h *harness) holding(r Report, pod string) Holding {
	h.t.Helper()
	i := slices.IndexFunc(r.Holdings, func(x Holding) bool { return x.Pod == pod })
	if i < 0 {
		h.t.Fatalf("no holding for %s in %+v", pod, r.Holdings)
	}
	return r.Holdings[i]
}

func hasHolding(r Report, pod string) bool {
	return slices.ContainsFunc(r.Holdings, func(x Holding) bool { return x.Pod == pod })
}

// quota builds a DesiredQuota "ns/q" with pods named p0..p(n-1) of target "web" at endpoint
// "http://p<i>", each with permits and safe default.
func quota(limit int32, n int, permits, sd int32) DesiredQuota {
	d := DesiredQuota{
		Key:        types.NamespacedName{Namespace: "ns", Name: "q"},
		Limit:      limit,
		Downstream: template("q"),
	}
	for i := range n {
		d.Pods = append(d.Pods, pod(i, permits, sd))
	}
	return d
}

func pod(i int, permits, sd int32) DesiredPod {
	name := fmt.Sprintf("p%d", i)
	return DesiredPod{Name: name, UID: types.UID("uid-" + name), Target: "web", Endpoint: "http://" + name, Permits: permits, SafeDefault: sd}
}

// template is the quota's per-pod enforcement, as the controller builds it: the shared test
// builder's downstream with the harness's request timeout. (DesiredQuota and DesiredPod are
// built here, not in internal/testing/builders: that package cannot import push, whose own
// tests import it.)
func template(name string) assignment.Downstream {
	return builders.MakeDownstream(name).RequestTimeout(hRT).Obj()
}
