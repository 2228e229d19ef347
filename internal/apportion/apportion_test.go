package apportion

import (
	"math/rand/v2"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestSplit(t *testing.T) {
	tests := []struct {
		name    string
		limit   int64
		factor  int64
		targets []Target
		want    Result
	}{
		{
			name: "limit 50, HPA 8 pods: 5 per pod", limit: 50, factor: 80,
			targets: []Target{{Weight: 1, Replicas: 8, MaxReplicas: 16}},
			want:    Result{Budget: 40, PerPod: []int64{5}, SafeDefault: []int64{2}, Assigned: 40, Weighted: 8, FitWeighted: 40},
		},
		{
			name: "limit 50, 10 pods: 4 per pod", limit: 50, factor: 80,
			targets: []Target{{Weight: 1, Replicas: 10, MaxReplicas: 16}},
			want:    Result{Budget: 40, PerPod: []int64{4}, SafeDefault: []int64{2}, Assigned: 40, Weighted: 10, FitWeighted: 40},
		},
		{
			name: "rounding leaves the remainder unassigned", limit: 50, factor: 80,
			targets: []Target{{Weight: 1, Replicas: 3, MaxReplicas: 3}},
			want:    Result{Budget: 40, PerPod: []int64{13}, SafeDefault: []int64{13}, Assigned: 39, Weighted: 3, FitWeighted: 40},
		},
		{
			name: "weights 3:1", limit: 50, factor: 80,
			targets: []Target{{Weight: 3, Replicas: 2, MaxReplicas: 4}, {Weight: 1, Replicas: 2, MaxReplicas: 4}},
			want:    Result{Budget: 40, PerPod: []int64{15, 5}, SafeDefault: []int64{7, 2}, Assigned: 40, Weighted: 8, FitWeighted: 40},
		},
		{
			name: "one-pod target next to a big one", limit: 10, factor: 100,
			targets: []Target{{Weight: 1, Replicas: 1}, {Weight: 1, Replicas: 6}},
			want:    Result{Budget: 10, PerPod: []int64{1, 1}, SafeDefault: []int64{1, 1}, Assigned: 7, Weighted: 7, FitWeighted: 10},
		},
		{
			name: "oversubscribed: 48 pods share 40", limit: 50, factor: 80,
			targets: []Target{{Weight: 1, Replicas: 48, MaxReplicas: 50}},
			want:    Result{Budget: 40, PerPod: []int64{0}, SafeDefault: []int64{0}, Assigned: 0, Weighted: 48, Oversubscribed: true, FitWeighted: 40},
		},
		{
			name: "target without pods gets nothing and does not dilute", limit: 50, factor: 80,
			targets: []Target{{Weight: 5, Replicas: 0}, {Weight: 1, Replicas: 4, MaxReplicas: 4}},
			want:    Result{Budget: 40, PerPod: []int64{0, 10}, SafeDefault: []int64{0, 10}, Assigned: 40, Weighted: 4, FitWeighted: 40},
		},
		{
			name: "factor 100 uses the whole limit", limit: 7, factor: 100,
			targets: []Target{{Weight: 1, Replicas: 7}},
			want:    Result{Budget: 7, PerPod: []int64{1}, SafeDefault: []int64{1}, Assigned: 7, Weighted: 7, FitWeighted: 7},
		},
		{
			name: "no targets", limit: 50, factor: 80,
			want: Result{Budget: 40, PerPod: []int64{}, SafeDefault: []int64{}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Split(tt.limit, tt.factor, tt.targets)
			if d := cmp.Diff(tt.want, got); d != "" {
				t.Errorf("Split() mismatch (-want +got):\n%s", d)
			}
		})
	}
}

func TestReplicas(t *testing.T) {
	tests := []struct {
		desired, current, spec, pods, want int64
	}{
		{8, 8, 8, 8, 8},
		{10, 8, 8, 8, 10},  // HPA decided, pods not yet there
		{8, 8, 8, 11, 11},  // terminating pods outlive their slot
		{0, 0, 3, 2, 3},    // no HPA: spec.replicas
		{4, 16, 4, 16, 16}, // scale-in: current still high
		{0, 0, 0, 0, 0},
	}
	for _, tt := range tests {
		if got := Replicas(tt.desired, tt.current, tt.spec, tt.pods); got != tt.want {
			t.Errorf("Replicas(%d, %d, %d, %d) = %d, want %d", tt.desired, tt.current, tt.spec, tt.pods, got, tt.want)
		}
	}
}

// TestSplitProperties checks, over random inputs, the three guarantees in the package doc.
func TestSplitProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for iter := range 20000 {
		limit := rng.Int64N(2000)
		if iter%5 == 0 {
			limit = rng.Int64N(20) // small limits, where rounding bites
		}
		factor := 1 + rng.Int64N(100)
		targets := make([]Target, 1+rng.IntN(16))
		for i := range targets {
			targets[i] = Target{Weight: 1 + rng.Int64N(10), Replicas: rng.Int64N(60)}
			targets[i].MaxReplicas = targets[i].Replicas + rng.Int64N(20)
		}
		r := Split(limit, factor, targets)

		var sum, safeSum int64
		for i, tg := range targets {
			sum += tg.Replicas * r.PerPod[i]
			safeSum += tg.MaxReplicas * r.SafeDefault[i]
			// No pod above its weighted fair share: pᵢ ≤ B·wᵢ/W.
			if r.Weighted > 0 && r.PerPod[i]*r.Weighted > r.Budget*tg.Weight {
				t.Fatalf("iter %d: target %d gets %d > fair share %d·%d/%d", iter, i, r.PerPod[i], r.Budget, tg.Weight, r.Weighted)
			}
		}
		if sum > limit || sum != r.Assigned {
			t.Fatalf("iter %d: Σ permits %d (reported %d) > limit %d", iter, sum, r.Assigned, limit)
		}
		if safeSum > limit {
			t.Fatalf("iter %d: Σ safe defaults at max replicas %d > limit %d", iter, safeSum, limit)
		}

		// Adding a replica never raises anyone's permits.
		grown := append([]Target(nil), targets...)
		j := rng.IntN(len(grown))
		grown[j].Replicas++
		grown[j].MaxReplicas = max(grown[j].MaxReplicas, grown[j].Replicas)
		r2 := Split(limit, factor, grown)
		for i := range targets {
			if targets[i].Replicas > 0 && r2.PerPod[i] > r.PerPod[i] {
				t.Fatalf("iter %d: adding a replica to target %d raised target %d from %d to %d", iter, j, i, r.PerPod[i], r2.PerPod[i])
			}
		}
	}
}
