package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/utils/clock"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/h1"
	"github.com/apportion/apportion/internal/testing/wait"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

type testAgent struct {
	enf     *enforce.Enforcer
	metrics *metrics.Metrics
	h       *Handler
	srv     testServer
	gen     int64
	client  *http.Client
}

// metricValue reads one series from the agent's registry (0 when absent).
func metricValue(t *testing.T, m *metrics.Metrics, name string, labels ...string) float64 {
	t.Helper()
	fams, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, s := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range s.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue series
				}
			}
			switch {
			case s.Counter != nil:
				return s.Counter.GetValue()
			case s.Gauge != nil:
				return s.Gauge.GetValue()
			case s.Histogram != nil:
				return float64(s.Histogram.GetSampleCount())
			}
		}
	}
	return 0
}

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

type testServer struct{ URL string }

// underNetHTTP makes serveAgent use net/http's server instead of the agent's own (see
// TestSuiteUnderNetHTTP): the Handler must work under both.
var underNetHTTP bool

// serveAgent serves h on 127.0.0.1 as the agent binary does, with h1.Server, or with
// httptest.Server when underNetHTTP.
func serveAgent(t *testing.T, h http.Handler) testServer {
	t.Helper()
	if underNetHTTP {
		srv := httptest.NewServer(h)
		t.Cleanup(srv.Close)
		return testServer{URL: srv.URL}
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &h1.Server{Refusal: Refusal, Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute, Logger: quietLogger(),
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 250}} // as the agent binary's
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		<-done
	})
	return testServer{URL: "http://" + ln.Addr().String()}
}

// newAgent serves a data plane on 127.0.0.1; clk nil means the real clock.
func newAgent(t *testing.T, clk clock.WithDelayedExecution) *testAgent {
	t.Helper()
	m := metrics.New()
	enf := enforce.New(enforce.Options{Clock: clk, Metrics: m, Logger: quietLogger()})
	h := New(Options{Enforcer: enf, StaleCacheBytes: 1 << 20, Logger: quietLogger()})
	srv := serveAgent(t, h)
	tr := &http.Transport{MaxIdleConnsPerHost: 200}
	t.Cleanup(tr.CloseIdleConnections)
	return &testAgent{enf: enf, metrics: m, h: h, srv: srv, client: &http.Client{Transport: tr, Timeout: 10 * time.Second}}
}

func downstream(name, upstream string, permits int32) assignment.Downstream {
	return assignment.Downstream{
		Name: name, Upstream: upstream, Permits: permits, SafeDefaultPermits: permits,
		AcquireTimeout: assignment.Duration(50 * time.Millisecond), RequestTimeout: assignment.Duration(5 * time.Second),
		Fallback: assignment.Fallback{Action: assignment.ActionReject},
	}
}

func (a *testAgent) apply(t *testing.T, sw []assignment.Switch, dss ...assignment.Downstream) {
	t.Helper()
	a.gen++
	if _, err := a.enf.Apply(&assignment.Assignment{Epoch: 1, Generation: a.gen, LeaseTTL: assignment.Duration(10 * time.Minute),
		Downstreams: dss, Switches: sw}, time.Time{}); err != nil {
		t.Fatalf("Apply: %v", err)
	}
}

type result struct {
	status int
	header http.Header
	body   string
	took   time.Duration
}

func (a *testAgent) do(t *testing.T, method, path string, hdr ...string) result {
	t.Helper()
	req, err := http.NewRequest(method, a.srv.URL+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	start := time.Now()
	resp, err := a.client.Do(req)
	if err != nil {
		t.Errorf("%s %s: %v", method, path, err)
		return result{}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return result{status: resp.StatusCode, header: resp.Header, body: string(b), took: time.Since(start)}
}

// problemCode returns the reason of a fallback rejection ("no-permit"), or the code of the
// data plane's own problems ("APPORTION_UPSTREAM_TIMEOUT"), or "" when r is no problem+json.
func problemCode(r result) string {
	if !strings.HasPrefix(r.header.Get("Content-Type"), "application/problem+json") {
		return ""
	}
	var p struct {
		Code   string `json:"code"`
		Reason string `json:"reason"`
	}
	_ = json.Unmarshal([]byte(r.body), &p)
	if p.Reason != "" {
		if r.header.Get("X-Apportion-Reason") != p.Reason {
			return "header/body mismatch"
		}
		return p.Reason
	}
	return p.Code
}

// counting is an upstream that counts calls and the highest concurrency it saw.
type counting struct {
	calls, cur, max atomic.Int64
	handler         http.HandlerFunc
}

func (c *counting) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	c.calls.Add(1)
	n := c.cur.Add(1)
	for {
		m := c.max.Load()
		if n <= m || c.max.CompareAndSwap(m, n) {
			break
		}
	}
	defer c.cur.Add(-1)
	c.handler(w, r)
}

func upstream(t *testing.T, h http.HandlerFunc) (*counting, *httptest.Server) {
	t.Helper()
	c := &counting{handler: h}
	s := httptest.NewServer(c)
	t.Cleanup(s.Close)
	return c, s
}

func TestForwarding(t *testing.T) {
	var got *http.Request
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		got = r.Clone(context.Background())
		w.Header().Set("X-Up", "1")
		w.Header().Set("Connection", "X-Hop")
		w.Header().Set("X-Hop", "must be removed")
		fmt.Fprintf(w, "hello %s", r.URL.RequestURI())
	})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("svc", up.URL+"/api?k=v", 4))
	r := a.do(t, http.MethodGet, "/svc/a/b%2Fc?x=1&y=2", "Connection", "X-Secret-Hop", "X-Secret-Hop", "1", "Keep-Alive", "timeout=5", "X-App", "app")
	if r.status != 200 || r.body != "hello /api/a/b%2Fc?k=v&x=1&y=2" || r.header.Get("X-Up") != "1" {
		t.Fatalf("answer %d %q %v", r.status, r.body, r.header)
	}
	if r.header.Get("X-Hop") != "" {
		t.Error("a hop-by-hop response header named in Connection was passed on")
	}
	if got.Header.Get("X-Secret-Hop") != "" || got.Header.Get("Keep-Alive") != "" {
		t.Errorf("hop-by-hop request headers reached the upstream: %v", got.Header)
	}
	if got.Header.Get("X-App") != "app" || got.Header.Get("X-Forwarded-For") != "127.0.0.1" || got.Header.Get("X-Forwarded-Host") != "" {
		t.Errorf("upstream headers: %v", got.Header)
	}
	if got.Host != strings.TrimPrefix(up.URL, "http://") {
		t.Errorf("upstream Host = %q", got.Host)
	}
	// The app's own forwarding headers pass; its address is appended to X-Forwarded-For.
	a.do(t, http.MethodGet, "/svc/", "X-Forwarded-For", "203.0.113.7", "X-Forwarded-Proto", "https", "X-Forwarded-Host", "shop.example")
	if xff, xfp, xfh := got.Header.Get("X-Forwarded-For"), got.Header.Get("X-Forwarded-Proto"), got.Header.Get("X-Forwarded-Host"); xff != "203.0.113.7, 127.0.0.1" || xfp != "https" || xfh != "shop.example" {
		t.Errorf("forwarding headers: %q %q %q", xff, xfp, xfh)
	}
	// The bare downstream path maps to the upstream path.
	if r := a.do(t, http.MethodGet, "/svc"); r.body != "hello /api?k=v" {
		t.Errorf("bare path: %q", r.body)
	}
	// POST bodies stream through.
	_, echo := upstream(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.Copy(w, r.Body) })
	a.apply(t, nil, downstream("echo", echo.URL, 4))
	resp, err := a.client.Post(a.srv.URL+"/echo/x", "text/plain", strings.NewReader("payload"))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "payload" {
		t.Errorf("echo = %q", b)
	}
}

func TestUnknownDownstream(t *testing.T) {
	a := newAgent(t, nil)
	// Before any assignment, nothing is known: 503 not-configured rather than a misleading 404.
	// Both answers carry the headers of every other refusal.
	refusal := func(r result, reason string) bool {
		return r.header.Get("Content-Type") == "application/problem+json" &&
			r.header.Get(fallback.HeaderFallback) == "reject" && r.header.Get(fallback.HeaderReason) == reason
	}
	// No Retry-After: when the first assignment comes is not known.
	if r := a.do(t, http.MethodGet, "/nope/x"); r.status != 503 || problemCode(r) != CodeNotConfigured || r.header.Get("Retry-After") != "" ||
		!refusal(r, "not-configured") {
		t.Errorf("unconfigured GET = %d %v %s", r.status, r.header, r.body)
	}
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {})
	a.apply(t, nil, downstream("known", up.URL, 4))
	for _, p := range []string{"/nope/x", "/", ""} {
		r := a.do(t, http.MethodGet, p)
		if r.status != 404 || problemCode(r) != CodeUnknownDownstream || !refusal(r, "unknown-downstream") {
			t.Errorf("GET %q = %d %v %s", p, r.status, r.header, r.body)
		}
	}
	// A deleted quota: the manager's assignment no longer has the downstream.
	if r := a.do(t, http.MethodGet, "/known/x"); r.status != 200 {
		t.Fatalf("GET /known/x = %d %s", r.status, r.body)
	}
	a.apply(t, nil)
	if r := a.do(t, http.MethodPost, "/known/x"); r.status != 404 || problemCode(r) != CodeUnknownDownstream || !refusal(r, "unknown-downstream") ||
		!strings.Contains(r.body, `"downstream":"known"`) {
		t.Errorf("POST to a removed downstream = %d %v %s", r.status, r.header, r.body)
	}
}

// In flight at the upstream never exceeds the permits; the excess fails fast with no-permit.
// The upstream holds every call until the test releases it, and it releases them only once every
// refusal has arrived: so each refusal came while all permits were still taken (it did not wait
// for one to free), however slow the machine, and none came before the acquire timeout.
func TestInFlightNeverExceedsPermits(t *testing.T) {
	const permits, clients = 4, 24
	const acquireTimeout = 30 * time.Millisecond
	release := make(chan struct{})
	var once sync.Once
	releaseAll := func() { once.Do(func() { close(release) }) }
	t.Cleanup(releaseAll)
	c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		<-release
		io.WriteString(w, "ok")
	})
	a := newAgent(t, nil)
	d := downstream("slow", up.URL, permits)
	d.AcquireTimeout = assignment.Duration(acquireTimeout)
	unbounded := int32(clients) // every client may wait: this test is about the acquire timeout
	d.MaxWaiting = &unbounded
	a.apply(t, nil, d)
	answers := make(chan result, clients)
	for range clients {
		go func() { answers <- a.do(t, http.MethodGet, "/slow/") }()
	}
	var results []result
	rejected := 0
	for rejected < clients-permits {
		r := <-answers
		results = append(results, r)
		if r.status == 503 && problemCode(r) == "no-permit" {
			rejected++
			continue
		}
		// Anything else before the release is wrong: the upstream answers nothing yet.
		releaseAll()
		t.Fatalf("answer before the upstream was released: %d %s", r.status, r.body)
	}
	releaseAll()
	for len(results) < clients {
		results = append(results, <-answers)
	}
	ok := 0
	for _, r := range results {
		switch {
		case r.status == 200:
			ok++
		case r.status == 503 && problemCode(r) == "no-permit":
			// Fail fast, but only after the acquire timeout: never refused at once.
			if r.took < acquireTimeout {
				t.Errorf("no-permit answer after %v, before the %v acquire timeout", r.took, acquireTimeout)
			}
		default:
			t.Errorf("unexpected answer %d %s", r.status, r.body)
		}
	}
	if m := c.max.Load(); m > permits {
		t.Fatalf("upstream saw %d in flight, permits %d", m, permits)
	}
	if ok < permits || rejected == 0 || ok+rejected != clients {
		t.Fatalf("ok=%d rejected=%d", ok, rejected)
	}
	if got := metricValue(t, a.metrics, "apportion_agent_rejected_total", "downstream", "slow", "reason", "no-permit"); got != float64(rejected) {
		t.Errorf("rejected_total{no-permit} = %v, want %d", got, rejected)
	}
	st := a.enf.State().Downstreams[0]
	if st.Rejected["no-permit"] != int64(rejected) || st.Requests != clients || st.InFlight != 0 {
		t.Fatalf("state = %+v", st)
	}
}

func withBreaker(d assignment.Downstream, minCalls, probes int32, open time.Duration) assignment.Downstream {
	d.Breaker = &assignment.Breaker{
		Window: assignment.Duration(10 * time.Second), FailureRatePercent: 50,
		SlowCallThreshold: assignment.Duration(10 * time.Second), SlowCallRatePercent: 100,
		MinimumCalls: minCalls, OpenDuration: assignment.Duration(open), HalfOpenProbes: probes,
	}
	return d
}

// A failing upstream opens the breaker; then calls get circuit-open with Retry-After and never
// reach it; after openDuration at most halfOpenProbes probes are admitted at once.
func TestBreakerOpensAndHalfOpenProbes(t *testing.T) {
	var failing atomic.Bool
	failing.Store(true)
	release := make(chan struct{})
	c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		if failing.Load() {
			http.Error(w, "boom", 500)
			return
		}
		<-release
		io.WriteString(w, "ok")
	})
	var releaseOnce sync.Once
	releaseAll := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(releaseAll) // before the upstream's Close: a failure must not hang on the held probes
	clk := clocktesting.NewFakeClock(t0)
	a := newAgent(t, clk)
	d := withBreaker(downstream("flaky", up.URL, 50), 4, 2, 30*time.Second)
	d.AcquireTimeout = assignment.Duration(time.Second)
	a.apply(t, nil, d)
	for range 4 {
		if r := a.do(t, http.MethodGet, "/flaky/"); r.status != 500 || r.body != "boom\n" {
			t.Fatalf("failing call = %d %q, want the upstream's 500", r.status, r.body)
		}
	}
	r := a.do(t, http.MethodGet, "/flaky/")
	if r.status != 503 || problemCode(r) != "circuit-open" || r.header.Get("Retry-After") != "30" {
		t.Fatalf("after 4 failures: %d %v %s", r.status, r.header, r.body)
	}
	clk.Step(10 * time.Second)
	if r := a.do(t, http.MethodGet, "/flaky/"); r.header.Get("Retry-After") != "20" {
		t.Fatalf("Retry-After after 10s = %q, want 20", r.header.Get("Retry-After"))
	}
	if n := c.calls.Load(); n != 4 {
		t.Fatalf("upstream saw %d calls, want 4 (none while open)", n)
	}
	if st := a.enf.State().Downstreams[0].Breaker; st != "open" {
		t.Fatalf("breaker state %q", st)
	}
	if v := metricValue(t, a.metrics, "apportion_agent_breaker_state", "downstream", "flaky"); v != 1 {
		t.Fatalf("breaker_state gauge = %v", v)
	}

	// Half-open: 2 probes at most.
	clk.Step(20 * time.Second)
	failing.Store(false)
	var wg sync.WaitGroup
	results := make(chan result, 5)
	for range 2 {
		wg.Add(1)
		go func() { defer wg.Done(); results <- a.do(t, http.MethodGet, "/flaky/") }()
	}
	waitFor(t, func() bool { return c.cur.Load() == 2 })
	for range 3 {
		r := a.do(t, http.MethodGet, "/flaky/")
		if r.status != 503 || problemCode(r) != "circuit-open" {
			t.Fatalf("third probe admitted: %d %s", r.status, r.body)
		}
	}
	if m := c.max.Load(); m != 2 {
		t.Fatalf("upstream saw %d concurrent probes, want 2", m)
	}
	releaseAll()
	wg.Wait()
	close(results)
	for r := range results {
		if r.status != 200 {
			t.Fatalf("probe = %d", r.status)
		}
	}
	if st := a.enf.State().Downstreams[0].Breaker; st != "closed" {
		t.Fatalf("after successful probes breaker is %q", st)
	}
	if v := metricValue(t, a.metrics, "apportion_agent_breaker_transitions_total", "downstream", "flaky", "from", "closed", "to", "open"); v != 1 {
		t.Fatalf("transitions closed->open = %v", v)
	}
}

// waitFor is wait.For for this package's many call sites, which name no condition (the failure's
// line does).
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	wait.For(t, "the condition", cond)
}

// An upstream 429 is passed through as is, counted, and never retried.
func TestUpstream429PassedThroughNeverRetried(t *testing.T) {
	c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "7")
		w.WriteHeader(429)
		io.WriteString(w, "slow down")
	})
	a := newAgent(t, nil)
	a.apply(t, nil, withBreaker(downstream("busy", up.URL, 4), 100, 1, time.Minute))
	for i := range 5 {
		r := a.do(t, http.MethodGet, "/busy/x")
		if r.status != 429 || r.header.Get("Retry-After") != "7" || r.body != "slow down" {
			t.Fatalf("call %d = %d %v %q", i, r.status, r.header, r.body)
		}
	}
	if n := c.calls.Load(); n != 5 {
		t.Fatalf("upstream saw %d calls for 5 requests", n)
	}
	if v := metricValue(t, a.metrics, "apportion_agent_upstream_429_total", "downstream", "busy"); v != 5 {
		t.Fatalf("upstream_429_total = %v", v)
	}
	if v := metricValue(t, a.metrics, "apportion_agent_upstream_responses_total", "downstream", "busy", "class", "4xx"); v != 5 {
		t.Fatalf("upstream_responses_total{4xx} = %v", v)
	}
	if st := a.enf.State().Downstreams[0]; st.Upstream429 != 5 {
		t.Fatalf("state upstream429 = %d", st.Upstream429)
	}
}

// TestHangingUpstreamTimesOut: a call the upstream does not answer within requestTimeout is
// answered 504 at its deadline; its upstream connection is closed, and its permit is held for
// abandonedHold after that (the downstream may still be working on it), counted in flight the
// whole time; with abandonedHold 0 it is released at once.
func TestHangingUpstreamTimesOut(t *testing.T) {
	stop := make(chan struct{})
	defer close(stop)
	closed := make(chan struct{}, 4)
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-stop:
		case <-r.Context().Done():
			closed <- struct{}{} // the agent closed the connection
		}
	})
	clk := clocktesting.NewFakeClock(t0)
	a := newAgent(t, clk)
	d := downstream("hang", up.URL, 4)
	d.RequestTimeout = assignment.Duration(100 * time.Millisecond)
	a.apply(t, nil, d)
	r := a.do(t, http.MethodGet, "/hang/")
	if r.status != 504 || problemCode(r) != CodeUpstreamTimeout {
		t.Fatalf("hanging upstream = %d %s", r.status, r.body)
	}
	if r.took < 100*time.Millisecond || r.took > 2*time.Second {
		t.Fatalf("timeout answer after %v, want about 100ms", r.took)
	}
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the upstream connection of the abandoned call was not closed")
	}
	if st := a.enf.State().Downstreams[0]; st.InFlight != 1 {
		t.Fatalf("abandoned call: %+v, want its permit held (in flight 1) for abandonedHold", st)
	}
	if v := metricValue(t, a.metrics, "apportion_agent_abandoned_calls_total", "downstream", "hang"); v != 1 {
		t.Fatalf("abandoned_calls_total = %v", v)
	}
	clk.Step(99 * time.Millisecond) // the default hold is requestTimeout
	if st := a.enf.State().Downstreams[0]; st.InFlight != 1 {
		t.Fatalf("released before abandonedHold passed: %+v", st)
	}
	clk.Step(time.Millisecond)
	if st := a.enf.State().Downstreams[0]; st.InFlight != 0 {
		t.Fatalf("permit not released after abandonedHold: %+v", st)
	}

	zero := assignment.Duration(0)
	d.AbandonedHold = &zero
	a.apply(t, nil, d)
	if r := a.do(t, http.MethodGet, "/hang/"); r.status != 504 {
		t.Fatalf("hanging upstream = %d %s", r.status, r.body)
	}
	if st := a.enf.State().Downstreams[0]; st.InFlight != 0 {
		t.Fatalf("abandonedHold 0: permit not released at once: %+v", st)
	}
}

// hijackClose answers nothing: it takes the connection and closes it.
func hijackClose(w http.ResponseWriter, r *http.Request) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(err)
	}
	conn.Close()
}

func TestConnectionResetIs502AndNotRetried(t *testing.T) {
	var n atomic.Int64
	c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 1 {
			io.WriteString(w, "first") // leaves a kept-alive connection in the agent's pool
			return
		}
		hijackClose(w, r)
	})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("reset", up.URL, 4))
	if r := a.do(t, http.MethodGet, "/reset/"); r.status != 200 {
		t.Fatalf("first = %d", r.status)
	}
	for _, m := range []string{http.MethodGet, http.MethodPost} {
		before := c.calls.Load()
		r := a.do(t, m, "/reset/")
		if r.status != 502 || problemCode(r) != CodeUpstreamUnavailable {
			t.Fatalf("%s on a closed connection = %d %s", m, r.status, r.body)
		}
		if got := c.calls.Load() - before; got != 1 {
			t.Fatalf("%s reached the upstream %d times, want exactly 1 (no retry)", m, got)
		}
	}
}

// A chunked response reaches the app while the upstream is still writing.
func TestStreaming(t *testing.T) {
	proceed := make(chan struct{})
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "first\n")
		http.NewResponseController(w).Flush()
		select {
		case <-proceed:
		case <-time.After(5 * time.Second):
		}
		io.WriteString(w, "second\n")
	})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("stream", up.URL, 4))
	resp, err := a.client.Get(a.srv.URL + "/stream/")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n')
	if err != nil || line != "first\n" {
		t.Fatalf("first line %q %v", line, err)
	}
	// The upstream has not finished: it waits for us.
	if st := a.enf.State().Downstreams[0]; st.InFlight != 1 {
		t.Fatalf("in flight while streaming = %d, want 1", st.InFlight)
	}
	close(proceed)
	rest, _ := io.ReadAll(br)
	if string(rest) != "second\n" {
		t.Fatalf("rest %q", rest)
	}
}

// ServeStale answers the last GET with Age and X-Apportion-Fallback once the breaker is open.
func TestServeStaleAfterBreakerOpens(t *testing.T) {
	var failing atomic.Bool
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		if failing.Load() {
			http.Error(w, "down", http.StatusServiceUnavailable)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"path":%q}`, r.URL.Path)
	})
	clk := clocktesting.NewFakeClock(t0)
	a := newAgent(t, clk)
	d := withBreaker(downstream("cat", up.URL, 4), 2, 1, time.Minute)
	d.Fallback = assignment.Fallback{Action: assignment.ActionServeStale, MaxStaleness: assignment.Duration(5 * time.Minute)}
	a.apply(t, nil, d)
	if r := a.do(t, http.MethodGet, "/cat/items?page=1"); r.status != 200 {
		t.Fatalf("warm-up = %d", r.status)
	}
	failing.Store(true)
	for range 2 {
		if r := a.do(t, http.MethodGet, "/cat/other"); r.status != 503 {
			t.Fatalf("failing = %d", r.status)
		}
	}
	clk.Step(42 * time.Second)
	r := a.do(t, http.MethodGet, "/cat/items?page=1")
	if r.status != 200 || r.body != `{"path":"/items"}` || r.header.Get("Content-Type") != "application/json" {
		t.Fatalf("stale answer = %d %v %q", r.status, r.header, r.body)
	}
	if r.header.Get("Age") != "42" || r.header.Get("X-Apportion-Fallback") == "" {
		t.Fatalf("stale headers = %v", r.header)
	}
	// Never cached (and a different query): rejected.
	if r := a.do(t, http.MethodGet, "/cat/items?page=2"); r.status != 503 || problemCode(r) != "circuit-open" {
		t.Fatalf("uncached = %d %s", r.status, r.body)
	}
	// Too old: rejected.
	clk.Step(5 * time.Minute)
	if r := a.do(t, http.MethodGet, "/cat/items?page=1"); r.status != 503 {
		t.Fatalf("stale beyond maxStaleness = %d %s", r.status, r.body)
	}
	if v := metricValue(t, a.metrics, "apportion_agent_fallback_total", "downstream", "cat", "action", "serve-stale"); v != 1 {
		t.Fatalf("fallback_total{serve-stale} = %v", v)
	}
}

// Static never gives a write a canned success.
func TestStaticNeverAnswersPOSTWithSuccess(t *testing.T) {
	c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "real") })
	a := newAgent(t, nil)
	d := downstream("geo", up.URL, 0) // no permits: every call gets the fallback, at once
	d.AcquireTimeout = assignment.Duration(2 * time.Second)
	d.Fallback = assignment.Fallback{Action: assignment.ActionStatic, Static: &assignment.StaticResponse{
		Status: 200, Headers: map[string]string{"Content-Type": "application/json"}, Body: `{"country":"unknown"}`}}
	a.apply(t, nil, d)
	r := a.do(t, http.MethodGet, "/geo/where")
	if r.status != 200 || r.body != `{"country":"unknown"}` || r.header.Get("Content-Type") != "application/json" {
		t.Fatalf("GET static = %d %v %q", r.status, r.header, r.body)
	}
	if r.took > time.Second {
		t.Errorf("with 0 permits the fallback took %v; it must not wait", r.took)
	}
	for _, m := range []string{http.MethodPost, http.MethodPut, http.MethodDelete, http.MethodPatch} {
		r := a.do(t, m, "/geo/where")
		if r.status < 400 {
			t.Fatalf("%s got %d %q: a canned success for a write", m, r.status, r.body)
		}
	}
	if c.calls.Load() != 0 {
		t.Fatal("upstream called with 0 permits")
	}
	// allowedMethods lets POST have it.
	d.Fallback.AllowedMethods = []string{"POST"}
	a.apply(t, nil, d)
	if r := a.do(t, http.MethodPost, "/geo/where"); r.status != 200 {
		t.Fatalf("allowed POST = %d", r.status)
	}
}

// A degrade switch answers with its action, then turns itself off at expiresAt.
func TestDegradeSwitchAppliesAndExpires(t *testing.T) {
	c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "real") })
	clk := clocktesting.NewFakeClock(t0)
	a := newAgent(t, clk)
	sw := []assignment.Switch{{
		Name: "shop/pause-recs", Downstream: "recs", ExpiresAt: t0.Add(time.Minute), Percent: 100,
		Methods: []string{"GET"},
		Action:  assignment.Fallback{Action: assignment.ActionStatic, Static: &assignment.StaticResponse{Status: 200, Body: "[]"}},
	}}
	a.apply(t, sw, downstream("recs", up.URL, 4))
	if r := a.do(t, http.MethodGet, "/recs/for/me"); r.status != 200 || r.body != "[]" {
		t.Fatalf("degraded GET = %d %q", r.status, r.body)
	}
	if r := a.do(t, http.MethodPost, "/recs/for/me"); r.body != "real" {
		t.Fatalf("POST is outside the switch's methods: %d %q", r.status, r.body)
	}
	if v := metricValue(t, a.metrics, "apportion_agent_degrade_switch_active", "downstream", "recs", "switch", "shop/pause-recs"); v != 1 {
		t.Fatalf("degrade_switch_active = %v", v)
	}
	if v := metricValue(t, a.metrics, "apportion_agent_rejected_total", "downstream", "recs", "reason", "degraded"); v != 1 {
		t.Fatalf("rejected_total{degraded} = %v", v)
	}
	clk.Step(time.Minute)
	if r := a.do(t, http.MethodGet, "/recs/for/me"); r.body != "real" {
		t.Fatalf("after expiry = %d %q", r.status, r.body)
	}
	if c.calls.Load() != 2 {
		t.Fatalf("upstream calls = %d, want 2", c.calls.Load())
	}
	if v := metricValue(t, a.metrics, "apportion_agent_degrade_switch_active", "downstream", "recs", "switch", "shop/pause-recs"); v != 0 {
		t.Fatalf("degrade_switch_active after expiry = %v", v)
	}
}

func TestRateLimited(t *testing.T) {
	c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	clk := clocktesting.NewFakeClock(t0)
	a := newAgent(t, clk)
	d := downstream("rl", up.URL, 10)
	d.Rate = &assignment.Rate{PerSecond: 1, Burst: 2, Mode: assignment.ModeTokenBucket}
	a.apply(t, nil, d)
	for i := range 2 {
		if r := a.do(t, http.MethodGet, "/rl/"); r.status != 200 {
			t.Fatalf("burst call %d = %d", i, r.status)
		}
	}
	r := a.do(t, http.MethodGet, "/rl/")
	if r.status != 503 || problemCode(r) != "rate-limited" {
		t.Fatalf("over the rate = %d %s", r.status, r.body)
	}
	clk.Step(time.Second)
	if r := a.do(t, http.MethodGet, "/rl/"); r.status != 200 {
		t.Fatalf("after a second = %d", r.status)
	}
	if c.calls.Load() != 3 {
		t.Fatalf("upstream calls = %d", c.calls.Load())
	}
}

// A removed downstream gets 404 for new calls while its call in flight finishes.
func TestReconfigureWhileInFlight(t *testing.T) {
	proceed := make(chan struct{})
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			<-proceed
		}
		io.WriteString(w, "ok")
	})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("a", up.URL, 1), downstream("b", up.URL, 1))
	done := make(chan result)
	go func() { done <- a.do(t, http.MethodGet, "/a/slow") }()
	waitFor(t, func() bool { return a.enf.State().Downstreams[0].InFlight == 1 })
	// Lower a's permits and remove b.
	a.apply(t, nil, downstream("a", up.URL, 1))
	if r := a.do(t, http.MethodGet, "/b/"); r.status != 404 {
		t.Fatalf("removed downstream = %d", r.status)
	}
	if r := a.do(t, http.MethodGet, "/a/fast"); r.status != 503 {
		t.Fatalf("a second call with 1 permit held = %d", r.status)
	}
	close(proceed)
	if r := <-done; r.status != 200 {
		t.Fatalf("in-flight call = %d", r.status)
	}
	if r := a.do(t, http.MethodGet, "/a/fast"); r.status != 200 {
		t.Fatalf("after release = %d", r.status)
	}
}

// Shutdown stops accepting and lets calls in flight finish.
func TestGracefulDrain(t *testing.T) {
	proceed := make(chan struct{})
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		<-proceed
		io.WriteString(w, "done")
	})
	m := metrics.New()
	enf := enforce.New(enforce.Options{Metrics: m, Logger: quietLogger()})
	if _, err := enf.Apply(&assignment.Assignment{Epoch: 1, Generation: 1, LeaseTTL: assignment.Duration(time.Minute),
		Downstreams: []assignment.Downstream{downstream("d", up.URL, 2)}}, time.Time{}); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h := New(Options{Enforcer: enf, Logger: quietLogger()})
	var srv interface {
		Serve(net.Listener) error
		Shutdown(context.Context) error
	} = &h1.Server{Refusal: Refusal, Handler: h, Logger: quietLogger()}
	if underNetHTTP {
		srv = &http.Server{Handler: h}
	}
	go srv.Serve(ln)
	url := "http://" + ln.Addr().String() + "/d/"
	done := make(chan string)
	go func() {
		resp, err := http.Get(url)
		if err != nil {
			done <- err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		done <- string(b)
	}()
	waitFor(t, func() bool { return enf.State().Downstreams[0].InFlight == 1 })
	enf.SetDraining()
	shut := make(chan error)
	go func() { shut <- srv.Shutdown(context.Background()) }()
	waitFor(t, func() bool {
		c, err := net.DialTimeout("tcp", ln.Addr().String(), 100*time.Millisecond)
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned (%v) with a call in flight", err)
	default:
	}
	close(proceed)
	if got := <-done; got != "done" {
		t.Fatalf("in-flight call during drain = %q", got)
	}
	if err := <-shut; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if enf.Ready() {
		t.Fatal("ready while draining")
	}
}

// A protocol upgrade (WebSocket and the like) passes through and holds its permit while open.
func TestUpgradePassesThrough(t *testing.T) {
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "echo" {
			http.Error(w, "want Upgrade: echo", 400)
			return
		}
		conn, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer conn.Close()
		brw.WriteString("HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
		brw.Flush()
		line, _ := brw.ReadString('\n')
		brw.WriteString("echo:" + line)
		brw.Flush()
	})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("ws", up.URL, 1))
	conn, err := net.Dial("tcp", strings.TrimPrefix(a.srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "GET /ws/ HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 101 {
		t.Fatalf("upgrade answer %d", resp.StatusCode)
	}
	if st := a.enf.State().Downstreams[0]; st.InFlight != 1 {
		t.Fatalf("an open upgraded connection holds %d permits, want 1", st.InFlight)
	}
	fmt.Fprintf(conn, "hello\n")
	line, err := br.ReadString('\n')
	if err != nil || line != "echo:hello\n" {
		t.Fatalf("echo %q %v", line, err)
	}
	conn.Close()
	waitFor(t, func() bool { return a.enf.State().Downstreams[0].InFlight == 0 })
}

// When the app gives up on a call, the downstream is still working on it: the permit stays held
// until the downstream answered, so in flight at the downstream never exceeds the permits.
func TestAppCancelKeepsThePermitUntilTheDownstreamAnswers(t *testing.T) {
	a := newAgent(t, nil)
	arrived, release := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		close(arrived)
		<-release
	})
	t.Cleanup(unblock) // runs before the upstream's Close, even when the test fails
	a.apply(t, nil, downstream("slow", up.URL, 1))
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, a.srv.URL+"/slow/x", nil)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if resp, err := a.client.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	<-arrived
	cancel()
	<-done
	ds := a.enf.Table().Lookup("slow")
	// The app is gone; the downstream still holds the call, and so does the permit.
	for range 20 {
		if got := ds.Sem.Stats().InFlight; got != 1 {
			t.Fatalf("in flight after the app gave up = %d, want 1 while the downstream still works", got)
		}
		time.Sleep(5 * time.Millisecond)
	}
	unblock()
	wait.For(t, "the permit released after the downstream answered", func() bool { return ds.Sem.Stats().InFlight == 0 })
}

// A call's duration is measured on the injected clock: an upstream that takes 11 s of the fake
// clock to answer (and no time at all on the wall clock) is slow for the breaker, which opens
// on slow calls alone; the same calls answered at once on the fake clock are not.
func TestSlowOnTheInjectedClockOpensTheBreaker(t *testing.T) {
	for _, slow := range []bool{false, true} {
		clk := clocktesting.NewFakeClock(t0)
		c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
			if slow {
				clk.Step(11 * time.Second) // the breaker's slowCallThreshold is 10 s
			}
			io.WriteString(w, "ok")
		})
		a := newAgent(t, clk)
		d := withBreaker(downstream("slow", up.URL, 4), 2, 1, 30*time.Second)
		d.Breaker.Window = assignment.Duration(time.Minute) // both calls in it
		d.Breaker.FailureRatePercent = 100                  // slow, not failed: only slowness can open it
		a.apply(t, nil, d)
		for range 2 {
			if r := a.do(t, http.MethodGet, "/slow/"); r.status != 200 {
				t.Fatalf("slow=%v: call = %d %s", slow, r.status, r.body)
			}
		}
		r := a.do(t, http.MethodGet, "/slow/")
		if !slow {
			if r.status != 200 || c.calls.Load() != 3 {
				t.Fatalf("fast calls: third call = %d, upstream calls %d; want 200 and 3", r.status, c.calls.Load())
			}
			continue
		}
		if r.status != 503 || problemCode(r) != "circuit-open" || r.header.Get("Retry-After") != "30" {
			t.Fatalf("after 2 calls slow on the fake clock: %d %v %s, want circuit-open", r.status, r.header, r.body)
		}
		if c.calls.Load() != 2 {
			t.Fatalf("upstream calls = %d, want 2", c.calls.Load())
		}
	}
}
