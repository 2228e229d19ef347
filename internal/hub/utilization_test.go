package hub

import (
	"math/rand/v2"
	"testing"
	"time"
)

// TestSteadyStateHandsOutTheWholeLimit: with skewed demand held steady, the hub's planning
// (Slices, then Ledger.Plan, members publishing and acknowledging every grant at once, a plan
// every second as the HubReconciler's requeues do) ends with Σ slices = the global limit — no
// remainder idle by rounding, no budget left unassigned by a raise the room cut short — and with
// every member that wants more than its slice at or above the others' level (water-filling).
// Random seeds; it prints the worst Σ slices / global seen in steady state.
func TestSteadyStateHandsOutTheWholeLimit(t *testing.T) {
	rng := rand.New(rand.NewPCG(33, 4))
	worst := 1.0
	for seed := range 300 {
		global := 10 + rng.Int64N(990)
		n := 2 + rng.IntN(5)
		shares := make([]Share, n)
		var reserved int64
		for i := range shares {
			shares[i].Cluster = string(rune('a' + i))
			if rng.IntN(2) == 0 {
				shares[i].Reserved = rng.Int64N(global/int64(2*n) + 1)
				reserved += shares[i].Reserved
			}
		}
		// Skewed: one member wants most of the limit, the others a little (Σ demand may be
		// above or below the global limit).
		for i := range shares {
			if i == 0 {
				shares[i].Demand = global * (50 + rng.Int64N(100)) / 100
			} else {
				shares[i].Demand = rng.Int64N(global/int64(2*n) + 2)
			}
		}
		policy := Policy(rng.IntN(2))
		l := mustLedger(t, Options{LeaseDuration: 3 * time.Second, ClockMargin: time.Second})
		for _, s := range shares {
			l.SetDrain(s.Cluster, 2*time.Second)
		}
		now, last := t0, time.Time{}
		var sum int64
		for round := range 300 { // 300 s: at most a quarter moved per 10 s round
			for i := range shares {
				shares[i].Current = l.Current(shares[i].Cluster).Slice
			}
			want, damped, err := Slices(global, policy, shares, 0, nil, now, last)
			if err != nil {
				t.Fatal(err)
			}
			if damped {
				last = now
			}
			targets := make([]Target, n)
			for i, s := range shares {
				targets[i] = Target{Cluster: s.Cluster, Reserved: s.Reserved, Want: want[i]}
			}
			changes, err := l.Plan(now, global, targets)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range changes {
				l.Published(c.Cluster, c.Grant.Seq, now)
				l.Acknowledged(c.Cluster, c.Grant.Seq)
			}
			if s := l.Sum(now); s > global {
				t.Fatalf("seed %d round %d: Σ counted %d > %d", seed, round, s, global)
			}
			now = now.Add(time.Second)
		}
		sum = 0
		for _, s := range shares {
			sum += l.Current(s.Cluster).Slice
		}
		if u := float64(sum) / float64(global); u < worst {
			worst = u
		}
		if sum != global {
			t.Errorf("seed %d (%v, global %d, reserved %d): Σ slices %d in steady state, shares %+v", seed, policy, global, reserved, sum, shares)
		}
	}
	t.Logf("300 skewed steady states: worst Σ slices / global %.3f", worst)
}
