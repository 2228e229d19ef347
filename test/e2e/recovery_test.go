package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/test/e2e/harness"
)

// Real agents (bootstrapped, no manager: the scenario is about the agent's own recovery) in
// front of a fragile downstream: it falls over — every call fails — while loaded above its
// capacity, and after an incident its capacity comes back slowly.

// fragile is the downstream. capacity(t) is its capacity t after the incident began (before the
// incident: full).
type fragile struct {
	URL      string
	latency  time.Duration
	full     int64
	incident atomic.Int64 // unix ns; 0: none yet
	down     time.Duration
	rise     time.Duration

	inFlight, peak, recPeak atomic.Int64 // recPeak: the peak since its capacity began to recover
	// recExcess is the most calls in flight above its capacity while it recovered; recFailed
	// the calls that failed then.
	recExcess, recFailed atomic.Int64
	ok, failed           atomic.Int64
	srv                  *http.Server
}

func startFragile(t *testing.T, full int64, latency, down, rise time.Duration) *fragile {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f := &fragile{URL: "http://" + ln.Addr().String(), latency: latency, full: full, down: down, rise: rise}
	f.srv = &http.Server{Handler: f, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = f.srv.Serve(ln) }()
	t.Cleanup(func() { _ = f.srv.Close() })
	return f
}

// capacity is what the downstream takes now: full, 0 for down after the incident began, then
// rising linearly from 1 to full over rise.
func (f *fragile) capacity(now time.Time) int64 {
	at := f.incident.Load()
	if at == 0 {
		return f.full
	}
	since := now.Sub(time.Unix(0, at))
	switch {
	case since < f.down:
		return 0
	case since >= f.down+f.rise:
		return f.full
	}
	return 1 + int64(float64(f.full-1)*float64(since-f.down)/float64(f.rise))
}

func (f *fragile) recovering(now time.Time) bool {
	at := f.incident.Load()
	return at != 0 && now.Sub(time.Unix(0, at)) >= f.down
}

func (f *fragile) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := f.inFlight.Add(1)
	defer f.inFlight.Add(-1)
	storeMax(&f.peak, n)
	now := time.Now()
	c := f.capacity(now)
	rec := f.recovering(now) && c < f.full
	if rec {
		storeMax(&f.recPeak, n)
		storeMax(&f.recExcess, n-c)
	}
	over := n > c
	time.Sleep(f.latency)
	// Loaded above its capacity at the start or at the end of the call, it falls over.
	if over || f.inFlight.Load() > f.capacity(time.Now()) {
		f.failed.Add(1)
		if rec {
			f.recFailed.Add(1)
		}
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	f.ok.Add(1)
	_, _ = io.WriteString(w, "ok")
}

func storeMax(v *atomic.Int64, n int64) {
	for {
		cur := v.Load()
		if n <= cur || v.CompareAndSwap(cur, n) {
			return
		}
	}
}

// bootAgents starts n agents with the bootstrap assignment a (epoch and generation 0, at safe
// defaults: safeDefaultPermits is the permits here).
func bootAgents(t *testing.T, ctx context.Context, n int, a assignment.Assignment) []*harness.Agent {
	t.Helper()
	bin, err := harness.Build(ctx)
	if err != nil {
		t.Fatalf("build: %v", err)
	}
	if !bin.HasAgent() {
		t.Fatalf("no agent binary: %v", harness.FirstLine(bin.AgentErr))
	}
	dir := t.TempDir()
	b, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "bootstrap.json")
	if err := os.WriteFile(file, b, 0o600); err != nil {
		t.Fatal(err)
	}
	ips := harness.NewIPPool()
	var agents []*harness.Agent
	for i := range n {
		ip, err := ips.Next()
		if err != nil {
			t.Fatal(err)
		}
		ag := harness.NewAgent(bin, "e2e", fmt.Sprintf("pod-%d", i), ip, "", dir, "--insecure-no-auth", "--bootstrap="+file)
		if err := ag.Start(ctx); err != nil {
			t.Fatalf("agent %d: %v", i, err)
		}
		t.Cleanup(func() { _ = ag.Stop(2 * time.Second) })
		agents = append(agents, ag)
	}
	// Started together, they get ready together: waiting for each before starting the next
	// took n times one agent's start on a busy machine.
	for i, ag := range agents {
		if err := ag.WaitReady(ctx, 20*time.Second); err != nil {
			t.Fatalf("agent %d: %v", i, err)
		}
	}
	return agents
}

var e2eHTTP = &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}

// agentState reads an agent's State.
func agentState(ctx context.Context, a *harness.Agent) (assignment.State, error) {
	var st assignment.State
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.ControlURL()+"/v1/state", nil)
	if err != nil {
		return st, err
	}
	res, err := e2eHTTP.Do(req)
	if err != nil {
		return st, err
	}
	defer res.Body.Close()
	return st, json.NewDecoder(res.Body).Decode(&st)
}

// trips is the agent's count of breaker trips from closed, from its metrics.
func trips(ctx context.Context, a *harness.Agent, ds string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, a.ControlURL()+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	res, err := e2eHTTP.Do(req)
	if err != nil {
		return 0, err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		return 0, err
	}
	want := fmt.Sprintf(`apportion_agent_breaker_transitions_total{downstream=%q,from="closed",to="open"} `, ds)
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, want); ok {
			var n float64
			_, err := fmt.Sscan(v, &n)
			return int(n), err
		}
	}
	return 0, nil
}

// closedLoad runs workers per agent calling ds in a loop until ctx ends; a refusal by the agent
// (an open breaker, no permit) makes the worker pause, as a well-behaved app would.
func closedLoad(ctx context.Context, agents []*harness.Agent, ds string, workers int) *sync.WaitGroup {
	var wg sync.WaitGroup
	for _, a := range agents {
		for range workers {
			wg.Go(func() {
				for ctx.Err() == nil {
					req, _ := http.NewRequestWithContext(ctx, http.MethodGet, a.DataURL(ds)+"/x", nil)
					res, err := e2eHTTP.Do(req)
					if err != nil {
						continue
					}
					_, _ = io.Copy(io.Discard, res.Body)
					res.Body.Close()
					if res.Header.Get("X-Apportion-Reason") != "" {
						_ = sleep(ctx, 50*time.Millisecond)
					}
				}
			})
		}
	}
	return &wg
}

type recoveryRun struct {
	trips        []int         // closed→open per agent
	fullAfter    time.Duration // from the incident to full permits with every breaker closed, for good
	recPeak      int64         // the downstream's peak in flight while its capacity recovered
	recExcess    int64         // the most in flight above its capacity then
	recFailed    int64         // calls that failed then
	failed, ok   int64
	finalHealthy bool
}

// runRecovery drives the scenario with the ramp on or off.
func runRecovery(t *testing.T, withRamp bool) recoveryRun {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	const agents, permits = 4, 10
	const down, rise = 2 * time.Second, 8 * time.Second
	f := startFragile(t, agents*permits+8, 50*time.Millisecond, down, rise)
	d := assignment.Downstream{
		Name: "fragile", Upstream: f.URL, Permits: permits, SafeDefaultPermits: permits,
		AcquireTimeout: assignment.Duration(20 * time.Millisecond), RequestTimeout: assignment.Duration(2 * time.Second),
		Fallback: assignment.Fallback{Action: assignment.ActionReject},
		Breaker: &assignment.Breaker{Window: assignment.Duration(2 * time.Second), FailureRatePercent: 50,
			SlowCallThreshold: assignment.Duration(10 * time.Minute), SlowCallRatePercent: 100, MinimumCalls: 10,
			OpenDuration: assignment.Duration(time.Second), HalfOpenProbes: 1},
	}
	if withRamp {
		// 10 % of the permits (1) at first, +10 % (1) after 4 healthy windows of 250ms: about 4
		// permits a second over the 4 agents, below the 5.5 a second the capacity regains.
		d.Recovery = &assignment.Recovery{Window: assignment.Duration(250 * time.Millisecond),
			Ramp: &assignment.Ramp{Shape: assignment.ShapeLinear, InitialPercent: 10, StepPercent: 10, HealthyWindows: 4}}
	}
	ags := bootAgents(t, ctx, agents, assignment.Assignment{Downstreams: []assignment.Downstream{d}})
	// A pod's first permits are not the downstream recovering: with the ramp on too, each agent
	// enforces its full permits from the start (before any call, so nothing else could have
	// widened a ramp).
	for i, a := range ags {
		st, err := agentState(ctx, a)
		if err != nil || len(st.Downstreams) != 1 {
			t.Fatalf("agent %d state: %v", i, err)
		}
		if s := st.Downstreams[0]; s.Limit != permits {
			t.Fatalf("agent %d enforces %d of its %d first permits (ramp %v): want them all at once", i, s.Limit, permits, withRamp)
		}
	}
	load := closedLoad(ctx, ags, "fragile", permits+4)
	defer func() { cancel(); load.Wait() }()

	// fullNow reports whether every agent holds its full permits with its breaker closed.
	fullNow := func() bool {
		for _, a := range ags {
			st, err := agentState(ctx, a)
			if err != nil || len(st.Downstreams) != 1 {
				return false
			}
			if s := st.Downstreams[0]; s.Limit != permits || s.Breaker != "closed" {
				return false
			}
		}
		return true
	}
	// Steady state first.
	deadline := time.Now().Add(30 * time.Second)
	for !fullNow() {
		if time.Now().After(deadline) {
			t.Fatal("the agents never reached their full permits before the incident")
		}
		_ = sleep(ctx, 100*time.Millisecond)
	}
	_ = sleep(ctx, time.Second)
	for i, a := range ags {
		if n, _ := trips(ctx, a, "fragile"); n != 0 {
			t.Fatalf("agent %d tripped %d times before the incident", i, n)
		}
	}
	incident := time.Now()
	f.incident.Store(incident.UnixNano())
	okBefore, failedBefore := f.ok.Load(), f.failed.Load()

	// Until the capacity is back and every agent stayed at full permits for 2 s.
	var lastNotFull time.Time
	end := incident.Add(down + rise + 20*time.Second)
	for time.Now().Before(end) {
		now := time.Now()
		if !fullNow() {
			lastNotFull = now
		} else if now.Sub(incident) > down+rise && now.Sub(lastNotFull) > 2*time.Second {
			break
		}
		_ = sleep(ctx, 100*time.Millisecond)
	}
	r := recoveryRun{fullAfter: lastNotFull.Sub(incident), recPeak: f.recPeak.Load(), recExcess: f.recExcess.Load(), recFailed: f.recFailed.Load(),
		ok: f.ok.Load() - okBefore, failed: f.failed.Load() - failedBefore, finalHealthy: fullNow()}
	for _, a := range ags {
		n, err := trips(ctx, a, "fragile")
		if err != nil {
			t.Fatal(err)
		}
		r.trips = append(r.trips, n)
	}
	return r
}

// TestRecoveryRamp: the agents' first permits apply at once, ramp or not (a new pod is not the
// downstream recovering); after an incident, with the ramp (started by each breaker's close)
// each agent's breaker trips once and the downstream recovers; without it (the control) the full
// permits come back at once onto a downstream that cannot take them yet, and breakers trip again.
func TestRecoveryRamp(t *testing.T) {
	// Agents only (no control plane): it runs without KUBEBUILDER_ASSETS too.
	ramp := runRecovery(t, true)
	t.Logf("with the ramp: trips per agent %v, full permits %s after the incident; while the capacity recovered: peak %d in flight, at most %d above capacity, %d calls failed; %d ok / %d failed calls in all",
		ramp.trips, ramp.fullAfter.Round(10*time.Millisecond), ramp.recPeak, ramp.recExcess, ramp.recFailed, ramp.ok, ramp.failed)
	control := runRecovery(t, false)
	t.Logf("without the ramp: trips per agent %v, full permits %s after the incident; while the capacity recovered: peak %d in flight, at most %d above capacity, %d calls failed; %d ok / %d failed calls in all",
		control.trips, control.fullAfter.Round(10*time.Millisecond), control.recPeak, control.recExcess, control.recFailed, control.ok, control.failed)

	for i, n := range ramp.trips {
		if n != 1 {
			t.Errorf("with the ramp, agent %d's breaker tripped %d times, want once", i, n)
		}
	}
	if !ramp.finalHealthy {
		t.Error("with the ramp, the agents did not end at full permits with closed breakers")
	}
	retripped := false
	for _, n := range control.trips {
		retripped = retripped || n >= 2
	}
	if !retripped {
		t.Errorf("without the ramp no breaker tripped again (trips %v): the control does not show what the ramp prevents", control.trips)
	}
}
