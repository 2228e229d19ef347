package e2e

import (
	"testing"
	"time"

	"github.com/apportion/apportion/test/e2e/harness"
)

// TestScaleStepsHTTPS: the bound holds with the downstream reached over verified TLS: a judge
// downstream served over https with a private CA, its CA bundle in a ConfigMap named by the
// quota's upstreamTLS, mounted by the webhook into every agent (the "kubelet" writes the
// projected volume), the agents verifying the chain — through a scale step 8 → 12 → 4 under
// load: Σ permits ≤ limit, Σ in flight ≤ limit, the judge's peak ≤ its limit, no 429.
func TestScaleStepsHTTPS(t *testing.T) {
	s := scenario(t, harness.ScenarioConfig{UpstreamTLS: true})
	ctx := t.Context()
	start := time.Now()
	mustConverge(t, ctx, s)
	for _, n := range []int32{12, 4} {
		if err := s.Workload.ScaleTo(ctx, n, harness.ScaleOptions{Step: 100 * time.Millisecond}); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		mustConverge(t, ctx, s)
		t.Logf("%d pods × %d permits after %s", n, s.PerPod(n), time.Since(t0).Round(time.Millisecond))
		_ = sleep(ctx, dur(time.Second, 5*time.Second))
	}
	st := finish(t, s, start) // ls.OK > 0 there: calls went through the agents' TLS
	if st.Downstream.OK == 0 {
		t.Fatal("no call reached the https downstream")
	}
}
