package push

import (
	"testing"

	"github.com/apportion/apportion/internal/assignment"
)

// Each pod's rate share reaches its agent as the controller set it, with the contract's mode
// from the template; a burst share of 0 (more pods than burst) is sent as 0, which the agent
// paces, not raised to 1; no rate share, no rate limit.
func TestRateSharesArePushedAsGiven(t *testing.T) {
	d := quota(100, 3, 10, 3)
	d.Downstream.Rate = &assignment.Rate{Mode: assignment.ModePacing}
	d.Pods[0].RatePerSecond, d.Pods[0].RateBurst = 16, 0
	d.Pods[1].RatePerSecond, d.Pods[1].RateBurst = 40, 2
	h := converged(t, d, nil)
	for pod, want := range map[string]*assignment.Rate{
		"http://p0": {PerSecond: 16, Burst: 0, Mode: assignment.ModePacing},
		"http://p1": {PerSecond: 40, Burst: 2, Mode: assignment.ModePacing},
		"http://p2": nil,
	} {
		a := h.agent(pod).a
		if a == nil || len(a.Downstreams) != 1 {
			t.Fatalf("%s holds %+v", pod, a)
		}
		got := a.Downstreams[0].Rate
		if (got == nil) != (want == nil) || (got != nil && *got != *want) {
			t.Errorf("%s was pushed rate %+v, want %+v", pod, got, want)
		}
		if err := a.Validate(); err != nil {
			t.Errorf("%s holds an assignment its agent refuses: %v", pod, err)
		}
	}
}
