package apportion

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"reflect"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// podIDs is n pod identities with a prefix.
func podIDs(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%08x-uid", prefix, i*7919)
	}
	return out
}

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
			want: Result{Budget: 40, PerPod: []int64{5}, Extra: []int64{0}, Permits: [][]int64{{}}, SafeDefault: []int64{2},
				Assigned: 40, Weighted: 8, FitWeighted: 40},
		},
		{
			name: "limit 50, 10 pods: 4 per pod", limit: 50, factor: 80,
			targets: []Target{{Weight: 1, Replicas: 10, MaxReplicas: 16}},
			want: Result{Budget: 40, PerPod: []int64{4}, Extra: []int64{0}, Permits: [][]int64{{}}, SafeDefault: []int64{2},
				Assigned: 40, Weighted: 10, FitWeighted: 40},
		},
		{
			name: "the remainder is assigned: 3 pods share 40 as 13, 13, 14", limit: 50, factor: 80,
			targets: []Target{{Weight: 1, Replicas: 3, MaxReplicas: 3}},
			want: Result{Budget: 40, PerPod: []int64{13}, Extra: []int64{1}, Permits: [][]int64{{}}, SafeDefault: []int64{13},
				Assigned: 40, Weighted: 3, FitWeighted: 40},
		},
		{
			name: "weights 3:1", limit: 50, factor: 80,
			targets: []Target{{Weight: 3, Replicas: 2, MaxReplicas: 4}, {Weight: 1, Replicas: 2, MaxReplicas: 4}},
			want: Result{Budget: 40, PerPod: []int64{15, 5}, Extra: []int64{0, 0}, Permits: [][]int64{{}, {}}, SafeDefault: []int64{7, 2},
				Assigned: 40, Weighted: 8, FitWeighted: 40},
		},
		{
			name: "weights 3:1, 3 + 1 replicas: 40·3/10 = 12 and 40/10 = 4, whole", limit: 50, factor: 80,
			targets: []Target{{Weight: 3, Replicas: 3}, {Weight: 1, Replicas: 1}},
			want: Result{Budget: 40, PerPod: []int64{12, 4}, Extra: []int64{0, 0}, Permits: [][]int64{{}, {}}, SafeDefault: []int64{12, 4},
				Assigned: 40, Weighted: 10, FitWeighted: 40},
		},
		{
			name: "oversubscribed: 48 pods share 40, one each for 40 of them", limit: 50, factor: 80,
			targets: []Target{{Weight: 1, Replicas: 48, MaxReplicas: 50}},
			want: Result{Budget: 40, PerPod: []int64{0}, Extra: []int64{40}, Permits: [][]int64{{}}, SafeDefault: []int64{0},
				Assigned: 40, Weighted: 48, Oversubscribed: true, FitWeighted: 40},
		},
		{
			name: "target without pods gets nothing and does not dilute", limit: 50, factor: 80,
			targets: []Target{{Weight: 5, Replicas: 0}, {Weight: 1, Replicas: 4, MaxReplicas: 4}},
			want: Result{Budget: 40, PerPod: []int64{0, 10}, Extra: []int64{0, 0}, Permits: [][]int64{{}, {}}, SafeDefault: []int64{0, 10},
				Assigned: 40, Weighted: 4, FitWeighted: 40},
		},
		{
			name: "factor 100 uses the whole limit", limit: 7, factor: 100,
			targets: []Target{{Weight: 1, Replicas: 7}},
			want: Result{Budget: 7, PerPod: []int64{1}, Extra: []int64{0}, Permits: [][]int64{{}}, SafeDefault: []int64{1},
				Assigned: 7, Weighted: 7, FitWeighted: 7},
		},
		{
			name: "no targets", limit: 50, factor: 80,
			want: Result{Budget: 40, PerPod: []int64{}, Extra: []int64{}, Permits: [][]int64{}, SafeDefault: []int64{}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Split(tt.limit, tt.factor, tt.targets, 0)
			if d := cmp.Diff(tt.want, got); d != "" {
				t.Errorf("Split() mismatch (-want +got):\n%s", d)
			}
		})
	}
}

// TestSplitPods: limit 50 at the default 80 % (budget 40), one target with every pod present:
// the floor, how many get one more, and Σ = 40 where the floor alone left permits idle.
func TestSplitPods(t *testing.T) {
	for _, tt := range []struct {
		pods, floor, extra, floorSum int64
	}{
		{8, 5, 0, 40},
		{12, 3, 4, 36},
		{16, 2, 8, 32},
		{21, 1, 19, 21},
		{32, 1, 8, 32},
		{48, 0, 40, 0}, // oversubscribed: 40 pods get 1, 8 get none
	} {
		t.Run(fmt.Sprintf("%d pods", tt.pods), func(t *testing.T) {
			ids := podIDs("gateway", int(tt.pods))
			for rot := range uint64(5) {
				r := Split(50, 80, []Target{{Weight: 1, Replicas: tt.pods, MaxReplicas: 64, Pods: ids}}, rot)
				if r.PerPod[0] != tt.floor || r.Extra[0] != tt.extra || r.Assigned != 40 {
					t.Fatalf("counter %d: floor %d extra %d assigned %d, want %d, %d, 40", rot, r.PerPod[0], r.Extra[0], r.Assigned, tt.floor, tt.extra)
				}
				var sum, more int64
				for _, p := range r.Permits[0] {
					sum += p
					switch p {
					case tt.floor + 1:
						more++
					case tt.floor:
					default:
						t.Fatalf("counter %d: a pod got %d, want %d or %d", rot, p, tt.floor, tt.floor+1)
					}
				}
				if sum != 40 || more != tt.extra {
					t.Fatalf("counter %d: Σ %d with %d pods at %d, want 40 and %d", rot, sum, more, tt.floor+1, tt.extra)
				}
				// The floor alone: what the split gave before remainders.
				if tt.pods*(40/tt.pods) != tt.floorSum {
					t.Fatalf("floor-only Σ %d, want %d", tt.pods*(40/tt.pods), tt.floorSum)
				}
			}
		})
	}
}

// TestSplitPendingSlots: slots without a pod take a target's remainder only after every pod has
// one, and keep their floor free.
func TestSplitPendingSlots(t *testing.T) {
	// 16 replicas, 12 pods: the 8 extras go to 8 of the 12 pods.
	r := Split(50, 80, []Target{{Weight: 1, Replicas: 16, Pods: podIDs("a", 12)}}, 3)
	if got := sumOf(r.Permits[0]); got != 12*2+8 {
		t.Fatalf("16 slots, 12 pods: Σ over pods %d, want %d (%v)", got, 12*2+8, r.Permits[0])
	}
	// 21 replicas, 4 pods: floor 1, 19 extras; every pod gets one, 15 stay with the 17 slots
	// without a pod: Σ over pods 8, + 17 slots × 1 = 25 ≤ 40.
	r = Split(50, 80, []Target{{Weight: 1, Replicas: 21, Pods: podIDs("a", 4)}}, 3)
	if !slices.Equal(r.Permits[0], []int64{2, 2, 2, 2}) || r.Assigned != 40 {
		t.Fatalf("21 slots, 4 pods: %v, assigned %d", r.Permits[0], r.Assigned)
	}
	// More pods than replicas (a terminating pod beyond its slot): the pods count.
	r = Split(50, 80, []Target{{Weight: 1, Replicas: 2, Pods: podIDs("a", 3)}}, 3)
	if r.Weighted != 3 || sumOf(r.Permits[0]) != 40 {
		t.Fatalf("3 pods, 2 replicas: W %d, %v", r.Weighted, r.Permits[0])
	}
}

func sumOf(s []int64) int64 {
	var t int64
	for _, v := range s {
		t += v
	}
	return t
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

// randomTargets is 1–16 targets with random weights, replicas and pods (some slots without a
// pod), distinct pod identities across targets.
func randomTargets(rng *rand.Rand) []Target {
	targets := make([]Target, 1+rng.IntN(16))
	if rng.IntN(3) == 0 {
		targets = targets[:1] // one target is the common case
	}
	for i := range targets {
		n := rng.Int64N(60)
		pods := n
		if rng.IntN(3) == 0 {
			pods = rng.Int64N(n + 1)
		}
		targets[i] = Target{Weight: 1 + rng.Int64N(10), Replicas: n, Pods: podIDs(fmt.Sprintf("t%d-%d", i, rng.Int64()), int(pods))}
		if rng.IntN(4) == 0 {
			targets[i].Weight = 1
		}
		targets[i].MaxReplicas = targets[i].Replicas + rng.Int64N(20)
	}
	return targets
}

// propertyIters is how many random cases TestSplitProperties checks: 4,000, or
// APPORTION_PROPERTY_ITERS (each case splits up to 16 targets of 60 pods four times, which -race
// makes slow on a shared machine).
func propertyIters(t *testing.T) int {
	if v := os.Getenv("APPORTION_PROPERTY_ITERS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("APPORTION_PROPERTY_ITERS=%q: want a positive count", v)
		}
		return n
	}
	return 4000
}

// TestSplitProperties checks, over random inputs, the guarantees in the package doc.
func TestSplitProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for iter := range propertyIters(t) {
		limit := rng.Int64N(2000)
		if iter%5 == 0 {
			limit = rng.Int64N(20) // small limits, where rounding bites
		}
		factor := 1 + rng.Int64N(100)
		targets := randomTargets(rng)
		rot := rng.Uint64()
		r := Split(limit, factor, targets, rot)
		B, W := r.Budget, r.Weighted

		var slotSum, podSum, safeSum int64
		for i, tg := range targets {
			n, w := tg.Replicas, tg.Weight
			slotSum += n*r.PerPod[i] + r.Extra[i]
			safeSum += tg.MaxReplicas * r.SafeDefault[i]
			if W == 0 || n == 0 {
				if r.PerPod[i] != 0 || r.Extra[i] != 0 {
					t.Fatalf("iter %d: target %d without replicas gets %d + %d", iter, i, r.PerPod[i], r.Extra[i])
				}
				continue
			}
			// The floor: pᵢ = ⌊B·wᵢ/W⌋.
			if r.PerPod[i]*W > B*w || (r.PerPod[i]+1)*W <= B*w {
				t.Fatalf("iter %d: target %d floor %d, fair share %d·%d/%d", iter, i, r.PerPod[i], B, w, W)
			}
			// The target in all: ⌊nᵢ·qᵢ⌋ or ⌈nᵢ·qᵢ⌉.
			total := n*r.PerPod[i] + r.Extra[i]
			if total*W > n*B*w+W-1 || (total+1)*W <= n*B*w {
				t.Fatalf("iter %d: target %d gets %d in all, due %d·%d·%d/%d", iter, i, total, n, B, w, W)
			}
			if B*w%W == 0 && r.Extra[i] != 0 {
				t.Fatalf("iter %d: target %d's share is whole, yet %d extras", iter, i, r.Extra[i])
			}
			// Every pod ⌊qᵢ⌋ or ⌈qᵢ⌉, the extras to pods first.
			var more int64
			for _, p := range r.Permits[i] {
				podSum += p
				if p == r.PerPod[i]+1 {
					more++
				} else if p != r.PerPod[i] {
					t.Fatalf("iter %d: target %d pod gets %d, floor %d", iter, i, p, r.PerPod[i])
				}
			}
			if more != min(r.Extra[i], int64(len(tg.Pods))) {
				t.Fatalf("iter %d: target %d: %d pods at floor+1, want min(extra %d, pods %d)", iter, i, more, r.Extra[i], len(tg.Pods))
			}
			podSum += (n - int64(len(tg.Pods))) * r.PerPod[i] // the slots without a pod keep their floor
		}
		want := B
		if W == 0 {
			want = 0
		}
		if slotSum != want || r.Assigned != want {
			t.Fatalf("iter %d: Σ over slots %d (reported %d), want %d (B %d, W %d)", iter, slotSum, r.Assigned, want, B, W)
		}
		if podSum > B || B > limit {
			t.Fatalf("iter %d: Σ over pods + floors of empty slots %d > budget %d (limit %d)", iter, podSum, B, limit)
		}
		if safeSum > limit {
			t.Fatalf("iter %d: Σ safe defaults at max replicas %d > limit %d", iter, safeSum, limit)
		}

		// The same inputs give the same split, in any order of the pods.
		if again := Split(limit, factor, targets, rot); !reflect.DeepEqual(r, again) {
			t.Fatalf("iter %d: two splits of the same inputs differ", iter)
		}
		shuffled := slices.Clone(targets)
		j := rng.IntN(len(shuffled))
		perm := rng.Perm(len(shuffled[j].Pods))
		shuffled[j].Pods = make([]string, len(perm))
		for k, p := range perm {
			shuffled[j].Pods[k] = targets[j].Pods[p]
		}
		r2 := Split(limit, factor, shuffled, rot)
		for k, p := range perm {
			if r2.Permits[j][k] != r.Permits[j][p] {
				t.Fatalf("iter %d: pod %s gets %d in one order, %d in another", iter, targets[j].Pods[p], r.Permits[j][p], r2.Permits[j][k])
			}
		}

		// Adding a replica: nobody above the ceiling of the share before; with one target, nobody
		// raised at all — whether the replica is a slot without a pod or a pod.
		grown := slices.Clone(targets)
		grown[j].Replicas++
		grown[j].MaxReplicas = max(grown[j].MaxReplicas, grown[j].Replicas)
		withPod := rng.IntN(2) == 0 && int64(len(grown[j].Pods)) == targets[j].Replicas
		if withPod {
			grown[j].Pods = append(slices.Clone(grown[j].Pods), fmt.Sprintf("new-%d", iter))
		}
		g := Split(limit, factor, grown, rot)
		for i, tg := range targets {
			for k, p := range g.Permits[i][:len(tg.Pods)] {
				if W > 0 && (p-1)*W >= B*tg.Weight {
					t.Fatalf("iter %d: adding a replica raised a pod of target %d to %d, above ⌈%d·%d/%d⌉", iter, i, p, B, tg.Weight, W)
				}
				if len(targets) == 1 && p > r.Permits[i][k] {
					t.Fatalf("iter %d: one target: adding a replica (pod: %v) raised a pod %d→%d", iter, withPod, r.Permits[i][k], p)
				}
			}
		}
	}
}

// TestSplitRotation: over a window of counters every pod gets the one more permit about as often
// as its fair share says — the mean permits of each pod is its fair share — and, oversubscribed,
// every pod gets its 1 in turn. Deterministic (a hash, no randomness), so the bounds cannot flake:
// they are what a fair draw meets (5 standard deviations of a binomial).
func TestSplitRotation(t *testing.T) {
	const window = 2000
	for _, tc := range []struct {
		name    string
		limit   int64
		targets []Target
	}{
		{"16 pods, 40: 8 of 16 get 3", 50, []Target{{Weight: 1, Replicas: 16, Pods: podIDs("a", 16)}}},
		{"21 pods, 40: 19 of 21 get 2", 50, []Target{{Weight: 1, Replicas: 21, Pods: podIDs("a", 21)}}},
		{"32 pods, 40: 8 of 32 get 2", 50, []Target{{Weight: 1, Replicas: 32, Pods: podIDs("a", 32)}}},
		{"oversubscribed: 48 pods, 40", 50, []Target{{Weight: 1, Replicas: 48, Pods: podIDs("a", 48)}}},
		{"weights 3:2:1 over 5, 4 and 7 pods", 50, []Target{
			{Weight: 3, Replicas: 5, Pods: podIDs("a", 5)}, {Weight: 2, Replicas: 4, Pods: podIDs("b", 4)}, {Weight: 1, Replicas: 7, Pods: podIDs("c", 7)}}},
		{"weights 7:1, 3 and 2 pods, limit 11", 11, []Target{{Weight: 7, Replicas: 3, Pods: podIDs("a", 3)}, {Weight: 1, Replicas: 2, Pods: podIDs("b", 2)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sums := make([][]int64, len(tc.targets))
			mins := make([][]int64, len(tc.targets))
			for i, tg := range tc.targets {
				sums[i], mins[i] = make([]int64, len(tg.Pods)), make([]int64, len(tg.Pods))
				for k := range mins[i] {
					mins[i][k] = math.MaxInt64
				}
			}
			var r Result
			start := uint64(29_000_000) // a counter of today's order (minutes since 1970 / 5)
			for c := start; c < start+window; c++ {
				r = Split(tc.limit, 80, tc.targets, c)
				for i := range tc.targets {
					for k, p := range r.Permits[i] {
						sums[i][k] += p
						mins[i][k] = min(mins[i][k], p)
					}
				}
			}
			for i, tg := range tc.targets {
				share := float64(r.Budget*tg.Weight) / float64(r.Weighted)
				frac := share - math.Floor(share)
				for k := range tg.Pods {
					got := float64(sums[i][k]-window*r.PerPod[i]) / window // how often one more
					tol := 5*math.Sqrt(frac*(1-frac)/window) + 1.0/window
					if math.Abs(got-frac) > tol {
						t.Errorf("target %d pod %d had one more in %.3f of the counters, fair share %.3f (floor %d), tolerance %.3f",
							i, k, got, frac, r.PerPod[i], tol)
					}
					if frac > 0 && mins[i][k] != r.PerPod[i] {
						t.Errorf("target %d pod %d never went without the extra", i, k)
					}
				}
				t.Logf("target %d (weight %d, %d pods): fair share %.3f, mean held %s", i, tg.Weight, len(tg.Pods), share, means(sums[i], window))
			}
		})
	}
}

func means(sums []int64, n int) string {
	out := make([]string, len(sums))
	for i, s := range sums {
		out[i] = fmt.Sprintf("%.3f", float64(s)/float64(n))
	}
	return fmt.Sprint(out)
}

func TestRotation(t *testing.T) {
	const period = 5 * time.Minute
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	c, next := Rotation(now, period, "quota-uid")
	if d := next.Sub(now); d <= 0 || d > period {
		t.Fatalf("next rotation %s after now, want within (0, %s]", d, period)
	}
	if c2, _ := Rotation(next.Add(-time.Nanosecond), period, "quota-uid"); c2 != c {
		t.Fatalf("counter changed before next: %d → %d", c, c2)
	}
	if c3, next3 := Rotation(next, period, "quota-uid"); c3 != c+1 || next3.Sub(next) != period {
		t.Fatalf("at next: counter %d (want %d), following %s later (want %s)", c3, c+1, next3.Sub(next), period)
	}
	// Quotas rotate at different instants.
	phases := map[time.Duration]bool{}
	for i := range 50 {
		_, n := Rotation(now, period, fmt.Sprintf("uid-%d", i))
		phases[n.Sub(now)] = true
	}
	if len(phases) < 40 {
		t.Fatalf("50 quotas rotate at only %d distinct instants", len(phases))
	}
	if c, n := Rotation(now, 0, "q"); c != 0 || !n.IsZero() {
		t.Fatalf("period 0: %d, %v", c, n)
	}
	if c, n := Rotation(time.Unix(-1, 0), time.Second, ""); n.Sub(time.Unix(-1, 0)) <= 0 || int64(c) >= 0 {
		t.Fatalf("before 1970: counter %d next %v", int64(c), n)
	}
}

// TestSteadyStateUtilization prints, for limit 50 at 80 % (budget 40) and one target with every
// pod present, Σ permits / budget with the floor alone (before remainders) and with the remainder
// handed out (docs/benchmarks.md, "Remainder"). Run with -v to see the table.
func TestSteadyStateUtilization(t *testing.T) {
	t.Logf("%5s  %21s  %21s", "pods", "floor only Σ / budget", "with remainder")
	for _, n := range []int64{8, 12, 16, 21, 32} {
		r := Split(50, 80, []Target{{Weight: 1, Replicas: n, MaxReplicas: 32, Pods: podIDs("gateway", int(n))}}, 0)
		floorOnly := n * r.PerPod[0]
		after := sumOf(r.Permits[0])
		if after != r.Budget {
			t.Fatalf("%d pods: Σ %d, want the budget %d", n, after, r.Budget)
		}
		t.Logf("%5d  %11d / %d = %3.0f%%  %11d / %d = %3.0f%%", n, floorOnly, r.Budget, 100*float64(floorOnly)/float64(r.Budget),
			after, r.Budget, 100*float64(after)/float64(r.Budget))
	}
}

func BenchmarkSplit(b *testing.B) {
	targets := []Target{{Weight: 1, Replicas: 1000, Pods: podIDs("a", 1000)}, {Weight: 3, Replicas: 200, Pods: podIDs("b", 200)}}
	for b.Loop() {
		Split(5000, 80, targets, 7)
	}
}
