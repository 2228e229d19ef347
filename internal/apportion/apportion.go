// Package apportion holds the pure arithmetic that splits one downstream's global in-flight limit
// among the pods that share it.
//
// Model: the budget is B = floor(limit × factorPercent / 100). Each target i has a weight wᵢ and a
// replica count nᵢ; the weighted pod count is W = Σ wᵢ·nᵢ. Every pod of target i gets
//
//	pᵢ = floor(B · wᵢ / W)
//
// permits. Flooring gives three guarantees that the rest of Apportion relies on:
//   - Σ nᵢ·pᵢ ≤ B ≤ limit, whatever the weights and counts (rounding never overshoots);
//   - no pod gets more than its weighted fair share B·wᵢ/W;
//   - adding a replica anywhere (W grows) never raises anyone's permits, so scale-out only ever
//     lowers existing pods and a lowering can always be applied before a raise.
//
// Outcomes: when B ≥ W every pod gets at least one permit. When B < W the quota is oversubscribed:
// some pods get 0 (their calls fail fast into the fallback), nothing above the budget is assigned,
// and Result.FitWeighted says how large W may be for every pod to get one permit.
//
// A rate contract (requests per second and a burst) is split the same way by SplitRate, with the
// same factor, weights and counts, and the same three guarantees.
//
// Replica counts err high on purpose (see Replicas): counting a pod that is not calling wastes a
// little quota; missing a pod that is calling breaks the global limit.
package apportion

// Target is one workload sharing the budget.
type Target struct {
	// Weight is the relative share of each of the target's pods (≥ 1).
	Weight int64
	// Replicas is the number of pods that may be calling (≥ 0).
	Replicas int64
	// MaxReplicas bounds Replicas from above as the autoscaler sees it (HPA maxReplicas); it is
	// only used for the safe default. Values below Replicas are raised to Replicas.
	MaxReplicas int64
}

// Result is the split of one budget.
type Result struct {
	// Budget is floor(limit × factorPercent / 100).
	Budget int64
	// PerPod is each target's permits per pod, in input order.
	PerPod []int64
	// SafeDefault is each target's permits per pod when every target runs at MaxReplicas; it is
	// what an agent may use with no valid assignment.
	SafeDefault []int64
	// Assigned is Σ Replicas × PerPod; always ≤ Budget.
	Assigned int64
	// Weighted is W = Σ Weight × Replicas.
	Weighted int64
	// Oversubscribed is true when some pod gets no permit (Budget < Weighted).
	Oversubscribed bool
	// FitWeighted is the largest W at which every pod still gets one permit: Budget × the
	// smallest weight among targets with replicas. With weight-1 targets it is a pod count.
	FitWeighted int64
}

// Split apportions floor(limit × factorPercent / 100) among targets. limit ≥ 0 and
// 1 ≤ factorPercent ≤ 100 are the caller's to ensure (the API validates them at admission); values
// outside are clamped so that the result is still within limit.
func Split(limit, factorPercent int64, targets []Target) Result {
	if limit < 0 {
		limit = 0
	}
	factorPercent = min(max(factorPercent, 0), 100)
	r := Result{
		Budget:      limit * factorPercent / 100,
		PerPod:      make([]int64, len(targets)),
		SafeDefault: make([]int64, len(targets)),
	}
	var weightedMax int64
	minWeight := int64(0)
	for _, t := range targets {
		w, n := max(t.Weight, 1), max(t.Replicas, 0)
		r.Weighted += w * n
		weightedMax += w * max(t.MaxReplicas, n)
		if n > 0 && (minWeight == 0 || w < minWeight) {
			minWeight = w
		}
	}
	for i, t := range targets {
		w, n := max(t.Weight, 1), max(t.Replicas, 0)
		if r.Weighted > 0 && n > 0 {
			r.PerPod[i] = r.Budget * w / r.Weighted
		}
		if weightedMax > 0 && max(t.MaxReplicas, n) > 0 {
			r.SafeDefault[i] = r.Budget * w / weightedMax
		}
		r.Assigned += n * r.PerPod[i]
	}
	r.Oversubscribed = r.Budget < r.Weighted
	r.FitWeighted = r.Budget * minWeight
	return r
}

// Replicas is the number of pods of one workload that may be calling the downstream: the highest
// of the HPA's desired and current replicas, the workload's spec.replicas and the pods that exist
// (terminating ones included). Each source can lag the others — an HPA decision precedes the
// pods, a terminating pod outlives its replica slot — so the count takes the maximum and errs high.
func Replicas(hpaDesired, hpaCurrent, specReplicas, existingPods int64) int64 {
	return max(hpaDesired, hpaCurrent, specReplicas, existingPods, 0)
}
