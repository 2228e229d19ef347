package apportion

import (
	"math"
	"math/big"
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestSplitRate(t *testing.T) {
	tests := []struct {
		name               string
		rate, burst, f     int64
		targets            []Target
		want               []RateShare
		wantRate           float64
		wantBurst          int64
		todayBurstTooLarge bool // the old formula (burst ≥ 1 for every pod) overshot the contract's burst
	}{
		{
			name: "1 pod: 100/s burst 20 at 80 %", rate: 100, burst: 20, f: 80,
			targets: []Target{{Weight: 1, Replicas: 1}},
			want:    []RateShare{{PerSecond: 80, Burst: 16}}, wantRate: 80, wantBurst: 16,
		},
		{
			name: "8 pods", rate: 100, burst: 20, f: 80,
			targets: []Target{{Weight: 1, Replicas: 8}},
			want:    []RateShare{{PerSecond: 10, Burst: 2}}, wantRate: 80, wantBurst: 16,
		},
		{
			name: "40 pods: more pods than burst, every pod paced", rate: 100, burst: 20, f: 80,
			targets: []Target{{Weight: 1, Replicas: 40}},
			want:    []RateShare{{PerSecond: 2, Burst: 0}}, wantRate: 80, wantBurst: 0,
			todayBurstTooLarge: true,
		},
		{
			name: "the API's default burst 1 with one pod", rate: 10, burst: 1, f: 80,
			targets: []Target{{Weight: 1, Replicas: 1}},
			want:    []RateShare{{PerSecond: 8, Burst: 0}}, wantRate: 8, wantBurst: 0,
		},
		{
			name: "weights 3:1", rate: 100, burst: 40, f: 80,
			targets: []Target{{Weight: 3, Replicas: 2}, {Weight: 1, Replicas: 2}},
			want:    []RateShare{{PerSecond: 30, Burst: 12}, {PerSecond: 10, Burst: 4}}, wantRate: 80, wantBurst: 32,
		},
		{
			name: "weights 3:1, small burst: the light target is paced", rate: 100, burst: 10, f: 100,
			targets: []Target{{Weight: 3, Replicas: 2}, {Weight: 1, Replicas: 4}},
			want:    []RateShare{{PerSecond: 30, Burst: 3}, {PerSecond: 10, Burst: 1}}, wantRate: 100, wantBurst: 10,
		},
		{
			name: "target without replicas gets nothing and does not dilute", rate: 50, burst: 10, f: 100,
			targets: []Target{{Weight: 5, Replicas: 0}, {Weight: 1, Replicas: 5}},
			want:    []RateShare{{}, {PerSecond: 10, Burst: 2}}, wantRate: 50, wantBurst: 10,
		},
		{
			name: "no pods", rate: 50, burst: 10, f: 80,
			targets: []Target{{Weight: 1, Replicas: 0}},
			want:    []RateShare{{}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := SplitRate(tt.rate, tt.burst, tt.f, tt.targets)
			if d := cmp.Diff(tt.want, got.PerPod); d != "" {
				t.Errorf("SplitRate().PerPod mismatch (-want +got):\n%s", d)
			}
			if got.PerSecond != tt.wantRate || got.Burst != tt.wantBurst {
				t.Errorf("Σ rate, burst = %v, %d, want %v, %d", got.PerSecond, got.Burst, tt.wantRate, tt.wantBurst)
			}
			_, todaySum := todayRate(tt.rate, tt.burst, tt.f, tt.targets)
			if over := todaySum > tt.burst; over != tt.todayBurstTooLarge {
				t.Errorf("the old formula's Σ burst %d vs contract %d: overshoot %v, want %v", todaySum, tt.burst, over, tt.todayBurstTooLarge)
			}
		})
	}
}

// todayRate is the controller's formula before SplitRate, kept as the reference for "equal to
// the old share where the old share was within the contract": a float share, and a burst of at
// least 1 for every pod.
func todayRate(rate, burst, f int64, targets []Target) (shares []RateShare, burstSum int64) {
	var weighted int64
	for _, t := range targets {
		weighted += t.Weight * t.Replicas
	}
	factor := float64(f) / 100
	for _, t := range targets {
		var s RateShare
		if weighted > 0 {
			share := factor * float64(t.Weight) / float64(weighted)
			s.PerSecond = float64(rate) * share
			s.Burst = int64(max(1, int32(float64(burst)*share)))
		}
		shares = append(shares, s)
		burstSum += t.Replicas * s.Burst
	}
	return shares, burstSum
}

// rateSeed is the property test's PCG seed; the report of the change that introduced SplitRate
// quotes it.
const rateSeed1, rateSeed2 = 16, 4

// TestSplitRateProperties checks, over random contracts and targets, the guarantees in
// SplitRate's doc: Σ rates ≤ R and Σ bursts ≤ B (exactly, in rational arithmetic), monotone in
// replicas, and equal to the old formula wherever the old one kept Σ bursts within the contract
// (the same rate, and the same bucket at the agent).
func TestSplitRateProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(rateSeed1, rateSeed2))
	const iters = 20000
	var sameAsToday, todayOvershot int
	for iter := range iters {
		rate := 1 + rng.Int64N(5000)
		burst := 1 + rng.Int64N(200)
		if iter%4 == 0 {
			burst = 1 + rng.Int64N(5) // small bursts, where pods outnumber the burst
		}
		f := 1 + rng.Int64N(100)
		targets := make([]Target, 1+rng.IntN(16))
		for i := range targets {
			targets[i] = Target{Weight: 1 + rng.Int64N(10), Replicas: rng.Int64N(60)}
		}
		r := SplitRate(rate, burst, f, targets)

		exactRate := new(big.Rat)
		var burstSum int64
		for i, tg := range targets {
			s := r.PerPod[i]
			if tg.Replicas > 0 && !(s.PerSecond > 0) {
				t.Fatalf("iter %d: target %d with %d replicas gets rate %v: it would run unlimited", iter, i, tg.Replicas, s.PerSecond)
			}
			exactRate.Add(exactRate, new(big.Rat).Mul(big.NewRat(tg.Replicas, 1), new(big.Rat).SetFloat64(s.PerSecond)))
			burstSum += tg.Replicas * s.Burst
		}
		if exactRate.Cmp(big.NewRat(rate*f, 100)) > 0 {
			t.Fatalf("iter %d: Σ rates %s > %d × %d%%", iter, exactRate.FloatString(9), rate, f)
		}
		if burstSum > burst*f/100 || burstSum != r.Burst {
			t.Fatalf("iter %d: Σ bursts %d (reported %d) > %d × %d%%", iter, burstSum, r.Burst, burst, f)
		}

		today, todaySum := todayRate(rate, burst, f, targets)
		if todaySum > burst {
			todayOvershot++
		} else {
			same := true
			for i, tg := range targets {
				if tg.Replicas == 0 {
					continue
				}
				// The old rate was a product of rounded floats; the new one is the exact share
				// rounded down, so they agree to within a few units in the last place.
				if d := math.Abs(r.PerPod[i].PerSecond - today[i].PerSecond); d > 1e-12*today[i].PerSecond {
					t.Fatalf("iter %d: target %d rate %v, the old formula gave %v", iter, i, r.PerPod[i].PerSecond, today[i].PerSecond)
				}
				// The agent's bucket holds max(1, burst) tokens (burst 0 is paced like burst 1), so
				// the bucket is the old one; the number differs only where the old formula lifted
				// a share below one call to 1.
				if r.PerPod[i].Burst != today[i].Burst {
					same = false
				}
				if max(1, r.PerPod[i].Burst) != today[i].Burst {
					// Only where the old float product fell just below a whole number.
					exact := new(big.Rat).SetFrac64(burst*f*tg.Weight, 100*weightedPods(targets))
					if !exact.IsInt() || r.PerPod[i].Burst != today[i].Burst+1 {
						t.Fatalf("iter %d: target %d burst %d (bucket %d), the old formula gave %d within the contract (exact %s)",
							iter, i, r.PerPod[i].Burst, max(1, r.PerPod[i].Burst), today[i].Burst, exact.FloatString(6))
					}
				}
			}
			if same {
				sameAsToday++
			}
		}

		// Adding a replica never raises anyone's rate or burst.
		grown := append([]Target(nil), targets...)
		j := rng.IntN(len(grown))
		grown[j].Replicas++
		r2 := SplitRate(rate, burst, f, grown)
		for i := range targets {
			if targets[i].Replicas == 0 {
				continue
			}
			if r2.PerPod[i].PerSecond > r.PerPod[i].PerSecond || r2.PerPod[i].Burst > r.PerPod[i].Burst {
				t.Fatalf("iter %d: adding a replica to target %d raised target %d from %+v to %+v", iter, j, i, r.PerPod[i], r2.PerPod[i])
			}
		}
	}
	t.Logf("seed PCG(%d, %d), %d cases: the old formula overshot the contract's burst in %d; of the others, %d had every share identical",
		rateSeed1, rateSeed2, iters, todayOvershot, sameAsToday)
}

// weightedPods is W = Σ weight × replicas.
func weightedPods(targets []Target) int64 {
	var w int64
	for _, t := range targets {
		w += t.Weight * t.Replicas
	}
	return w
}
