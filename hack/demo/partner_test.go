package main

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/apportion/apportion/hack/demo/report"
)

// TestLatencyCalibration draws from the partner's model (a fixed seed, so the draw is the same
// on every run) and checks that it has the story's figures: mean ≈ 20 ms and P99 ≈ 220 ms
// normally, P99 ≈ 1.8 s when slow, and that Scale stretches all of them.
func TestLatencyCalibration(t *testing.T) {
	for _, scale := range []float64{1, 3.8} {
		l := newLatency(20*time.Millisecond, 220*time.Millisecond, 0.0125, 1700*time.Millisecond, 2300*time.Millisecond, scale)
		rng := rand.New(rand.NewPCG(7, 11))
		stats := func(slow bool) (mean, p99 time.Duration) {
			const n = 400_000
			ds := make([]time.Duration, n)
			var sum time.Duration
			for i := range ds {
				ds[i] = l.draw(rng, slow)
				sum += ds[i]
			}
			return sum / n, report.Percentile(ds, 0.99)
		}
		near := func(what string, got, want time.Duration, tol float64) {
			t.Helper()
			w := time.Duration(float64(want) * scale)
			if d := float64(got-w) / float64(w); d > tol || d < -tol {
				t.Errorf("scale %.1f: %s = %s, want %s ± %.0f %%", scale, what, got, w, 100*tol)
			}
		}
		mean, p99 := stats(false)
		near("normal mean", mean, 20*time.Millisecond, 0.05)
		near("normal P99", p99, 220*time.Millisecond, 0.05)
		_, slowP99 := stats(true)
		near("slow P99", slowP99, 1800*time.Millisecond, 0.05)
	}
}
