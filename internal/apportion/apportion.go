// Package apportion holds the pure arithmetic that splits one downstream's global in-flight limit
// among the pods that share it.
//
// # Model
//
// The budget is B = floor(limit × factorPercent / 100). Each target i has a weight wᵢ and nᵢ
// replica slots (its replica count, which errs high: see Replicas); the weighted pod count is
// W = Σ wᵢ·nᵢ, and a pod's fair share is qᵢ = B·wᵢ/W. Every slot of target i gets the floor
//
//	pᵢ = ⌊B · wᵢ / W⌋
//
// and the remainder R = B − Σ nᵢ·pᵢ is handed out one permit per slot, as Hamilton's
// largest-remainder method does, so that no permit stays idle by rounding: at 16 pods and B = 40
// the floor alone gives 2 each, Σ 32; with the remainder 8 pods get 3, Σ 40. Unlike Hamilton's
// method the units do not always go to the largest fractional parts: they are drawn in proportion
// to them and the draw rotates (below), so that no pod is favoured for long.
//
// Guarantees (tested as properties):
//   - Σ over slots = B exactly whenever some replica is counted (W > 0), 0 otherwise; Σ ≤ B ≤
//     limit whatever the weights and counts;
//   - every pod gets ⌊qᵢ⌋ or ⌈qᵢ⌉: never more than the ceiling of its weighted fair share, never
//     less than its floor, and a pod whose share is a whole number gets exactly it;
//   - every target gets ⌊nᵢ·qᵢ⌋ or ⌈nᵢ·qᵢ⌉ in all;
//   - the same inputs (limit, factor, targets, pods and rotation counter) give the same split, so
//     a reconcile that changes nothing pushes nothing;
//   - over rotation counters each pod gets the one more permit as often as its fair share says:
//     in expectation over the counter's hash a pod holds qᵢ, not ⌊qᵢ⌋ (when every slot of its
//     target has a pod; TestSplitRotation measures it).
//
// What no longer holds with remainders: "adding a replica never raises anyone's permits". A
// pod may go from ⌊qᵢ⌋ to ⌊qᵢ⌋+1 and back as replicas come and go or the counter advances — never
// above the ceiling of its fair share before the change, since that share only falls as W grows.
// With a single target and the same counter it does still hold: the +1s go to the pods ranked
// first, and one more replica lowers the floor or shrinks the remainder, so the pods ranked first
// are a subset of those before. Nothing relies on it for safety: the push engine's planner lowers
// before it raises and raises only from the room its ledger shows (docs/protocol.md §5 and §11),
// so moving a permit from pod A to pod B never lets Σ of what live pods may use exceed the
// limit, whatever the split decides.
//
// # The remainder: who gets one more
//
// Target i is due eᵢ = nᵢ·(B·wᵢ mod W)/W remainder permits. It gets ⌊eᵢ⌋, and the
// L = R − Σ⌊eᵢ⌋ units left go to targets with probability equal to the fractional part of eᵢ, by
// systematic sampling: the fractional parts are laid end to end (in input order, as integers
// over W) and the L points u, u+W, …, u+(L−1)W, u in [0, W) drawn from the rotation counter,
// pick the targets they land in. Each part is below W, so a target gets at most one, and exactly
// L are picked. Over uniformly spread u each target gets its unit with probability exactly its
// fractional part, so equal and weighted targets alike get their due on average.
//
// Within a target the units go to its pods (Target.Pods) ranked by Rank(pod, counter): a hash of
// the pod's identity and the counter, so every counter ranks the pods anew and which pods get one
// more — and, when B < W, which pods get none — rotates. Slots a target counts but that have no
// pod yet (a pod the HPA decided and the ReplicaSet has not created, or one on its way out) take
// a target's units only when every pod of the target already has one: the units go where a pod
// can use them, and a pod that appears later takes its unit as its rank says. The slots without a
// pod keep at least their floor free, so Σ over the pods + the floor of every slot without a pod
// ≤ B, and a new pod finds its floor as room.
//
// The counter is the caller's: Rotation derives one from the time, advancing once per period
// with a phase of its own per quota. Every counter is a new split (one push per pod that gains or
// loses its unit); between two counters the split only changes with its other inputs.
//
// # Oversubscription and safe defaults
//
// When B < W the quota is oversubscribed: pᵢ is 0 for some targets, the B permits still go out one
// per pod (some pods 1, the others 0 — their calls fail fast into the fallback — rotating), nothing
// above the budget is assigned, and Result.FitWeighted says how large W may be for every pod to get
// one permit.
//
// The safe default (Result.SafeDefault) stays the floor of B split over every target's MaxReplicas,
// with no remainder: it is what an agent uses without a manager, at any replica count up to the
// maximum, and only the floor sums to ≤ B at every such count without coordination.
//
// A rate contract (requests per second and a burst) is split by SplitRate, with the same factor,
// weights and counts and its own guarantees.
//
// Replica counts err high on purpose (see Replicas): counting a pod that is not calling wastes a
// little quota; missing a pod that is calling breaks the global limit.
package apportion

import (
	"cmp"
	"math/bits"
	"slices"
	"time"
)

// Target is one workload sharing the budget.
type Target struct {
	// Weight is the relative share of each of the target's pods (≥ 1).
	Weight int64
	// Replicas is the number of pods that may be calling (≥ 0); raised to len(Pods).
	Replicas int64
	// MaxReplicas bounds Replicas from above as the autoscaler sees it (HPA maxReplicas); it is
	// only used for the safe default. Values below Replicas are raised to Replicas.
	MaxReplicas int64
	// Pods identifies the target's pods that can use a permit more (the caller passes the pods
	// that exist and are not terminating), by an identity that outlives a reconcile (the pod's
	// UID). The rest of the Replicas slots have no pod yet. Result.Permits follows this order.
	Pods []string
}

// Result is the split of one budget.
type Result struct {
	// Budget is floor(limit × factorPercent / 100).
	Budget int64
	// PerPod is each target's floor, in input order: every slot gets at least this.
	PerPod []int64
	// Extra is, per target, how many of its slots get PerPod + 1 (its part of the remainder);
	// at most Replicas, and 0 when the target's fair share is a whole number.
	Extra []int64
	// Permits is, per target, each of Target.Pods' permits: PerPod, or PerPod + 1 for the first
	// min(Extra, len(Pods)) pods in rank order.
	Permits [][]int64
	// SafeDefault is each target's permits per pod when every target runs at MaxReplicas; it is
	// what an agent may use with no valid assignment (a floor: no remainder).
	SafeDefault []int64
	// Assigned is Σ Replicas × PerPod + Extra: Budget when Weighted > 0, else 0.
	Assigned int64
	// Weighted is W = Σ Weight × Replicas.
	Weighted int64
	// Oversubscribed is true when some pod gets no permit (Budget < Weighted).
	Oversubscribed bool
	// FitWeighted is the largest W at which every pod still gets one permit: Budget × the
	// smallest weight among targets with replicas. With weight-1 targets it is a pod count.
	FitWeighted int64
	// Rotation is the counter the remainder was handed out with.
	Rotation uint64
}

// Split apportions floor(limit × factorPercent / 100) among targets, the remainder rotated by
// rotation (see the package doc). limit ≥ 0 and 1 ≤ factorPercent ≤ 100 are the caller's to
// ensure (the API validates them at admission); values outside are clamped so that the result
// is still within limit.
func Split(limit, factorPercent int64, targets []Target, rotation uint64) Result {
	if limit < 0 {
		limit = 0
	}
	factorPercent = min(max(factorPercent, 0), 100)
	r := Result{
		Budget:      limit * factorPercent / 100,
		PerPod:      make([]int64, len(targets)),
		Extra:       make([]int64, len(targets)),
		Permits:     make([][]int64, len(targets)),
		SafeDefault: make([]int64, len(targets)),
		Rotation:    rotation,
	}
	var weightedMax int64
	minWeight := int64(0)
	for _, t := range targets {
		w, n := max(t.Weight, 1), t.slots()
		r.Weighted += w * n
		weightedMax += w * max(t.MaxReplicas, n)
		if n > 0 && (minWeight == 0 || w < minWeight) {
			minWeight = w
		}
	}
	// frac[i] is the fractional part of target i's due remainder eᵢ, times W.
	frac := make([]int64, len(targets))
	var fracSum int64
	for i, t := range targets {
		w, n := max(t.Weight, 1), t.slots()
		if r.Weighted > 0 && n > 0 {
			r.PerPod[i] = r.Budget * w / r.Weighted
			r.Extra[i], frac[i] = mulDiv(n, r.Budget*w%r.Weighted, r.Weighted)
			fracSum += frac[i]
		}
		if weightedMax > 0 && max(t.MaxReplicas, n) > 0 {
			r.SafeDefault[i] = r.Budget * w / weightedMax
		}
	}
	if left := fracSum / max(r.Weighted, 1); left > 0 {
		// Systematic sampling: the points u + k·W, k < left, over the parts laid end to end.
		u := int64(mix(rotation^0x9e3779b97f4a7c15) % uint64(r.Weighted))
		var at int64
		for i, f := range frac {
			if f == 0 {
				continue
			}
			k := int64(0) // the first point at or after at
			if at > u {
				k = (at - u + r.Weighted - 1) / r.Weighted
			}
			if k < left && u+k*r.Weighted < at+f {
				r.Extra[i]++
			}
			at += f
		}
	}
	for i, t := range targets {
		r.Assigned += t.slots()*r.PerPod[i] + r.Extra[i]
		r.Permits[i] = permits(t.Pods, r.PerPod[i], r.Extra[i], rotation)
	}
	r.Oversubscribed = r.Budget < r.Weighted
	r.FitWeighted = r.Budget * minWeight
	return r
}

// slots is the target's replica count, never below its pods.
func (t Target) slots() int64 { return max(t.Replicas, int64(len(t.Pods)), 0) }

// permits gives floor to every pod and one more to the extra pods ranked first.
func permits(pods []string, floor, extra int64, rotation uint64) []int64 {
	out := make([]int64, len(pods))
	for j := range out {
		out[j] = floor
	}
	switch {
	case extra <= 0:
		return out
	case extra >= int64(len(pods)):
		for j := range out {
			out[j]++
		}
		return out
	}
	type ranked struct {
		rank uint64
		j    int
	}
	order := make([]ranked, len(pods))
	for j, p := range pods {
		order[j] = ranked{Rank(p, rotation), j}
	}
	slices.SortFunc(order, func(a, b ranked) int {
		return cmp.Or(cmp.Compare(b.rank, a.rank), cmp.Compare(a.j, b.j))
	})
	for _, o := range order[:extra] {
		out[o.j]++
	}
	return out
}

// mulDiv is ⌊a·b/c⌋ and a·b mod c for 0 ≤ a, 0 ≤ b < c, without overflow (a·b may exceed int64
// for counts and weighted sums the API allows).
func mulDiv(a, b, c int64) (q, rem int64) {
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	uq, ur := bits.Div64(hi, lo, uint64(c)) // hi < c: a·b/c < a
	return int64(uq), int64(ur)
}

// Rank orders pods for the remainder at one rotation counter: the pods with the highest rank
// get one more permit. It is a hash of the pod's identity and the counter — the same on every
// manager, for every reconcile with that counter — so a new counter ranks the pods anew and no
// pod is favoured for longer than a counter lasts. Package demand breaks its ties with it.
func Rank(pod string, rotation uint64) uint64 {
	// FNV-1a over the identity, then the counter's 8 bytes (little-endian).
	const offset, prime = 14695981039346656037, 1099511628211
	h := uint64(offset)
	for i := 0; i < len(pod); i++ {
		h = (h ^ uint64(pod[i])) * prime
	}
	for i := range 8 {
		h = (h ^ (rotation >> (8 * i) & 0xff)) * prime
	}
	return mix(h)
}

// mix is splitmix64's finaliser: FNV's low bits alone are poorly spread.
func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// Rotation is the remainder's rotation counter at now and when it next advances: one step per
// period, at a phase drawn from salt (the quota's UID) so that quotas rotate at different
// instants rather than all at once. It reads the wall time the caller passes, so every manager
// — a new leader too — computes the same counter and the same split. period ≤ 0 never rotates
// (counter 0, next zero).
func Rotation(now time.Time, period time.Duration, salt string) (counter uint64, next time.Time) {
	if period <= 0 {
		return 0, time.Time{}
	}
	p := int64(period)
	phase := int64(Rank(salt, 0) % uint64(p))
	t := now.UnixNano() + phase
	c := t / p
	if t%p < 0 {
		c-- // floor, for times before 1970
	}
	return uint64(c), time.Unix(0, (c+1)*p-phase)
}

// Replicas is the number of pods of one workload that may be calling the downstream: the highest
// of the HPA's desired and current replicas, the workload's spec.replicas and the pods that exist
// (terminating ones included). Each source can lag the others — an HPA decision precedes the
// pods, a terminating pod outlives its replica slot — so the count takes the maximum and errs high.
func Replicas(hpaDesired, hpaCurrent, specReplicas, existingPods int64) int64 {
	return max(hpaDesired, hpaCurrent, specReplicas, existingPods, 0)
}
