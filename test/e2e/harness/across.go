package harness

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"
)

// AcrossStats is what SumAcross found over several clusters' monitor samples.
type AcrossStats struct {
	// N is how many instants were summed: every sample instant of every cluster within the
	// span all clusters' monitors ran.
	N int
	// Worst is the largest sum, at WorstAt, made of WorstDetail's per-cluster values.
	Worst       int32
	WorstAt     time.Time
	WorstDetail string
	// Over counts the instants whose sum is above the limit; FirstOver describes the first.
	Over      int
	FirstOver string
}

func (s AcrossStats) String() string {
	out := fmt.Sprintf("%d instants summed, worst %d (%s at %s), %d over", s.N, s.Worst, s.WorstDetail, s.WorstAt.Format("15:04:05.000"), s.Over)
	if s.FirstOver != "" {
		out += "; first over: " + s.FirstOver
	}
	return out
}

// AcrossWindow is the window SumAcross needs for monitors sampling at hz: a sample stands for
// readings up to Monitor.stale old (3 periods + 100 ms: older, the monitor models the agent
// instead), so what an agent held at instant t can first show in a sample up to that long after t.
func AcrossWindow(hz float64) time.Duration {
	if hz <= 0 {
		hz = 25
	}
	return 3*time.Duration(float64(time.Second)/hz) + 100*time.Millisecond
}

// SumAcross bounds Σ permits held over several clusters' agents, each cluster sampled by its own
// monitor (Sample.SumPermits, samples in time order, KeepHistory), and counts the instants over
// limit. The monitors tick independently, so no two clusters are sampled at one instant; the sum
// at an instant t takes, for every cluster, the largest of: its last sample at or before t, its
// first at or after t (however far: a monitor that stalled on a busy machine is bridged by its
// neighbours, never skipped), and every sample in [t, t + window]. It is evaluated at every
// sample instant of every cluster within the span all monitors ran.
//
// It never under-counts what the samples show, whatever the monitors' phases: what a cluster's
// agents held at t is bounded by its samples bracketing t (the single-cluster monitor's own
// assumption: Σ between two samples is at most the larger; an excursion no reading sees is not
// counted), and a reading of t taken later shows in a sample at most window after t (window ≥
// AcrossWindow(hz), the readings' largest age). All monitors run in this process: one clock, no
// skew but their phases. It may over-count: a slice lowered in one cluster less than window
// before another cluster's raise counts in both.
func SumAcross(series map[string][]Sample, window time.Duration, limit int32) AcrossStats {
	names := make([]string, 0, len(series))
	for name := range series {
		names = append(names, name)
	}
	sort.Strings(names)
	var st AcrossStats
	var from, to time.Time
	for i, name := range names {
		s := series[name]
		if len(s) == 0 {
			return st // a cluster without samples: nothing can be summed
		}
		if i == 0 || s[0].At.After(from) {
			from = s[0].At
		}
		if i == 0 || s[len(s)-1].At.Before(to) {
			to = s[len(s)-1].At
		}
	}
	var instants []time.Time
	for _, name := range names {
		for _, s := range series[name] {
			if !s.At.Before(from) && !s.At.After(to) {
				instants = append(instants, s.At)
			}
		}
	}
	slices.SortFunc(instants, func(a, b time.Time) int { return a.Compare(b) })
	vals := make([]int32, len(names))
	for _, t := range instants {
		var sum int32
		for i, name := range names {
			s := series[name]
			first := func(ok func(time.Time) bool) int { return sort.Search(len(s), func(k int) bool { return ok(s[k].At) }) }
			above := first(func(at time.Time) bool { return !at.Before(t) })            // first at or after t
			hi := first(func(at time.Time) bool { return at.After(t.Add(window)) }) - 1 // last within the window
			// t lies within [from, to]: a sample at or after t exists, and so does one before it
			// (above − 1) unless s[above] is at t itself.
			v := s[above].SumPermits
			if above > 0 && s[above].At.After(t) {
				v = max(v, s[above-1].SumPermits)
			}
			for k := above + 1; k <= hi; k++ {
				v = max(v, s[k].SumPermits)
			}
			vals[i] = v
			sum += v
		}
		st.N++
		if sum > st.Worst || st.N == 1 {
			st.Worst, st.WorstAt, st.WorstDetail = sum, t, detailAcross(names, vals)
		}
		if sum > limit {
			st.Over++
			if st.FirstOver == "" {
				st.FirstOver = fmt.Sprintf("%s Σ=%d (%s)", t.Format("15:04:05.000"), sum, detailAcross(names, vals))
			}
		}
	}
	return st
}

func detailAcross(names []string, vals []int32) string {
	parts := make([]string, len(names))
	for i, n := range names {
		parts[i] = fmt.Sprintf("%s=%d", n, vals[i])
	}
	return strings.Join(parts, " ")
}
