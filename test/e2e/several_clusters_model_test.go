package e2e

import (
	"testing"
	"time"

	"github.com/apportion/apportion/test/e2e/harness"
)

// TestSumAcrossClusters checks harness.SumAcross, the sum over several clusters' monitors that
// TestSeveralClusters and TestThreeClusters rely on, on made-up samples (no control plane): the
// monitors tick at other phases, so no instant has a sample of every cluster.
func TestSumAcrossClusters(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	// sampled is a monitor ticking every 40 ms from phase until end, reading f at each tick, and
	// skipping the ticks in gaps (a stalled monitor).
	sampled := func(phase, end int, f func(ms int) int32, gaps ...[2]int) []harness.Sample {
		var out []harness.Sample
	tick:
		for at := phase; at <= end; at += 40 {
			for _, g := range gaps {
				if at > g[0] && at < g[1] {
					continue tick
				}
			}
			out = append(out, harness.Sample{At: ms(at), SumPermits: f(at)})
		}
		return out
	}
	step := func(before, after int32, at int) func(int) int32 {
		return func(m int) int32 {
			if m < at {
				return before
			}
			return after
		}
	}
	flat := func(v int32) func(int) int32 { return func(int) int32 { return v } }
	window := harness.AcrossWindow(25)
	if window != 220*time.Millisecond {
		t.Fatalf("AcrossWindow(25) = %v, want 3 periods + 100 ms", window)
	}

	t.Run("a raise before the other cluster's lowering is caught", func(t *testing.T) {
		// a rises at 1000 ms, b lowers only at 1030 ms: Σ is 55 > 45 for 30 ms.
		st := harness.SumAcross(map[string][]harness.Sample{
			"a": sampled(0, 2000, step(20, 30, 1000)),
			"b": sampled(13, 2000, step(20, 10, 1030)),
			"c": sampled(27, 2000, flat(5)),
		}, window, 45)
		if st.Over == 0 || st.Worst != 55 {
			t.Errorf("want instants over 45 with worst 55, got %s", st)
		}
	})
	t.Run("a lowering a window before the raise is not counted", func(t *testing.T) {
		// b lowers at 1000 ms, a rises at 1300 ms: Σ never above 45.
		st := harness.SumAcross(map[string][]harness.Sample{
			"a": sampled(0, 2000, step(20, 30, 1300)),
			"b": sampled(13, 2000, step(20, 10, 1000)),
			"c": sampled(27, 2000, flat(5)),
		}, window, 45)
		if st.Over != 0 || st.Worst != 45 {
			t.Errorf("want no instant over 45 and worst 45, got %s", st)
		}
		// Every sample instant of every cluster inside the span all three ran is summed.
		if st.N < 3*45 {
			t.Errorf("only %d instants summed", st.N)
		}
	})
	t.Run("a stalled monitor is bridged by its neighbouring samples", func(t *testing.T) {
		// b's monitor takes no sample between 900 and 2100 ms while b holds 20; a rises to 30 at
		// 1500 ms. No b sample lies within the window of a's raise: its neighbours stand for it.
		st := harness.SumAcross(map[string][]harness.Sample{
			"a": sampled(0, 3000, step(20, 30, 1500)),
			"b": sampled(13, 3000, flat(20), [2]int{900, 2100}),
			"c": sampled(27, 3000, flat(5)),
		}, window, 45)
		if st.Over == 0 || st.Worst != 55 {
			t.Errorf("want instants over 45 with worst 55, got %s", st)
		}
	})
	t.Run("a cluster without samples sums nothing", func(t *testing.T) {
		st := harness.SumAcross(map[string][]harness.Sample{"a": sampled(0, 1000, flat(50)), "b": nil}, window, 45)
		if st.N != 0 {
			t.Errorf("want nothing summed, got %s", st)
		}
	})
}
