package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/test/e2e/harness"
)

// TestClusterSoak is `make soak` (skipped unless E2E_SOAK=1; never part of `make test`): the
// cluster mode (the real kube-controller-manager, kube-scheduler and kwok nodes) with real
// agents, 8–32 pods of one Deployment in two quotas ("logistics", limit 50, and "inventory",
// limit 30, each its own partner), an open-loop load over both, and a fault schedule drawn from
// a seed (E2E_SOAK_SEED; printed): the partners slowing (2 % of calls held 8 × the latency: P99
// × 8) and failing (5xx bursts) in waves, the manager killed about every sixth of the run (every
// ~10 min of an hour), agents SIGKILLed or SIGSTOPped and restarted, the signing key rotated
// (--key-rotation-interval), inventory's limit raised, lowered and restored, a rolling update,
// scale events and HPA flaps. It lasts E2E_SOAK_DURATION (default 60m) and prints, per window of
// a twelfth of it (5 minutes of an hour): the calls, answered by a partner / by a fallback /
// lost with a killed or frozen agent / unanswered, Σ-permit violations, each judge's peak
// against its limit, 429s, the manager's and the agents' RSS, goroutines and open descriptors,
// and the manager's API requests per second. It fails on an unanswered call, a violation, a
// 429, a judge's peak over its limit, or a resource that grows without bound (a least-squares
// slope over the last two thirds of the run: see soakGrowth).
func TestClusterSoak(t *testing.T) {
	if os.Getenv("E2E_SOAK") == "" {
		t.Skip("E2E_SOAK is not set: `make soak` runs this (SOAK_DURATION, default 60m)")
	}
	total := 60 * time.Minute
	if v := os.Getenv("E2E_SOAK_DURATION"); v != "" {
		var err error
		if total, err = time.ParseDuration(v); err != nil || total < 5*time.Minute {
			t.Fatalf("E2E_SOAK_DURATION=%q: a duration of at least 5m", v)
		}
	}
	seed := uint64(time.Now().UnixNano() % 1e9)
	if v := os.Getenv("E2E_SOAK_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("E2E_SOAK_SEED: %v", err)
		}
	}
	rate := 120.0
	if v := os.Getenv("E2E_SOAK_RATE"); v != "" {
		var err error
		if rate, err = strconv.ParseFloat(v, 64); err != nil || rate <= 0 {
			t.Fatalf("E2E_SOAK_RATE=%q", v)
		}
	}
	window := total / 12
	t.Logf("soak: %s, windows of %s, seed %d (replay: make soak SOAK_DURATION=%s SOAK_SEED=%d), %.0f calls/s open loop", total, window, seed, total, seed, rate)

	port := freeLoopbackPort(t)
	// A key made every third of the run (at least twice the minimum overlap of 2 min): one
	// rotation — a key published, signing after the overlap, the old one withdrawn — in the run.
	rotation := max(total/3, 4*time.Minute+time.Second)
	s := scenario(t, harness.ScenarioConfig{
		Deployment: rollingDeployment("gateway", "25%"), Replicas: 8, MinReplicas: 8, MaxReplicas: 32,
		NoLoad: true, MonitorHz: 10, KeepHistory: false,
		ManagerArgs: []string{"--metrics-bind-address=127.0.0.1:" + strconv.Itoa(port), "--metrics-secure=false",
			"--key-rotation-interval=" + rotation.String(), "--key-overlap=2m"},
	})
	ctx := t.Context()
	mustConverge(t, ctx, s)
	cp := s.Env.CP

	// The second quota: the same pods, another partner.
	ds2, err := harness.StartDownstream(30, s.Cfg.Latency)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ds2.Close() })
	q2 := harness.NewQuota(harness.QuotaConfig{Namespace: s.Cfg.Namespace, Name: "inventory", Limit: 30,
		Target: s.Cfg.Workload, AcquireTimeout: s.Cfg.AcquireTimeout, RequestTimeout: s.Cfg.RequestTimeout})
	q2.Spec.Upstream = ds2.URL
	if err := cp.Client.Create(ctx, q2); err != nil {
		t.Fatal(err)
	}
	var judge2 atomic.Int32 // inventory's limit in force for the judge and its monitor
	judge2.Store(30)
	var safe2 atomic.Int32
	mon2, err := harness.StartMonitor(ctx, harness.MonitorConfig{
		Source: s.Workload, Downstream: "inventory", Limit: 30, LimitNow: judge2.Load, Hz: 10, Key: s.Keys.Key,
		SafeDefault: safe2.Load, RequestTimeout: s.Cfg.RequestTimeout, DS: ds2, LeaseTTL: s.Cfg.LeaseTTL,
		Ledger: func(ctx context.Context) (harness.LedgerReading, error) {
			dq, err := cp.GetQuota(ctx, s.Cfg.Namespace, "inventory")
			if err != nil {
				return harness.LedgerReading{}, err
			}
			safe2.Store(dq.Status.SafeDefaultPermits)
			ready := meta.FindStatusCondition(dq.Status.Conditions, apportionv1.ConditionReady)
			rec := ready != nil && ready.Status == metav1.ConditionFalse && ready.Reason == apportionv1.ReasonRecovering
			return harness.LedgerReading{Sum: dq.Status.Ledger, Recovering: rec, Detail: fmt.Sprintf("pods=%d perPod=%s", dq.Status.Pods, dq.Status.PerPod)}, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mon2.Stop() })

	load := harness.StartOpenLoad(ctx, harness.OpenLoadConfig{Source: s.Workload, Downstreams: []string{s.Cfg.Quota, "inventory"}, Rate: rate,
		Logf: s.Cfg.Logf})
	sampler := startSoakSampler(ctx, s, port)
	start := time.Now()

	// The windows' report runs beside the schedule.
	rep := &soakReport{t: t, s: s, ds2: ds2, mon2: mon2, load: load, sampler: sampler, start: start, window: window}
	repDone := make(chan struct{})
	repCtx, stopRep := context.WithCancel(ctx)
	go func() { defer close(repDone); rep.run(repCtx) }()

	runSoakSchedule(t, ctx, s, ds2, &judge2, seed, total, start)

	ls := load.Stop()
	stopRep()
	<-repDone
	rep.close(time.Now()) // the last, partial window
	sampler.stop()
	st1, st2 := s.Monitor.Stop(), mon2.Stop()
	table := rep.table()
	t.Logf("soak: %s, seed %d\n%s\nload: %+v\nlogistics: %s\ninventory: %s", time.Since(start).Round(time.Second), seed, table, ls, st1, st2)
	if out := os.Getenv("E2E_SOAK_OUT"); out != "" {
		if err := os.WriteFile(out, []byte(fmt.Sprintf("soak %s, seed %d, %.0f calls/s\n%s\n", total, seed, rate, table)), 0o644); err == nil {
			t.Logf("table written to %s", out)
		}
	}

	if ls.Unanswered > 0 {
		t.Errorf("%d calls unanswered (neither the partner nor a fallback answered, and their agent was neither killed nor frozen): %v", ls.Unanswered, load.Unanswered())
	}
	if ls.TooMany429 > 0 || st1.Downstream.TooMany429 > 0 || st2.Downstream.TooMany429 > 0 {
		t.Errorf("429s: the app saw %d, logistics answered %d, inventory %d", ls.TooMany429, st1.Downstream.TooMany429, st2.Downstream.TooMany429)
	}
	for name, st := range map[string]harness.MonitorStats{"logistics": st1, "inventory": st2} {
		if st.PermitViolations+st.InFlightViolations+st.LedgerViolations > 0 {
			t.Errorf("%s: violations: Σ permits %d, Σ in-flight %d, ledger %d", name, st.PermitViolations, st.InFlightViolations, st.LedgerViolations)
		}
	}
	if rep.peakOver != "" {
		t.Errorf("a judge's peak went over its limit: %s", rep.peakOver)
	}
	for _, g := range soakGrowth(sampler.samples(), start, total) {
		t.Error(g)
	}
}

func freeLoopbackPort(t *testing.T) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// soakEvent is one step of the fault schedule, at an offset from the start.
type soakEvent struct {
	At   time.Duration
	What string
	Do   func(ctx context.Context) error
}

// runSoakSchedule draws the fault schedule from seed and plays it, one event after another (an
// event that overruns delays the next), until total; an event's error fails the test, except an
// agent fault whose pod went away meanwhile (a scale-in chose it).
func runSoakSchedule(t *testing.T, ctx context.Context, s *harness.Scenario, ds2 *harness.Downstream, judge2 *atomic.Int32, seed uint64, total time.Duration, start time.Time) {
	rng := rand.New(rand.NewPCG(seed, seed^0x51ed2701))
	w := s.Workload
	frac := func(f float64) time.Duration { return time.Duration(f * float64(total)) }
	jitter := func(d time.Duration) time.Duration { return time.Duration(rng.Int64N(int64(d))) }
	var ev []soakEvent
	add := func(at time.Duration, what string, do func(context.Context) error) {
		if at < total-30*time.Second {
			ev = append(ev, soakEvent{At: at, What: what, Do: do})
		}
	}
	dss := []*harness.Downstream{s.DS, ds2}
	lat := s.Cfg.Latency
	// Partner waves: a slow tail, then a 5xx burst, alternating, every ~window.
	for i, at := 0, frac(1.0/24); at < total; i, at = i+1, at+total/12+jitter(total/24) {
		d := dss[rng.IntN(2)]
		name := []string{"logistics", "inventory"}[slices.Index(dss, d)]
		if i%2 == 0 {
			dur := 60*time.Second + jitter(30*time.Second)
			add(at, fmt.Sprintf("%s partner slow for %s (2%% of calls at %s: P99 × 8)", name, dur, 8*lat), func(ctx context.Context) error {
				d.SetFaults(0, 20, 8*lat)
				time.AfterFunc(dur, func() { d.SetFaults(0, 0, 0) }) // the wave runs beside the next events
				return nil
			})
		} else {
			dur := 15*time.Second + jitter(15*time.Second)
			pm := 100 + rng.Int64N(200)
			add(at, fmt.Sprintf("%s partner fails %d‰ of calls (500) for %s", name, pm, dur), func(ctx context.Context) error {
				d.SetFaults(pm, 0, 0)
				time.AfterFunc(dur, func() { d.SetFaults(0, 0, 0) })
				return nil
			})
		}
	}
	// The manager killed about every sixth of the run.
	for at := total/6 - jitter(total/24); at < total; at += total/6 + jitter(total/24) - total/48 {
		add(at, "kill -9 the manager and start it again", s.Manager.Restart)
	}
	// Agents: a fault every ~45 s.
	for at := 20 * time.Second; at < total; at += 30*time.Second + jitter(30*time.Second) {
		pick, down := rng.Uint64(), 2*time.Second+jitter(6*time.Second)
		if rng.IntN(2) == 0 {
			add(at, fmt.Sprintf("SIGKILL an agent (pod #%d), restarted %s later", pick%100, down), func(ctx context.Context) error {
				return agentFault(ctx, w, pick, down, false)
			})
		} else {
			add(at, fmt.Sprintf("SIGSTOP an agent (pod #%d), killed and restarted %s later", pick%100, down), func(ctx context.Context) error {
				return agentFault(ctx, w, pick, down, true)
			})
		}
	}
	// inventory's limit: raised (the partner first), lowered (the judge after the drain),
	// restored.
	add(frac(0.3), "inventory's limit 30 → 45", func(ctx context.Context) error { return setLimit(ctx, s, ds2, judge2, 45) })
	add(frac(0.55), "inventory's limit 45 → 24", func(ctx context.Context) error { return setLimit(ctx, s, ds2, judge2, 24) })
	add(frac(0.8), "inventory's limit 24 → 30", func(ctx context.Context) error { return setLimit(ctx, s, ds2, judge2, 30) })
	// A rolling update.
	add(frac(0.45), "rolling update (a template annotation)", func(ctx context.Context) error {
		n := int32(len(w.Pods()))
		if err := w.UpdateTemplate(ctx, func(d *appsv1.Deployment) {
			if d.Spec.Template.Annotations == nil {
				d.Spec.Template.Annotations = map[string]string{}
			}
			d.Spec.Template.Annotations["soak.apportion.io/rev"] = strconv.FormatInt(time.Now().Unix(), 10)
		}); err != nil {
			return err
		}
		return w.WaitSettled(ctx, n, 5*time.Minute)
	})
	// Scale events (8–24), one to 32 and back, and HPA flaps.
	for at := frac(0.08); at < total; at += total/10 + jitter(total/20) {
		n := 8 + rng.Int32N(17)
		add(at, fmt.Sprintf("scale to %d", n), func(ctx context.Context) error { return w.ScaleTo(ctx, n, harness.ScaleOptions{}) })
	}
	add(frac(0.65), "scale to 32", func(ctx context.Context) error { return w.ScaleTo(ctx, 32, harness.ScaleOptions{}) })
	add(frac(0.7), "scale to 12", func(ctx context.Context) error { return w.ScaleTo(ctx, 12, harness.ScaleOptions{}) })
	for at := frac(0.15); at < total; at += total/4 + jitter(total/8) {
		a, b := 8+rng.Int32N(8), 14+rng.Int32N(8)
		add(at, fmt.Sprintf("HPA flap %d ↔ %d, 4 times 3 s apart", a, b), func(ctx context.Context) error {
			for i := range 4 {
				if err := w.ScaleTo(ctx, []int32{a, b}[i%2], harness.ScaleOptions{}); err != nil {
					return err
				}
				_ = sleep(ctx, 3*time.Second)
			}
			return nil
		})
	}
	slices.SortStableFunc(ev, func(a, b soakEvent) int { return int(a.At - b.At) })
	t.Logf("schedule: %d events", len(ev))
	for _, e := range ev {
		t.Logf("  +%s %s", e.At.Round(time.Second), e.What)
	}
	for _, e := range ev {
		if err := sleep(ctx, time.Until(start.Add(e.At))); err != nil {
			t.Fatalf("soak: %v", err)
		}
		t0 := time.Now()
		if err := e.Do(ctx); err != nil {
			t.Fatalf("seed %d, +%s %s: %v", seed, time.Since(start).Round(time.Second), e.What, err)
		}
		t.Logf("+%s %s (%s)", time.Since(start).Round(time.Second), e.What, time.Since(t0).Round(time.Millisecond))
	}
	_ = sleep(ctx, time.Until(start.Add(total)))
}

// agentFault kills (or freezes) the agent of pod pick modulo the pods, and after down kills the
// frozen one and starts it again, as a kubelet restarts a crashed or unresponsive container. A
// pod that went away meanwhile (a scale-in or a rollout chose it) is left alone.
func agentFault(ctx context.Context, w *harness.Workload, pick uint64, down time.Duration, freeze bool) error {
	pods := w.Pods()
	if len(pods) == 0 {
		return nil
	}
	p := pods[pick%uint64(len(pods))]
	var err error
	if freeze {
		err = w.SuspendAgent(p)
	} else {
		err = w.KillAgent(p)
	}
	if err != nil {
		return ignoreGone(w, p, err)
	}
	_ = sleep(ctx, down)
	if !slices.Contains(w.Pods(), p) {
		return nil
	}
	if err := w.KillAgent(p); err != nil {
		return ignoreGone(w, p, err)
	}
	return ignoreGone(w, p, w.RestartAgent(ctx, p))
}

func ignoreGone(w *harness.Workload, pod string, err error) error {
	if err != nil && !slices.Contains(w.Pods(), pod) {
		return nil
	}
	return err
}

// setLimit edits inventory's maxInFlight. Raised: the partner admits more first (the judge
// follows it), then the quota. Lowered: the quota first; the judge keeps the old limit until the
// manager's ledger is within the new one (the lowerings acknowledged) and the calls admitted
// under the old one have ended (the request timeout, twice: an abandoned call keeps its permit
// for abandonedCallHold), as docs/protocol.md §11 promises.
func setLimit(ctx context.Context, s *harness.Scenario, ds2 *harness.Downstream, judge2 *atomic.Int32, n int32) error {
	cp := s.Env.CP
	patch := func() error {
		dq, err := cp.GetQuota(ctx, s.Cfg.Namespace, "inventory")
		if err != nil {
			return err
		}
		orig := dq.DeepCopy()
		dq.Spec.MaxInFlight = n
		return cp.Client.Patch(ctx, dq, client.MergeFrom(orig))
	}
	if n >= judge2.Load() {
		ds2.SetLimit(int64(n))
		judge2.Store(n)
		return patch()
	}
	if err := patch(); err != nil {
		return err
	}
	deadline := time.Now().Add(2 * time.Minute)
	for {
		dq, err := cp.GetQuota(ctx, s.Cfg.Namespace, "inventory")
		if err == nil && dq.Status.ObservedGeneration >= dq.Generation && dq.Status.Ledger <= n {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("inventory's ledger did not come within the lowered limit %d in 2 min", n)
		}
		if err := sleep(ctx, 200*time.Millisecond); err != nil {
			return err
		}
	}
	if err := sleep(ctx, 2*s.Cfg.RequestTimeout+time.Second); err != nil {
		return err
	}
	ds2.SetLimit(int64(n))
	judge2.Store(n)
	return nil
}

// soakSample is one reading of the processes' resources.
type soakSample struct {
	At                                  time.Time
	ManagerPid                          int
	Manager                             harness.ProcResources
	APIRequests                         float64 // the manager's rest_client_requests_total (since its start)
	Agents                              int
	AgentRSS, AgentGoroutines, AgentFDs float64 // means over the agents read
}

type soakSampler struct {
	mu     sync.Mutex
	list   []soakSample
	cancel context.CancelFunc
	done   chan struct{}
}

// startSoakSampler reads the manager's and every agent's resources every 10 s.
func startSoakSampler(ctx context.Context, s *harness.Scenario, port int) *soakSampler {
	sp := &soakSampler{done: make(chan struct{})}
	ctx, sp.cancel = context.WithCancel(ctx)
	metricsURL := fmt.Sprintf("http://127.0.0.1:%d/metrics", port)
	go func() {
		defer close(sp.done)
		tk := time.NewTicker(10 * time.Second)
		defer tk.Stop()
		for {
			var smp soakSample
			smp.At = time.Now()
			smp.ManagerPid = s.Manager.Pid()
			if r, err := harness.ReadProcResources(smp.ManagerPid); err == nil {
				smp.Manager = r
			}
			if m, err := harness.ScrapeMetrics(ctx, metricsURL); err == nil {
				smp.Manager.Goroutines = int(m["go_goroutines"])
				smp.APIRequests = m["rest_client_requests_total"]
			}
			var n, g float64
			for _, a := range s.Workload.Agents() {
				if a.Suspended() {
					continue
				}
				r, err := harness.ReadProcResources(a.Pid())
				if err != nil {
					continue
				}
				smp.Agents++
				smp.AgentRSS += float64(r.RSS)
				smp.AgentFDs += float64(r.FDs)
				if m, err := harness.ScrapeMetrics(ctx, a.ControlURL()+"/metrics"); err == nil {
					smp.AgentGoroutines += m["go_goroutines"]
					g++
				}
				n++
			}
			if n > 0 {
				smp.AgentRSS /= n
				smp.AgentFDs /= n
			}
			if g > 0 {
				smp.AgentGoroutines /= g
			}
			sp.mu.Lock()
			sp.list = append(sp.list, smp)
			sp.mu.Unlock()
			select {
			case <-ctx.Done():
				return
			case <-tk.C:
			}
		}
	}()
	return sp
}

func (sp *soakSampler) stop() { sp.cancel(); <-sp.done }

func (sp *soakSampler) samples() []soakSample {
	sp.mu.Lock()
	defer sp.mu.Unlock()
	return slices.Clone(sp.list)
}

// apiRate is the manager's API requests per second over samples, counting from 0 again after a
// restart (a counter that went down).
func apiRate(ss []soakSample) float64 {
	if len(ss) < 2 {
		return 0
	}
	var n float64
	for i := 1; i < len(ss); i++ {
		d := ss[i].APIRequests - ss[i-1].APIRequests
		if ss[i].ManagerPid != ss[i-1].ManagerPid || d < 0 {
			d = ss[i].APIRequests
		}
		n += d
	}
	return n / ss[len(ss)-1].At.Sub(ss[0].At).Seconds()
}

// soakReport prints one line per window.
type soakReport struct {
	t       *testing.T
	s       *harness.Scenario
	ds2     *harness.Downstream
	mon2    *harness.Monitor
	load    *harness.OpenLoad
	sampler *soakSampler
	start   time.Time
	window  time.Duration

	lines    []string
	from     time.Time
	prevLoad harness.OpenLoadStats
	prevViol int
	prev429  int64
	peakOver string
}

const soakHeader = "window        calls  partner  fallback  504/502  lost  unanswered  Σviol  peak L/I (limit)  429  mgr RSS MiB  mgr gor  mgr fds  agents  agent RSS MiB  agent gor  agent fds  API req/s"

func (r *soakReport) run(ctx context.Context) {
	r.from = r.start
	tk := time.NewTicker(r.window)
	defer tk.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tk.C:
		}
		r.close(time.Now())
	}
}

// close ends the window [r.from, now) and prints its line.
func (r *soakReport) close(now time.Time) {
	if now.Sub(r.from) < time.Second {
		return
	}
	ls := r.load.Stats()
	d := ls.Sub(r.prevLoad)
	st1, st2 := r.s.Monitor.Stats(), r.mon2.Stats()
	viol := st1.PermitViolations + st1.InFlightViolations + st1.LedgerViolations + st2.PermitViolations + st2.InFlightViolations + st2.LedgerViolations
	n429 := st1.Downstream.TooMany429 + st2.Downstream.TooMany429
	p1, p2 := r.s.DS.ResetWindow(), r.ds2.ResetWindow()
	l1, l2 := r.s.DS.CurrentLimit(), r.ds2.CurrentLimit()
	if (p1 > l1 || p2 > l2) && r.peakOver == "" {
		r.peakOver = fmt.Sprintf("window from +%s: logistics %d/%d, inventory %d/%d", r.from.Sub(r.start).Round(time.Second), p1, l1, p2, l2)
	}
	var in []soakSample
	for _, smp := range r.sampler.samples() {
		if !smp.At.Before(r.from) && smp.At.Before(now) {
			in = append(in, smp)
		}
	}
	var last soakSample
	if len(in) > 0 {
		last = in[len(in)-1]
	}
	line := fmt.Sprintf("+%4.0f–%4.0fs %7d  %7d  %8d  %7d  %4d  %10d  %5d  %2d/%-2d %2d/%-2d (%d/%d)  %3d  %11.1f  %7d  %7d  %6d  %13.1f  %9.1f  %9.1f  %9.2f",
		r.from.Sub(r.start).Seconds(), now.Sub(r.start).Seconds(), d.Calls, d.Downstream, d.Fallback, d.AgentProblem, d.Lost, d.Unanswered,
		viol-r.prevViol, p1, l1, p2, l2, l1, l2, n429-r.prev429,
		float64(last.Manager.RSS)/(1<<20), last.Manager.Goroutines, last.Manager.FDs, last.Agents,
		last.AgentRSS/(1<<20), last.AgentGoroutines, last.AgentFDs, apiRate(in))
	r.lines = append(r.lines, line)
	r.t.Logf("%s\n%s", soakHeader, line)
	r.from, r.prevLoad, r.prevViol, r.prev429 = now, ls, viol, n429
}

func (r *soakReport) table() string { return soakHeader + "\n" + strings.Join(r.lines, "\n") }

// soakGrowth is the slope test: over the samples of the last two thirds of the run (the first
// third warms up: caches, connection pools, the first rotation), the least-squares line of each
// resource must not rise by more than a quarter of its mean and more than a floor (noise: a
// garbage collector's swing) across that span. The agents' figures are means over the agents
// alive at each sample; the manager's are fitted within its longest incarnation in the span (it
// is killed every sixth of the run, which starts it from scratch), when that lasted a sixth of
// the run and 12 samples at least. The API rate is fitted per sample interval over the span.
func soakGrowth(ss []soakSample, start time.Time, total time.Duration) []string {
	from := start.Add(total / 3)
	var fit []soakSample
	for _, s := range ss {
		if !s.At.Before(from) {
			fit = append(fit, s)
		}
	}
	if len(fit) < 6 {
		return []string{fmt.Sprintf("slope test: only %d resource samples in the last two thirds", len(fit))}
	}
	var out []string
	check := func(name string, ss []soakSample, v func(soakSample) float64, floor float64) {
		xs, ys := make([]float64, len(ss)), make([]float64, len(ss))
		var mean float64
		for i, s := range ss {
			xs[i], ys[i] = s.At.Sub(start).Seconds(), v(s)
			mean += ys[i]
		}
		mean /= float64(len(ss))
		span := xs[len(xs)-1] - xs[0]
		rise := harness.Slope(xs, ys) * span
		if rise > floor && rise > mean/4 {
			out = append(out, fmt.Sprintf("%s grows without bound: +%.1f over the last %s (mean %.1f; allowed: a quarter of the mean or %.0f)",
				name, rise, time.Duration(span*float64(time.Second)).Round(time.Second), mean, floor))
		}
	}
	check("agent RSS (MiB, mean per agent)", fit, func(s soakSample) float64 { return s.AgentRSS / (1 << 20) }, 8)
	check("agent goroutines (mean per agent)", fit, func(s soakSample) float64 { return s.AgentGoroutines }, 20)
	check("agent open fds (mean per agent)", fit, func(s soakSample) float64 { return s.AgentFDs }, 10)
	// The manager's longest incarnation in the span.
	var best []soakSample
	for i := 0; i < len(fit); {
		j := i
		for j < len(fit) && fit[j].ManagerPid == fit[i].ManagerPid {
			j++
		}
		if j-i > len(best) {
			best = fit[i:j]
		}
		i = j
	}
	if len(best) >= 12 && best[len(best)-1].At.Sub(best[0].At) >= total/6 {
		check("manager RSS (MiB)", best, func(s soakSample) float64 { return float64(s.Manager.RSS) / (1 << 20) }, 32)
		check("manager goroutines", best, func(s soakSample) float64 { return float64(s.Manager.Goroutines) }, 50)
		check("manager open fds", best, func(s soakSample) float64 { return float64(s.Manager.FDs) }, 20)
	}
	// The API rate over the whole span (a restarted manager's first requests recur every sixth
	// of the run: periodic, not a trend).
	if len(fit) >= 12 {
		rates := make([]soakSample, 0, len(fit))
		for i := 1; i < len(fit); i++ {
			r := fit[i]
			r.APIRequests = apiRate(fit[i-1 : i+1])
			rates = append(rates, r)
		}
		check("manager API requests/s", rates, func(s soakSample) float64 { return s.APIRequests }, 5)
	}
	return out
}
