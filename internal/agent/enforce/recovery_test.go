package enforce

import (
	"testing"
	"time"

	"github.com/apportion/apportion/internal/agent/breaker"
	"github.com/apportion/apportion/internal/assignment"
)

func withRamp(d assignment.Downstream) assignment.Downstream {
	d.Recovery = &assignment.Recovery{Window: assignment.Duration(time.Second),
		Ramp: &assignment.Ramp{Shape: assignment.ShapeLinear, InitialPercent: 10, StepPercent: 30, HealthyWindows: 1}}
	d.Breaker = &assignment.Breaker{Window: assignment.Duration(10 * time.Second), FailureRatePercent: 50,
		SlowCallThreshold: assignment.Duration(time.Second), SlowCallRatePercent: 100, MinimumCalls: 4,
		OpenDuration: assignment.Duration(5 * time.Second), HalfOpenProbes: 1}
	return d
}

// healthyWindow finishes n quick calls and lets the window end.
func healthyWindow(e *Enforcer, clk interface{ Step(time.Duration) }, name string, n int) {
	d := e.Table().Lookup(name)
	for range n {
		d.Observe(time.Millisecond, false)
	}
	clk.Step(time.Second)
	d.Tick()
}

// withAdaptive adds adaptive concurrency to d's recovery (d has one from withRamp).
func withAdaptive(d assignment.Downstream) assignment.Downstream {
	r := *d.Recovery
	r.Adaptive = &assignment.Adaptive{TolerancePercent: 150, BaselineWindows: 60, MinLimit: 1}
	d.Recovery = &r
	return d
}

// tripAndClose opens d's breaker with failing calls and closes it with a successful probe.
func tripAndClose(t *testing.T, d *Downstream, clk interface {
	Now() time.Time
	Step(time.Duration)
}) {
	t.Helper()
	b := d.Breaker()
	for range 4 {
		tk, _, ok := b.Allow(clk.Now())
		if !ok {
			t.Fatal("closed breaker refused")
		}
		tk.Done(clk.Now(), true, time.Millisecond)
	}
	if b.State(clk.Now()) != breaker.Open {
		t.Fatal("breaker did not open")
	}
	clk.Step(5 * time.Second)
	tk, _, ok := b.Allow(clk.Now())
	if !ok {
		t.Fatal("half-open breaker refused the probe")
	}
	tk.Done(clk.Now(), false, time.Millisecond)
	if b.State(clk.Now()) != breaker.Closed {
		t.Fatal("breaker did not close")
	}
}

// settle runs healthy windows until name's ramp (if any) is over: a no-op now that first
// permits apply at once, kept so that the tests below fail for their own reason on an agent that
// ramps first permits.
func settle(t *testing.T, e *Enforcer, clk interface{ Step(time.Duration) }, name string) {
	t.Helper()
	for range 20 {
		if !ramping(t, e, name) {
			return
		}
		healthyWindow(e, clk, name, 10)
	}
	t.Fatalf("%s: still ramping after 20 healthy windows", name)
}

func ramping(t *testing.T, e *Enforcer, name string) bool {
	t.Helper()
	st, ok := e.Table().Lookup(name).Recovery()
	if !ok {
		t.Fatalf("%s: no recovery configured", name)
	}
	return st.Ramping
}

// TestFirstPermitsAtOnce: a pod's first permits are not the downstream recovering: with the ramp
// and adaptive concurrency configured they apply at once — from nothing, from a fail-closed
// bootstrap, for a downstream added later, and from 0 permits — and so does a raise.
func TestFirstPermitsAtOnce(t *testing.T) {
	e, _ := newTestEnforcer(t)
	mustApply(t, e, asg(1, 1, 10*time.Minute, withRamp(ds("a", 20, 5)), withAdaptive(withRamp(ds("b", 20, 5)))))
	for _, name := range []string{"a", "b"} {
		if got := effective(t, e, name); got != 20 || ramping(t, e, name) {
			t.Fatalf("%s, first permits: %d (ramping %v), want the permits 20 at once", name, got, ramping(t, e, name))
		}
	}
	// A downstream added by a later assignment, one at 0 permits (more pods than the budget),
	// then its first permits, and a raise: all at once.
	mustApply(t, e, asg(1, 2, 10*time.Minute, withRamp(ds("a", 20, 5)), withRamp(ds("c", 0, 0))))
	if got := effective(t, e, "c"); got != 0 {
		t.Fatalf("c at 0 permits: %d", got)
	}
	mustApply(t, e, asg(1, 3, 10*time.Minute, withRamp(ds("a", 30, 5)), withRamp(ds("c", 12, 0))))
	if got := effective(t, e, "c"); got != 12 || ramping(t, e, "c") {
		t.Fatalf("c, first permits after 0: %d (ramping %v), want 12 at once", got, ramping(t, e, "c"))
	}
	if got := effective(t, e, "a"); got != 30 {
		t.Fatalf("a raised to 30: %d, want 30 at once", got)
	}

	// A fresh agent bootstrapped fail-closed (base 0), then the manager's first push.
	e2, _ := newTestEnforcer(t)
	boot := withRamp(ds("a", 20, 0))
	boot.FailClosed = true
	if err := e2.ApplyBootstrap(asg(0, 0, time.Minute, boot)); err != nil {
		t.Fatal(err)
	}
	if got := effective(t, e2, "a"); got != 0 {
		t.Fatalf("fail-closed bootstrap: %d, want 0", got)
	}
	mustApply(t, e2, asg(1, 1, 10*time.Minute, withRamp(ds("a", 20, 5))))
	if got := effective(t, e2, "a"); got != 20 || ramping(t, e2, "a") {
		t.Fatalf("first push after a fail-closed bootstrap: %d (ramping %v), want 20 at once", got, ramping(t, e2, "a"))
	}
}

// TestRampAfterBreakerCloses: the breaker's close (its probes succeeded) starts a ramp.
func TestRampAfterBreakerCloses(t *testing.T) {
	e, clk := newTestEnforcer(t)
	mustApply(t, e, asg(1, 1, 10*time.Minute, withRamp(ds("a", 10, 5))))
	if got := effective(t, e, "a"); got != 10 {
		t.Fatalf("first permits: %d, want 10 at once", got)
	}
	d := e.Table().Lookup("a")
	tripAndClose(t, d, clk)
	if got := effective(t, e, "a"); got != 1 || !ramping(t, e, "a") {
		t.Fatalf("after the breaker closed: %d (ramping %v), want the ramp's start 1", got, ramping(t, e, "a"))
	}
	// A failing window lowers nothing below the start and widens nothing.
	for range 10 {
		d.Observe(time.Millisecond, true)
	}
	clk.Step(time.Second)
	d.Tick()
	if got := effective(t, e, "a"); got != 1 {
		t.Fatalf("after a failing window: %d, want 1", got)
	}
	// Healthy windows widen it (+30 % of 10 each) back to the permits; a raise meanwhile widens
	// only as the ramp does.
	healthyWindow(e, clk, "a", 10)
	if got := effective(t, e, "a"); got != 4 {
		t.Fatalf("after a healthy window: %d, want 4", got)
	}
	mustApply(t, e, asg(1, 2, 10*time.Minute, withRamp(ds("a", 20, 5))))
	if got := effective(t, e, "a"); got != 4 {
		t.Fatalf("a raise during the ramp: %d, want 4 (held by the ramp)", got)
	}
	for _, want := range []int{10, 16, 20} {
		healthyWindow(e, clk, "a", 10)
		if got := effective(t, e, "a"); got != want {
			t.Fatalf("after a healthy window: %d, want %d", got, want)
		}
	}
}

// TestLeaseRestoredAtOnce: permits come back from the safe default at once — by a renewal or a
// newer assignment, with the adaptive limit on too (the lapse does not clamp it) — because a
// lapsed lease is the control plane's failure, not the downstream's.
func TestLeaseRestoredAtOnce(t *testing.T) {
	e, clk := newTestEnforcer(t)
	a := asg(1, 1, time.Minute, withRamp(ds("a", 20, 4)), withAdaptive(withRamp(ds("b", 20, 4))))
	mustApply(t, e, a)
	lapse := func(what string) {
		t.Helper()
		settle(t, e, clk, "a")
		settle(t, e, clk, "b")
		healthyWindow(e, clk, "b", 10)
		clk.Step(time.Minute)
		for _, name := range []string{"a", "b"} {
			if got := effective(t, e, name); got != 4 {
				t.Fatalf("%s: %s: lease passed: %d, want the safe default 4", what, name, got)
			}
			e.Table().Lookup(name).Observe(time.Millisecond, false) // calls at the safe limit
		}
		clk.Step(time.Second)
	}
	restored := func(what string) {
		t.Helper()
		for _, name := range []string{"a", "b"} {
			if got := effective(t, e, name); got != 20 || ramping(t, e, name) {
				t.Fatalf("%s: %s: %d (ramping %v), want the permits 20 at once", what, name, got, ramping(t, e, name))
			}
		}
		if st := e.State().Downstreams[0]; st.EffectivePermits != 20 || st.Limit != 20 {
			t.Fatalf("%s: state %+v", what, st)
		}
	}
	lapse("renewal")
	mustApply(t, e, a) // the renewal
	restored("renewal")
	lapse("newer assignment")
	mustApply(t, e, asg(1, 2, time.Minute, withRamp(ds("a", 20, 4)), withAdaptive(withRamp(ds("b", 20, 4)))))
	restored("newer assignment")
}

// TestRampInProgressOutlivesALapse: a ramp after an incident is about the downstream; a lapse of
// the lease meanwhile neither ends it nor restarts it, and the renewal returns to where it was.
func TestRampInProgressOutlivesALapse(t *testing.T) {
	e, clk := newTestEnforcer(t)
	a := asg(1, 1, time.Minute, withRamp(ds("a", 20, 4)))
	mustApply(t, e, a)
	settle(t, e, clk, "a")
	mustApply(t, e, a) // a renewal: a minute from now
	d := e.Table().Lookup("a")
	tripAndClose(t, d, clk) // 5 s of the lease
	healthyWindow(e, clk, "a", 10)
	if got := effective(t, e, "a"); got != 8 {
		t.Fatalf("ramp after the breaker closed, one healthy window: %d, want 2+6", got)
	}
	clk.Step(54 * time.Second)
	if got := effective(t, e, "a"); got != 4 {
		t.Fatalf("lease passed: %d, want the safe default 4", got)
	}
	mustApply(t, e, a)
	if got := effective(t, e, "a"); got != 8 || !ramping(t, e, "a") {
		t.Fatalf("renewed during the ramp: %d (ramping %v), want the ramp's 8, still ramping", got, ramping(t, e, "a"))
	}
}

// TestRampAfterAdaptiveDrop: when the adaptive limit drops (the latency rose), the climb back is
// a ramp from the dropped limit, paced by healthy windows, not only the adaptive growth.
func TestRampAfterAdaptiveDrop(t *testing.T) {
	e, clk := newTestEnforcer(t)
	d := withAdaptive(withRamp(ds("a", 20, 4)))
	d.Recovery.Ramp.StepPercent, d.Recovery.Ramp.HealthyWindows = 10, 2
	mustApply(t, e, asg(1, 1, 10*time.Minute, d))
	dd := e.Table().Lookup("a")
	window := func(n int, took time.Duration) int {
		for range n {
			dd.Observe(took, false)
		}
		clk.Step(time.Second)
		dd.Tick()
		return effective(t, e, "a")
	}
	if got := window(100, 10*time.Millisecond); got != 20 {
		t.Fatalf("baseline window: %d, want 20", got)
	}
	// 20 calls at 100 ms, 10x the baseline: the adaptive limit halves to 10.
	if got := window(20, 100*time.Millisecond); got != 10 || !ramping(t, e, "a") {
		t.Fatalf("latency 10x: %d (ramping %v), want 10 and a ramp from it", got, ramping(t, e, "a"))
	}
	// Back to 10 ms, 10 in flight: the adaptive limit grows by ⌊√limit⌋ a window (13, 16, 20),
	// the ramp by 10 % of 20 after 2 healthy windows (10, 12, 12, 14): the ramp paces the climb.
	for i, want := range []int{10, 12, 12, 14} {
		if got := window(1000, 10*time.Millisecond); got != want {
			t.Fatalf("healthy window %d after the drop: %d, want %d", i+1, got, want)
		}
	}
}

// TestMaxWaitingFromTheWire: the bound on waiters reaches the semaphore.
func TestMaxWaitingFromTheWire(t *testing.T) {
	e, _ := newTestEnforcer(t)
	d := ds("a", 4, 2)
	three := int32(3)
	d.MaxWaiting = &three
	mustApply(t, e, asg(1, 1, 10*time.Minute, d))
	if got := e.Table().Lookup("a").Sem.MaxWaiting(); got != 3 {
		t.Fatalf("max waiting %d, want 3", got)
	}
}

// TestMaxWaitingDefault: without a bound on the wire, ten calls per permit may wait, and the
// bound follows the permits from one assignment to the next; a pod with no permits still
// queues ten (a call then waits for the permits its lease brings, or its acquireTimeout).
func TestMaxWaitingDefault(t *testing.T) {
	e, _ := newTestEnforcer(t)
	for i, permits := range []int32{5, 3, 0, 4} {
		mustApply(t, e, asg(int64(i+1), 1, 10*time.Minute, ds("a", permits, 0)))
		want := 10 * max(int(permits), 1)
		if got := e.Table().Lookup("a").Sem.MaxWaiting(); got != want {
			t.Fatalf("%d permits: max waiting %d, want %d", permits, got, want)
		}
	}
	if got := DefaultMaxWaiting(5); got != 50 {
		t.Fatalf("DefaultMaxWaiting(5) = %d", got)
	}
}

// flagged is d with RampRaise: its raise follows an incident the manager saw.
func flagged(d assignment.Downstream) assignment.Downstream {
	d.RampRaise = true
	return d
}

// TestFlaggedRaiseRamps: a raise the manager flags as following an incident (RampRaise) climbs
// through the ramp from the permits held before; the same raise unflagged, a flagged lowering, a
// flagged downstream new to the agent (a new pod's first permits), a flagged raise without a
// ramp configured and a renewal all apply at once.
func TestFlaggedRaiseRamps(t *testing.T) {
	e, clk := newTestEnforcer(t)
	// The incident: the quota was lowered; every downstream holds 8.
	mustApply(t, e, asg(1, 1, 10*time.Minute, withRamp(ds("a", 8, 4)), withRamp(ds("b", 8, 4)),
		withRamp(ds("c", 8, 4)), ds("d", 8, 4)))
	// Raised back to 20: a flagged, b not, c flagged but lowered, d flagged without a ramp, and
	// e new to the agent, flagged.
	mustApply(t, e, asg(1, 2, 10*time.Minute, flagged(withRamp(ds("a", 20, 4))), withRamp(ds("b", 20, 4)),
		flagged(withRamp(ds("c", 5, 4))), flagged(ds("d", 20, 4)), flagged(withRamp(ds("e", 20, 4)))))
	if got := effective(t, e, "a"); got != 8 || !ramping(t, e, "a") {
		t.Fatalf("a, flagged raise 8 → 20: %d (ramping %v), want a ramp from the 8 held before", got, ramping(t, e, "a"))
	}
	for name, want := range map[string]int{"b": 20, "c": 5, "e": 20} {
		if got := effective(t, e, name); got != want || ramping(t, e, name) {
			t.Fatalf("%s: %d (ramping %v), want %d at once", name, got, ramping(t, e, name), want)
		}
	}
	if got := effective(t, e, "d"); got != 20 {
		t.Fatalf("d, flagged raise without a ramp: %d, want 20 at once", got)
	}
	if st := e.State().Downstreams[0]; st.EffectivePermits != 20 || st.Limit != 8 {
		t.Fatalf("a's state %+v: the manager counts the permits 20, the agent admits 8", st)
	}
	// A renewal (the same pair) changes nothing; healthy windows widen a by 30 % of 20 each.
	if _, err := e.Apply(asg(1, 2, 10*time.Minute, flagged(withRamp(ds("a", 20, 4))), withRamp(ds("b", 20, 4)),
		flagged(withRamp(ds("c", 5, 4))), flagged(ds("d", 20, 4)), flagged(withRamp(ds("e", 20, 4)))), time.Time{}); err != nil {
		t.Fatal(err)
	}
	if got := effective(t, e, "a"); got != 8 {
		t.Fatalf("a after a renewal: %d, want 8", got)
	}
	for _, want := range []int{14, 20} {
		healthyWindow(e, clk, "a", 10)
		if got := effective(t, e, "a"); got != want {
			t.Fatalf("a after a healthy window: %d, want %d", got, want)
		}
	}
	if ramping(t, e, "a") {
		t.Fatal("a still ramping at its permits")
	}
	// From 0 (the incident took every permit), the climb starts at the ramp's start, 10 % of 20.
	mustApply(t, e, asg(1, 3, 10*time.Minute, flagged(withRamp(ds("a", 0, 0)))))
	mustApply(t, e, asg(1, 4, 10*time.Minute, flagged(withRamp(ds("a", 20, 4)))))
	if got := effective(t, e, "a"); got != 2 || !ramping(t, e, "a") {
		t.Fatalf("a, flagged raise 0 → 20: %d (ramping %v), want the ramp's start 2", got, ramping(t, e, "a"))
	}
}
