package e2e

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/test/e2e/harness"
)

// The randomized scenario (TestRandomized, and `make chaos`: TestChaos runs it many times):
// scale events, manager kills (also in the middle of a scale event), agent kills and freezes,
// and flapping, in a schedule drawn from a seed before the run starts — so that the seed alone
// gives the same schedule again — then the whole record checked offline (harness.CheckHistory)
// beside the live monitor's checks. A failed run saves its schedule and record to a file.

// chaosAction is one step of a schedule. Which pod an agent action hits is Pick modulo the
// pods alive when it runs (oldest first): the same seed picks the same pods as long as the
// scale events left the same pods.
type chaosAction struct {
	Kind  string
	N, N2 int32
	// Phase is where a manager kill lands in a scale event ("decided", "spec", "pods").
	Phase string
	// Step paces a scale event; Down is how long a killed manager stays down.
	Step, Down time.Duration
	Pick       uint64
	// Flap holds the pauses between a flap's four scale events.
	Flap [4]time.Duration
	// Pause follows the action.
	Pause time.Duration
}

func (a chaosAction) String() string {
	switch a.Kind {
	case "scale":
		return fmt.Sprintf("scale to %d (step %s)", a.N, a.Step)
	case "scale+manager-kill":
		return fmt.Sprintf("scale to %d (step %s), killing the manager after %q, down %s", a.N, a.Step, a.Phase, a.Down)
	case "agent-kill", "agent-stop":
		return fmt.Sprintf("%s of pod #%d", a.Kind, a.Pick)
	case "flap":
		return fmt.Sprintf("flap %d ↔ %d (pauses %v)", a.N, a.N2, a.Flap)
	}
	return a.Kind
}

// chaosSchedule draws a run's actions from seed, until their pauses and nominal durations sum
// to d. The draw is the one TestRandomized always made (scale 30 %, scale with a manager kill
// 10 %, manager restart 10 %, agent kill 10 %, agent freeze 10 %, heal 10 %, flap 20 %).
func chaosSchedule(seed uint64, d time.Duration) []chaosAction {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	between := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(rng.Int64N(int64(hi-lo))) }
	pods := func() int32 { return 4 + rng.Int32N(13) }
	var out []chaosAction
	var total time.Duration
	for total < d {
		var a chaosAction
		switch k := rng.IntN(10); {
		case k < 3:
			a = chaosAction{Kind: "scale", N: pods(), Step: between(0, 300*time.Millisecond)}
			total += 3 * a.Step
		case k < 4:
			a = chaosAction{Kind: "scale+manager-kill", N: pods(), Phase: []string{"decided", "spec", "pods"}[rng.IntN(3)],
				Down: between(100*time.Millisecond, 2*time.Second), Step: between(50*time.Millisecond, 300*time.Millisecond)}
			total += 3*a.Step + a.Down + time.Second
		case k < 5:
			a = chaosAction{Kind: "manager-restart"}
			total += time.Second
		case k < 6:
			a = chaosAction{Kind: "agent-kill", Pick: rng.Uint64()}
		case k < 7:
			a = chaosAction{Kind: "agent-stop", Pick: rng.Uint64()}
		case k < 8:
			a = chaosAction{Kind: "heal"}
			total += 500 * time.Millisecond
		default:
			a = chaosAction{Kind: "flap", N: pods(), N2: pods()}
			for i := range a.Flap {
				a.Flap[i] = between(100*time.Millisecond, 700*time.Millisecond)
				total += a.Flap[i]
			}
		}
		a.Pause = between(200*time.Millisecond, 1500*time.Millisecond)
		total += a.Pause
		out = append(out, a)
	}
	return out
}

// chaosResult is what one run measured.
type chaosResult struct {
	Seed     uint64
	Actions  int
	Elapsed  time.Duration
	Converge time.Duration // from the end of the schedule (all healed) to every pod at its share
	Findings []harness.Finding
	Monitor  harness.MonitorStats
	Load     harness.LoadStats
	Saved    string // the record's file, when the run failed
}

// chaosOut is where failed runs' records go (E2E_CHAOS_OUT, default a directory under the
// system's temporary one).
func chaosOut() string {
	if d := os.Getenv("E2E_CHAOS_OUT"); d != "" {
		return d
	}
	return filepath.Join(os.TempDir(), "apportion-chaos")
}

// runChaos plays seed's schedule for about d on a fresh scenario, checks the record and, when
// the run failed, saves the schedule and the record (the path is logged, with the seed). The
// run is bounded: the schedule must end within d + 2 min.
func runChaos(t *testing.T, seed uint64, d time.Duration, replay string, res *chaosResult) {
	res.Seed = seed
	schedule := chaosSchedule(seed, d)
	res.Actions = len(schedule)
	t.Logf("seed %d: %d actions over about %s (replay: %s)", seed, len(schedule), d, replay)
	s := scenario(t, harness.ScenarioConfig{KeepHistory: true, Record: true})
	w, mon := s.Workload, s.Monitor
	var saved bool
	save := func() {
		if saved {
			return
		}
		saved = true
		h := mon.History()
		h.Seed, h.Load = seed, s.Load.Stats()
		for _, a := range schedule {
			h.Schedule = append(h.Schedule, a.String())
		}
		dir := chaosOut()
		path := filepath.Join(dir, fmt.Sprintf("seed-%d.json", seed))
		if err := os.MkdirAll(dir, 0o755); err == nil {
			err = h.Save(path)
			if err == nil {
				res.Saved = path
				t.Logf("seed %d: schedule and record saved to %s (replay: %s)", seed, path, replay)
				return
			}
		}
		t.Logf("seed %d: could not save the record to %s", seed, dir)
	}
	// A run that fails anywhere (a t.Fatalf of the harness included) leaves its record; this
	// cleanup runs before the scenario's own, which stops the agents.
	t.Cleanup(func() {
		if t.Failed() {
			save()
			t.Logf("FAILED: seed %d (replay: %s)", seed, replay)
		}
	})
	ctx, cancel := context.WithTimeout(t.Context(), d+2*time.Minute)
	defer cancel()
	start := time.Now()
	mustConverge(t, ctx, s)
	var dead, frozen []string
	kill := func(p string) error {
		a := w.Agent(p)
		if a == nil {
			return fmt.Errorf("no agent %s", p)
		}
		pid := a.Pid()
		if err := w.KillAgent(p); err != nil {
			return err
		}
		mon.Note(a, pid, harness.EventKilled)
		return nil
	}
	// heal restarts killed agents whose pods still exist, and frozen ones (kill -9 and start:
	// the kubelet restarting a container that failed its probes). Resuming a frozen agent
	// (SIGCONT) is TestFrozenAgentResumes' subject: outside the protocol's model.
	heal := func() error {
		live := w.Pods()
		for _, p := range frozen {
			if a := w.Agent(p); a != nil && a.Running() {
				if err := kill(p); err != nil {
					return err
				}
				dead = append(dead, p)
			}
		}
		for _, p := range dead {
			if slices.Contains(live, p) {
				if err := w.RestartAgent(ctx, p); err != nil {
					return err
				}
			}
		}
		dead, frozen = nil, nil
		return nil
	}
	pick := func(n uint64) string { p := w.Pods(); return p[n%uint64(len(p))] }
	for i, act := range schedule {
		if t.Failed() {
			break
		}
		var err error
		switch act.Kind {
		case "scale":
			err = w.ScaleTo(ctx, act.N, harness.ScaleOptions{Step: act.Step})
		case "scale+manager-kill":
			// The restart runs beside the scale: pods wait for the injection webhook (as the
			// ReplicaSet controller's retries do) while no manager serves it.
			restarted := make(chan error, 1)
			killed := false
			err = w.ScaleTo(ctx, act.N, harness.ScaleOptions{Step: act.Step, BetweenPhases: func(p string) {
				if p == act.Phase {
					killed = true
					_ = s.Manager.Kill()
					go func() {
						_ = sleep(ctx, act.Down)
						restarted <- s.Manager.Start(ctx)
					}()
				}
			}})
			if killed {
				if serr := <-restarted; err == nil {
					err = serr
				}
			}
		case "manager-restart":
			err = s.Manager.Restart(ctx)
		case "agent-kill":
			p := pick(act.Pick)
			if slices.Contains(dead, p) || slices.Contains(frozen, p) {
				t.Logf("action %d: %s: %s is down already, skipped", i, act, p)
				continue
			}
			err = kill(p)
			dead = append(dead, p)
		case "agent-stop":
			p := pick(act.Pick)
			if slices.Contains(dead, p) || slices.Contains(frozen, p) {
				t.Logf("action %d: %s: %s is down already, skipped", i, act, p)
				continue
			}
			a := w.Agent(p)
			// A reading right before the signal: the record's last one of this process.
			_ = mon.ReadNow(ctx, a)
			pid := a.Pid()
			if err = w.SuspendAgent(p); err == nil {
				mon.Note(a, pid, harness.EventFrozen)
			}
			frozen = append(frozen, p)
		case "heal":
			err = heal()
		case "flap":
			for j := range 4 {
				if err = w.ScaleTo(ctx, []int32{act.N, act.N2}[j%2], harness.ScaleOptions{}); err != nil {
					break
				}
				_ = sleep(ctx, act.Flap[j])
			}
		}
		if err != nil {
			t.Fatalf("seed %d, action %d (%s): %v", seed, i, act, err)
		}
		t.Logf("action %d: %s", i, act)
		_ = sleep(ctx, act.Pause)
	}
	if err := heal(); err != nil {
		t.Fatalf("seed %d: %v", seed, err)
	}
	t0 := time.Now()
	mustConverge(t, ctx, s)
	res.Converge = time.Since(t0)
	if ctx.Err() != nil {
		t.Fatalf("seed %d: the run took longer than its bound %s", seed, d+2*time.Minute)
	}
	res.Monitor = finish(t, s, start)
	res.Load = s.Load.Stats()
	res.Elapsed = time.Since(start)
	h := mon.History()
	h.Load = res.Load
	res.Findings = harness.CheckHistory(h)
	t.Logf("seed %d: %d readings, %d ledger readings, %d events checked offline; converged %s after the schedule",
		seed, len(h.Readings), len(h.Ledger), len(h.Events), res.Converge.Round(time.Millisecond))
	for _, f := range res.Findings {
		t.Errorf("seed %d: offline check: %s", seed, f)
	}
	if t.Failed() {
		save()
	}
}

// TestRandomized runs one seed's schedule for 30 s (full: 3 minutes); E2E_SEED replays a seed.
func TestRandomized(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("E2E_SEED"); v != "" {
		var err error
		if seed, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("E2E_SEED: %v", err)
		}
	}
	d := dur(30*time.Second, 3*time.Minute)
	replay := fmt.Sprintf("E2E_SEED=%d go test -run '^TestRandomized$' ./test/e2e/", seed)
	if full {
		replay = "E2E_FULL=1 " + replay
	}
	runChaos(t, seed, d, replay, &chaosResult{})
}

// TestChaos is `make chaos`: the randomized scenario E2E_CHAOS_RUNS times (seeds
// E2E_CHAOS_SEED, +1, +2, ...; default seed the time), each for E2E_CHAOS_RUN (default 20s), one
// subtest per seed, then a summary: runs, failed seeds, offline findings, the slowest
// convergence. Skipped unless E2E_CHAOS_RUNS is set.
func TestChaos(t *testing.T) {
	runs, err := strconv.Atoi(os.Getenv("E2E_CHAOS_RUNS"))
	if err != nil || runs <= 0 {
		t.Skip("E2E_CHAOS_RUNS is not set: `make chaos RUNS=n SEED=s` runs this")
	}
	base := uint64(time.Now().UnixNano() % 1e9)
	if v := os.Getenv("E2E_CHAOS_SEED"); v != "" {
		if base, err = strconv.ParseUint(v, 10, 64); err != nil {
			t.Fatalf("E2E_CHAOS_SEED: %v", err)
		}
	}
	d := 20 * time.Second
	if v := os.Getenv("E2E_CHAOS_RUN"); v != "" {
		if d, err = time.ParseDuration(v); err != nil {
			t.Fatalf("E2E_CHAOS_RUN: %v", err)
		}
	}
	envFor(t) // build and start once, before the first run's clock
	var results []chaosResult
	var failed []string
	began := time.Now()
	for i := range runs {
		seed := base + uint64(i)
		replay := fmt.Sprintf("make chaos RUNS=1 SEED=%d CHAOS_RUN=%s", seed, d)
		var res chaosResult
		ok := t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { runChaos(t, seed, d, replay, &res) })
		results = append(results, res)
		if !ok {
			failed = append(failed, fmt.Sprintf("%d (%s)", seed, res.Saved))
		}
	}
	t.Log(chaosSummary(results, failed, time.Since(began)))
}

// chaosSummary is the table `make chaos` ends with.
func chaosSummary(rs []chaosResult, failed []string, elapsed time.Duration) string {
	var b strings.Builder
	var findings, permitViol, ledgerViol, tooMany int
	var slowest chaosResult
	var actions int
	var calls, ok, fallback, errs int64
	for _, r := range rs {
		findings += len(r.Findings)
		permitViol += r.Monitor.PermitViolations + r.Monitor.InFlightViolations
		ledgerViol += r.Monitor.LedgerViolations
		tooMany += int(r.Monitor.Downstream.TooMany429)
		actions += r.Actions
		calls, ok, fallback, errs = calls+r.Load.Requests, ok+r.Load.OK, fallback+r.Load.Fallback, errs+r.Load.Errors
		if r.Converge > slowest.Converge {
			slowest = r
		}
	}
	fmt.Fprintf(&b, "chaos: %d runs in %s, %d actions; %d failed", len(rs), elapsed.Round(time.Second), actions, len(failed))
	if len(failed) > 0 {
		fmt.Fprintf(&b, ": %s", strings.Join(failed, ", "))
	}
	fmt.Fprintf(&b, "\nviolations: %d offline findings, %d confirmed Σ-permit/in-flight samples, %d ledger samples, %d × 429", findings, permitViol, ledgerViol, tooMany)
	fmt.Fprintf(&b, "\ncalls: %d (2xx %d, fallback %d, transport errors at killed or frozen agents %d)", calls, ok, fallback, errs)
	fmt.Fprintf(&b, "\nslowest convergence after a schedule: %s (seed %d)", slowest.Converge.Round(time.Millisecond), slowest.Seed)
	b.WriteString("\nseed        actions  elapsed  converge  samples  Hz    maxΣ  findings")
	for _, r := range rs {
		fmt.Fprintf(&b, "\n%-11d %7d  %7s  %8s  %7d  %4.1f  %4d  %d", r.Seed, r.Actions, r.Elapsed.Round(time.Second),
			r.Converge.Round(time.Millisecond), r.Monitor.Samples, r.Monitor.Hz(), r.Monitor.MaxSumPermits, len(r.Findings))
	}
	return b.String()
}
