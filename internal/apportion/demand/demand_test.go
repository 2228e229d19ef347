package demand

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/apportion/apportion/internal/apportion"
)

func repeat(v int64, n int) []int64 {
	out := make([]int64, n)
	for i := range out {
		out[i] = v
	}
	return out
}

func TestTarget(t *testing.T) {
	busy8of32 := append(repeat(5, 8), repeat(0, 24)...)
	tests := []struct {
		name   string
		budget int64
		floor  int64
		demand []int64
		want   []int64
	}{
		{name: "no pods", budget: 10, floor: 1, demand: nil, want: []int64{}},
		{name: "no budget", budget: 0, floor: 1, demand: []int64{3, 3}, want: []int64{0, 0}},
		{name: "idle pods share equally", budget: 40, floor: 1, demand: repeat(0, 8), want: repeat(5, 8)},
		{name: "equal demand without ranks: the remainder unused", budget: 40, floor: 1, demand: repeat(2, 32), want: repeat(1, 32)},
		{
			name: "32 pods, budget 40, 8 busy: the 8 spare go to the busy", budget: 40, floor: 1, demand: busy8of32,
			want: append(repeat(2, 8), repeat(1, 24)...),
		},
		{
			name: "skew: 2 of 8 pods carry most calls", budget: 40, floor: 1, demand: []int64{20, 20, 2, 2, 2, 2, 2, 2},
			want: []int64{14, 14, 2, 2, 2, 2, 2, 2},
		},
		{
			name: "all wants met: the spare lifts the least to a level, remainder to the highest", budget: 20, floor: 1, demand: []int64{4, 2, 1},
			want: []int64{7, 7, 6},
		},
		{
			name: "all wants met, one above the level: it keeps its want, the rest share the spare", budget: 40, floor: 1,
			demand: []int64{12, 3, 1, 0, 2, 4, 1, 0}, want: []int64{12, 4, 4, 4, 4, 4, 4, 4},
		},
		{
			name: "noisy equal load: the Equal split, not each ask plus a sliver", budget: 50, floor: 1,
			demand: []int64{2, 5, 3, 1, 4, 3, 2, 6}, want: []int64{6, 7, 6, 6, 6, 6, 6, 7},
		},
		{
			name: "remainder never splits a tie", budget: 10, floor: 1, demand: []int64{9, 9, 9},
			want: []int64{3, 3, 3},
		},
		{
			name: "remainder to the highest want first", budget: 10, floor: 1, demand: []int64{9, 8, 8},
			want: []int64{4, 3, 3},
		},
		{name: "floor larger than the budget allows: Equal", budget: 7, floor: 3, demand: []int64{10, 0, 0}, want: []int64{3, 2, 2}},
		{name: "floor 0: idle pods may get nothing", budget: 4, floor: 0, demand: []int64{8, 0, 0, 0}, want: []int64{4, 0, 0, 0}},
		{name: "negative demand counts as 0", budget: 6, floor: 1, demand: []int64{-5, 4}, want: []int64{2, 4}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Target(tt.budget, tt.floor, tt.demand, nil)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Target(%d, %d, %v) (-want +got):\n%s", tt.budget, tt.floor, tt.demand, diff)
			}
		})
	}
}

// TestTargetRanked: with ranks, a tie group that cannot take a unit each gives them to the pods
// ranked first; everything else is as without.
func TestTargetRanked(t *testing.T) {
	tests := []struct {
		name   string
		budget int64
		demand []int64
		rank   []uint64
		want   []int64
	}{
		{name: "equal demand: the remainder to the ranked first", budget: 10, demand: []int64{9, 9, 9}, rank: []uint64{5, 9, 7},
			want: []int64{3, 4, 3}},
		{name: "32 pods asking alike, budget 40: 8 get 2", budget: 40, demand: repeat(2, 32), rank: ranks(32),
			want: append(repeat(1, 24), repeat(2, 8)...)},
		{name: "the highest want first, then the ranked first within the next group", budget: 11, demand: []int64{9, 8, 8, 8}, rank: []uint64{0, 1, 3, 2},
			want: []int64{3, 2, 3, 3}},
		{name: "all wants met: the spare's remainder to the ranked first", budget: 10, demand: []int64{1, 1, 1}, rank: []uint64{1, 2, 3},
			want: []int64{3, 3, 4}},
		{name: "ranks of the wrong length are ignored", budget: 10, demand: []int64{9, 9, 9}, rank: []uint64{1},
			want: []int64{3, 3, 3}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Target(tt.budget, 1, tt.demand, tt.rank)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("Target(%d, 1, %v, %v) (-want +got):\n%s", tt.budget, tt.demand, tt.rank, diff)
			}
		})
	}
}

// ranks is 0, 1, …, n-1: the last pods ranked first.
func ranks(n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(i)
	}
	return out
}

func sum(s []int64) int64 {
	var t int64
	for _, v := range s {
		t += v
	}
	return t
}

func randomCase(r *rand.Rand) (budget, floor int64, d []int64) {
	n := 1 + r.IntN(40)
	budget = r.Int64N(200)
	floor = r.Int64N(4)
	d = make([]int64, n)
	for i := range d {
		if r.IntN(3) > 0 {
			d[i] = r.Int64N(30)
		}
	}
	return budget, floor, d
}

// TestTargetProperties checks the guarantees of the package doc on random inputs: Σ ≤ budget
// (= budget with ranks), the floor, monotonicity in a pod's own demand, and Equal under equal
// demand.
func TestTargetProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 15))
	for iter := range 20000 {
		budget, floor, d := randomCase(r)
		n := int64(len(d))
		pods := make([]string, n)
		for i := range pods {
			pods[i] = fmt.Sprintf("pod-%d-%d", iter, i)
		}
		counter := r.Uint64()
		var rank []uint64
		if iter%4 != 0 {
			rank = make([]uint64, n)
			for i, p := range pods {
				rank[i] = apportion.Rank(p, counter)
			}
		}
		got := Target(budget, floor, d, rank)
		if s := sum(got); s > budget || (rank != nil && s != budget) {
			t.Fatalf("#%d Σ %d, budget %d (ranks %v): Target(%d, %d, %v) = %v", iter, s, budget, rank != nil, budget, floor, d, got)
		}
		if budget >= n*floor {
			for i, g := range got {
				if g < floor {
					t.Fatalf("#%d pod %d got %d < floor %d: Target(%d, %d, %v) = %v", iter, i, g, floor, budget, floor, d, got)
				}
			}
		}
		// Σ want ≤ budget: every pod gets its want, and the pods given more hold μ or μ+1 with
		// nobody below μ (the spare lifts the least).
		if n > 0 && budget >= n*floor {
			var sumWant int64
			for _, v := range d {
				sumWant += max(v, floor)
			}
			if sumWant <= budget {
				least := slices.Min(got)
				for j, g := range got {
					if w := max(d[j], floor); g < w || (g > w && g > least+1) {
						t.Fatalf("#%d pod %d: want %d, got %d, least share %d: Target(%d, %d, %v) = %v", iter, j, w, g, least, budget, floor, d, got)
					}
				}
			}
		}
		// Monotone: raise one pod's demand.
		i := r.IntN(len(d))
		more := slices.Clone(d)
		more[i] += 1 + r.Int64N(10)
		got2 := Target(budget, floor, more, rank)
		if got2[i] < got[i] {
			t.Fatalf("#%d raising pod %d's demand %d→%d lowered its share %d→%d (budget %d floor %d demand %v)",
				iter, i, d[i], more[i], got[i], got2[i], budget, floor, d)
		}
		// Equal demand ⇒ the Equal split: with ranks exactly package apportion's for one target;
		// without, its floor.
		eq := repeat(r.Int64N(30), len(d))
		equal := apportion.Split(budget, 100, []apportion.Target{{Weight: 1, Replicas: n, Pods: pods}}, counter)
		for j, g := range Target(budget, floor, eq, rank) {
			want := equal.Permits[0][j]
			if rank == nil {
				want = equal.PerPod[0]
			}
			if g != want {
				t.Fatalf("#%d equal demand %d: pod %d got %d, Equal gives %d (budget %d, %d pods, ranks %v)", iter, eq[0], j, g, want, budget, n, rank != nil)
			}
		}
	}
}

// TestTargetUsesBudgetWhenAsked: when Σ want ≥ budget and wants differ, at most one tie group's
// worth of units is left unused.
func TestTargetUsesBudgetWhenAsked(t *testing.T) {
	got := Target(40, 1, append(repeat(5, 8), repeat(0, 24)...), nil)
	if s := sum(got); s != 40 {
		t.Fatalf("Σ = %d, want the whole budget 40: %v", s, got)
	}
}

func TestStep(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	d := Damping{HysteresisPercent: 20, MaxMove: 4, MinInterval: 10 * time.Second}
	tests := []struct {
		name          string
		budget, floor int64
		cur, tgt      []int64
		now, last     time.Time
		want          []int64
		wantDamped    bool
	}{
		{name: "at target: nothing moves", budget: 10, floor: 1, cur: []int64{5, 5}, tgt: []int64{5, 5}, now: t0, want: []int64{5, 5}},
		{name: "within the dead band: nothing moves", budget: 20, floor: 1, cur: []int64{10, 10}, tgt: []int64{11, 9}, now: t0, want: []int64{10, 10}},
		{name: "bounded move", budget: 20, floor: 1, cur: []int64{10, 10}, tgt: []int64{18, 2}, now: t0, want: []int64{14, 6}, wantDamped: true},
		{name: "too soon", budget: 20, floor: 1, cur: []int64{10, 10}, tgt: []int64{18, 2}, now: t0, last: t0.Add(-5 * time.Second), want: []int64{10, 10}},
		{name: "free room raises without lowering", budget: 20, floor: 1, cur: []int64{2, 2}, tgt: []int64{10, 10}, now: t0, want: []int64{4, 4}, wantDamped: true},
		{name: "over budget: the target at once", budget: 10, floor: 1, cur: []int64{8, 8}, tgt: []int64{5, 5}, now: t0, last: t0, want: []int64{5, 5}},
		{name: "a new pod: the target at once", budget: 10, floor: 1, cur: []int64{5, 5, 0}, tgt: []int64{4, 3, 3}, now: t0, last: t0, want: []int64{4, 3, 3}},
		{name: "pods changed: the target at once", budget: 10, floor: 1, cur: []int64{5, 5}, tgt: []int64{10}, now: t0, want: []int64{10}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, damped := Step(tt.budget, tt.floor, tt.cur, tt.tgt, d, tt.now, tt.last)
			if diff := cmp.Diff(tt.want, got); diff != "" || damped != tt.wantDamped {
				t.Errorf("Step: damped %v, want %v (-want +got):\n%s", damped, tt.wantDamped, diff)
			}
		})
	}
}

// TestStepProperties: from any split within budget, Step stays within budget, moves at most
// MaxMove per round, and reaches a steady split in bounded rounds after which it does not move
// (no flapping under steady demand).
func TestStepProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(2, 15))
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	for iter := range 5000 {
		budget, floor, dem := randomCase(r)
		tgt := Target(budget, floor, dem, nil)
		cur := Target(budget, floor, shuffle(r, dem), nil) // another split within budget, ≥ floor
		d := Damping{HysteresisPercent: r.Int64N(50), MaxMove: 1 + r.Int64N(10), MinInterval: time.Second}
		now, last := t0, time.Time{}
		steady := 0
		for round := 0; round < 1000 && steady < 3; round++ {
			next, damped := Step(budget, floor, cur, tgt, d, now, last)
			if s := sum(next); s > budget {
				t.Fatalf("#%d round %d: Σ %d > budget %d (%v → %v)", iter, round, s, budget, cur, next)
			}
			var lowered, raised int64
			for i := range next {
				if next[i] < cur[i] {
					lowered += cur[i] - next[i]
				} else {
					raised += next[i] - cur[i]
				}
			}
			if lowered > d.MaxMove || raised > d.MaxMove {
				t.Fatalf("#%d round %d: moved down %d / up %d > MaxMove %d", iter, round, lowered, raised, d.MaxMove)
			}
			if damped {
				last = now
				steady = 0
			} else {
				steady++
			}
			cur = next
			now = now.Add(time.Second)
		}
		if steady < 3 {
			t.Fatalf("#%d: still moving after 1000 rounds: %v target %v", iter, cur, tgt)
		}
		// Steady: every pod within its dead band of the target.
		for i := range cur {
			if diff := tgt[i] - cur[i]; diff >= max(1, cur[i]*d.HysteresisPercent/100) && sum(cur) < budget {
				t.Fatalf("#%d: pod %d settled at %d, target %d, with room left (Σ %d < %d)", iter, i, cur[i], tgt[i], sum(cur), budget)
			}
		}
	}
}

func shuffle(r *rand.Rand, s []int64) []int64 {
	out := slices.Clone(s)
	r.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}

func TestSmoothAndPermits(t *testing.T) {
	if got := Smooth(0, 10, time.Second, 0); got != 10 {
		t.Errorf("tau 0: %v", got)
	}
	if got := Smooth(4, 10, 0, time.Second); got != 4 {
		t.Errorf("dt 0: %v", got)
	}
	// After one time constant, 1-1/e of the way.
	if got := Smooth(0, 10, time.Second, time.Second); got < 6.32 || got > 6.33 {
		t.Errorf("one tau: %v", got)
	}
	for _, tc := range []struct {
		in   float64
		want int64
	}{{0, 0}, {-1, 0}, {2.0000001, 2}, {2.1, 3}, {1e300, 1e12}} {
		if got := Permits(tc.in); got != tc.want {
			t.Errorf("Permits(%v) = %d, want %d", tc.in, got, tc.want)
		}
	}
	if got := Sample(3, 2, 100, 4); got != 9 {
		t.Errorf("Sample = %v, want 3+2+min(100,4)=9", got)
	}
}

func TestQuantize(t *testing.T) {
	for _, tc := range []struct {
		prev     int64
		smoothed float64
		want     int64
	}{
		{-1, 3.2, 4}, // nothing held: rounded up
		{3, 3.7, 3},  // within the band: kept
		{3, 2.3, 3},
		{3, 4.2, 4}, // beyond: rounded to the nearest
		{3, 1.5, 2},
		{0, 0.9, 0},
		{0, 0.95, 1},
	} {
		if got := Quantize(tc.prev, tc.smoothed, DemandBand); got != tc.want {
			t.Errorf("Quantize(%d, %v) = %d, want %d", tc.prev, tc.smoothed, got, tc.want)
		}
	}
}

// TestSteadyNoisyDemandDoesNotFlap: demand sampled with ±1 of jitter around a steady mean,
// smoothed, quantized and shared every round, moves shares only at the start: once settled, no
// round moves anything — with ties left unsplit and with ties split by rank at one counter.
func TestSteadyNoisyDemandDoesNotFlap(t *testing.T) {
	means := []float64{20, 20, 3, 3, 3, 3, 3, 3}
	for _, rank := range [][]uint64{nil, {8, 3, 5, 1, 7, 2, 6, 4}} {
		r := rand.New(rand.NewPCG(4, 15))
		t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
		smoothed := slices.Clone(means)
		levels := repeat(-1, len(means))
		cur := repeat(5, len(means))
		d := DefaultDamping(40)
		d.MinInterval = 2 * time.Second
		var last time.Time
		lastMove := -1
		for round := range 600 { // 5 minutes at 500 ms
			now := t0.Add(time.Duration(round) * 500 * time.Millisecond)
			dem := make([]int64, len(means))
			for i, m := range means {
				smoothed[i] = Smooth(smoothed[i], m+float64(r.IntN(3)-1), 500*time.Millisecond, 2*time.Second)
				levels[i] = Quantize(levels[i], smoothed[i], DemandBand)
				dem[i] = levels[i]
			}
			next, damped := Step(40, 1, cur, Target(40, 1, dem, rank), d, now, last)
			if damped {
				last = now
			}
			if !slices.Equal(next, cur) {
				lastMove = round
			}
			cur = next
		}
		if lastMove > 100 {
			t.Fatalf("ranks %v: shares still moved at round %d of 600 under steady demand: %v", rank, lastMove, cur)
		}
		t.Logf("ranks %v: last move at round %d of 600: %v (Σ %d)", rank, lastMove, cur, sum(cur))
	}
}
