package proxy

import (
	"context"
	"net/http"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/agent/breaker"
	"github.com/apportion/apportion/internal/agent/deadline"
	"github.com/apportion/apportion/internal/agent/degrade"
	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/assignment"
)

// The admission pipeline on its own: an Enforcer holding the downstream, a fake clock, no HTTP.

type admitRig struct {
	clk *clocktesting.FakeClock
	enf *enforce.Enforcer
	m   *metrics.Metrics
}

func newAdmitRig(t *testing.T, sw []assignment.Switch, d assignment.Downstream) *admitRig {
	t.Helper()
	r := &admitRig{clk: clocktesting.NewFakeClock(t0), m: metrics.New()}
	r.enf = enforce.New(enforce.Options{Clock: r.clk, Metrics: r.m, Logger: quietLogger()})
	if _, err := r.enf.Apply(&assignment.Assignment{Epoch: 1, Generation: 1, LeaseTTL: assignment.Duration(10 * time.Minute),
		Downstreams: []assignment.Downstream{d}, Switches: sw}, time.Time{}); err != nil {
		t.Fatalf("Apply: %v", err)
	}
	return r
}

func (r *admitRig) ds() *enforce.Downstream { return r.enf.Table().Lookup("d") }

// admit runs one call through the pipeline as ServeHTTP does.
func (r *admitRig) admit(ctx context.Context, method string) admission {
	return r.admitWithin(ctx, method, deadline.Budget{})
}

// admitWithin runs one call with the app's budget b.
func (r *admitRig) admitWithin(ctx context.Context, method string, b deadline.Budget) admission {
	ds := r.ds()
	return admit(ctx, r.clk, r.enf.Table(), ds, ds.Config(), degrade.RequestView{Method: method, Header: http.Header{}, Rand: func() uint32 { return 0 }}, b)
}

func (r *admitRig) rejected(t *testing.T, reason string) float64 {
	t.Helper()
	return metricValue(t, r.m, "apportion_agent_rejected_total", "downstream", "d", "reason", reason)
}

func (r *admitRig) inFlight() int { return r.ds().Sem.Stats().InFlight }

// openBreaker fails minCalls calls through the downstream's breaker, which opens it.
func (r *admitRig) openBreaker(t *testing.T, minCalls int) {
	t.Helper()
	br := r.ds().Breaker()
	for range minCalls {
		tk, _, ok := br.Allow(r.clk.Now())
		if !ok {
			t.Fatal("the breaker refused before it should have opened")
		}
		tk.Done(r.clk.Now(), true, 0)
	}
	if st := br.State(r.clk.Now()); st != breaker.Open {
		t.Fatalf("breaker %v, want open", st)
	}
}

func admitDownstream(permits int32) assignment.Downstream {
	return downstream("d", "http://upstream.invalid", permits)
}

func wantRefused(t *testing.T, ad admission, reason fallback.Reason, retryAfter time.Duration) {
	t.Helper()
	if ad.verdict != refused || ad.reason != reason || ad.retryAfter != retryAfter {
		t.Fatalf("admission = %+v, want refused %s with Retry-After %v", ad, reason, retryAfter)
	}
}

// 2. A matching degrade switch answers with its action before anything else is looked at.
func TestAdmitDegradeSwitch(t *testing.T) {
	d := withBreaker(admitDownstream(4), 2, 1, 30*time.Second)
	sw := []assignment.Switch{{Name: "ns/pause", Downstream: "d", ExpiresAt: t0.Add(time.Minute), Percent: 100,
		Methods: []string{"GET"}, Action: assignment.Fallback{Action: assignment.ActionStatic, Static: &assignment.StaticResponse{Status: 200, Body: "[]"}}}}
	r := newAdmitRig(t, sw, d)
	r.openBreaker(t, 2)
	ad := r.admit(context.Background(), http.MethodGet)
	wantRefused(t, ad, fallback.Degraded, time.Minute) // the switch expires within maxDegradeRetryAfter
	if ad.action.Action != fallback.Static || ad.at != t0 {
		t.Fatalf("degraded with %+v at %v, want the switch's Static at %v", ad.action, ad.at, t0)
	}
	if n := r.rejected(t, "degraded"); n != 1 {
		t.Fatalf("rejected{degraded} = %v", n)
	}
	// Outside the switch (another method): the open breaker refuses.
	wantRefused(t, r.admit(context.Background(), http.MethodPost), fallback.CircuitOpen, 30*time.Second)
}

// 3. An open breaker refuses before a rate token or a permit is taken, with the time left
// until it admits probes.
func TestAdmitOpenBreakerTakesNoTokenNorPermit(t *testing.T) {
	d := withBreaker(admitDownstream(4), 2, 1, 30*time.Second)
	d.Rate = &assignment.Rate{PerSecond: 1, Burst: 1, Mode: assignment.ModeTokenBucket}
	r := newAdmitRig(t, nil, d)
	r.openBreaker(t, 2)
	r.clk.Step(10 * time.Second)
	ad := r.admit(context.Background(), http.MethodGet)
	wantRefused(t, ad, fallback.CircuitOpen, 20*time.Second)
	if ad.action != &r.ds().Config().Fallback || ad.at != t0.Add(10*time.Second) {
		t.Fatalf("refused with %p at %v, want the downstream's fallback at t0+10s", ad.action, ad.at)
	}
	if r.inFlight() != 0 || r.rejected(t, "circuit-open") != 1 {
		t.Fatalf("in flight %d, rejected{circuit-open} %v", r.inFlight(), r.rejected(t, "circuit-open"))
	}
	// The rate token is still there: once the breaker admits a probe, the call goes through.
	r.clk.Step(20 * time.Second)
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("probe after openDuration = %+v, want admitted", ad)
	}
}

// 4. No rate token within AcquireTimeout: rate-limited, no permit taken, and Retry-After when the
// limiter's next token accrues.
func TestAdmitRateLimited(t *testing.T) {
	d := admitDownstream(4)
	d.Rate = &assignment.Rate{PerSecond: 1, Burst: 1, Mode: assignment.ModeTokenBucket}
	r := newAdmitRig(t, nil, d)
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("first call = %+v", ad)
	}
	wantRefused(t, r.admit(context.Background(), http.MethodGet), fallback.RateLimited, time.Second)
	r.clk.Step(700 * time.Millisecond)
	wantRefused(t, r.admit(context.Background(), http.MethodGet), fallback.RateLimited, 300*time.Millisecond)
	if r.inFlight() != 1 || r.rejected(t, "rate-limited") != 2 {
		t.Fatalf("in flight %d (want the first call's 1), rejected{rate-limited} %v (want 2)", r.inFlight(), r.rejected(t, "rate-limited"))
	}
}

// 5. No permit: at once when the effective limit is 0, else once AcquireTimeout passed on the
// clock.
func TestAdmitNoPermit(t *testing.T) {
	r := newAdmitRig(t, nil, admitDownstream(0))
	wantRefused(t, r.admit(context.Background(), http.MethodGet), fallback.NoPermit, 0)

	r = newAdmitRig(t, nil, admitDownstream(1))
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("first call = %+v", ad)
	}
	lease := r.clk.Waiters() // the lease's timer
	done := make(chan admission)
	go func() { done <- r.admit(context.Background(), http.MethodGet) }()
	waitFor(t, func() bool { return r.ds().Sem.Stats().Waiting == 1 && r.clk.Waiters() == lease+1 })
	r.clk.Step(50*time.Millisecond - time.Nanosecond)
	select {
	case ad := <-done:
		t.Fatalf("admission %+v before AcquireTimeout passed", ad)
	default:
	}
	r.clk.Step(time.Nanosecond)
	ad := <-done
	wantRefused(t, ad, fallback.NoPermit, 0)
	if ad.at != t0.Add(50*time.Millisecond) {
		t.Fatalf("refused at %v, want t0+50ms", ad.at)
	}
	if r.inFlight() != 1 || r.rejected(t, "no-permit") != 1 {
		t.Fatalf("in flight %d, rejected{no-permit} %v", r.inFlight(), r.rejected(t, "no-permit"))
	}
}

// 4 and 5 on the clock: a rate wait within AcquireTimeout is waited on the clock, and only what
// is left of AcquireTimeout after it is waited for a permit.
func TestAdmitRateWaitCountsAgainstAcquireTimeout(t *testing.T) {
	d := admitDownstream(1)
	d.AcquireTimeout = assignment.Duration(time.Second)
	d.Rate = &assignment.Rate{PerSecond: 2, Burst: 1, Mode: assignment.ModeTokenBucket}
	r := newAdmitRig(t, nil, d)
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted { // the token and the permit
		t.Fatalf("first call = %+v", ad)
	}
	lease := r.clk.Waiters() // the lease's timer
	done := make(chan admission)
	go func() { done <- r.admit(context.Background(), http.MethodGet) }()
	waitFor(t, func() bool { return r.clk.Waiters() == lease+1 }) // the rate wait: 500 ms for the next token
	r.clk.Step(500 * time.Millisecond)
	waitFor(t, func() bool { return r.ds().Sem.Stats().Waiting == 1 && r.clk.Waiters() == lease+1 }) // then the permit
	r.clk.Step(500 * time.Millisecond)
	wantRefused(t, <-done, fallback.NoPermit, 0)
	if r.clk.Since(t0) != time.Second {
		t.Fatalf("refused after %v, want the acquire timeout of 1s in all", r.clk.Since(t0))
	}
}

// 6. A half-open breaker whose probe slots are taken refuses once the permit is held: the permit
// is released, and no Retry-After is known.
func TestAdmitHalfOpenProbeSlotsTaken(t *testing.T) {
	r := newAdmitRig(t, nil, withBreaker(admitDownstream(4), 2, 1, 30*time.Second))
	r.openBreaker(t, 2)
	r.clk.Step(30 * time.Second)
	probe := r.admit(context.Background(), http.MethodGet)
	if probe.verdict != admitted || probe.ticket == (breaker.Ticket{}) {
		t.Fatalf("probe = %+v, want admitted with a ticket", probe)
	}
	wantRefused(t, r.admit(context.Background(), http.MethodGet), fallback.CircuitOpen, 0)
	if r.inFlight() != 1 {
		t.Fatalf("in flight %d, want the probe's 1", r.inFlight())
	}
	probe.ticket.Done(r.clk.Now(), false, time.Millisecond)
	if st := r.ds().Breaker().State(r.clk.Now()); st != breaker.Closed {
		t.Fatalf("after the probe succeeded: %v", st)
	}
}

// The app leaving while its call waits for a permit: nothing held, nothing counted as refused,
// and the half-open breaker's only probe slot is not spent on the abandoned call (the next
// call is admitted as the probe).
func TestAdmitAppLeavesWhileWaiting(t *testing.T) {
	d := withBreaker(admitDownstream(1), 2, 1, 30*time.Second)
	d.AcquireTimeout = assignment.Duration(5 * time.Second) // the most allowed: the test cancels first
	r := newAdmitRig(t, nil, d)
	if !r.ds().Sem.TryAcquire() { // another call holds the only permit
		t.Fatal("TryAcquire")
	}
	r.openBreaker(t, 2)
	r.clk.Step(30 * time.Second) // half-open, one probe slot
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan admission)
	go func() { done <- r.admit(ctx, http.MethodGet) }()
	waitFor(t, func() bool { return r.ds().Sem.Stats().Waiting == 1 })
	cancel()
	if ad := <-done; ad.verdict != appLeft {
		t.Fatalf("admission = %+v, want appLeft", ad)
	}
	if r.inFlight() != 1 || r.rejected(t, "no-permit") != 0 {
		t.Fatalf("in flight %d (want the other call's 1), rejected{no-permit} %v", r.inFlight(), r.rejected(t, "no-permit"))
	}
	r.ds().Sem.Release()
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("next probe = %+v, want admitted: the abandoned call's probe slot was given back", ad)
	}
}

// A degrade switch that holds longer than maxDegradeRetryAfter gives no Retry-After: no advice a
// caller could act on.
func TestAdmitDegradeSwitchFarExpiry(t *testing.T) {
	sw := []assignment.Switch{{Name: "ns/pause", Downstream: "d", ExpiresAt: t0.Add(time.Hour), Percent: 100,
		Action: assignment.Fallback{Action: assignment.ActionReject}}}
	r := newAdmitRig(t, sw, admitDownstream(4))
	wantRefused(t, r.admit(context.Background(), http.MethodGet), fallback.Degraded, 0)
	r.clk.Step(time.Hour - 20*time.Second)
	wantRefused(t, r.admit(context.Background(), http.MethodGet), fallback.Degraded, 20*time.Second)
}

// A call that would wait for a permit while MaxWaiting calls already wait is refused at once
// (queue-full); with room in the queue it waits as before.
func TestAdmitQueueFull(t *testing.T) {
	d := admitDownstream(1)
	d.AcquireTimeout = assignment.Duration(5 * time.Second)
	one := int32(1)
	d.MaxWaiting = &one
	r := newAdmitRig(t, nil, d)
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("first call = %+v", ad)
	}
	done := make(chan admission)
	go func() { done <- r.admit(context.Background(), http.MethodGet) }()
	waitFor(t, func() bool { return r.ds().Sem.Stats().Waiting == 1 })
	start := time.Now()
	wantRefused(t, r.admit(context.Background(), http.MethodGet), fallback.QueueFull, 0)
	if took := time.Since(start); took >= 5*time.Second {
		t.Fatalf("queue-full after %v: not at once", took)
	}
	if r.rejected(t, "queue-full") != 1 {
		t.Fatalf("rejected{queue-full} %v", r.rejected(t, "queue-full"))
	}
	r.ds().Sem.Release()
	if ad := <-done; ad.verdict != admitted {
		t.Fatalf("the waiter = %+v, want admitted", ad)
	}
}

// The default bound on waiters is ten per permit.
func TestAdmitQueueDefaultsToTenPerPermit(t *testing.T) {
	r := newAdmitRig(t, nil, admitDownstream(3))
	if got := r.ds().Sem.MaxWaiting(); got != 30 {
		t.Fatalf("max waiting %d, want 10 × the permits 3", got)
	}
}

// The app's budget bounds the wait for a permit and for a token: never beyond it (on the
// agent's clock).
func TestAdmitWaitsNoLongerThanTheBudget(t *testing.T) {
	d := admitDownstream(1)
	d.AcquireTimeout = assignment.Duration(5 * time.Second)
	r := newAdmitRig(t, nil, d)
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("first call = %+v", ad)
	}
	lease := r.clk.Waiters() // the lease's timer
	done := make(chan admission)
	go func() {
		done <- r.admitWithin(context.Background(), http.MethodGet, deadline.New(r.clk.Now(), 50*time.Millisecond, true))
	}()
	waitFor(t, func() bool { return r.ds().Sem.Stats().Waiting == 1 && r.clk.Waiters() == lease+1 })
	r.clk.Step(50*time.Millisecond - time.Nanosecond)
	select {
	case ad := <-done:
		t.Fatalf("refused before the 50ms budget ended: %+v", ad)
	case <-time.After(20 * time.Millisecond):
	}
	r.clk.Step(time.Nanosecond)
	wantRefused(t, <-done, fallback.NoPermit, 0) // at the budget, well before the 5s acquire timeout
	// A budget already spent: no wait at all.
	spent := deadline.New(r.clk.Now(), time.Nanosecond, true)
	r.clk.Step(time.Nanosecond)
	ad := r.admitWithin(context.Background(), http.MethodGet, spent)
	wantRefused(t, ad, fallback.NoPermit, 0)

	// Rate: a token 1s away is not waited for with a 100ms budget, though the acquire timeout
	// would allow it.
	d = admitDownstream(4)
	d.AcquireTimeout = assignment.Duration(5 * time.Second)
	d.Rate = &assignment.Rate{PerSecond: 1, Burst: 1, Mode: assignment.ModeTokenBucket}
	r = newAdmitRig(t, nil, d)
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("first call = %+v", ad)
	}
	wantRefused(t, r.admitWithin(context.Background(), http.MethodGet, deadline.New(r.clk.Now(), 100*time.Millisecond, true)), fallback.RateLimited, time.Second)
}

// jumpingClock is a fake clock that moves by jump at every read after the first: a process
// frozen between the steps of admission.
type jumpingClock struct {
	*clocktesting.FakeClock
	jump  time.Duration
	reads int
}

func (c *jumpingClock) Now() time.Time {
	if c.reads++; c.reads > 1 {
		c.Step(c.jump)
	}
	return c.FakeClock.Now()
}

func (c *jumpingClock) Since(t time.Time) time.Duration { return c.Now().Sub(t) }

// A call admitted far later than admission can take (2×AcquireTimeout + stallSlack) is not
// forwarded: the permit and the breaker's ticket are given back.
func TestAdmitStalled(t *testing.T) {
	r := newAdmitRig(t, nil, withBreaker(admitDownstream(1), 2, 1, 30*time.Second))
	ds := r.ds()
	for _, tc := range []struct {
		jump time.Duration
		want verdict
	}{
		{jump: 0, want: admitted},
		{jump: 2*50*time.Millisecond + stallSlack + time.Millisecond, want: stalled},
	} {
		clk := &jumpingClock{FakeClock: clocktesting.NewFakeClock(t0), jump: tc.jump}
		ad := admit(context.Background(), clk, r.enf.Table(), ds, ds.Config(), degrade.RequestView{Method: http.MethodGet}, deadline.Budget{})
		if ad.verdict != tc.want {
			t.Fatalf("admission after a jump of %v = %+v, want verdict %d", tc.jump, ad, tc.want)
		}
		if ad.verdict == admitted {
			ad.ticket.Cancel()
			ds.Sem.Release()
		}
		if r.inFlight() != 0 {
			t.Fatalf("after a jump of %v: %d permits held", tc.jump, r.inFlight())
		}
	}
	// The stalled call's ticket was cancelled, not recorded: the breaker counted no call.
	if st := ds.Breaker().State(t0); st != breaker.Closed {
		t.Fatalf("breaker %v", st)
	}
}
