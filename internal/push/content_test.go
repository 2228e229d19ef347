package push

import (
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// A switch the agents would refuse is left out of the content; the permits are pushed anyway,
// and the switch follows once it is valid.
func TestInvalidSwitchIsDroppedAndThePermitsArePushed(t *testing.T) {
	d := quota(20, 2, 10, 3)
	sw := assignment.Switch{Name: "ns/r1", ExpiresAt: time.Date(2026, 7, 2, 0, 0, 0, 0, time.UTC), Percent: 50,
		Action: assignment.Fallback{Action: assignment.ActionReject}} // below 100 percent without a keyHeader
	d.Switches = []TargetedSwitch{{Switch: sw}}
	h := converged(t, d, nil)
	for _, ep := range []string{"http://p0", "http://p1"} {
		a := h.agent(ep).a
		if a.Switches != nil || len(a.Downstreams) != 1 || a.Downstreams[0].Permits != 10 {
			t.Fatalf("%s holds switches %+v, downstreams %+v; want no switch and 10 permits", ep, a.Switches, a.Downstreams)
		}
	}
	// Renewals and answers rebuild the content; without the switch it is unchanged, so it keeps
	// its generation (a new one each time would push forever).
	gen := h.agent("http://p0").a.Generation
	h.runFor(3 * DefaultRenewEvery)
	if g := h.agent("http://p0").a.Generation; g != gen {
		t.Fatalf("generation %d after renewals, want %d: content without the invalid switch renumbered", g, gen)
	}
	d.Switches[0].Switch.KeyHeader = "X-User"
	h.set(d)
	h.settle()
	if a, n := h.c.reports.switchApplied("ns/r1"); a != 2 || n != 2 {
		t.Fatalf("applied %d/%d once valid, want 2/2", a, n)
	}
}

// Content the agents would refuse for anything but a switch is not pushed: each agent keeps
// what it holds, and the ledger goes on counting it.
func TestInvalidDownstreamKeepsTheLastContent(t *testing.T) {
	h := converged(t, quota(20, 2, 10, 3), nil)
	before := *h.agent("http://p0").a
	d := quota(20, 2, 5, 3)
	d.Downstream.Upstream = "" // no upstream
	d.Switches = []TargetedSwitch{{Switch: assignment.Switch{Name: "ns/r1", ExpiresAt: time.Date(2026, 7, 2, 0, 0, 0, 0, time.UTC),
		Percent: 50, Action: assignment.Fallback{Action: assignment.ActionReject}}}} // invalid too
	h.set(d)
	h.settle()
	a := h.agent("http://p0").a
	if a.Generation != before.Generation || a.Downstreams[0].Permits != 10 || a.Switches != nil {
		t.Fatalf("agent holds generation %d, permits %d, switches %+v; want generation %d, 10 permits, no switch",
			a.Generation, a.Downstreams[0].Permits, a.Switches, before.Generation)
	}
	if r := h.report("ns", "q"); r.Ledger != 20 {
		t.Fatalf("ledger %d, want 20 (both agents still hold 10)", r.Ledger)
	}
}

// Observe and dry-run switches go only to agents that advertise CapabilityObserve: an older
// agent's strict decoding would refuse the members (and a dry-run switch sent without its
// member would be enforced). The others enforce, and get the switches in force only.
func TestObserveOnlyToAgentsThatKnowIt(t *testing.T) {
	d := quota(20, 4, 5, 3)
	d.Downstream.Observe = true
	at := time.Date(2026, 7, 2, 0, 0, 0, 0, time.UTC)
	d.Switches = []TargetedSwitch{
		{Switch: assignment.Switch{Name: "ns/dry", ExpiresAt: at, Percent: 100, Action: assignment.Fallback{Action: assignment.ActionReject}, DryRun: true}},
		{Switch: assignment.Switch{Name: "ns/real", ExpiresAt: at, Percent: 100, Action: assignment.Fallback{Action: assignment.ActionReject}}},
	}
	h := converged(t, d, nil)
	knows, not := 0, 0
	for _, ep := range []string{"http://p0", "http://p1", "http://p2", "http://p3"} {
		ag := h.agent(ep)
		a := ag.a
		var names []string
		for _, sw := range a.Switches {
			names = append(names, sw.Name)
		}
		if ag.batch {
			knows++
			if !a.Downstreams[0].Observe || len(a.Switches) != 2 || !a.Switches[0].DryRun {
				t.Errorf("%s knows Observe: observe %v, switches %v; want Observe and both switches", ep, a.Downstreams[0].Observe, names)
			}
		} else {
			not++
			if a.Downstreams[0].Observe || len(a.Switches) != 1 || a.Switches[0].Name != "ns/real" {
				t.Errorf("%s does not know Observe: observe %v, switches %v; want Enforce and ns/real only", ep, a.Downstreams[0].Observe, names)
			}
		}
	}
	if knows == 0 || not == 0 {
		t.Fatalf("%d agents know Observe, %d do not: the test needs both", knows, not)
	}
}

// The per-second counts an agent reports reach the quota's Report with its holding, on a quiet
// renewal too (they never change what the ledger counts).
func TestReportCarriesTheSecondCounts(t *testing.T) {
	h := converged(t, quota(20, 2, 5, 2), nil)
	a0 := h.agent("http://p0")
	a0.secondsEnd, a0.seconds = 1_000_000, []int32{3, 7}
	h.advance(DefaultRenewEvery)
	h.settle()
	hp := h.holding(h.report("ns", "q"), "p0")
	if hp.SecondsEnd != 1_000_000 || len(hp.Seconds) != 2 || hp.Seconds[1] != 7 {
		t.Fatalf("p0's holding %+v, want the reported seconds", hp)
	}
}
