package recovery

import (
	"math/rand/v2"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// feed records n calls of latency took, failing the first failures of them.
func feed(c *Controller, n, failures int, took time.Duration) {
	for i := range n {
		c.Record(took, i < failures)
	}
}

func TestRampWidensOnlyAfterHealthyWindows(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	c := New(Config{Window: time.Second, Ramp: &RampConfig{}}, 20, clk)
	if got := c.Limit(); got != 20 {
		t.Fatalf("before any ramp: limit %d, want the permits 20", got)
	}
	if got := c.Start(); got != 2 {
		t.Fatalf("ramp start: %d, want 10%% of 20 = 2", got)
	}
	// Default: +10 % (2) after every 2 healthy windows: 2, 2, 4, 4, 6, ... 18, then done.
	want := []int{2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14, 16, 16, 18, 18, 20}
	for i, w := range want {
		feed(c, 10, 0, 5*time.Millisecond)
		clk.Step(time.Second)
		if got := c.Limit(); got != w {
			t.Fatalf("after healthy window %d: limit %d, want %d", i+1, got, w)
		}
	}
	if c.Status().Ramping {
		t.Fatal("the ramp reached the permits but is still in progress")
	}
}

func TestRampHoldsOnEmptyAndLowersOnBadWindows(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	h := Health{FailureRatePercent: 50, SlowCallThreshold: 100 * time.Millisecond, SlowCallRatePercent: 50}
	c := New(Config{Window: time.Second, Health: h, Ramp: &RampConfig{InitialPercent: 10, StepPercent: 20, HealthyWindows: 2}}, 40, clk)
	c.Start() // 4
	feed(c, 10, 0, time.Millisecond)
	clk.Step(time.Second) // healthy 1
	clk.Step(5 * time.Second)
	if got := c.Limit(); got != 4 {
		t.Fatalf("after 1 healthy and 5 empty windows: %d, want 4 (held)", got)
	}
	feed(c, 10, 0, time.Millisecond)
	clk.Step(time.Second) // healthy 2: the empty ones kept the streak
	if got := c.Limit(); got != 12 {
		t.Fatalf("after the 2nd healthy window: %d, want 4+8", got)
	}
	feed(c, 10, 0, time.Millisecond)
	clk.Step(time.Second) // healthy 1
	feed(c, 10, 0, time.Millisecond)
	clk.Step(time.Second) // healthy 2
	if got := c.Limit(); got != 20 {
		t.Fatalf("%d, want 20", got)
	}
	// Failure rate at the threshold: unhealthy, halves.
	feed(c, 10, 5, time.Millisecond)
	clk.Step(time.Second)
	if got := c.Limit(); got != 10 {
		t.Fatalf("after a failing window: %d, want 20/2", got)
	}
	// Slow calls at the slow-call threshold: unhealthy; halving stops at the start (4).
	for _, want := range []int{5, 4, 4} {
		feed(c, 10, 0, 100*time.Millisecond)
		clk.Step(time.Second)
		if got := c.Limit(); got != want {
			t.Fatalf("after a slow window: %d, want %d", got, want)
		}
	}
	// A healthy, then a bad window: the streak restarts.
	feed(c, 10, 0, time.Millisecond)
	clk.Step(time.Second)
	feed(c, 10, 9, time.Millisecond)
	clk.Step(time.Second)
	feed(c, 10, 0, time.Millisecond)
	clk.Step(time.Second)
	if got := c.Limit(); got != 4 {
		t.Fatalf("healthy, bad, healthy: %d, want 4 (no step)", got)
	}
}

func TestRampLatencyTarget(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	c := New(Config{Window: time.Second, Health: Health{LatencyTarget: 50 * time.Millisecond},
		Ramp: &RampConfig{InitialPercent: 50, StepPercent: 50, HealthyWindows: 1}}, 10, clk)
	c.Start() // 5
	feed(c, 10, 0, 60*time.Millisecond)
	clk.Step(time.Second)
	if got := c.Limit(); got != 5 {
		t.Fatalf("mean latency above the target: %d, want 5 (held at the start)", got)
	}
	feed(c, 10, 0, 40*time.Millisecond)
	clk.Step(time.Second)
	if got := c.Limit(); got != 10 {
		t.Fatalf("below the target: %d, want 10", got)
	}
}

func TestRampExponentialAndRestart(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	c := New(Config{Window: time.Second, Ramp: &RampConfig{Shape: Exponential, InitialPercent: 5, HealthyWindows: 1}}, 100, clk)
	c.Start()
	for _, want := range []int{10, 20, 40, 80, 100} {
		feed(c, 10, 0, time.Millisecond)
		clk.Step(time.Second)
		if got := c.Limit(); got != want {
			t.Fatalf("exponential: %d, want %d", got, want)
		}
	}
	c.Start()
	feed(c, 10, 0, time.Millisecond)
	clk.Step(time.Second)
	if got := c.Start(); got != 5 {
		t.Fatalf("a restart during a ramp at 10: %d, want the start 5", got)
	}
	// Permits lowered below the ramp limit: the permits bound it, the ramp ends.
	if got := c.SetPermits(3); got != 3 {
		t.Fatalf("permits 3 during a ramp at 5: %d", got)
	}
	if c.Status().Ramping {
		t.Fatal("still ramping above the permits")
	}
}

func TestOnePermitAndZero(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	c := New(Config{Ramp: &RampConfig{}}, 1, clk)
	if got := c.Start(); got != 1 {
		t.Fatalf("1 permit: %d, want 1 (a ramp never goes to 0)", got)
	}
	c = New(Config{Ramp: &RampConfig{}, Adaptive: &AdaptiveConfig{}}, 0, clk)
	if got := c.Start(); got != 0 {
		t.Fatalf("0 permits: %d", got)
	}
	if got := c.SetPermits(8); got != 8 {
		t.Fatalf("first permits 8 without a Start: %d, want 8", got)
	}
}

// TestPermitsStartNothing: a pod's first permits, a raise and a lowering change the ceiling and
// start no ramp; an adaptive limit that narrowed nothing moves with the permits (up too), one
// that narrowed stays where the latency put it.
func TestPermitsStartNothing(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	c := New(Config{Window: time.Second, Ramp: &RampConfig{}, Adaptive: &AdaptiveConfig{}}, 0, clk)
	for _, p := range []int{20, 40, 8, 30} {
		if got := c.SetPermits(p); got != p || c.Status().Ramping || c.Status().Adaptive != p {
			t.Fatalf("permits %d: limit %d, status %+v; want the permits at once", p, got, c.Status())
		}
	}
	// The adaptive limit narrows (latency 10x): a raise leaves it where it is.
	feed(c, 100, 0, 10*time.Millisecond)
	clk.Step(time.Second)
	feed(c, 20, 0, 100*time.Millisecond)
	clk.Step(time.Second)
	narrowed := c.Limit()
	if narrowed >= 30 {
		t.Fatalf("latency 10x: limit %d, want below 30", narrowed)
	}
	if got := c.SetPermits(60); got != narrowed {
		t.Fatalf("raise while the adaptive limit narrows: %d, want %d held", got, narrowed)
	}
}

// TestAdaptiveDropStartsARamp: with the ramp and the adaptive limit on, a window in which the
// adaptive limit dropped begins a ramp at the dropped limit; the climb back then needs healthy
// windows too, and a bad window lowers it no further than the adaptive limit says.
func TestAdaptiveDropStartsARamp(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	c := New(Config{Window: time.Second, Ramp: &RampConfig{StepPercent: 10, HealthyWindows: 2}, Adaptive: &AdaptiveConfig{}}, 20, clk)
	feed(c, 100, 0, 10*time.Millisecond) // the baseline: 10 ms
	clk.Step(time.Second)
	if st := c.Status(); st.Limit != 20 || st.Ramping {
		t.Fatalf("baseline window: %+v", st)
	}
	feed(c, 20, 0, 100*time.Millisecond) // 10x the baseline: the adaptive limit halves
	clk.Step(time.Second)
	if st := c.Status(); st.Limit != 10 || !st.Ramping || st.Ramp != 10 || st.Adaptive != 10 {
		t.Fatalf("after the adaptive drop: %+v, want a ramp at the adaptive limit 10", st)
	}
	// 1,000 calls at 10 ms (10 in flight): the adaptive limit grows 13, 16, 20; the ramp +2
	// after every 2 healthy windows.
	for i, want := range []int{10, 12, 12, 14, 14, 16, 16, 18, 18, 20} {
		feed(c, 1000, 0, 10*time.Millisecond)
		clk.Step(time.Second)
		if got := c.Limit(); got != want {
			t.Fatalf("healthy window %d: limit %d, want %d (%+v)", i+1, got, want, c.Status())
		}
	}
	if c.Status().Ramping {
		t.Fatal("still ramping at the permits")
	}
	// Without a ramp configured a drop starts none.
	c = New(Config{Window: time.Second, Adaptive: &AdaptiveConfig{}}, 20, clk)
	feed(c, 100, 0, 10*time.Millisecond)
	clk.Step(time.Second)
	feed(c, 20, 0, 100*time.Millisecond)
	clk.Step(time.Second)
	if st := c.Status(); st.Ramping || st.Limit != 10 {
		t.Fatalf("adaptive only, after the drop: %+v", st)
	}
}

// TestRampFromBelowTheStart: a ramp begun below its start (the adaptive limit dropped there)
// never rises on a bad window, and RampFrom never raises a lower ramp in progress.
func TestRampFromBelowTheStart(t *testing.T) {
	r := (Config{Ramp: &RampConfig{}}).withDefaults().Ramp // start: 10 % of 40 = 4
	s := RampFrom(RampState{}, 1, 40)
	if s != (RampState{Active: true, Limit: 1}) {
		t.Fatalf("RampFrom(1): %+v", s)
	}
	bad := Window{Length: time.Second, Calls: 10, Failures: 10}
	if got := StepRamp(s, bad, 40, Health{}, r); got.Limit != 1 {
		t.Fatalf("a bad window at 1, below the start 4: %d, want 1", got.Limit)
	}
	if got := RampFrom(RampState{Active: true, Limit: 3, Streak: 1}, 7, 40); got != (RampState{Active: true, Limit: 3}) {
		t.Fatalf("RampFrom(7) over a ramp at 3: %+v, want 3 kept, streak reset", got)
	}
	if got := RampFrom(RampState{}, 40, 40); got.Active {
		t.Fatalf("RampFrom at the permits: %+v, want no ramp", got)
	}
	if got := RampFrom(RampState{}, 0, 40); got.Limit != 1 {
		t.Fatalf("RampFrom(0): %+v, want at least 1", got)
	}
}

// TestAdaptiveShrinksTowardLittleAndRecovers drives a downstream that can take 10 calls in
// flight at 10 ms (1,000 calls/s); above that its latency grows with the queue.
func TestAdaptiveShrinksTowardLittleAndRecovers(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	c := New(Config{Window: time.Second, Adaptive: &AdaptiveConfig{}}, 100, clk)
	const capacity, base = 10, 10 * time.Millisecond
	// window simulates one second with the limit as the in-flight count (a saturating app).
	window := func(degraded bool) int {
		l := c.Limit()
		lat := base
		if degraded && l > capacity {
			lat = base * time.Duration(l) / capacity // queueing: latency ∝ in flight
		}
		tput := float64(l) / lat.Seconds()
		if degraded {
			tput = min(tput, capacity/base.Seconds())
		}
		for range int(tput) {
			c.Record(lat, false)
		}
		clk.Step(time.Second)
		return c.Limit()
	}
	// Healthy and app-saturating: the limit stays at the permits.
	for range 5 {
		if got := window(false); got != 100 {
			t.Fatalf("healthy: %d, want 100", got)
		}
	}
	// Degraded: latency 10x; Little's law at the baseline says 10.
	var seen []int
	for range 8 {
		seen = append(seen, window(true))
	}
	if seen[0] != 50 {
		t.Fatalf("first degraded window: %d, want 100/2 (at most halving)", seen[0])
	}
	// It settles where the latency is within the tolerance (1.5x the baseline, which itself
	// drifts up slowly, as Gradient2's long RTT does): between Little's 10 and 2.5x that, never
	// below Little's law.
	for i, l := range seen {
		if l < capacity || (i >= 3 && l > capacity*5/2) {
			t.Fatalf("degraded: limits %v, want them to settle in [%d, %d] after 3 windows", seen, capacity, capacity*5/2)
		}
	}
	// Recovered: grows back to the permits.
	var up []int
	for range 60 {
		up = append(up, window(false))
	}
	if up[len(up)-1] != 100 {
		t.Fatalf("recovered: limits %v, want back to 100", up)
	}
	for i := 1; i < len(up); i++ {
		if up[i] < up[i-1] {
			t.Fatalf("recovered: limits %v fall", up)
		}
	}
}

func TestAdaptiveAppLimitedHolds(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	c := New(Config{Window: time.Second, Adaptive: &AdaptiveConfig{}}, 50, clk)
	c.adapt.Limit = 20
	for range 10 {
		feed(c, 100, 0, 10*time.Millisecond) // 1 in flight on average
		clk.Step(time.Second)
	}
	if got := c.Limit(); got != 20 {
		t.Fatalf("app-limited: %d, want 20 held", got)
	}
}

// TestNeverAbovePermits runs random windows, permits, restarts and configurations and checks the
// invariant after every operation.
func TestNeverAbovePermits(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for run := range 200 {
		clk := testingclock.NewFakeClock(t0)
		cfg := Config{Window: time.Duration(1+r.IntN(5)) * 100 * time.Millisecond,
			Health: Health{SlowCallThreshold: 50 * time.Millisecond, SlowCallRatePercent: 50}}
		if r.IntN(3) > 0 {
			cfg.Ramp = &RampConfig{Shape: []Shape{Linear, Exponential}[r.IntN(2)], InitialPercent: r.IntN(101), StepPercent: r.IntN(101), HealthyWindows: r.IntN(4)}
		}
		if r.IntN(2) == 0 {
			cfg.Adaptive = &AdaptiveConfig{MinLimit: r.IntN(5)}
		}
		permits := r.IntN(30)
		c := New(cfg, permits, clk)
		for op := range 300 {
			var got int
			switch r.IntN(10) {
			case 0:
				permits = r.IntN(30)
				got = c.SetPermits(permits)
			case 1:
				got = c.Start()
			case 2, 3:
				clk.Step(time.Duration(r.IntN(1500)) * time.Millisecond)
				got = c.Limit()
			default:
				got = c.Record(time.Duration(r.IntN(200))*time.Millisecond, r.IntN(4) == 0)
			}
			if got < 0 || got > permits {
				t.Fatalf("run %d op %d: limit %d outside 0..permits %d (%+v)", run, op, got, permits, c.Status())
			}
			if permits > 0 && got == 0 {
				t.Fatalf("run %d op %d: limit 0 with %d permits", run, op, permits)
			}
		}
	}
}

func TestValidate(t *testing.T) {
	bad := []Config{
		{Window: -1},
		{Health: Health{FailureRatePercent: 101}},
		{Ramp: &RampConfig{Shape: "Cubic"}},
		{Ramp: &RampConfig{InitialPercent: 101}},
		{Ramp: &RampConfig{HealthyWindows: -1}},
		{Adaptive: &AdaptiveConfig{MinLimit: -1}},
	}
	for _, c := range bad {
		if c.Validate() == nil {
			t.Errorf("%+v: no error", c)
		}
	}
	if err := (Config{Ramp: &RampConfig{}, Adaptive: &AdaptiveConfig{}}).Validate(); err != nil {
		t.Fatal(err)
	}
}

// The method RampFrom (a raise the manager flagged as following an incident) begins a ramp at
// the permits held before, not below the ramp's start, keeps a lower ramp in progress, narrows
// nothing at or above the permits, judges the new limit on its own calls, and does nothing
// without a ramp configured.
func TestControllerRampFrom(t *testing.T) {
	clk := testingclock.NewFakeClock(t0)
	c := New(Config{Window: time.Second, Ramp: &RampConfig{StepPercent: 10, HealthyWindows: 1}}, 8, clk)
	clk.Step(500 * time.Millisecond)
	c.SetPermits(20)
	if got := c.RampFrom(8); got != 8 || !c.Status().Ramping {
		t.Fatalf("raise 8 → 20: limit %d (ramping %v), want 8", got, c.Status().Ramping)
	}
	// The ramp's first window starts at RampFrom, not with the window in progress before it.
	feed(c, 10, 0, time.Millisecond)
	clk.Step(600 * time.Millisecond)
	if got := c.Limit(); got != 8 {
		t.Fatalf("0.6 s into the ramp's first window: %d, want 8 (the window is 1 s from RampFrom)", got)
	}
	clk.Step(400 * time.Millisecond)
	if got := c.Limit(); got != 10 {
		t.Fatalf("after a healthy window: %d, want 8 + 10 %% of 20 = 10", got)
	}
	if got := c.RampFrom(15); got != 10 {
		t.Fatalf("a higher level during a lower ramp: %d, want the ramp's 10", got)
	}
	if got := c.RampFrom(20); got != 10 {
		t.Fatalf("a level at the permits: %d, want 10 unchanged", got)
	}
	c = New(Config{Window: time.Second, Ramp: &RampConfig{}}, 20, clk)
	if got := c.RampFrom(0); got != 2 {
		t.Fatalf("from 0: %d, want the ramp's start, 10 %% of 20 = 2", got)
	}
	c = New(Config{Window: time.Second}, 20, clk)
	if got := c.RampFrom(5); got != 20 || c.Status().Ramping {
		t.Fatalf("without a ramp: %d, want the permits 20 at once", got)
	}
}
