package hub

import (
	"testing"
	"time"
)

var t0 = time.Unix(1_800_000_000, 0)

func mustLedger(t *testing.T, opts Options) *Ledger {
	t.Helper()
	l, err := NewLedger(opts)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func plan(t *testing.T, l *Ledger, now time.Time, global int64, targets ...Target) map[string]Change {
	t.Helper()
	ch, err := l.Plan(now, global, targets)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]Change{}
	for _, c := range ch {
		out[c.Cluster] = c
	}
	return out
}

// A slice moves from a to b only as a lowering of a, and b gets the room only once a
// acknowledged, or once the lowering was published and its bound passed.
func TestMoveLowersBeforeRaising(t *testing.T) {
	opts := Options{LeaseDuration: 10 * time.Second, ClockMargin: time.Second}
	for _, ack := range []bool{true, false} {
		l := mustLedger(t, opts)
		l.SetDrain("a", 5*time.Second)
		l.SetDrain("b", 5*time.Second)
		c := plan(t, l, t0, 20, Target{Cluster: "a", Want: 15}, Target{Cluster: "b", Want: 5})
		if c["a"].Grant.Slice != 15 || c["b"].Grant.Slice != 5 {
			t.Fatalf("first plan: %+v", c)
		}
		c = plan(t, l, t0, 20, Target{Cluster: "a", Want: 5}, Target{Cluster: "b", Want: 15})
		if c["a"].Grant.Slice != 5 || c["a"].Raise {
			t.Fatalf("a not lowered to 5: %+v", c)
		}
		if _, raised := c["b"]; raised {
			t.Fatalf("b raised while a may still hold 15: %+v", c)
		}
		if got := l.Counted("a", t0); got != 15 {
			t.Fatalf("a counted %d before it acknowledged, want 15", got)
		}
		// Unpublished, the lowering has no bound however long it waits.
		if got := l.Counted("a", t0.Add(time.Hour)); got != 15 {
			t.Fatalf("a counted %d an hour later without a publish, want 15", got)
		}
		pub := t0.Add(time.Second)
		l.Published("a", c["a"].Grant.Seq, pub)
		now := pub.Add(10*time.Second + time.Second + 5*time.Second - time.Millisecond)
		if ack {
			l.Acknowledged("a", c["a"].Grant.Seq)
		}
		c = plan(t, l, now, 20, Target{Cluster: "a", Want: 5}, Target{Cluster: "b", Want: 15})
		if got := c["b"].Grant.Slice; ack != (got == 15) {
			t.Fatalf("ack %v: b raised to %d just before the bound", ack, got)
		}
		c = plan(t, l, now.Add(time.Millisecond), 20, Target{Cluster: "a", Want: 5}, Target{Cluster: "b", Want: 15})
		if got := l.Current("b").Slice; got != 15 {
			t.Fatalf("ack %v: b at %d after the bound, want 15 (%+v)", ack, got, c)
		}
		if s := l.Sum(now.Add(time.Millisecond)); s > 20 {
			t.Fatalf("Σ counted %d > 20", s)
		}
	}
}

// A raise that the room does not cover is partial, and a member holding nothing goes first.
func TestRaiseOnlyFromRoom(t *testing.T) {
	l := mustLedger(t, Options{LeaseDuration: time.Second})
	for _, n := range []string{"a", "b", "c"} {
		l.SetDrain(n, time.Second)
	}
	plan(t, l, t0, 10, Target{Cluster: "a", Want: 8}, Target{Cluster: "b"}, Target{Cluster: "c"})
	c := plan(t, l, t0, 10, Target{Cluster: "a", Want: 8}, Target{Cluster: "b", Want: 5}, Target{Cluster: "c", Want: 5})
	// a is not listed as lowered: 2 of room left for b and c, both at 0, by name.
	if c["b"].Grant.Slice != 2 || c["c"].Grant.Slice != 0 || l.Sum(t0) != 10 {
		t.Fatalf("raises: %+v, Σ %d", c, l.Sum(t0))
	}
}

// A member that never reported its drain bound is granted nothing.
func TestNothingWithoutDrain(t *testing.T) {
	l := mustLedger(t, Options{LeaseDuration: time.Second})
	if c := plan(t, l, t0, 10, Target{Cluster: "a", Reserved: 3, Want: 8}); len(c) != 0 {
		t.Fatalf("granted without a drain bound: %+v", c)
	}
	l.SetDrain("a", time.Second)
	if c := plan(t, l, t0, 10, Target{Cluster: "a", Reserved: 3, Want: 8}); c["a"].Grant != (Grant{Seq: 1, Slice: 8, Reserved: 3}) {
		t.Fatalf("after the drain bound: %+v", c)
	}
}

// A lowered reserved slice takes two grants: the slice stays at the old reserved slice until
// the member acknowledged the grant with the new one (its pods' safe defaults were split from
// the old one).
func TestReservedLoweredInTwoSteps(t *testing.T) {
	l := mustLedger(t, Options{LeaseDuration: time.Second})
	l.SetDrain("a", time.Second)
	plan(t, l, t0, 10, Target{Cluster: "a", Reserved: 6, Want: 6})
	c := plan(t, l, t0, 10, Target{Cluster: "a", Reserved: 1, Want: 1})
	if g := c["a"].Grant; g.Slice != 6 || g.Reserved != 1 {
		t.Fatalf("first step: %+v", g)
	}
	if c := plan(t, l, t0, 10, Target{Cluster: "a", Reserved: 1, Want: 1}); len(c) != 0 {
		t.Fatalf("lowered below the old reserved slice before the acknowledgement: %+v", c)
	}
	l.Acknowledged("a", 2)
	if c := plan(t, l, t0, 10, Target{Cluster: "a", Reserved: 1, Want: 1}); c["a"].Grant != (Grant{Seq: 3, Slice: 1, Reserved: 1}) {
		t.Fatalf("second step: %+v", c)
	}
}

// A restored ledger counts the former grant in full until it sees a newer one published,
// whatever the time; an acknowledgement of an unknown grant retires nothing.
func TestRestoreForgetsBounds(t *testing.T) {
	opts := Options{LeaseDuration: time.Second}
	l, err := Restore(opts, Allocation{Members: []MemberSlice{{Cluster: "a", Grant: Grant{Seq: 4, Slice: 2}, Former: 9, Drain: time.Second}}})
	if err != nil {
		t.Fatal(err)
	}
	if got := l.Counted("a", t0.Add(24*time.Hour)); got != 9 {
		t.Fatalf("counted %d, want 9", got)
	}
	l.Acknowledged("a", 5)
	if got := l.Counted("a", t0); got != 9 {
		t.Fatalf("an acknowledgement of seq 5 > 4 retired something: counted %d", got)
	}
	l.Published("a", 4, t0)
	if got := l.Counted("a", t0.Add(2*time.Second-1)); got != 9 {
		t.Fatalf("counted %d before the bound, want 9", got)
	}
	if got := l.Counted("a", t0.Add(2*time.Second)); got != 2 {
		t.Fatalf("counted %d after the bound, want 2", got)
	}
	if a := l.Allocation(); a.Members[0].Former != 9 {
		t.Fatalf("allocation dropped the former grant before an acknowledgement: %+v", a)
	}
	l.Acknowledged("a", 4)
	if a := l.Allocation(); a.Members[0].Former != 0 {
		t.Fatalf("allocation kept a retired grant: %+v", a)
	}
	if _, err := Restore(opts, Allocation{Members: []MemberSlice{{Cluster: "a"}, {Cluster: "a"}}}); err == nil {
		t.Fatal("a cluster named twice was restored")
	}
}

// The lease: the newest grant for LeaseDuration from the start of its read, then its fallback;
// no older grant is taken; an acknowledgement needs the ledger under the slice and a record.
func TestLease(t *testing.T) {
	l := NewLease(nil)
	if lim, held := l.Limit(t0); lim != 0 || held {
		t.Fatalf("before any read: %d %v", lim, held)
	}
	g := Grant{Seq: 3, Slice: 8, Reserved: 2}
	if ok, err := l.Read(g, 10*time.Second, t0); !ok || err != nil {
		t.Fatalf("read: %v %v", ok, err)
	}
	if lim, held := l.Limit(t0.Add(10*time.Second - 1)); lim != 8 || !held {
		t.Fatalf("in the lease: %d %v", lim, held)
	}
	if lim, held := l.Limit(t0.Add(10 * time.Second)); lim != 2 || held {
		t.Fatalf("after the lease: %d %v", lim, held)
	}
	if ok, _ := l.Read(Grant{Seq: 2, Slice: 20}, 10*time.Second, t0.Add(time.Minute)); ok {
		t.Fatal("an older grant was taken")
	}
	if lim, _ := l.Limit(t0.Add(time.Minute)); lim != 2 {
		t.Fatalf("an older grant's read renewed the lease: %d", lim)
	}
	if _, err := l.Read(Grant{Seq: 3, Slice: 9}, 10*time.Second, t0); err == nil {
		t.Fatal("two grants with one sequence number were accepted")
	}
	if _, ok := l.Acknowledge(9, 3); ok {
		t.Fatal("acknowledged with the ledger above the slice")
	}
	if _, ok := l.Acknowledge(8, 2); ok {
		t.Fatal("acknowledged before the grant was recorded")
	}
	if seq, ok := l.Acknowledge(8, 3); !ok || seq != 3 {
		t.Fatalf("acknowledge: %d %v", seq, ok)
	}
	r := NewLease(&g)
	if lim, held := r.Limit(t0); lim != 2 || held {
		t.Fatalf("restarted from the record: %d %v, want its fallback", lim, held)
	}
}

// The hub's bound for a lowered grant comes, in true time, no earlier than the member's use of
// it can end when the member's clock runs slow and the hub's fast, with MinClockMargin; with a
// margin a little smaller it can come earlier.
func TestMinClockMargin(t *testing.T) {
	const rho = 0.01
	lease, drain, late := 10*time.Second, 5*time.Second, 100*time.Millisecond
	trueAfter := func(clockInterval time.Duration, rate float64) float64 { return float64(clockInterval) / (1 + rate) }
	memberDone := trueAfter(lease+drain, -rho) + float64(late)
	for _, tc := range []struct {
		margin time.Duration
		safe   bool
	}{
		{MinClockMargin(lease, drain, rho, late), true},
		{MinClockMargin(lease, drain, rho, late) - 5*time.Millisecond, false},
		{late, false}, // the lateness alone: the drift is not covered
	} {
		l := mustLedger(t, Options{LeaseDuration: lease, ClockMargin: tc.margin})
		l.SetDrain("a", drain)
		plan(t, l, t0, 10, Target{Cluster: "a", Want: 8})
		c := plan(t, l, t0, 10, Target{Cluster: "a", Want: 2})
		l.Published("a", c["a"].Grant.Seq, t0) // the hub's clock reads t0 at the publish
		hubBound := l.NextBound(t0)
		hubDone := trueAfter(hubBound.Sub(t0), rho)
		if safe := hubDone >= memberDone; safe != tc.safe {
			t.Errorf("margin %v: hub regrants %.3fs after the publish, the member is done %.3fs after it: safe %v, want %v",
				tc.margin, hubDone/1e9, memberDone/1e9, safe, tc.safe)
		}
	}
}
