// Package demand holds the pure arithmetic of demand-aware sharing: how one quota's budget is
// split among its pods by what each of them asks for, and how the split moves over time without
// oscillating. It sits next to package apportion (the Equal split) and, like it, reads no clock
// and does no I/O: the manager gathers the inputs and calls it.
//
// # Model
//
// The budget B is what package apportion computes (limit × factor). Each pod i reports a demand
// dᵢ in permits (what it had in flight, queued, and refused for lack of a permit, smoothed: see
// Smooth, Sample and Quantize). Target computes the split a pod should converge to:
//
//  1. every pod gets the floor f (FloorPermits; when B < n·f, the floor the budget allows,
//     ⌊B/n⌋, which is the Equal split);
//  2. the rest of B is shared by water-filling on wantᵢ = max(dᵢ, f): every pod gets
//     min(wantᵢ, λ) for the highest level λ that fits, and the units that do not make a whole
//     level go to the pods with the highest want, one each, a tie split by rank (see below);
//  3. what is left when every want is met lifts the smallest shares to a common level μ (every
//     pod gets max(wantᵢ, μ) for the highest μ that fits), and its remainder goes to pods at
//     that level, the highest wants first, a tie split by rank. So where demand fits the budget
//     the split is the Equal split except for the pods that ask above it: an idle pod keeps the
//     headroom to absorb its next burst, and a noisy sample cannot leave one pod with its ask
//     plus a sliver while another sits on idle permits.
//
// Guarantees of Target (tested as properties): Σ shares ≤ B, and Σ = B whenever ranks are given
// and some pod exists; every pod ≥ f when B ≥ n·f; monotone: raising one pod's demand, all else
// equal, never lowers its share; with equal demand every pod gets ⌊B/n⌋ or ⌊B/n⌋+1, the B mod n
// units to the pods ranked first — exactly the Equal split of one target (package apportion) with
// the same ranks; and whenever Σ want ≤ B, every pod gets at least its want, and every pod given
// more than its want holds μ or μ+1 with no pod below μ (the spare lifts the least). Ties are
// split by rank only: the units that do not make a whole level go to the highest wants first,
// and within a group that asks alike to the pods ranked first by apportion.Rank(pod, counter) —
// a hash that changes only with the slow rotation counter, not with demand, so the odd unit is
// neither tied to a pod's name nor moved by noise, and over counters each pod of the group gets
// it in turn. Without ranks (nil) ties are never split and the odd units of a tie group stay
// unused.
//
// Step moves the current split towards the target under three dampers: a pod's share moves only
// when its target differs by more than a dead band (hysteresis), no more than MaxMove permits
// change hands per round, and a round happens at most every MinInterval. The reasoning: demand
// is sampled (at the manager's renewal period) and noisy by a permit or two; a dead band of
// HysteresisPercent of the share (at least one permit) keeps a pod with steady demand from
// flapping, the bounded move keeps one round from draining many pods at once (each lowered pod
// must acknowledge before anyone is raised, see docs/protocol.md), and the interval lets the
// smoothed demand reflect the previous move before the next. Rounds that must happen for safety
// or for the floor — the budget shrank below Σ current, a pod appeared or left — skip the dampers
// and go straight to the target.
//
// Step never breaks the bound: its result sums to at most B whenever the current split did or
// the target is taken directly, and a permit moves from pod A to pod B only as a lowering of A
// and a raise of B in the same plan — the push engine applies the lowering and waits for it to be
// acknowledged (or counts A at its in-flight) before it raises B.
package demand

import (
	"cmp"
	"math"
	"slices"
	"time"
)

// Target splits budget among pods by demand (see the package doc). demand[i] is pod i's demand
// in permits (negative counts as 0); floor is the per-pod floor (negative counts as 0); rank[i]
// orders pod i within a tie (higher first: apportion.Rank), nil to leave ties unsplit. The result
// has one share per pod, in input order.
func Target(budget, floor int64, demand []int64, rank []uint64) []int64 {
	n := int64(len(demand))
	out := make([]int64, n)
	if n == 0 || budget <= 0 {
		return out
	}
	if rank != nil && len(rank) != len(demand) {
		rank = nil // a caller's mistake: no pod is favoured by it
	}
	floor = max(floor, 0)
	if budget < n*floor {
		floor = budget / n
	}
	want := make([]int64, n)
	var sumWant int64
	for i, d := range demand {
		want[i] = max(d, floor)
		sumWant += want[i]
	}
	if sumWant <= budget {
		// Every want is met; the spare lifts the smallest shares to a common level μ, the
		// highest with Σ max(wantᵢ, μ) ≤ budget, and its remainder goes to pods at that level.
		// (Not an equal increment on top of each want: that keeps a pod that happened to ask little
		// at the sample that little above its ask, and its next burst waits while the pod that
		// asked more sits on idle permits. Sampled demand is noisy; where it fits, the Equal split
		// is the robust answer, and this is the Equal split wherever no pod asks above it.)
		// Σ max(want, floor) = Σ want ≤ budget, and budget+1 does not fit (n ≥ 2) or is past
		// the end (n = 1).
		lo := highest(floor, budget+1, func(l int64) bool { return lift(want, l) <= budget })
		var used int64
		for i := range out {
			out[i] = max(want[i], lo)
			used += out[i]
		}
		// Fewer units are left than pods at the level (else lo+1 would fit).
		giveRemainder(out, want, rank, budget-used, func(i int) bool { return want[i] <= lo })
		return out
	}
	// Water-filling: the highest level λ ≥ floor with Σ min(wantᵢ, λ) ≤ budget (Σ min(want,
	// floor) ≤ budget; Σ min(want, max want) = Σ want > budget).
	lo := highest(floor, slices.Max(want), func(l int64) bool { return level(want, l) <= budget })
	var used int64
	for i := range out {
		out[i] = min(want[i], lo)
		used += out[i]
	}
	giveRemainder(out, want, rank, budget-used, func(i int) bool { return want[i] > lo })
	return out
}

// highest is the highest l in [lo, hi) for which fits holds, by binary search: fits(lo) must
// hold, fits must be monotone (true up to some level, false above), and hi is taken not to fit.
func highest(lo, hi int64, fits func(int64) bool) int64 {
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if fits(mid) {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}

// lift is Σ max(wantᵢ, l): the budget the pods take when every share below l is lifted to it.
func lift(want []int64, l int64) int64 {
	var s int64
	for _, w := range want {
		s += max(w, l)
	}
	return s
}

func level(want []int64, l int64) int64 {
	var s int64
	for _, w := range want {
		s += min(w, l)
	}
	return s
}

// giveRemainder hands rem single units to the eligible pods with the highest want, one each;
// within a tie group it cannot give to entirely, to the pods ranked first, or (rank nil) to none
// of them (see the package doc).
func giveRemainder(out, want []int64, rank []uint64, rem int64, eligible func(int) bool) {
	if rem <= 0 {
		return
	}
	var idx []int
	for i := range out {
		if eligible == nil || eligible(i) {
			idx = append(idx, i)
		}
	}
	slices.SortStableFunc(idx, func(a, b int) int {
		if c := cmp.Compare(want[b], want[a]); c != 0 || rank == nil {
			return c
		}
		return cmp.Compare(rank[b], rank[a])
	})
	for start := 0; start < len(idx) && rem > 0; {
		end := start
		for end < len(idx) && want[idx[end]] == want[idx[start]] {
			end++
		}
		if int64(end-start) > rem {
			if rank != nil {
				for _, i := range idx[start : start+int(rem)] {
					out[i]++
				}
			}
			return
		}
		for _, i := range idx[start:end] {
			out[i]++
		}
		rem -= int64(end - start)
		start = end
	}
}

// Damping configures Step.
type Damping struct {
	// HysteresisPercent is the dead band: a pod's share moves only when its target differs from
	// it by at least max(1, share × HysteresisPercent / 100) permits.
	HysteresisPercent int64
	// MaxMove bounds the permits lowered (and so raised) in one round; at least 1.
	MaxMove int64
	// MinInterval is the least time between two damped rounds.
	MinInterval time.Duration
}

// DefaultDamping is the damping the manager uses: a 20 % dead band, at most a quarter of the
// budget (at least 2 permits) moved per round, a round at most every 10 s.
func DefaultDamping(budget int64) Damping {
	return Damping{HysteresisPercent: 20, MaxMove: max(2, budget/4), MinInterval: 10 * time.Second}
}

// Step is one round of moving current towards target (both in pod order, same length) within
// budget, at now, the previous damped round having been at last (zero: never). It returns the new
// split and whether this was a damped round (the caller records now as last then).
//
// When Σ current > budget, or a pod is below the floor target gives it (a new pod), or the
// lengths differ, the target is returned as is (forced: not damped). Otherwise, unless
// MinInterval has not passed since last (current is returned), pods above their target by more
// than the dead band are lowered, a permit at a time round-robin from the largest excess, at most
// MaxMove in all, and pods below their target by more than the dead band are raised the same way
// from what was lowered plus the budget left free, at most MaxMove in all. A round that moves
// nothing is not damped. Σ result ≤ budget in every case
// where Σ target ≤ budget (Target's guarantee).
func Step(budget, floor int64, current, target []int64, d Damping, now, last time.Time) (next []int64, damped bool) {
	if len(current) != len(target) {
		return slices.Clone(target), false
	}
	n := int64(len(target))
	if n > 0 && budget < n*max(floor, 0) {
		floor = budget / n
	}
	var sum int64
	for i, c := range current {
		sum += c
		if c < min(floor, target[i]) {
			return slices.Clone(target), false
		}
	}
	if sum > budget {
		return slices.Clone(target), false
	}
	next = slices.Clone(current)
	if !last.IsZero() && now.Sub(last) < d.MinInterval {
		return next, false
	}
	band := func(c int64) int64 { return max(1, c*max(d.HysteresisPercent, 0)/100) }
	maxMove := max(d.MaxMove, 1)
	var down, up []int
	for i := range current {
		switch diff := target[i] - current[i]; {
		case diff <= -band(current[i]):
			down = append(down, i)
		case diff >= band(current[i]):
			up = append(up, i)
		}
	}
	if len(down) == 0 && len(up) == 0 {
		return next, false
	}
	slices.SortStableFunc(down, func(a, b int) int {
		return cmp.Compare(current[b]-target[b], current[a]-target[a])
	})
	slices.SortStableFunc(up, func(a, b int) int {
		return cmp.Compare(target[b]-current[b], target[a]-current[a])
	})
	// One permit at a time, round-robin over each list (largest gap first), so that a round
	// spreads its move over the pods that need it instead of filling the first.
	var lowered int64
	for moved := true; moved && lowered < maxMove; {
		moved = false
		for _, i := range down {
			if lowered < maxMove && next[i] > target[i] {
				next[i]--
				lowered++
				moved = true
			}
		}
	}
	room := min(lowered+budget-sum, maxMove)
	var raised int64
	for moved := true; moved && raised < room; {
		moved = false
		for _, i := range up {
			if raised < room && next[i] < target[i] {
				next[i]++
				raised++
				moved = true
			}
		}
	}
	if lowered == 0 && raised == 0 {
		return next, false
	}
	return next, true
}

// Smooth is an exponentially weighted moving average of a demand with time constant tau: the
// previous value decays by e^(−dt/tau) towards sample. A zero or negative tau returns sample; a
// non-positive dt returns prev.
func Smooth(prev, sample float64, dt, tau time.Duration) float64 {
	if tau <= 0 {
		return sample
	}
	if dt <= 0 {
		return prev
	}
	a := 1 - math.Exp(-float64(dt)/float64(tau))
	return prev + a*(sample-prev)
}

// Sample is one observation of a pod's demand in permits: the calls it had in flight, the calls
// queued for a permit, and the calls refused for lack of a permit since the previous observation,
// the last capped at the pod's share (a pod refusing calls asks for at most twice what it has per
// observation, so one burst cannot claim the whole budget at once).
func Sample(inFlight, waiting, refusedNoPermit, share int64) float64 {
	return float64(max(inFlight, 0) + max(waiting, 0) + min(max(refusedNoPermit, 0), max(share, 1)))
}

// Quantize turns a smoothed demand into whole permits with hysteresis: the level held, prev,
// is kept while the smoothed demand stays within band of it, and only then rounded to the nearest
// permit (the first level, with none held, is rounded up: Permits).
// A sampled demand jitters by a call or two around a steady mean (a call more or less in flight
// at the sampling instant); without the band that jitter would cross a rounding boundary now and
// then and move the pod's target, and with it, through the odd unit's tie-breaking, its
// neighbours' — flapping the dead band of a small share (one permit) cannot absorb. prev < 0
// means none held yet.
func Quantize(prev int64, smoothed, band float64) int64 {
	if prev >= 0 && math.Abs(smoothed-float64(prev)) <= band {
		return prev
	}
	if prev < 0 {
		return Permits(smoothed)
	}
	return max(0, int64(math.Round(min(smoothed, 1e12))))
}

// DemandBand is the hysteresis band Quantize is used with: nine tenths of a permit, so that a
// steady change of one whole permit still passes.
const DemandBand = 0.9

// Permits rounds a smoothed demand up to whole permits (a pod that asked for 2.1 on average
// needs 3 to serve its peaks), ignoring the last hundredth so that a decayed 2.0000001 is 2.
func Permits(smoothed float64) int64 {
	if smoothed <= 0 || math.IsNaN(smoothed) {
		return 0
	}
	if math.IsInf(smoothed, 1) || smoothed > 1e12 {
		return 1e12
	}
	return int64(math.Ceil(smoothed - 0.01))
}
