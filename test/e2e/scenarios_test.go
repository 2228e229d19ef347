package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/test/e2e/harness"
)

// converge is how long permits may take to follow a change. Pods removed by a scale-in are
// counted until their lease (2s) and the request timeout (1s) passed, hence the margin.
const converge = 15 * time.Second

func mustConverge(t *testing.T, ctx context.Context, s *harness.Scenario) {
	t.Helper()
	n := int32(len(s.Workload.Pods()))
	if err := s.WaitPermits(ctx, s.PerPod(n), converge); err != nil {
		t.Fatalf("%d pods: %v", n, err)
	}
}

// TestScaleSteps: 8 → 10 → 16 → 4 pods under steady load.
func TestScaleSteps(t *testing.T) {
	playedInClusterWhenShort(t)
	s := scenario(t, harness.ScenarioConfig{})
	ctx := t.Context()
	start := time.Now()
	mustConverge(t, ctx, s)
	hold := dur(time.Second, 5*time.Second)
	for _, n := range []int32{10, 16, 4} {
		if err := s.Workload.ScaleTo(ctx, n, harness.ScaleOptions{Step: 100 * time.Millisecond}); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		mustConverge(t, ctx, s)
		t.Logf("%d pods × %d permits after %s", n, s.PerPod(n), time.Since(t0).Round(time.Millisecond))
		_ = sleep(ctx, hold)
	}
	finish(t, s, start)
}

// TestManagerKilledDuringScaleOut: kill -9 the manager after the HPA decided 8 → 16 and before
// the new pods exist; a new manager starts a second later, must fence the old one's assignments
// with a higher epoch and wait out leases before raising anyone. The new pods cannot be created
// while no manager serves the injection webhook (failurePolicy Fail: no pod of a target without
// its agent); the harness retries their creation as the ReplicaSet controller does, so they come
// up while the new manager starts.
//
// It prints the time from the new leader's start (its push engine's) until Σ permits reached
// 75 % of the budget, and each new pod's time from its first permit to its full share (figures
// only: no assertion on them, docs/benchmarks.md "Failover").
func TestManagerKilledDuringScaleOut(t *testing.T) {
	playedInClusterWhenShort(t)
	s := scenario(t, harness.ScenarioConfig{KeepHistory: true, ManagerArgs: failoverArgs})
	ctx := t.Context()
	start := time.Now()
	mustConverge(t, ctx, s)
	sts, err := s.States(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var oldEpoch int64
	before := map[string]bool{}
	for pod, st := range sts {
		oldEpoch = max(oldEpoch, st.Epoch)
		before[pod] = true
	}
	restarted := make(chan error, 1)
	err = s.Workload.ScaleTo(ctx, 16, harness.ScaleOptions{Step: 150 * time.Millisecond, BetweenPhases: func(phase string) {
		if phase == "spec" {
			t.Logf("kill -9 the manager (pid %d)", s.Manager.Pid())
			if err := s.Manager.Kill(); err != nil {
				t.Error(err)
			}
			go func() {
				_ = sleep(ctx, time.Second)
				restarted <- s.Manager.Start(ctx)
			}()
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-restarted; err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	mustConverge(t, ctx, s)
	t.Logf("16 pods × %d permits %s after the restart", s.PerPod(16), time.Since(t0).Round(time.Millisecond))
	if starts, err := engineStarts(s.Manager.LogPath); err != nil || len(starts) < 2 {
		t.Logf("no failover figures: the manager's log shows %d engine starts (%v)", len(starts), err)
	} else if s.Monitor != nil {
		budget := s.Cfg.Limit * s.Cfg.FactorPercent / 100
		t.Logf("failover: %s", measureFailover(s.Monitor.Samples(), starts[len(starts)-1], budget, s.PerPod(16), before))
	}
	sts, err = s.States(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for pod, st := range sts {
		if st.Epoch <= oldEpoch {
			t.Errorf("%s holds epoch %d after the restart, want > %d", pod, st.Epoch, oldEpoch)
		}
	}
	if err := s.Workload.ScaleTo(ctx, 8, harness.ScaleOptions{Step: 100 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	mustConverge(t, ctx, s)
	finish(t, s, start)
}

// TestAgentKilledAndRestarted: kill -9 one agent; scale 8 → 10 while it is down (the others
// lower, the dead one cannot ack); the kubelet restarts it on the same address; it gets its
// permits back.
func TestAgentKilledAndRestarted(t *testing.T) {
	playedInClusterWhenShort(t)
	s := scenario(t, harness.ScenarioConfig{})
	ctx := t.Context()
	start := time.Now()
	mustConverge(t, ctx, s)
	victim := s.Workload.Pods()[2]
	if err := s.Workload.KillAgent(victim); err != nil {
		t.Fatal(err)
	}
	_ = sleep(ctx, 500*time.Millisecond)
	if err := s.Workload.ScaleTo(ctx, 10, harness.ScaleOptions{Step: 100 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	_ = sleep(ctx, time.Second)
	if err := s.Workload.RestartAgent(ctx, victim); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	mustConverge(t, ctx, s)
	t.Logf("the restarted agent %s got %d permits after %s", victim, s.PerPod(10), time.Since(t0).Round(time.Millisecond))
	// And once more without a scale event in between.
	if err := s.Workload.KillAgent(victim); err != nil {
		t.Fatal(err)
	}
	if err := s.Workload.RestartAgent(ctx, victim); err != nil {
		t.Fatal(err)
	}
	mustConverge(t, ctx, s)
	_ = sleep(ctx, dur(time.Second, 5*time.Second))
	finish(t, s, start)
}

// TestAgentSuspendedShareReclaimedAfterLease: SIGSTOP one agent (alive, holding 5 permits,
// unreachable), then scale 4 → 5 pods. Global 20 with factor 100%: every pod should hold 4, the
// others are lowered, but the new pod can only get what the stopped one's 5 leave free until the
// stopped agent's lease passed plus the request timeout, after which it counts at its safe
// default (min(5, 20/8 = 2)). Then the kubelet restarts the frozen container (kill -9, start):
// it gets its 4 permits.
func TestAgentSuspendedShareReclaimedAfterLease(t *testing.T) {
	s, victim := suspendAndReclaim(t, harness.ScenarioConfig{})
	ctx := t.Context()
	if err := s.Workload.KillAgent(victim); err != nil {
		t.Fatal(err)
	}
	if err := s.Workload.RestartAgent(ctx, victim); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	mustConverge(t, ctx, s)
	t.Logf("after the restart of %s, all 5 pods × %d permits in %s", victim, s.PerPod(5), time.Since(t0).Round(time.Millisecond))
	finish(t, s, s.Started)
}

// TestFrozenAgentResumes is the same, but the frozen agent resumes (SIGCONT) while its app kept
// calling it: the control requests and the calls that queued in the kernel while it was frozen
// all arrive at once. The agent must not apply the pushes the manager gave up on long ago (a
// renewal of the old grant, a lowering), which would start a fresh lease the manager no longer
// counts, nor admit calls on its lapsed lease before its lease timer ran (docs/protocol.md,
// "Frozen agents").
func TestFrozenAgentResumes(t *testing.T) {
	s, victim := suspendAndReclaim(t, harness.ScenarioConfig{CallSuspended: true})
	ctx := t.Context()
	resumed := time.Now()
	if err := s.Workload.ResumeAgent(victim); err != nil {
		t.Fatal(err)
	}
	mustConverge(t, ctx, s)
	t.Logf("after SIGCONT, all 5 pods × %d permits in %s", s.PerPod(5), time.Since(resumed).Round(time.Millisecond))
	_ = sleep(ctx, time.Second)
	for _, at := range s.DS.First429s() {
		t.Logf("the downstream answered 429 at SIGCONT%+v", at.Sub(resumed).Round(time.Millisecond))
	}
	finish(t, s, s.Started)
}

// suspendAndReclaim runs the first part of both: it returns with the stopped agent's pod name,
// after the reclaim was checked.
func suspendAndReclaim(t *testing.T, cfg harness.ScenarioConfig) (*harness.Scenario, string) {
	const limit = 20
	cfg.Limit, cfg.FactorPercent, cfg.Replicas, cfg.MinReplicas, cfg.MaxReplicas, cfg.KeepHistory = limit, 100, 4, 2, 8, true
	s := scenario(t, cfg)
	ctx := t.Context()
	mustConverge(t, ctx, s)
	_ = sleep(ctx, 200*time.Millisecond) // the monitor has read everyone since
	victim := s.Workload.Pods()[1]
	if r, ok := s.Monitor.Last(victim); !ok || !r.Found {
		t.Fatalf("no reading of %s", victim)
	}
	if err := s.Workload.SuspendAgent(victim); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	last, _ := s.Monitor.Last(victim)
	held := last.DS.EffectivePermits
	// The true lease end is at or after the one last read (a renewal may have landed since).
	deadline := last.State.LeaseExpiresAt.Add(s.Cfg.RequestTimeout)
	t.Logf("%s stopped holding %d permits; its lease ends %s after the stop; nothing may be reclaimed before +%s",
		victim, held, last.State.LeaseExpiresAt.Sub(stopped).Round(time.Millisecond), deadline.Sub(stopped).Round(time.Millisecond))

	if err := s.Workload.ScaleTo(ctx, 5, harness.ScaleOptions{Step: 50 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	newPod := s.Workload.Pods()[4]
	want := s.PerPod(5) // 4
	var reclaimed time.Time
	for time.Since(stopped) < deadline.Sub(stopped)+converge {
		sts, _ := s.States(ctx)
		if st, ok := sts[newPod]; ok && s.Effective(st) == want {
			reclaimed = time.Now()
			break
		}
		_ = sleep(ctx, 20*time.Millisecond)
	}
	if reclaimed.IsZero() {
		t.Fatalf("the new pod %s never got %d permits", newPod, want)
	}
	t.Logf("new pod %s got its %d permits %s after the stop (lease+requestTimeout: %s)", newPod, want,
		reclaimed.Sub(stopped).Round(time.Millisecond), deadline.Sub(stopped).Round(time.Millisecond))

	// Before the deadline, the others (new pod included) held at most limit - held.
	var maxBefore int32
	var samplesBefore int
	for _, smp := range s.Monitor.Samples() {
		if smp.At.Before(stopped) || !smp.At.Before(deadline) {
			continue
		}
		var others int32
		for pod, a := range smp.Agents {
			if pod != victim {
				others += a.Effective
			}
		}
		samplesBefore++
		maxBefore = max(maxBefore, others)
		if others > limit-held {
			t.Errorf("%s after the stop, before the stopped agent's lease+requestTimeout: the others held %d > %d - %d (%s)",
				smp.At.Sub(stopped).Round(time.Millisecond), others, limit, held, smp.PerPod())
		}
	}
	t.Logf("before the deadline: %d samples, the others held at most %d (≤ %d)", samplesBefore, maxBefore, limit-held)
	if samplesBefore < 20 {
		t.Errorf("only %d samples before the deadline", samplesBefore)
	}
	if reclaimed.Before(deadline) {
		t.Errorf("the new pod got its full share %s before the deadline", deadline.Sub(reclaimed))
	}
	return s, victim
}

// TestHPAFlapping: the HPA flaps 8 ↔ 12 every 2 s (10 s short, a minute full).
func TestHPAFlapping(t *testing.T) {
	playedInClusterWhenShort(t)
	s := scenario(t, harness.ScenarioConfig{})
	ctx := t.Context()
	start := time.Now()
	mustConverge(t, ctx, s)
	end := time.Now().Add(dur(10*time.Second, time.Minute))
	flaps := 0
	for n := int32(12); time.Now().Before(end); n = 20 - n {
		t0 := time.Now()
		if err := s.Workload.ScaleTo(ctx, n, harness.ScaleOptions{}); err != nil {
			t.Fatal(err)
		}
		flaps++
		_ = sleep(ctx, 2*time.Second-time.Since(t0))
	}
	mustConverge(t, ctx, s)
	t.Logf("%d flaps", flaps)
	finish(t, s, start)
}

// TestScaleOutWhileDraining: from 6 pods × 6 permits, each saturated with slow calls (1 s), the
// HPA decides 15. The old pods are lowered to 2 but still have 6 calls in flight each (36) when
// the new pods come up: the manager may give the new pods only what the drains leave free.
//
// Agents started with --bootstrap are not exercised here on purpose: they call on their safe
// default before the manager has counted them, which is within the limit only while every pod
// runs on it (36 draining + 9 × 2 = 54 > 50 in this scenario). docs/agent.md says so.
func TestScaleOutWhileDraining(t *testing.T) {
	s := scenario(t, harness.ScenarioConfig{Replicas: 6, MinReplicas: 4, MaxReplicas: 16, Latency: time.Second,
		RequestTimeout: 3 * time.Second, WorkersPerAgent: 8})
	ctx := t.Context()
	mustConverge(t, ctx, s)
	_ = sleep(ctx, 1500*time.Millisecond) // every old pod saturated: 6 × 6 in flight
	decided := time.Now()
	if err := s.Workload.ScaleTo(ctx, 15, harness.ScaleOptions{}); err != nil {
		t.Fatal(err)
	}
	mustConverge(t, ctx, s)
	t.Logf("15 pods × %d permits %s after the decision", s.PerPod(15), time.Since(decided).Round(time.Millisecond))
	_ = sleep(ctx, 2*time.Second)
	if at := s.DS.First429s(); len(at) > 0 {
		t.Logf("the downstream's first 429 came %s after the HPA's decision", at[0].Sub(decided).Round(time.Millisecond))
	}
	finish(t, s, s.Started)
}

// TestQuotaDeletedAndCreatedAgain (issue 20): under load, `kubectl delete dq` and `kubectl apply`
// of it again 0.1 s, 1 s and 10 s later (the second time with another safety factor). Agents
// still hold this manager's generations of the deleted quota when it comes back; that must never
// stop the manager, the re-created quota converges like a new one, and meanwhile the calls to
// it are refused like every other refusal (X-Apportion-Fallback, X-Apportion-Reason).
func TestQuotaDeletedAndCreatedAgain(t *testing.T) {
	s := scenario(t, harness.ScenarioConfig{})
	ctx := t.Context()
	start := time.Now()
	mustConverge(t, ctx, s)
	pid, starts := s.Manager.Pid(), s.Manager.Starts()
	for i, gap := range []time.Duration{100 * time.Millisecond, time.Second, 10 * time.Second} {
		old, err := s.Quota(ctx)
		if err != nil {
			t.Fatal(err)
		}
		factor := int32(80)
		if i == 1 {
			factor = 60 // another spec
		}
		dq := &apportionv1.DownstreamQuota{ObjectMeta: metav1.ObjectMeta{Namespace: old.Namespace, Name: old.Name}, Spec: *old.Spec.DeepCopy()}
		dq.Spec.SafetyFactorPercent = factor
		if err := s.Env.CP.Client.Delete(ctx, old); err != nil {
			t.Fatal(err)
		}
		deleted := time.Now()
		t.Logf("deleted %s/%s (uid %s); creating it again in %s", old.Namespace, old.Name, old.UID, gap)
		if gap >= 10*time.Second {
			// Once the pods drained, their agents no longer know the downstream: 404, refused like
			// every other refusal.
			if err := waitUnknownDownstream(ctx, s, gap-time.Second); err != nil {
				t.Fatal(err)
			}
			t.Logf("the agents answer 404 unknown-downstream %s after the deletion", time.Since(deleted).Round(time.Millisecond))
		}
		_ = sleep(ctx, time.Until(deleted.Add(gap)))
		if err := s.Env.CP.Client.Create(ctx, dq); err != nil {
			t.Fatal(err)
		}
		s.Cfg.FactorPercent = factor
		t0 := time.Now()
		mustConverge(t, ctx, s)
		t.Logf("created again (uid %s), factor %d%%: %d pods × %d permits after %s", dq.UID, factor,
			len(s.Workload.Pods()), s.PerPod(int32(len(s.Workload.Pods()))), time.Since(t0).Round(time.Millisecond))
		if !s.Manager.Running() || s.Manager.Pid() != pid || s.Manager.Starts() != starts {
			t.Fatalf("the manager stopped (running %v, pid %d → %d, starts %d → %d): see %s",
				s.Manager.Running(), pid, s.Manager.Pid(), starts, s.Manager.Starts(), s.Manager.LogPath)
		}
	}
	// After the 10 s gap the manager had forgotten the pods (their agents got an empty
	// assignment); meeting them again it re-learned them and said so on the quota.
	if err := waitEvent(ctx, s, "AgentRelearned", 15*time.Second); err != nil {
		t.Error(err)
	}
	_ = sleep(ctx, time.Second)
	if !s.Manager.Running() {
		t.Fatalf("the manager exited: %v", s.Manager.ExitErr())
	}
	if b, err := os.ReadFile(s.Manager.LogPath); err == nil && strings.Contains(string(b), `"msg":"fenced`) {
		t.Errorf("the manager logged a fencing: see %s", s.Manager.LogPath)
	}
	finish(t, s, start)
}

// waitUnknownDownstream waits until one agent answers a call to the (deleted) quota with the
// 404 refusal, and checks its headers.
func waitUnknownDownstream(ctx context.Context, s *harness.Scenario, within time.Duration) error {
	a := s.Workload.Agent(s.Workload.Pods()[0])
	c := &http.Client{Timeout: time.Second}
	deadline := time.Now().Add(within)
	var last string
	for {
		resp, err := c.Get(a.DataURL(s.Cfg.Quota) + "/probe")
		if err != nil {
			last = err.Error()
		} else {
			last = resp.Status
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusNotFound {
				if f, r := resp.Header.Get("X-Apportion-Fallback"), resp.Header.Get("X-Apportion-Reason"); f != "reject" || r != "unknown-downstream" ||
					resp.Header.Get("Content-Type") != "application/problem+json" {
					return fmt.Errorf("404 for a deleted quota with X-Apportion-Fallback %q, X-Apportion-Reason %q, Content-Type %q",
						f, r, resp.Header.Get("Content-Type"))
				}
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no 404 for the deleted quota within %s (last: %s)", within, last)
		}
		if err := sleep(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
}

// waitEvent waits for an Event with the reason about the scenario's quota.
func waitEvent(ctx context.Context, s *harness.Scenario, reason string, within time.Duration) error {
	deadline := time.Now().Add(within)
	for {
		var evs eventsv1.EventList
		if err := s.Env.CP.Client.List(ctx, &evs, client.InNamespace(s.Cfg.Namespace)); err != nil {
			return err
		}
		for _, e := range evs.Items {
			if e.Reason == reason && e.Regarding.Kind == "DownstreamQuota" && e.Regarding.Name == s.Cfg.Quota {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no %s Event on the quota within %s", reason, within)
		}
		if err := sleep(ctx, 100*time.Millisecond); err != nil {
			return err
		}
	}
}
