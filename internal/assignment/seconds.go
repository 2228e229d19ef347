package assignment

// This file sums the per-second call counts agents report (DownstreamState.SecondsEnd and
// Seconds) into a quota's busiest second. Pure: the time is an input.

// SecondCounts is one agent's per-second counts for one downstream, as its State reports them:
// Counts[i] is the calls addressed to the downstream in the Unix second End − len(Counts) + i.
type SecondCounts struct {
	End    int64
	Counts []int32
}

// count is the calls s counted in second sec; ok false when s does not cover it.
func (s SecondCounts) count(sec int64) (n int64, ok bool) {
	i := sec - (s.End - int64(len(s.Counts)))
	if i < 0 || i >= int64(len(s.Counts)) {
		return 0, false
	}
	return int64(max(s.Counts[i], 0)), true
}

// BusiestSecond is the busiest whole second of the window seconds before now's second, summed
// over the agents' counts: its start (Unix seconds) and its calls; ok false when no second
// qualifies.
//
// Exactness: a second is considered only once every agent that reported within the window has
// reported it complete (an agent reports only seconds before the one it answers in), so a
// considered second's sum is the exact count of the calls the agents received in it. An agent
// whose last report is older than the window covers none of it and holds nothing back. The
// seconds are the agents' wall clocks': between agents they agree to within their clocks' skew,
// which a call near a second's edge may fall on either side of.
func BusiestSecond(agents []SecondCounts, now int64, window int64) (sec, calls int64, ok bool) {
	from := now - window
	to := now // the seconds considered: [from, to)
	for _, a := range agents {
		if len(a.Counts) == 0 || a.End <= from {
			continue // nothing reported within the window
		}
		to = min(to, a.End)
	}
	for s := from; s < to; s++ {
		var sum int64
		for _, a := range agents {
			if n, covered := a.count(s); covered {
				sum += n
			}
		}
		if !ok || sum > calls {
			sec, calls, ok = s, sum, true
		}
	}
	return sec, calls, ok
}
