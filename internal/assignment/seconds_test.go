package assignment

import "testing"

// The busiest second is summed across agents, per second, over the seconds every agent that
// reported within the window has reported; an agent silent for longer holds nothing back.
func TestBusiestSecond(t *testing.T) {
	const now = 1000
	a := SecondCounts{End: 1000, Counts: []int32{1, 9, 2}} // seconds 997, 998, 999
	b := SecondCounts{End: 999, Counts: []int32{5, 1}}     // 997, 998: 999 not reported yet
	old := SecondCounts{End: 900, Counts: []int32{100}}    // before the window
	sec, calls, ok := BusiestSecond([]SecondCounts{a, b, old}, now, 60)
	if !ok || sec != 998 || calls != 10 {
		t.Fatalf("busiest = %d, %d, %v; want second 998 with 9+1 calls", sec, calls, ok)
	}
	// 999 is a's busiest alone, but b has not reported it: not considered until it has.
	a.Counts = []int32{1, 1, 50}
	if sec, calls, _ = BusiestSecond([]SecondCounts{a, b}, now, 60); sec != 997 || calls != 6 {
		t.Fatalf("busiest = %d, %d; want 997 with 6 (999 incomplete)", sec, calls)
	}
	b = SecondCounts{End: 1000, Counts: []int32{5, 1, 0}}
	if sec, calls, _ = BusiestSecond([]SecondCounts{a, b}, now, 60); sec != 999 || calls != 50 {
		t.Fatalf("busiest = %d, %d; want 999 with 50 once both reported it", sec, calls)
	}
	if _, _, ok = BusiestSecond(nil, now, 60); !ok {
		t.Fatal("no agent: every second of the window is complete (and empty)")
	}
}
