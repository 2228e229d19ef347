package control_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
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

	"github.com/apportion/apportion/internal/agent/clock"
	"github.com/apportion/apportion/internal/agent/control"
	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/assignment"
)

var (
	t0      = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	keyPrev = assignment.Key{ID: "2026-01", Secret: bytes.Repeat([]byte{0xA1}, 32)}
	keyCur  = assignment.Key{ID: "2026-02", Secret: bytes.Repeat([]byte{0xB2}, 32)}
)

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
	clk     *clock.Fake
	enf     *enforce.Enforcer
	srv     *httptest.Server
	logs    *syncBuffer
}

func newFixture(t *testing.T, auth bool) *fixture {
	t.Helper()
	f := &fixture{clk: clock.NewFake(t0), logs: &syncBuffer{}}
	log := slog.New(slog.NewJSONHandler(f.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	m := metrics.New()
	f.enf = enforce.New(enforce.Options{Clock: f.clk, Metrics: m, Logger: log})
	o := control.Options{Backend: f.enf, Clock: f.clk, Logger: log,
		Metrics: promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}), MaxBodyBytes: 64 << 10,
		Stalled: f.stalled.Load}
	if auth {
		ks, err := assignment.NewKeySet(keyPrev, keyCur)
		if err != nil {
			t.Fatal(err)
		}
		o.Keys = func() assignment.KeySet { return ks }
	}
	f.srv = httptest.NewServer(control.New(o))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fixture) client(key assignment.Key) *assignment.Client {
	return &assignment.Client{HTTP: f.srv.Client(), Key: key, Now: f.clk.Now}
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

func TestAuthentication(t *testing.T) {
	f := newFixture(t, true)
	body, _ := json.Marshal(testAssignment(1, 1))
	signWith := func(k assignment.Key, at time.Time) func(*http.Request, []byte) {
		return func(r *http.Request, b []byte) { assignment.Sign(r, b, k, at) }
	}
	forged := assignment.Key{ID: keyCur.ID, Secret: bytes.Repeat([]byte{0xC3}, 32)}
	tests := []struct {
		name   string
		sign   func(*http.Request, []byte)
		status int
		code   string
	}{
		{"missing", nil, 401, assignment.CodeUnauthenticated},
		{"forged", signWith(forged, t0), 403, assignment.CodeForbidden},
		{"expired", signWith(keyCur, t0.Add(-3*time.Minute)), 403, assignment.CodeForbidden},
		{"unknown key", signWith(assignment.Key{ID: "other", Secret: keyCur.Secret}, t0), 403, assignment.CodeForbidden},
		{"previous key after rotation", signWith(keyPrev, t0), 200, ""},
		{"current key", signWith(keyCur, t0), 200, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			status, h, b := f.raw(t, http.MethodPut, assignment.PathAssignment, body, tt.sign)
			if status != tt.status {
				t.Fatalf("status %d, want %d: %s", status, tt.status, b)
			}
			if tt.code != "" {
				if p := problemOf(t, h, b); p.Code != tt.code || p.Status != tt.status {
					t.Fatalf("problem %+v", p)
				}
			}
			if tt.status == 401 && h.Get("WWW-Authenticate") != assignment.AuthScheme {
				t.Errorf("401 without WWW-Authenticate")
			}
		})
	}
	// GET /v1/state too.
	if status, _, _ := f.raw(t, http.MethodGet, assignment.PathState, nil, nil); status != 401 {
		t.Fatalf("unsigned GET state = %d", status)
	}
	if status, _, _ := f.raw(t, http.MethodGet, assignment.PathState, nil, signWith(forged, t0)); status != 403 {
		t.Fatalf("forged GET state = %d", status)
	}
	// Authentication comes before parsing: garbage without a signature is 401, not 400.
	if status, _, _ := f.raw(t, http.MethodPut, assignment.PathAssignment, []byte("{garbage"), nil); status != 401 {
		t.Fatalf("unsigned garbage = %d", status)
	}
	logs := f.logs.String()
	if strings.Count(logs, `"level":"WARN","msg":"control request refused"`) < 4 {
		t.Errorf("refusals not logged at warn:\n%s", logs)
	}
	for _, k := range []assignment.Key{keyPrev, keyCur, forged} {
		if strings.Contains(logs, string(k.Secret)) || strings.Contains(logs, fmt.Sprintf("%x", k.Secret)) {
			t.Fatal("a secret reached the logs")
		}
	}
}

func TestPushStateAndFencing(t *testing.T) {
	f := newFixture(t, true)
	c := f.client(keyCur)
	ctx := context.Background()

	if status, _, _ := f.raw(t, http.MethodGet, "/readyz", nil, nil); status != 503 {
		t.Fatalf("readyz before any assignment = %d", status)
	}
	st, err := c.Push(ctx, f.srv.URL, testAssignment(2, 5))
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
		_, err := c.Push(ctx, f.srv.URL, testAssignment(p[0], p[1]))
		var stale *assignment.StaleError
		if !errors.As(err, &stale) || stale.State.Epoch != 2 || stale.State.Generation != 5 {
			t.Fatalf("Push(%v) = %v, want a StaleError holding 2/5", p, err)
		}
	}
	// Same pair: renewal, after the lease expired.
	f.clk.Advance(30 * time.Second)
	st, err = c.State(ctx, f.srv.URL)
	if err != nil || !st.LeaseExpired || st.Downstreams[0].EffectivePermits != 2 {
		t.Fatalf("state after expiry = %+v, %v", st, err)
	}
	st, err = c.Push(ctx, f.srv.URL, testAssignment(2, 5))
	if err != nil || st.LeaseExpired || st.Downstreams[0].EffectivePermits != 8 {
		t.Fatalf("renewal = %+v, %v", st, err)
	}
	// Newer epoch with a lower generation wins.
	if st, err = c.Push(ctx, f.srv.URL, testAssignment(3, 1)); err != nil || st.Epoch != 3 {
		t.Fatalf("newer epoch = %+v, %v", st, err)
	}
}

// Right after the process stalled, a push may have waited in the kernel for longer than the
// manager allows a push to land: it is refused with 503 and nothing changes.
func TestPushRefusedRightAfterAStall(t *testing.T) {
	f := newFixture(t, true)
	c := f.client(keyCur)
	ctx := context.Background()
	if _, err := c.Push(ctx, f.srv.URL, testAssignment(2, 5)); err != nil {
		t.Fatal(err)
	}
	f.stalled.Store(true)
	_, err := c.Push(ctx, f.srv.URL, testAssignment(2, 6))
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
	if st, err := c.Push(ctx, f.srv.URL, testAssignment(2, 6)); err != nil || st.Generation != 6 {
		t.Fatalf("push after the stall = %+v, %v", st, err)
	}
}

func TestInvalidAssignment(t *testing.T) {
	f := newFixture(t, true)
	sign := func(r *http.Request, b []byte) { assignment.Sign(r, b, keyCur, t0) }
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
