package e2e

import (
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/test/e2e/harness"
)

// TestMonitorModelsAFrozenAgentAsTheAgentFallsBack pins what the monitor counts for an agent
// that stopped answering, with no control plane (it runs in -short): what it last reported until
// its lease ends, then the limit the agent itself falls back to (min of permits and the safe
// default, 0 when failing closed), never raised, and its in-flight calls until they time out.
func TestMonitorModelsAFrozenAgentAsTheAgentFallsBack(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	reading := func(effective, permits, inFlight int32) harness.Reading {
		return harness.Reading{At: t0, Found: true,
			State: assignment.State{Epoch: 3, Generation: 7, LeaseExpiresAt: t0.Add(10 * time.Second)},
			DS:    assignment.DownstreamState{Name: "logistics", Permits: permits, EffectivePermits: effective, InFlight: inFlight}}
	}
	const timeout = 30 * time.Second
	unleased := reading(5, 5, 4)
	unleased.State.LeaseExpiresAt = time.Time{}
	for name, tc := range map[string]struct {
		last                    harness.Reading
		after                   time.Duration
		safe                    int32
		failClosed              bool
		wantEffective, wantBusy int32
	}{
		"within the lease: as reported":                {reading(5, 5, 4), 5 * time.Second, 2, false, 5, 4},
		"lease passed: the safe default":               {reading(5, 5, 4), 11 * time.Second, 2, false, 2, 4},
		"lease passed, safe default above permits":     {reading(5, 5, 4), 11 * time.Second, 9, false, 5, 4},
		"lease passed, failing closed: nothing":        {reading(5, 5, 4), 11 * time.Second, 2, true, 0, 4},
		"lease passed, already lower: never raised":    {reading(1, 5, 1), 11 * time.Second, 2, false, 1, 1},
		"lease passed, safe default unknown: as is":    {reading(5, 5, 4), 11 * time.Second, -1, true, 5, 4},
		"calls timed out: nothing in flight":           {reading(5, 5, 4), 31 * time.Second, 2, false, 2, 0},
		"no lease reported: as reported, however late": {unleased, time.Hour, 2, true, 5, 0},
	} {
		t.Run(name, func(t *testing.T) {
			got := harness.Modeled(tc.last, t0.Add(tc.after), tc.safe, tc.failClosed, timeout)
			if got.Effective != tc.wantEffective || got.InFlight != tc.wantBusy || got.Permits != tc.last.DS.Permits ||
				got.Reachable || got.Epoch != 3 || got.Gen != 7 {
				t.Errorf("Modeled = %+v; want effective %d, in flight %d, permits %d, unreachable, e3.g7",
					got, tc.wantEffective, tc.wantBusy, tc.last.DS.Permits)
			}
		})
	}
}
