package control_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/agent/control"
	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/assignment"
)

var (
	t0           = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	keyWithdrawn = assignment.SigningKey{ID: "2025-12", Private: ed25519.NewKeyFromSeed(bytes.Repeat([]byte{0x90}, 32))}
	keyPrev      = assignment.SigningKey{ID: "2026-01", Private: ed25519.NewKeyFromSeed(bytes.Repeat([]byte{0xA1}, 32))}
	keyCur       = assignment.SigningKey{ID: "2026-02", Private: ed25519.NewKeyFromSeed(bytes.Repeat([]byte{0xB2}, 32))}
)

const testPod = "shop/gateway-0"

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type fixture struct {
	stalled atomic.Bool
	clk     *clocktesting.FakeClock
	enf     *enforce.Enforcer
	srv     *httptest.Server
	to      assignment.Endpoint
	logs    *syncBuffer
	metrics *metrics.Metrics
}

func newFixture(t *testing.T, auth bool) *fixture {
	t.Helper()
	f := &fixture{clk: clocktesting.NewFakeClock(t0), logs: &syncBuffer{}}
	log := slog.New(slog.NewJSONHandler(f.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	m := metrics.New()
	f.metrics = m
	f.enf = enforce.New(enforce.Options{Clock: f.clk, Metrics: m, Logger: log})
	o := control.Options{Backend: f.enf, Clock: f.clk, Logger: log,
		Metrics: promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}), MaxBodyBytes: 64 << 10,
		Stalled: f.stalled.Load, Pod: testPod, Rejected: m.RejectedPush}
	if auth {
		ts, err := assignment.NewTrustSet(keyPrev.Public(), keyCur.Public())
		if err != nil {
			t.Fatal(err)
		}
		o.Trust = func() assignment.TrustSet { return ts }
	}
	f.srv = httptest.NewServer(control.New(o))
	f.to = assignment.Endpoint{URL: f.srv.URL, Pod: testPod}
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fixture) client(key assignment.SigningKey) *assignment.Client {
	return &assignment.Client{HTTP: f.srv.Client(), Key: key, Clock: f.clk}
}

// asg is testAssignment addressed to the fixture's agent process.
func (f *fixture) asg(epoch, gen int64) *assignment.Assignment {
	a := testAssignment(epoch, gen)
	a.Instance = f.enf.Instance()
	return a
}

// rejected reads apportion_agent_rejected_pushes_total{reason} from the agent's registry.
func (f *fixture) rejected(t *testing.T, reason string) float64 {
	t.Helper()
	mfs, err := f.metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "apportion_agent_rejected_pushes_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "reason" && l.GetValue() == reason {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

func testAssignment(epoch, gen int64) *assignment.Assignment {
	return &assignment.Assignment{
		Epoch: epoch, Generation: gen, LeaseTTL: assignment.Duration(30 * time.Second),
		Downstreams: []assignment.Downstream{{
			Name: "payments", Upstream: "http://127.0.0.1:9", Permits: 8, SafeDefaultPermits: 2,
			AcquireTimeout: assignment.Duration(100 * time.Millisecond), RequestTimeout: assignment.Duration(time.Second),
			Fallback: assignment.Fallback{Action: assignment.ActionReject},
		}},
	}
}

func (f *fixture) raw(t *testing.T, method, path string, body []byte, sign func(*http.Request, []byte)) (int, http.Header, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, f.srv.URL+path, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if sign != nil {
		sign(req, body)
	}
	resp, err := f.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b
}

func problemOf(t *testing.T, h http.Header, b []byte) assignment.Problem {
	t.Helper()
	if ct := h.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("Content-Type %q, body %s", ct, b)
	}
	var p assignment.Problem
	if err := json.Unmarshal(b, &p); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestHostilePushes: every hostile push is refused with 401/403 and its reason, nothing is
// applied, and apportion_agent_rejected_pushes_total{reason} counts it.
func TestHostilePushes(t *testing.T) {
	f := newFixture(t, true)
	ctx := context.Background()
	// A genuine push first: the agent holds 1/1 with 8 permits.
	if _, err := f.client(keyCur).Push(ctx, f.to, f.asg(1, 1)); err != nil {
		t.Fatal(err)
	}
	genuine, _ := json.Marshal(f.asg(1, 2))
	self := assignment.Target{Pod: testPod, Instance: f.enf.Instance(), Epoch: 1}
	signWith := func(k assignment.SigningKey, to assignment.Target, at time.Time) func(*http.Request, []byte) {
		return func(r *http.Request, b []byte) { assignment.Sign(r, b, k, to, at) }
	}
	untrusted := assignment.SigningKey{ID: keyCur.ID, Private: ed25519.NewKeyFromSeed(bytes.Repeat([]byte{0xC3}, 32))}
	otherID := assignment.SigningKey{ID: "k-attacker", Private: untrusted.Private}
	otherPod := assignment.Target{Pod: "shop/gateway-1", Instance: self.Instance, Epoch: 1}
	oldProcess := assignment.Target{Pod: testPod, Instance: "0000000000000000", Epoch: 1}
	tests := []struct {
		name   string
		body   []byte
		sign   func(*http.Request, []byte)
		status int
		reason string
	}{
		{"unsigned", genuine, nil, 401, assignment.ReasonMissing},
		{"signed by a key the agent does not trust (trusted id)", genuine, signWith(untrusted, self, t0), 403, assignment.ReasonBadSignature},
		{"signed by a key the agent does not trust (own id)", genuine, signWith(otherID, self, t0), 403, assignment.ReasonUnknownKey},
		{"valid push replayed to another pod", genuine, signWith(keyCur, otherPod, t0), 403, assignment.ReasonWrongPod},
		{"valid push replayed after a restart", genuine, signWith(keyCur, oldProcess, t0), 403, assignment.ReasonWrongInstance},
		{"timestamp outside the window", genuine, signWith(keyCur, self, t0.Add(-3*time.Minute)), 403, assignment.ReasonStaleTimestamp},
		{"body changed after signing", genuine, func(r *http.Request, b []byte) {
			assignment.Sign(r, b, keyCur, self, t0)
			changed := bytes.Replace(b, []byte(`"permits":8`), []byte(`"permits":800`), 1)
			r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(changed)), int64(len(changed))
		}, 403, assignment.ReasonBadSignature},
		{"withdrawn key", genuine, signWith(keyWithdrawn, self, t0), 403, assignment.ReasonUnknownKey},
		{"signed epoch differs from the body's", genuine, signWith(keyCur, assignment.Target{Pod: testPod, Instance: self.Instance, Epoch: 9}, t0), 403, assignment.ReasonBindingMismatch},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := f.rejected(t, tt.reason)
			status, h, b := f.raw(t, http.MethodPut, assignment.PathAssignment, tt.body, tt.sign)
			if status != tt.status {
				t.Fatalf("status %d, want %d: %s", status, tt.status, b)
			}
			p := problemOf(t, h, b)
			if p.Reason != tt.reason || p.Status != tt.status {
				t.Fatalf("problem %+v, want reason %s", p, tt.reason)
			}
			if tt.status == 401 && (p.Code != assignment.CodeUnauthenticated || h.Get("WWW-Authenticate") != assignment.AuthScheme) {
				t.Errorf("401 problem %+v, WWW-Authenticate %q", p, h.Get("WWW-Authenticate"))
			}
			if tt.status == 403 && p.Code != assignment.CodeForbidden {
				t.Errorf("403 code %q", p.Code)
			}
			if (p.State != nil) != (tt.reason == assignment.ReasonWrongInstance) {
				t.Errorf("State in the problem: %v (only a wrong-instance refusal carries it)", p.State != nil)
			}
			if st := f.enf.State(); st.Generation != 1 || st.Downstreams[0].Permits != 8 {
				t.Fatalf("a refused push was applied: %+v", st)
			}
			if got := f.rejected(t, tt.reason); got != before+1 {
				t.Fatalf("rejected_pushes_total{reason=%q} = %v, want %v", tt.reason, got, before+1)
			}
		})
	}
	// GET /v1/state too; a GET may leave the instance empty (first contact).
	if status, _, _ := f.raw(t, http.MethodGet, assignment.PathState, nil, nil); status != 401 {
		t.Fatalf("unsigned GET state = %d", status)
	}
	if status, _, _ := f.raw(t, http.MethodGet, assignment.PathState, nil, signWith(untrusted, self, t0)); status != 403 {
		t.Fatalf("forged GET state = %d", status)
	}
	if status, _, _ := f.raw(t, http.MethodGet, assignment.PathState, nil, signWith(keyCur, assignment.Target{Pod: testPod, Epoch: 1}, t0)); status != 200 {
		t.Fatalf("GET state without instance = %d", status)
	}
	// Authentication comes before parsing: garbage without a signature is 401, not 400.
	if status, _, _ := f.raw(t, http.MethodPut, assignment.PathAssignment, []byte("{garbage"), nil); status != 401 {
		t.Fatalf("unsigned garbage = %d", status)
	}
	// The genuine push itself, and one signed with the previous (still published) key, pass.
	if status, _, b := f.raw(t, http.MethodPut, assignment.PathAssignment, genuine, signWith(keyPrev, self, t0)); status != 200 {
		t.Fatalf("previous key: %d %s", status, b)
	}
	logs := f.logs.String()
	if strings.Count(logs, `"level":"WARN","msg":"control request refused"`) < len(tests) {
		t.Errorf("refusals not logged at warn:\n%s", logs)
	}
}

// Regression (issue 11, defect 6): a captured push replayed within its timestamp window after
// the lease lapsed does not restore the permits.
func TestReplayedPushDoesNotReviveAnExpiredLease(t *testing.T) {
	f := newFixture(t, true)
	a := f.asg(1, 1)
	body, _ := json.Marshal(a)
	to := assignment.Target{Pod: testPod, Instance: f.enf.Instance(), Epoch: 1}
	var captured string
	sign := func(r *http.Request, b []byte) {
		if captured == "" {
			assignment.Sign(r, b, keyCur, to, f.clk.Now())
			captured = r.Header.Get("Authorization")
		}
		r.Header.Set("Authorization", captured)
	}
	if status, _, b := f.raw(t, http.MethodPut, assignment.PathAssignment, body, sign); status != 200 {
		t.Fatalf("push: %d %s", status, b)
	}
	f.clk.Step(31 * time.Second) // the 30 s lease lapses
	if st := f.enf.State(); !st.LeaseExpired || st.Downstreams[0].EffectivePermits != 2 {
		t.Fatalf("lease did not lapse: %+v", st)
	}
	status, _, b := f.raw(t, http.MethodPut, assignment.PathAssignment, body, sign) // 31 s later: inside the 2-minute window
	if status != 200 {
		t.Fatalf("replay: %d %s", status, b)
	}
	if st := f.enf.State(); !st.LeaseExpired || st.Downstreams[0].EffectivePermits != 2 {
		t.Fatalf("the replay revived the lease: %+v", st)
	}
}

func TestPushStateAndFencing(t *testing.T) {
	f := newFixture(t, true)
	c := f.client(keyCur)
	ctx := context.Background()

	if status, _, _ := f.raw(t, http.MethodGet, "/readyz", nil, nil); status != 503 {
		t.Fatalf("readyz before any assignment = %d", status)
	}
	st, err := c.Push(ctx, f.to, f.asg(2, 5))
	if err != nil {
		t.Fatalf("Push: %v", err)
	}
	if st.Epoch != 2 || st.Generation != 5 || !st.Configured || st.Downstreams[0].EffectivePermits != 8 {
		t.Fatalf("ack = %+v", st)
	}
	if status, _, _ := f.raw(t, http.MethodGet, "/readyz", nil, nil); status != 200 {
		t.Fatalf("readyz after an assignment = %d", status)
	}
	// Stale pairs: 409 with the State held.
	for _, p := range [][2]int64{{2, 4}, {1, 99}} {
		_, err := c.Push(ctx, f.to, f.asg(p[0], p[1]))
		var stale *assignment.StaleError
		if !errors.As(err, &stale) || stale.State.Epoch != 2 || stale.State.Generation != 5 {
			t.Fatalf("Push(%v) = %v, want a StaleError holding 2/5", p, err)
		}
	}
	// Same pair: renewal, after the lease expired.
	f.clk.Step(30 * time.Second)
	st, err = c.State(ctx, f.to, 2)
	if err != nil || !st.LeaseExpired || st.Downstreams[0].EffectivePermits != 2 {
		t.Fatalf("state after expiry = %+v, %v", st, err)
	}
	st, err = c.Push(ctx, f.to, f.asg(2, 5))
	if err != nil || st.LeaseExpired || st.Downstreams[0].EffectivePermits != 8 {
		t.Fatalf("renewal = %+v, %v", st, err)
	}
	// Newer epoch with a lower generation wins.
	if st, err = c.Push(ctx, f.to, f.asg(3, 1)); err != nil || st.Epoch != 3 {
		t.Fatalf("newer epoch = %+v, %v", st, err)
	}
}

// Right after the process stalled, a push may have waited in the kernel for longer than the
// manager allows a push to land: it is refused with 503 and nothing changes.
func TestPushRefusedRightAfterAStall(t *testing.T) {
	f := newFixture(t, true)
	c := f.client(keyCur)
	ctx := context.Background()
	if _, err := c.Push(ctx, f.to, f.asg(2, 5)); err != nil {
		t.Fatal(err)
	}
	f.stalled.Store(true)
	_, err := c.Push(ctx, f.to, f.asg(2, 6))
	var se *assignment.StatusError
	if !errors.As(err, &se) || se.StatusCode != http.StatusServiceUnavailable || se.Problem.Code != assignment.CodeAgentStalled {
		t.Fatalf("push right after a stall = %v, want 503 %s", err, assignment.CodeAgentStalled)
	}
	if st := f.enf.State(); st.Generation != 5 {
		t.Fatalf("a push refused after a stall changed the generation to %d", st.Generation)
	}
	if !strings.Contains(f.logs.String(), "the agent stalled just now") {
		t.Fatal("the refusal was not logged")
	}
	f.stalled.Store(false)
	if st, err := c.Push(ctx, f.to, f.asg(2, 6)); err != nil || st.Generation != 6 {
		t.Fatalf("push after the stall = %+v, %v", st, err)
	}
}

func TestInvalidAssignment(t *testing.T) {
	f := newFixture(t, true)
	sign := func(r *http.Request, b []byte) {
		assignment.Sign(r, b, keyCur, assignment.Target{Pod: testPod, Instance: f.enf.Instance(), Epoch: 1}, t0)
	}
	body := []byte(`{"epoch":1,"generation":1,"leaseTTL":"1h","bogus":true,"downstreams":[{"name":"Bad Name","upstream":"ftp://x","permits":-1,"safeDefaultPermits":0,"acquireTimeout":"9s","requestTimeout":"1s","fallback":{"action":"Reject"}}]}`)
	status, h, b := f.raw(t, http.MethodPut, assignment.PathAssignment, body, sign)
	if status != 400 {
		t.Fatalf("status %d: %s", status, b)
	}
	p := problemOf(t, h, b)
	if p.Code != assignment.CodeInvalidAssignment || len(p.Errors) != 1 || p.Errors[0] != "bogus: unknown field" {
		t.Fatalf("shape problem = %+v", p)
	}
	body = bytes.Replace(body, []byte(`"bogus":true,`), nil, 1)
	status, h, b = f.raw(t, http.MethodPut, assignment.PathAssignment, body, sign)
	p = problemOf(t, h, b)
	want := []string{"leaseTTL: ", "downstreams[0].name: ", "downstreams[0].upstream: ", "downstreams[0].permits: ", "downstreams[0].acquireTimeout: "}
	if status != 400 || len(p.Errors) != len(want) {
		t.Fatalf("status %d errors %q", status, p.Errors)
	}
	for i, w := range want {
		if !strings.HasPrefix(p.Errors[i], w) {
			t.Errorf("errors[%d] = %q, want prefix %q", i, p.Errors[i], w)
		}
	}
	if st := f.enf.State(); st.Configured {
		t.Fatal("an invalid assignment was applied")
	}
	// Too large, wrong media type, wrong method, unknown path.
	big := append([]byte(`{"epoch":1,"pad":"`), bytes.Repeat([]byte("x"), 70<<10)...)
	big = append(big, `"}`...)
	if status, _, _ := f.raw(t, http.MethodPut, assignment.PathAssignment, big, sign); status != 413 {
		t.Errorf("too large = %d", status)
	}
	req, _ := http.NewRequest(http.MethodPut, f.srv.URL+assignment.PathAssignment, strings.NewReader("x"))
	req.Header.Set("Content-Type", "text/plain")
	resp, err := f.srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 415 {
		t.Errorf("text/plain = %d", resp.StatusCode)
	}
	if status, h, _ := f.raw(t, http.MethodPost, assignment.PathAssignment, nil, nil); status != 405 || h.Get("Allow") != "PUT" {
		t.Errorf("POST = %d Allow %q", status, h.Get("Allow"))
	}
	if status, _, _ := f.raw(t, http.MethodGet, "/v2/nothing", nil, nil); status != 404 {
		t.Errorf("unknown path = %d", status)
	}
}

func TestHealthReadinessMetrics(t *testing.T) {
	f := newFixture(t, false)
	if status, _, _ := f.raw(t, http.MethodGet, "/healthz", nil, nil); status != 200 {
		t.Fatalf("healthz = %d", status)
	}
	if status, _, _ := f.raw(t, http.MethodGet, "/readyz", nil, nil); status != 503 {
		t.Fatalf("readyz = %d", status)
	}
	// Without keys (--insecure-no-auth) unsigned calls are accepted.
	body, _ := json.Marshal(testAssignment(1, 7))
	if status, _, b := f.raw(t, http.MethodPut, assignment.PathAssignment, body, nil); status != 200 {
		t.Fatalf("unsigned push without auth = %d %s", status, b)
	}
	if status, _, _ := f.raw(t, http.MethodGet, "/readyz", nil, nil); status != 200 {
		t.Fatalf("readyz after push = %d", status)
	}
	status, _, b := f.raw(t, http.MethodGet, "/metrics", nil, nil)
	for _, want := range []string{
		`apportion_agent_config_generation 7`,
		`apportion_agent_lease_expired 0`,
		`apportion_agent_permits{downstream="payments"} 8`,
		`apportion_agent_inflight{downstream="payments"} 0`,
		`apportion_agent_peak_rps_last_minute{downstream="payments"} 0`,
		`go_goroutines`,
	} {
		if status != 200 || !bytes.Contains(b, []byte(want)) {
			t.Errorf("metrics lack %q", want)
		}
	}
	f.enf.SetDraining()
	if status, _, _ := f.raw(t, http.MethodGet, "/readyz", nil, nil); status != 503 {
		t.Fatalf("readyz while draining = %d", status)
	}
	if status, _, _ := f.raw(t, http.MethodGet, "/healthz", nil, nil); status != 200 {
		t.Fatalf("healthz while draining = %d", status)
	}
}
