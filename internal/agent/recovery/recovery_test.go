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
