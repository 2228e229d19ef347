package controller

import (
	"fmt"
	"testing"

	"github.com/apportion/apportion/internal/push"
)

// TestSummarizeHoldings: up to the limit every holding is listed; beyond it the telling ones
// (not synced, gone, counted above the grant) are kept first, listed by pod, and the rest counted.
func TestSummarizeHoldings(t *testing.T) {
	var hs []push.Holding
	for i := range 250 {
		h := push.Holding{Pod: fmt.Sprintf("p%03d", i), Target: "t", Granted: 4, Counted: 4, Synced: true}
		switch i {
		case 7:
			h.Synced = false
		case 120:
			h.Gone = true
		case 249:
			h.Counted = 6
		}
		hs = append(hs, h)
	}
	out, omitted := summarizeHoldings(hs[:MaxHoldingsInStatus], MaxHoldingsInStatus)
	if len(out) != MaxHoldingsInStatus || omitted != 0 {
		t.Fatalf("at the limit: %d listed, %d omitted; want all %d, 0", len(out), omitted, MaxHoldingsInStatus)
	}
	out, omitted = summarizeHoldings(hs, MaxHoldingsInStatus)
	if len(out) != MaxHoldingsInStatus || omitted != 150 {
		t.Fatalf("beyond the limit: %d listed, %d omitted; want %d, 150", len(out), omitted, MaxHoldingsInStatus)
	}
	listed := map[string]bool{}
	for i, h := range out {
		listed[h.Pod] = true
		if i > 0 && out[i-1].Pod >= h.Pod {
			t.Fatalf("not sorted by pod: %s before %s", out[i-1].Pod, h.Pod)
		}
	}
	for _, p := range []string{"p007", "p120", "p249"} {
		if !listed[p] {
			t.Errorf("%s (not synced, gone or counted above its grant) left out", p)
		}
	}
	if !listed["p000"] || listed["p199"] {
		t.Errorf("the rest should be the first by name: p000 listed %v, p199 listed %v", listed["p000"], listed["p199"])
	}
}
