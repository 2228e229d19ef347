package proxy

import (
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/agent/deadline"
	"github.com/apportion/apportion/internal/assignment"
)

// A deadline header that is present but not a deadline is the app's error: 400, nothing sent.
func TestDeadlineMalformedIsRefused(t *testing.T) {
	c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("d", up.URL, 4))
	for _, h := range [][]string{{"X-Apportion-Timeout", "soon"}, {"X-Apportion-Timeout", "0s"}, {"Grpc-Timeout", "1s"}} {
		r := a.do(t, http.MethodGet, "/d/x", h...)
		if r.status != 400 || problemCode(r) != CodeBadRequest || !strings.Contains(r.body, h[0]+" ") && !strings.Contains(r.body, "grpc-timeout") {
			t.Errorf("%v: %d %s, want 400 naming the header", h, r.status, r.body)
		}
	}
	if n := c.calls.Load(); n != 0 {
		t.Fatalf("upstream called %d times", n)
	}
}

// What is left of the call's time reaches the upstream: in the configured header, and in
// grpc-timeout when the app sent one; X-Apportion-Timeout, the agent's own, is not passed on.
func TestDeadlinePassedOn(t *testing.T) {
	var mu sync.Mutex
	var got http.Header
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = r.Header.Clone()
		mu.Unlock()
	})
	a := newAgent(t, nil)
	d := downstream("d", up.URL, 4)
	d.DeadlineHeader = "X-Request-Timeout"
	a.apply(t, nil, d)
	seen := func() http.Header {
		mu.Lock()
		defer mu.Unlock()
		return got
	}
	left := func(h http.Header) time.Duration {
		v, err := time.ParseDuration(h.Get("X-Request-Timeout"))
		if err != nil {
			t.Fatalf("X-Request-Timeout %q: %v", h.Get("X-Request-Timeout"), err)
		}
		return v
	}

	if r := a.do(t, http.MethodGet, "/d/x", "X-Apportion-Timeout", "2s"); r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	h := seen()
	if v := left(h); v > 2*time.Second || v < time.Second {
		t.Fatalf("upstream told %v is left of a 2s budget", v)
	}
	if _, ok := h["X-Apportion-Timeout"]; ok {
		t.Fatal("X-Apportion-Timeout passed on")
	}

	if r := a.do(t, http.MethodGet, "/d/x", "Grpc-Timeout", "1S"); r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	h = seen()
	g, err := deadline.ParseGRPC(h.Get("Grpc-Timeout"))
	if err != nil || g > time.Second || g < 500*time.Millisecond || h.Get("Grpc-Timeout") == "1S" {
		t.Fatalf("grpc-timeout passed on as %q (%v, %v), want what is left of 1s", h.Get("Grpc-Timeout"), g, err)
	}
	if v := left(h); v > time.Second {
		t.Fatalf("X-Request-Timeout %v beyond the app's 1s", v)
	}

	// No deadline from the app: the upstream is told requestTimeout's (5s).
	if r := a.do(t, http.MethodGet, "/d/x"); r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if v := left(seen()); v > 5*time.Second || v < 4*time.Second {
		t.Fatalf("without a deadline the upstream is told %v, want about the 5s requestTimeout", v)
	}
}

// The upstream call ends at the app's deadline when that comes before requestTimeout.
func TestDeadlineBoundsTheUpstreamCall(t *testing.T) {
	stop := make(chan struct{})
	defer close(stop)
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-stop:
		case <-r.Context().Done():
		}
	})
	a := newAgent(t, nil)
	d := downstream("d", up.URL, 4) // requestTimeout 5s
	zero := assignment.Duration(0)
	d.AbandonedHold = &zero
	a.apply(t, nil, d)
	r := a.do(t, http.MethodGet, "/d/x", "X-Apportion-Timeout", "150ms")
	if r.status != 504 || problemCode(r) != CodeUpstreamTimeout || !strings.Contains(r.body, "own deadline") {
		t.Fatalf("%d %s, want 504 at the app's deadline", r.status, r.body)
	}
	if r.took < 150*time.Millisecond || r.took >= 5*time.Second {
		t.Fatalf("answered after %v: want the 150ms budget, not the 5s requestTimeout", r.took)
	}
}

// The wait for a permit ends at the app's deadline, not at a longer acquire timeout.
func TestDeadlineBoundsThePermitWait(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	releaseAll := func() { once.Do(func() { close(release) }) }
	t.Cleanup(releaseAll)
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) { <-release })
	a := newAgent(t, nil)
	d := downstream("d", up.URL, 1)
	d.AcquireTimeout = assignment.Duration(5 * time.Second)
	a.apply(t, nil, d)
	held := make(chan result, 1)
	go func() { held <- a.do(t, http.MethodGet, "/d/held") }()
	waitFor(t, func() bool { return a.enf.State().Downstreams[0].InFlight == 1 })
	r := a.do(t, http.MethodGet, "/d/x", "X-Apportion-Timeout", "100ms")
	if r.status != 503 || problemCode(r) != "no-permit" {
		t.Fatalf("%d %s, want no-permit", r.status, r.body)
	}
	if r.took < 100*time.Millisecond || r.took >= 5*time.Second {
		t.Fatalf("refused after %v: want the 100ms budget, not the 5s acquire timeout", r.took)
	}
	releaseAll()
	if r := <-held; r.status != 200 {
		t.Fatalf("held call: %d", r.status)
	}
}

// A budget spent before the call could be forwarded: 504 deadline-exceeded, nothing sent, the
// permit given back.
func TestDeadlineSpentBeforeForwarding(t *testing.T) {
	c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("d", up.URL, 4))
	r := a.do(t, http.MethodGet, "/d/x", "X-Apportion-Timeout", "1ns")
	if r.status != 504 || problemCode(r) != CodeDeadlineExceeded || r.header.Get("Retry-After") != "" {
		t.Fatalf("%d %v %s, want 504 %s", r.status, r.header, r.body, CodeDeadlineExceeded)
	}
	if c.calls.Load() != 0 || a.enf.State().Downstreams[0].InFlight != 0 {
		t.Fatalf("upstream calls %d, in flight %d", c.calls.Load(), a.enf.State().Downstreams[0].InFlight)
	}
	if v := metricValue(t, a.metrics, "apportion_agent_rejected_total", "downstream", "d", "reason", "deadline-exceeded"); v != 1 {
		t.Fatalf("rejected{deadline-exceeded} = %v", v)
	}
}

// A call that would wait while maxWaiting calls already wait is refused at once with
// queue-full, and without Retry-After (when a slot frees is not known).
func TestQueueFull(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	releaseAll := func() { once.Do(func() { close(release) }) }
	t.Cleanup(releaseAll)
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) { <-release })
	a := newAgent(t, nil)
	d := downstream("d", up.URL, 1)
	d.AcquireTimeout = assignment.Duration(5 * time.Second)
	one := int32(1) // one waiter (the default would queue 10)
	d.MaxWaiting = &one
	a.apply(t, nil, d)
	answers := make(chan result, 2)
	go func() { answers <- a.do(t, http.MethodGet, "/d/held") }()
	waitFor(t, func() bool { return a.enf.State().Downstreams[0].InFlight == 1 })
	go func() { answers <- a.do(t, http.MethodGet, "/d/waits") }()
	waitFor(t, func() bool { return a.enf.State().Downstreams[0].Waiting == 1 })
	r := a.do(t, http.MethodGet, "/d/x")
	if r.status != 503 || problemCode(r) != "queue-full" || r.header.Get("Retry-After") != "" || !strings.Contains(r.body, "APPORTION_QUEUE_FULL") {
		t.Fatalf("%d %v %s, want 503 queue-full without Retry-After", r.status, r.header, r.body)
	}
	if r.took >= 5*time.Second {
		t.Fatalf("queue-full after %v: not at once", r.took)
	}
	releaseAll()
	for range 2 {
		if r := <-answers; r.status != 200 {
			t.Fatalf("held or waiting call: %d %s", r.status, r.body)
		}
	}
}

// Refused by the rate limiter: Retry-After is when its next token accrues, rounded up.
func TestRateLimitedRetryAfter(t *testing.T) {
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {})
	a := newAgent(t, nil)
	d := downstream("d", up.URL, 4)
	d.Rate = &assignment.Rate{PerSecond: 0.4, Burst: 1, Mode: assignment.ModeTokenBucket}
	a.apply(t, nil, d)
	if r := a.do(t, http.MethodGet, "/d/x"); r.status != 200 {
		t.Fatalf("first: %d", r.status)
	}
	r := a.do(t, http.MethodGet, "/d/x")
	if r.status != 503 || problemCode(r) != "rate-limited" {
		t.Fatalf("%d %s", r.status, r.body)
	}
	// The next token is 2.5s after the first call, less what passed since (on a slow machine,
	// up to 1.5s), rounded up.
	if ra, err := strconv.Atoi(r.header.Get("Retry-After")); err != nil || ra < 1 || ra > 3 {
		t.Fatalf("Retry-After %q, want the limiter's 2.5s (less what passed) rounded up", r.header.Get("Retry-After"))
	}
}

// TestHoldLeftRunsFromTheDeadline: an abandoned call released at its deadline, give or take the
// scheduler's jitter, keeps its whole hold; one released a stall past it (the agent was frozen)
// holds only what is left of the hold counted from the deadline.
func TestHoldLeftRunsFromTheDeadline(t *testing.T) {
	for _, tc := range []struct{ hold, late, want time.Duration }{
		{time.Second, 0, time.Second},                                                   // at its deadline: the whole hold
		{time.Second, -5 * time.Millisecond, time.Second},                               // a hair early: the whole hold
		{time.Second, 30 * time.Millisecond, time.Second},                               // jitter: still the whole hold
		{time.Second, stallSlack - time.Millisecond, time.Second},                       // below a stall: the whole hold
		{time.Second, stallSlack, time.Second - stallSlack},                             // a stall: the rest of it
		{time.Second, time.Second, 0},                                                   // the hold passed while frozen: at once
		{time.Second, 3 * time.Second, -2 * time.Second},                                // long past: at once
		{100 * time.Millisecond, 2 * time.Second, 100*time.Millisecond - 2*time.Second}, // a short hold, frozen long
	} {
		if got := holdLeft(tc.hold, tc.late); got != tc.want {
			t.Errorf("holdLeft(%s, late %s) = %s, want %s", tc.hold, tc.late, got, tc.want)
		}
	}
}

// The same with priority lanes: the lane's permit is given back too (it leaked before: every
// such call left one lane permit held for good).
func TestDeadlineSpentBeforeForwardingReleasesTheLane(t *testing.T) {
	c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {})
	a := newAgent(t, nil)
	d := downstream("d", up.URL, 4)
	d.Lanes = []assignment.Lane{{Name: "core", ReservePercent: 50, LendPercent: 50, Methods: []string{"POST"}}}
	a.apply(t, nil, d)
	for range 6 { // more than the 4 permits: a leak would leave the later calls without one
		if r := a.do(t, http.MethodGet, "/d/x", "X-Apportion-Timeout", "1ns"); r.status != 504 || problemCode(r) != CodeDeadlineExceeded {
			t.Fatalf("%d %s, want 504 %s", r.status, r.body, CodeDeadlineExceeded)
		}
	}
	st := a.enf.State().Downstreams[0]
	for _, l := range st.Lanes {
		if l.InFlight != 0 {
			t.Fatalf("lane %s holds %d permits after every call ended: %+v", l.Name, l.InFlight, st.Lanes)
		}
	}
	if c.calls.Load() != 0 || st.InFlight != 0 {
		t.Fatalf("upstream calls %d, in flight %d", c.calls.Load(), st.InFlight)
	}
}
