package hub

import (
	"math/rand/v2"
	"testing"
	"time"
)

// Slices never sums above the global limit, gives every member at least its reserved slice,
// and under Equal splits the rest equally (±1).
func TestSlicesProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		global := int64(rng.IntN(200))
		n := 1 + rng.IntN(6)
		shares := make([]Share, n)
		var reserved int64
		for i := range shares {
			shares[i].Cluster = string(rune('a' + i))
			if left := global - reserved; left > 0 && rng.IntN(2) == 0 {
				shares[i].Reserved = rng.Int64N(left/int64(n) + 1)
				reserved += shares[i].Reserved
			}
			shares[i].Demand = rng.Int64N(global + 1)
			shares[i].Current = shares[i].Reserved + rng.Int64N((global-reserved)/int64(n)+1)
		}
		policy := Policy(rng.IntN(2))
		out, _, err := Slices(global, policy, shares, rng.Uint64(), nil, t0, t0.Add(-time.Duration(rng.Int64N(20e9))))
		if err != nil {
			t.Fatal(err)
		}
		var sum, lo, hi int64 = 0, 1 << 62, 0
		for i, s := range out {
			sum += s
			if s < shares[i].Reserved {
				t.Fatalf("%s gets %d below its reserved %d", shares[i].Cluster, s, shares[i].Reserved)
			}
			lo, hi = min(lo, s-shares[i].Reserved), max(hi, s-shares[i].Reserved)
		}
		if sum > global {
			t.Fatalf("Σ %d > global %d: %v %+v", sum, global, out, shares)
		}
		if policy == Equal && (hi-lo > 1 || sum != global) {
			t.Fatalf("Equal: %v of %d, shares %+v", out, global, shares)
		}
	}
	if _, _, err := Slices(5, Equal, []Share{{Cluster: "a", Reserved: 3}, {Cluster: "b", Reserved: 3}}, 0, nil, t0, t0); err == nil {
		t.Fatal("reserved slices above the global limit were accepted")
	}
}

// Under DemandAware the busy member gets more than the idle one, and moves are damped.
func TestSlicesFollowDemand(t *testing.T) {
	shares := []Share{{Cluster: "a", Demand: 90, Current: 50}, {Cluster: "b", Demand: 5, Current: 50}}
	out, damped, err := Slices(100, DemandAware, shares, 0, nil, t0, t0.Add(-10*time.Second))
	if err != nil || !damped {
		t.Fatalf("%v %v", err, damped)
	}
	// At most a quarter of the budget moves per round.
	if out[0] != 75 || out[1] != 25 {
		t.Fatalf("first round: %v", out)
	}
	if out2, damped, _ := Slices(100, DemandAware, []Share{{Cluster: "a", Demand: 90, Current: 75}, {Cluster: "b", Demand: 5, Current: 25}}, 0, nil, t0.Add(time.Second), t0); damped || out2[0] != 75 {
		t.Fatalf("a second round within the interval moved: %v", out2)
	}
}
