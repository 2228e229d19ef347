package apportion

import (
	"math"
	"math/big"
)

// RateShare is one pod's share of a rate contract.
type RateShare struct {
	// PerSecond is the pod's steady rate: the exact share R·f·wᵢ/W rounded down to a float64
	// (never above the exact share); 0 for a target without replicas.
	PerSecond float64
	// Burst is the pod's share of the contract's burst, floor(B·f·wᵢ/W); it is 0 when the
	// pods outnumber the burst. A pod with burst 0 is paced: see SplitRate.
	Burst int64
}

// RateResult is the split of one rate contract.
type RateResult struct {
	// PerPod is each target's share per pod, in input order.
	PerPod []RateShare
	// PerSecond is Σ Replicas × PerPod.PerSecond, as float64 (the exact sum is ≤ the contract's
	// rate × factor; this float sum can differ from it by rounding).
	PerSecond float64
	// Burst is Σ Replicas × PerPod.Burst; always ≤ the contract's burst × factor.
	Burst int64
}

// SplitRate apportions a global rate contract — perSecond requests per second with a bucket of
// burst requests — like Split apportions the in-flight limit: with the same factorPercent, the
// same weights and the same replica counts. Every pod of target i gets
//
//	rateᵢ  = R · f · wᵢ / W   (rounded down to a float64)
//	burstᵢ = ⌊B · f · wᵢ / W⌋
//
// where f = factorPercent / 100 and W = Σ wᵢ·nᵢ. Guarantees, whatever the weights and counts:
//   - Σ nᵢ·rateᵢ ≤ R·f ≤ R and Σ nᵢ·burstᵢ ≤ ⌊B·f⌋ ≤ B (in exact arithmetic: no rounding
//     overshoots);
//   - adding a replica anywhere (W grows) never raises anyone's rate or burst;
//   - no pod gets more than its weighted fair share of either.
//
// Outcomes: the rate share is always positive for a target with replicas (R ≥ 1), so no pod is
// left unlimited by rounding. The burst share is a whole number of calls and reaches 0 when
// B·f·wᵢ < W — more weighted pods than burst. Burst 0 does not stop a pod: the agent treats a
// bucket below one token as a bucket of one (Pacing), so such a pod sends one call, then one
// per 1/rateᵢ, and never two at once; what it gives up is the ability to send several calls at
// once after an idle spell. Because each pod's pacing starts independently, up to one call per
// paced pod can still coincide across pods: no limiter without coordination between pods can
// rule that out (docs/agent.md, "Rate limits").
//
// perSecond ≤ 0 or burst < 0 is read as 0; factorPercent is clamped to 0..100, as in Split.
func SplitRate(perSecond, burst, factorPercent int64, targets []Target) RateResult {
	perSecond, burst = max(perSecond, 0), max(burst, 0)
	factorPercent = min(max(factorPercent, 0), 100)
	r := RateResult{PerPod: make([]RateShare, len(targets))}
	var weighted int64
	for _, t := range targets {
		weighted += max(t.Weight, 1) * max(t.Replicas, 0)
	}
	if weighted == 0 {
		return r
	}
	for i, t := range targets {
		w, n := max(t.Weight, 1), max(t.Replicas, 0)
		if n == 0 {
			continue
		}
		// R·f·w/W = (R·factorPercent·w) / (100·W): exact in int64 for the API's ranges
		// (R < 2³¹, factor ≤ 100, w ≤ 1000; W ≤ 16 targets × 1000 × 2³¹).
		r.PerPod[i] = RateShare{
			PerSecond: floorFloat(perSecond*factorPercent*w, 100*weighted),
			Burst:     burst * factorPercent * w / (100 * weighted),
		}
		r.PerSecond += float64(n) * r.PerPod[i].PerSecond
		r.Burst += n * r.PerPod[i].Burst
	}
	return r
}

// floorFloat is the largest float64 ≤ num/den (num ≥ 0, den > 0).
func floorFloat(num, den int64) float64 {
	exact := new(big.Rat).SetFrac64(num, den)
	f, _ := exact.Float64() // nearest; may lie above the exact value
	if new(big.Rat).SetFloat64(f).Cmp(exact) > 0 {
		f = math.Nextafter(f, 0)
	}
	return f
}
