package e2e

import (
	"slices"
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

// TestLeaseTrackerSeesLapses pins how the monitor judges an agent's lease from its readings
// (LeaseStats, asserted by TestHostileTenant), with no control plane (it runs in -short): renewals
// on time are no lapse; a reading that says leaseExpired is one, counted once however long it
// lasts and not again when the renewal comes; a renewal signed after the previous lease had
// ended is one even when no reading fell in between — unless the readings were too far apart to
// have seen every renewal; a restarted agent starts over.
func TestLeaseTrackerSeesLapses(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	const ttl = 2 * time.Second
	// read is a reading at t0+at of a lease signed at t0+signed (its end signed+ttl).
	type read struct {
		at, signed time.Duration
		expired    bool
		pid        int
	}
	for name, tc := range map[string]struct {
		reads     []read
		wantLapse []int // indexes of the readings that reveal a lapse
		wantGap   time.Duration
	}{
		"renewed every 500ms":             {[]read{{0, 0, false, 1}, {40 * ms, 0, false, 1}, {520 * ms, 500 * ms, false, 1}, {1020 * ms, time.Second, false, 1}}, nil, 500 * ms},
		"renewed 1.9s late, just in time": {[]read{{0, 0, false, 1}, {1960 * ms, 1900 * ms, false, 1}}, nil, 1900 * ms},
		"caught on its safe default, then renewed": {
			[]read{{0, 0, false, 1}, {1900 * ms, 0, false, 1}, {2100 * ms, 0, true, 1}, {2400 * ms, 0, true, 1}, {2700 * ms, 2600 * ms, false, 1}},
			[]int{2}, 2600 * ms},
		"renewal signed after the lease ended, between two readings": {
			[]read{{0, 0, false, 1}, {1900 * ms, 0, false, 1}, {2200 * ms, 2100 * ms, false, 1}}, []int{2}, 2100 * ms},
		"readings too far apart: only the flag counts": {
			[]read{{0, 0, false, 1}, {2500 * ms, 2400 * ms, false, 1}}, nil, 2400 * ms},
		"a restarted agent starts over": {
			[]read{{0, 0, false, 1}, {40 * ms, 0, false, 1}, {3000 * ms, 2900 * ms, false, 2}, {3040 * ms, 2900 * ms, false, 2}}, nil, 0},
	} {
		t.Run(name, func(t *testing.T) {
			lt := &harness.LeaseTracker{TTL: ttl}
			var lapses []int
			var gap time.Duration
			for i, r := range tc.reads {
				ev := lt.Observe(harness.Reading{At: t0.Add(r.at), Pid: r.pid,
					State: assignment.State{LeaseExpiresAt: t0.Add(r.signed + ttl), LeaseExpired: r.expired}})
				if !ev.Leased || ev.Left != r.signed+ttl-r.at {
					t.Errorf("reading %d: %+v, want leased with %s left", i, ev, r.signed+ttl-r.at)
				}
				if ev.Lapse != "" {
					lapses = append(lapses, i)
				}
				gap = max(gap, ev.Gap)
			}
			if !slices.Equal(lapses, tc.wantLapse) || gap != tc.wantGap {
				t.Errorf("lapses at readings %v, worst gap %s; want %v and %s", lapses, gap, tc.wantLapse, tc.wantGap)
			}
		})
	}
}

const ms = time.Millisecond
