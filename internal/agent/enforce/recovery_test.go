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

// TestRampOnFirstPermits: a downstream's first permits come in a ramp, widened only by healthy
// windows, up to the permits and never above.
func TestRampOnFirstPermits(t *testing.T) {
	e, clk := newTestEnforcer(t)
	mustApply(t, e, asg(1, 1, 10*time.Minute, withRamp(ds("a", 20, 5)), ds("plain", 20, 5)))
	if got := effective(t, e, "plain"); got != 20 {
		t.Fatalf("no recovery configured: %d, want 20 at once", got)
	}
	if got := effective(t, e, "a"); got != 2 {
		t.Fatalf("first permits: %d, want the ramp's start 2", got)
	}
	clk.Step(5 * time.Second)
	e.Table().Lookup("a").Tick()
	if got := effective(t, e, "a"); got != 2 {
		t.Fatalf("windows without calls: %d, want 2 held", got)
	}
	for _, want := range []int{8, 14, 20, 20} {
		healthyWindow(e, clk, "a", 10)
		if got := effective(t, e, "a"); got != want {
			t.Fatalf("after a healthy window: %d, want %d", got, want)
		}
	}
	st := e.State().Downstreams[0]
	if st.Permits != 20 || st.EffectivePermits != 20 {
		t.Fatalf("state %+v", st)
	}
	// A higher grant later is not a first grant: it applies at once.
	mustApply(t, e, asg(1, 2, 10*time.Minute, withRamp(ds("a", 30, 5)), ds("plain", 20, 5)))
	if got := effective(t, e, "a"); got != 30 {
		t.Fatalf("raised grant: %d, want 30", got)
	}
}

// TestRampAfterBreakerCloses: the breaker's close (its probes succeeded) starts a ramp.
func TestRampAfterBreakerCloses(t *testing.T) {
	e, clk := newTestEnforcer(t)
	mustApply(t, e, asg(1, 1, 10*time.Minute, withRamp(ds("a", 10, 5))))
	for range 4 {
		healthyWindow(e, clk, "a", 10)
	}
	if got := effective(t, e, "a"); got != 10 {
		t.Fatalf("ramped: %d, want 10", got)
	}
	d := e.Table().Lookup("a")
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
	if got := effective(t, e, "a"); got != 1 {
		t.Fatalf("after the breaker closed: %d, want the ramp's start 1", got)
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
}

// TestRampAfterLeaseRenewed: permits come back from the safe default in a ramp.
func TestRampAfterLeaseRenewed(t *testing.T) {
	e, clk := newTestEnforcer(t)
	a := asg(1, 1, 10*time.Second, withRamp(ds("a", 20, 4)))
	mustApply(t, e, a)
	for range 4 {
		healthyWindow(e, clk, "a", 10)
	}
	if got := effective(t, e, "a"); got != 20 {
		t.Fatalf("ramped: %d, want 20", got)
	}
	clk.Step(10 * time.Second)
	if got := effective(t, e, "a"); got != 4 {
		t.Fatalf("lease passed: %d, want the safe default 4", got)
	}
	mustApply(t, e, a) // the renewal
	if got := effective(t, e, "a"); got != 2 {
		t.Fatalf("renewed: %d, want the ramp's start 2 (not the permits at once)", got)
	}
	// Lapsed again, then a newer assignment (not a renewal) ends it: a ramp too.
	for range 4 {
		healthyWindow(e, clk, "a", 10)
	}
	clk.Step(10 * time.Second)
	if got := effective(t, e, "a"); got != 4 {
		t.Fatalf("lease passed: %d, want the safe default 4", got)
	}
	mustApply(t, e, asg(1, 2, 10*time.Second, withRamp(ds("a", 20, 4))))
	if got := effective(t, e, "a"); got != 2 {
		t.Fatalf("a newer assignment after the lease lapsed: %d, want the ramp's start 2", got)
	}
	if st := e.State().Downstreams[0]; st.EffectivePermits != 20 || st.Limit != 2 {
		t.Fatalf("state %+v: want effectivePermits 20 (what the manager counts), limit 2", st)
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
