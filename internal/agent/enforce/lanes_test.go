package enforce

import (
	"net/http"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/assignment"
)

func laned(name string, permits int32, l ...assignment.Lane) assignment.Downstream {
	d := ds(name, permits, 2)
	d.Lanes = l
	return d
}

var coreLane = assignment.Lane{Name: "core", ReservePercent: 50, LendPercent: 50, Methods: []string{"POST"},
	Headers: []assignment.HeaderMatch{{Name: "x-lane", Value: "core"}}, PathPrefixes: []string{"/orders"}}

// The lanes follow the effective limit (assignments, lease expiry), are kept across assignments
// that leave them unchanged, replaced when they change, and dropped when removed.
func TestLanesFollowTheLimit(t *testing.T) {
	e, clk := newTestEnforcer(t)
	mustApply(t, e, asg(1, 1, time.Second, laned("a", 10, coreLane)))
	d := e.Table().Lookup("a")
	ls := d.Lanes()
	if ls == nil {
		t.Fatal("no lanes")
	}
	if st := ls.Sem.Stats(); st.Limit != 10 || st.Lanes[0].Reserve != 5 {
		t.Fatalf("lanes %+v", st)
	}
	mustApply(t, e, asg(1, 2, time.Second, laned("a", 6, coreLane)))
	if d.Lanes() != ls {
		t.Fatal("unchanged lanes were replaced")
	}
	if st := ls.Sem.Stats(); st.Limit != 6 || st.Lanes[0].Reserve != 3 {
		t.Fatalf("lanes after lowering %+v", st)
	}
	clk.Step(2 * time.Second) // lease expires: min(6, safe 2)
	if got := effective(t, e, "a"); got != 2 || ls.Sem.Stats().Limit != 2 {
		t.Fatalf("after expiry: effective %d, lanes %d", got, ls.Sem.Stats().Limit)
	}
	other := coreLane
	other.ReservePercent = 20
	mustApply(t, e, asg(1, 3, time.Second, laned("a", 6, other)))
	if d.Lanes() == ls || d.Lanes().Sem.Stats().Lanes[0].Reserve != 2 {
		t.Fatalf("changed lanes: %+v", d.Lanes().Sem.Stats())
	}
	mustApply(t, e, asg(1, 4, time.Second, laned("a", 6)))
	if d.Lanes() != nil {
		t.Fatal("lanes kept after removal")
	}
}

func TestLaneMatch(t *testing.T) {
	ls := newLaneSet("a", []assignment.Lane{coreLane, {Name: "reads", Methods: []string{"GET"}}}, 10, metrics.New())
	h := http.Header{}
	h.Set("X-Lane", "core")
	for _, tc := range []struct {
		method, path string
		h            http.Header
		want         string
	}{
		{"POST", "/orders/7", h, "core"},
		{"POST", "/orders", http.Header{}, "default"}, // header missing
		{"PUT", "/orders", h, "default"},              // method
		{"POST", "/order", h, "default"},              // prefix
		{"GET", "/orders", h, "reads"},
		{"GET", "", nil, "reads"},
	} {
		if got := ls.Name(ls.Match(tc.method, tc.path, tc.h)); got != tc.want {
			t.Errorf("Match(%s %s %v) = %s, want %s", tc.method, tc.path, tc.h, got, tc.want)
		}
	}
}
