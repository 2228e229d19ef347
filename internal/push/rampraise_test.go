package push

import "testing"

// RampRaise goes only to agents that advertise CapabilityRampRaise (an older agent's strict
// decoding would refuse the member, and with it the permits); the others get the same permits
// without it, and apply a raise at once as they always did. Clearing it reaches every agent.
func TestRampRaiseOnlyToAgentsThatKnowIt(t *testing.T) {
	d := quota(20, 4, 5, 3)
	d.Downstream.RampRaise = true
	h := converged(t, d, nil)
	check := func(want bool) {
		t.Helper()
		knows, not := 0, 0
		for _, ep := range []string{"http://p0", "http://p1", "http://p2", "http://p3"} {
			ag := h.agent(ep)
			got := ag.a.Downstreams[0]
			if ag.batch {
				knows++
			} else {
				not++
			}
			if got.Permits != 5 || got.RampRaise != (want && ag.batch) {
				t.Errorf("%s (knows it: %v): permits %d, rampRaise %v; want 5 and %v", ep, ag.batch, got.Permits, got.RampRaise, want && ag.batch)
			}
		}
		if knows == 0 || not == 0 {
			t.Fatalf("%d agents know RampRaise, %d do not: the test needs both", knows, not)
		}
	}
	check(true)
	d.Downstream.RampRaise = false // the incident's window passed
	h.set(d)
	h.settle()
	check(false)
}
