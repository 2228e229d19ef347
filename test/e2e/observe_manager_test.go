package e2e

import (
	"testing"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/test/e2e/harness"
)

// TestObserveThenEnforceThroughTheManager: the switch of TestObserveThenEnforceDrains through the
// real manager and the API server: 8 pods × 5 permits (limit 50 × 80 %) under a quota created in
// Observe, 12 callers per pod; the manager's ledger (status.ledger) stays within the limit while
// the pods run far more than their permits (Observe's calls are not counted, docs/protocol.md
// §11b); then `spec.enforcement: Enforce` is patched under the load: every agent acknowledges it,
// and a request timeout after the last acknowledgement Σ in flight is within Σ permits for good.
// It prints the drain time. Full run only (E2E_FULL=1): the short run has the agents-only form.
func TestObserveThenEnforceThroughTheManager(t *testing.T) {
	if !full {
		t.Skip("full run only (E2E_FULL=1): the short run plays the switch on the agents alone (TestObserveThenEnforceDrains)")
	}
	q := harness.NewQuota(harness.QuotaConfig{Name: "logistics", Limit: 50, Target: "gateway"})
	q.Spec.Enforcement = apportionv1.EnforcementObserve
	s := scenario(t, harness.ScenarioConfig{QuotaObject: q, WorkersPerAgent: 12, KeepHistory: true})
	ctx := t.Context()
	mustConverge(t, ctx, s)
	const budget = 40 // 8 pods × 5 permits
	observeFrom := time.Now()
	var maxLedger int32
	for range 15 {
		dq, err := s.Quota(ctx)
		if err != nil {
			t.Fatal(err)
		}
		maxLedger = max(maxLedger, dq.Status.Ledger)
		_ = sleep(ctx, 200*time.Millisecond)
	}
	var observedPeak int32
	for _, smp := range s.Monitor.Samples() {
		if smp.At.After(observeFrom) {
			observedPeak = max(observedPeak, smp.SumInFlight)
		}
	}
	t.Logf("Observe, 3 s: Σ in flight up to %d for Σ permits %d; status.ledger up to %d (limit 50)", observedPeak, budget, maxLedger)
	if observedPeak <= budget {
		t.Fatalf("Σ in flight stayed within the permits (%d) under Observe: the test proves nothing", observedPeak)
	}
	if maxLedger > 50 {
		t.Errorf("status.ledger reached %d under Observe, above the limit 50: Observe's calls were counted", maxLedger)
	}

	dq, err := s.Quota(ctx)
	if err != nil {
		t.Fatal(err)
	}
	orig := dq.DeepCopy()
	dq.Spec.Enforcement = apportionv1.EnforcementEnforce
	switchAt := time.Now()
	if err := s.Env.CP.Client.Patch(ctx, dq, client.MergeFrom(orig)); err != nil {
		t.Fatal(err)
	}
	var lastAck time.Time
	for {
		sts, err := s.States(ctx)
		enforcing := 0
		for _, st := range sts {
			for _, d := range st.Downstreams {
				if d.Name == s.Cfg.Quota && !d.Observe {
					enforcing++
				}
			}
		}
		if err == nil && enforcing == len(s.Workload.Pods()) {
			lastAck = time.Now() // an upper bound on the last acknowledgement
			break
		}
		if time.Since(switchAt) > converge {
			t.Fatalf("%d of %d agents enforce %v after the patch (%v)", enforcing, len(s.Workload.Pods()), converge, err)
		}
		_ = sleep(ctx, 50*time.Millisecond)
	}
	rt := s.Cfg.RequestTimeout
	_ = sleep(ctx, rt+2*time.Second)
	ls := s.Load.Stop()
	st := s.Monitor.Stop()
	var lastOver time.Time
	var settled int32
	for _, smp := range s.Monitor.Samples() {
		if smp.At.After(switchAt) && smp.SumInFlight > budget {
			lastOver = smp.At
		}
		if smp.At.After(lastAck.Add(rt)) {
			settled = max(settled, smp.SumInFlight)
		}
	}
	drain := time.Duration(0)
	if !lastOver.IsZero() {
		drain = lastOver.Sub(switchAt)
	}
	t.Logf("Enforce patched: every agent enforcing %v after the patch; Σ in flight above %d until %v after the patch; up to %d a request timeout (%v) after the last acknowledgement\nload: %s\nmonitor: %s",
		lastAck.Sub(switchAt).Round(time.Millisecond), budget, drain.Round(time.Millisecond), settled, rt, ls, st)
	if settled > budget {
		t.Errorf("a request timeout after every agent enforced, Σ in flight reached %d, above Σ permits %d", settled, budget)
	}
	if st.PermitViolations > 0 {
		t.Errorf("Σ permits exceeded the limit: %d confirmed violations", st.PermitViolations)
	}
}
