// Package recovery holds a downstream's effective in-flight limit inside the pod's permits:
// the gradual recovery ramp after an incident, and the optional adaptive concurrency limit.
//
// # Invariant
//
// The effective limit is never above the pod's permits: 0 <= Limit() <= permits, whatever
// was observed. Everything here only narrows what the manager granted, so the global bound
// (Σ permits of live pods <= the quota) is untouched.
//
// # Model
//
// Finished calls are counted in consecutive windows of Config.Window (calls, failures, slow
// calls, summed latency). When a window ends (noticed lazily, on the next Record, Limit or
// Start: nothing reads the clock on its own) the pure step functions stepRamp and stepAdaptive
// turn the window's counts into the next limits. Windows that passed without a call hold every
// limit and leave the healthy streak as it was: they carry no evidence either way.
//
// A window is healthy when it has at least one call, its failure rate is below
// Health.FailureRatePercent, its slow-call rate below Health.SlowCallRatePercent (when that rule
// is on), and, when Health.LatencyTarget is set, its mean latency below the target. The
// thresholds are the breaker's, so the ramp widens only while the breaker would stay closed.
//
// Ramp (Config.Ramp, nil: none). Start begins a ramp: the ramp limit drops to the start,
// ceil(permits × InitialPercent / 100) (at least 1 when permits > 0), or stays where it is if a
// ramp in progress is lower. After HealthyWindows consecutive healthy windows the limit widens
// by one step — Linear: + ceil(permits × StepPercent / 100); Exponential: doubles — and the
// streak starts again. An unhealthy window halves the limit, not below the start (nor above
// where it was), and resets the streak: a worse window never widens it. Once the limit reaches
// the permits the ramp is over and the ramp no longer narrows anything.
//
// A ramp follows the downstream's health, never the pod's lifecycle: it begins when the
// downstream has just shown it was in trouble — the agent calls Start when its breaker closes
// after half-open probes, the Controller itself begins one at the adaptive limit when that
// limit drops (below), and the agent calls the method RampFrom with the permits held before a
// raise that the manager flagged as following an incident (assignment.Downstream.RampRaise) —
// and at no other time. SetPermits starts nothing: a pod's first permits, an unflagged
// raise, and permits restored after a lapsed lease apply at once (unless a ramp in progress
// still holds the limit: a raise during a ramp widens only as the ramp does). The permits the
// Controller works within are the grant; the safe limit of a lapsed lease is applied outside it
// (package enforce), so a lapse and its renewal leave the ramp and the adaptive estimate as they
// were.
//
// The shapes follow Envoy's slow-start mode (a new host's weight starts at min_weight_percent,
// 10 % by default, and grows over slow_start_window, linearly or per an aggression curve) and
// Sentinel's warm-up (a cold system admits threshold / coldFactor and warms to the threshold),
// with one difference that the incident calls for: both of those widen with time alone, and this
// ramp widens only with evidence, healthy windows, and steps back on a bad one. Envoy applies it
// to hosts returning from failure and, only when asked, to hosts new to a healthy cluster; here
// a new pod is not new to the downstream, so it never ramps for that.
//
// Adaptive (Config.Adaptive, nil: off) is a Gradient2-style estimator (Netflix
// concurrency-limits, Gradient2Limit) with Little's law as its floor. It keeps a baseline
// latency, an exponential moving average of the windows' mean latency over BaselineWindows
// windows (Gradient2's long RTT, decayed by 5 % a window while it is more than twice the
// current latency, as Gradient2 does after a prolonged overload). For each window with calls:
//
//   - its mean latency above TolerancePercent of the baseline (the downstream is queueing): the
//     limit shrinks toward what Little's law says the downstream takes at its baseline latency,
//     L = throughput × baseline, but by at most half a window (Gradient2's gradient is bounded
//     by 0.5), and never below MinLimit;
//   - otherwise, if the calls in flight (throughput × latency, again Little's law) used at least
//     half the limit, it grows by max(1, ⌊√limit⌋) (Gradient2's queue size), up to the permits;
//     a window that used less says nothing about more and holds it (Gradient2's app-limited
//     rule).
//
// The adaptive limit starts at the permits. When the permits change, an adaptive limit that was
// not narrowing anything (at the permits) moves with them, up or down: only measured latency
// narrows it, not a change of the grant. One that was narrowing stays where it is, within the
// new permits.
//
// With both on, a window in which the adaptive limit dropped also begins a ramp at the dropped
// limit (RampFrom), or lowers a ramp in progress to it: the adaptive limit says how much the
// latency allows, the ramp how fast the limit may climb back — only after healthy windows (the
// failure and slow-call rates, which the adaptive estimator does not look at). The climb back
// is the slower of the two.
//
// Limit() is min(permits, ramp limit while ramping, adaptive limit when on).
package recovery

import (
	"fmt"
	"math"
	"sync"
	"time"

	"k8s.io/utils/clock"

	"github.com/apportion/apportion/api/v1alpha1/defaults"
)

// Shape is how a ramp widens.
type Shape string

const (
	// Linear widens by StepPercent of the permits per step.
	Linear Shape = "Linear"
	// Exponential doubles the limit per step (TCP's slow start).
	Exponential Shape = "Exponential"
)

// Defaults for zero fields: the CRD's (spec.agent.recovery; the failure rate that makes a window
// unhealthy is the breaker's), from the one package that states them for the API and the agent.
const (
	DefaultWindow                   = defaults.RecoveryWindow
	DefaultInitialPercent           = defaults.RampInitialPercent
	DefaultStepPercent              = defaults.RampStepPercent
	DefaultHealthyWindows           = defaults.RampHealthyWindows
	DefaultFailureRatePercent       = defaults.BreakerFailureRatePercent
	DefaultAdaptiveTolerancePercent = defaults.AdaptiveTolerancePercent
	DefaultBaselineWindows          = defaults.AdaptiveBaselineWindows
	DefaultMinLimit                 = defaults.AdaptiveMinLimit
)

// Health is what makes a window healthy. Zero FailureRatePercent means
// DefaultFailureRatePercent; the slow-call rule is on when SlowCallThreshold > 0 and
// SlowCallRatePercent > 0; LatencyTarget 0 is no latency rule.
type Health struct {
	FailureRatePercent  int
	SlowCallThreshold   time.Duration
	SlowCallRatePercent int
	LatencyTarget       time.Duration
}

// RampConfig configures the recovery ramp. Zero fields take defaults; Shape "" is Linear.
type RampConfig struct {
	Shape          Shape
	InitialPercent int
	StepPercent    int
	HealthyWindows int
}

// AdaptiveConfig configures adaptive concurrency. Zero fields take defaults.
type AdaptiveConfig struct {
	TolerancePercent int
	BaselineWindows  int
	MinLimit         int
}

// Config configures a Controller.
type Config struct {
	// Window is the length of the windows calls are judged in; 0 is DefaultWindow.
	Window   time.Duration
	Health   Health
	Ramp     *RampConfig     // nil: no ramp, permits apply in one step
	Adaptive *AdaptiveConfig // nil: no adaptive limit
}

// Validate reports values that cannot be meant.
func (c Config) Validate() error {
	switch {
	case c.Window < 0 || c.Health.SlowCallThreshold < 0 || c.Health.LatencyTarget < 0:
		return fmt.Errorf("recovery: negative duration in %+v", c)
	case c.Health.FailureRatePercent < 0 || c.Health.FailureRatePercent > 100 ||
		c.Health.SlowCallRatePercent < 0 || c.Health.SlowCallRatePercent > 100:
		return fmt.Errorf("recovery: a rate outside 0..100 in %+v", c.Health)
	}
	if r := c.Ramp; r != nil {
		switch {
		case r.Shape != "" && r.Shape != Linear && r.Shape != Exponential:
			return fmt.Errorf("recovery: unknown ramp shape %q", r.Shape)
		case r.InitialPercent < 0 || r.InitialPercent > 100 || r.StepPercent < 0 || r.StepPercent > 100:
			return fmt.Errorf("recovery: ramp percent outside 0..100 in %+v", *r)
		case r.HealthyWindows < 0:
			return fmt.Errorf("recovery: negative healthyWindows %d", r.HealthyWindows)
		}
	}
	if a := c.Adaptive; a != nil && (a.TolerancePercent < 0 || a.BaselineWindows < 0 || a.MinLimit < 0) {
		return fmt.Errorf("recovery: negative adaptive setting in %+v", *a)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Window <= 0 {
		c.Window = DefaultWindow
	}
	if c.Health.FailureRatePercent <= 0 {
		c.Health.FailureRatePercent = DefaultFailureRatePercent
	}
	if c.Ramp != nil {
		r := *c.Ramp
		if r.Shape == "" {
			r.Shape = Linear
		}
		if r.InitialPercent <= 0 {
			r.InitialPercent = DefaultInitialPercent
		}
		if r.StepPercent <= 0 {
			r.StepPercent = DefaultStepPercent
		}
		if r.HealthyWindows <= 0 {
			r.HealthyWindows = DefaultHealthyWindows
		}
		c.Ramp = &r
	}
	if c.Adaptive != nil {
		a := *c.Adaptive
		if a.TolerancePercent <= 0 {
			a.TolerancePercent = DefaultAdaptiveTolerancePercent
		}
		if a.BaselineWindows <= 0 {
			a.BaselineWindows = DefaultBaselineWindows
		}
		if a.MinLimit <= 0 {
			a.MinLimit = DefaultMinLimit
		}
		c.Adaptive = &a
	}
	return c
}

// Window is one window's finished calls.
type Window struct {
	Length                time.Duration
	Calls, Failures, Slow int
	Latency               time.Duration // summed over Calls
}

// Mean is the window's mean latency (0 without calls).
func (w Window) Mean() time.Duration {
	if w.Calls == 0 {
		return 0
	}
	return w.Latency / time.Duration(w.Calls)
}

// Healthy reports whether w is a healthy window under h (see the package documentation).
func (h Health) Healthy(w Window) bool {
	if w.Calls == 0 {
		return false
	}
	frp := h.FailureRatePercent
	if frp <= 0 {
		frp = DefaultFailureRatePercent
	}
	if w.Failures*100 >= frp*w.Calls {
		return false
	}
	if h.SlowCallThreshold > 0 && h.SlowCallRatePercent > 0 && w.Slow*100 >= h.SlowCallRatePercent*w.Calls {
		return false
	}
	return h.LatencyTarget <= 0 || w.Mean() < h.LatencyTarget
}

// ---- ramp ----

// RampState is a ramp's state; the zero value is no ramp in progress.
type RampState struct {
	Active bool
	Limit  int
	Streak int // consecutive healthy windows since the last step
}

// rampStart is where a ramp over permits starts.
func rampStart(permits int, r *RampConfig) int {
	if permits <= 0 {
		return 0
	}
	return min(permits, max(1, ceilDiv(permits*r.InitialPercent, 100)))
}

// StartRamp begins a ramp at its start (or keeps a lower one in progress). cfg has defaults
// applied.
func StartRamp(s RampState, permits int, r *RampConfig) RampState {
	start := rampStart(permits, r)
	if s.Active && s.Limit <= start {
		return RampState{Active: true, Limit: s.Limit}
	}
	if start >= permits {
		return RampState{} // nothing to ramp: one permit, or a start at 100 %
	}
	return RampState{Active: true, Limit: start}
}

// RampFrom begins a ramp at level (at least 1 when permits > 0), or lowers a ramp in progress to
// it, or keeps a lower one; the streak starts again. A level at or above the permits narrows
// nothing and leaves s as it was. The Controller calls it with the adaptive limit when that
// limit dropped.
func RampFrom(s RampState, level, permits int) RampState {
	if permits <= 0 || level >= permits {
		return s
	}
	level = max(level, 1)
	if s.Active && s.Limit <= level {
		return RampState{Active: true, Limit: s.Limit}
	}
	return RampState{Active: true, Limit: level}
}

// StepRamp is the ramp after window w: the transition function of the ramp. r has defaults.
func StepRamp(s RampState, w Window, permits int, h Health, r *RampConfig) RampState {
	if !s.Active || w.Calls == 0 {
		return s
	}
	start := rampStart(permits, r)
	if !h.Healthy(w) {
		// Halved, not below the start; a ramp begun below the start (RampFrom) stays where it is.
		return RampState{Active: true, Limit: min(s.Limit, max(start, s.Limit/2))}
	}
	s.Streak++
	if s.Streak < r.HealthyWindows {
		return s
	}
	s.Streak = 0
	if r.Shape == Exponential {
		s.Limit = max(s.Limit*2, s.Limit+1)
	} else {
		s.Limit += max(1, ceilDiv(permits*r.StepPercent, 100))
	}
	if s.Limit >= permits {
		return RampState{}
	}
	return s
}

// ---- adaptive ----

// AdaptiveState is the adaptive estimator's state.
type AdaptiveState struct {
	Limit    int
	Baseline time.Duration // 0 until the first window with calls
}

// StepAdaptive is the adaptive limit after window w. a has defaults applied.
func StepAdaptive(s AdaptiveState, w Window, permits int, a *AdaptiveConfig) AdaptiveState {
	s.Limit = min(s.Limit, permits)
	if w.Calls == 0 || w.Length <= 0 {
		return s
	}
	short := w.Mean()
	if short <= 0 {
		short = time.Nanosecond
	}
	if s.Baseline <= 0 {
		s.Baseline = short
		return s
	}
	base := s.Baseline
	throughput := float64(w.Calls) / w.Length.Seconds() // calls a second
	floor := min(a.MinLimit, permits)
	if float64(short)*100 > float64(base)*float64(a.TolerancePercent) {
		little := int(math.Ceil(throughput * base.Seconds()))
		next := max(little, ceilDiv(s.Limit, 2), floor)
		s.Limit = min(s.Limit, next)
	} else if inflight := throughput * short.Seconds(); inflight*2 >= float64(s.Limit) {
		s.Limit = min(permits, s.Limit+max(1, int(math.Sqrt(float64(s.Limit)))))
	}
	// The baseline follows the windows' latency (Gradient2's long RTT), and drops faster when
	// it is far above the latency now: after a long overload it would otherwise keep
	// tolerating an inflated latency.
	alpha := 2 / float64(a.BaselineWindows+1)
	s.Baseline = time.Duration(float64(base)*(1-alpha) + float64(short)*alpha)
	if s.Baseline > 2*short {
		s.Baseline = time.Duration(float64(s.Baseline) * 0.95)
	}
	return s
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// ---- controller ----

// Clock is the time source: k8s.io/utils/clock.PassiveClock (its testing fakes in tests).
type Clock = clock.PassiveClock

// Controller is one downstream's recovery state: a window of calls being counted, the ramp and
// the adaptive estimator. It is safe for concurrent use.
type Controller struct {
	mu       sync.Mutex
	clk      clock.PassiveClock
	cfg      Config // defaults applied
	permits  int
	winStart time.Time
	cur      Window
	ramp     RampState
	adapt    AdaptiveState
}

// New returns a Controller for permits, with no ramp in progress and the adaptive limit (if on)
// at the permits.
func New(cfg Config, permits int, clk clock.PassiveClock) *Controller {
	cfg = cfg.withDefaults()
	return &Controller{clk: clk, cfg: cfg, permits: max(permits, 0), winStart: clk.Now(),
		adapt: AdaptiveState{Limit: max(permits, 0)}}
}

// SetConfig replaces the configuration; a ramp in progress continues under the new one (it ends
// if the ramp was turned off), and the adaptive limit restarts at the permits when adaptive
// concurrency is turned on. It returns the limit.
func (c *Controller) SetConfig(cfg Config) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	cfg = cfg.withDefaults()
	if cfg.Ramp == nil {
		c.ramp = RampState{}
	}
	if cfg.Adaptive != nil && c.cfg.Adaptive == nil {
		c.adapt = AdaptiveState{Limit: c.permits}
	}
	if cfg.Window != c.cfg.Window {
		c.winStart, c.cur = c.clk.Now(), Window{}
	}
	c.cfg = cfg
	return c.limitLocked()
}

// SetPermits changes the ceiling, the permits granted (not the safe limit of a lapsed lease:
// see the package documentation). It starts nothing — a pod's first permits and a raise apply
// at once unless a ramp in progress or a narrowing adaptive limit holds the limit — and an
// adaptive limit at the old permits moves to the new ones. It returns the limit.
func (c *Controller) SetPermits(n int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n = max(n, 0)
	if c.adapt.Limit >= c.permits {
		c.adapt.Limit = n // it narrowed nothing: no measurement holds it below the new permits
	} else {
		c.adapt.Limit = min(c.adapt.Limit, n)
	}
	c.permits = n
	if c.ramp.Active && c.ramp.Limit >= c.permits {
		c.ramp = RampState{}
	}
	return c.limitLocked()
}

// Start begins a ramp at its start (see the package documentation): the agent calls it when
// the downstream's breaker closes after half-open probes. Without a ramp configured it does
// nothing. It returns the limit.
func (c *Controller) Start() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.advanceLocked(c.clk.Now())
	if c.cfg.Ramp != nil {
		c.ramp = StartRamp(c.ramp, c.permits, c.cfg.Ramp)
		c.cur, c.winStart = Window{}, c.clk.Now() // judge the new limit on its own calls
	}
	return c.limitLocked()
}

// RampFrom begins a ramp at level, the permits held before a raise that follows an incident the
// manager saw (assignment.Downstream.RampRaise): the agent calls it right after SetPermits
// raised the permits. The ramp starts at level but not below the ramp's own start (a raise is no
// worse news than a breaker closing), keeps a lower ramp in progress, and narrows nothing when
// level is at or above the permits. Without a ramp configured it does nothing: the raise applies
// at once. It returns the limit.
func (c *Controller) RampFrom(level int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.advanceLocked(c.clk.Now())
	if c.cfg.Ramp != nil {
		before := c.ramp
		c.ramp = RampFrom(c.ramp, max(level, rampStart(c.permits, c.cfg.Ramp)), c.permits)
		if c.ramp != before {
			c.cur, c.winStart = Window{}, c.clk.Now() // judge the new limit on its own calls
		}
	}
	return c.limitLocked()
}

// Record counts a finished call that took took (failed: the proxy's verdict, as the breaker's)
// and returns the limit, which changes only when a window ends.
func (c *Controller) Record(took time.Duration, failed bool) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.advanceLocked(c.clk.Now())
	c.cur.Calls++
	c.cur.Latency += max(took, 0)
	if failed {
		c.cur.Failures++
	}
	if h := c.cfg.Health; h.SlowCallThreshold > 0 && took >= h.SlowCallThreshold {
		c.cur.Slow++
	}
	return c.limitLocked()
}

// Limit returns the effective limit now, ending a window first if its time is up.
func (c *Controller) Limit() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.advanceLocked(c.clk.Now())
	return c.limitLocked()
}

// Status is a snapshot for the control API and tests.
type Status struct {
	Limit    int
	Ramping  bool
	Ramp     int // the ramp limit while ramping
	Adaptive int // the adaptive limit, 0 when off
	Baseline time.Duration
}

// Status returns a snapshot, ending a window first if its time is up.
func (c *Controller) Status() Status {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.advanceLocked(c.clk.Now())
	st := Status{Limit: c.limitLocked(), Ramping: c.ramp.Active, Ramp: c.ramp.Limit}
	if c.cfg.Adaptive != nil {
		st.Adaptive, st.Baseline = c.adapt.Limit, c.adapt.Baseline
	}
	return st
}

// advanceLocked ends the window in progress if now is past it: its counts go through the step
// functions, and windows that passed since without calls hold everything.
func (c *Controller) advanceLocked(now time.Time) {
	w := c.cfg.Window
	if now.Sub(c.winStart) < w {
		return
	}
	done := c.cur
	done.Length = w
	if c.cfg.Ramp != nil {
		c.ramp = StepRamp(c.ramp, done, c.permits, c.cfg.Health, c.cfg.Ramp)
	}
	if c.cfg.Adaptive != nil {
		before := min(c.adapt.Limit, c.permits)
		c.adapt = StepAdaptive(c.adapt, done, c.permits, c.cfg.Adaptive)
		if c.cfg.Ramp != nil && c.adapt.Limit < before {
			// The latency said the downstream is queueing: the climb back is a ramp.
			c.ramp = RampFrom(c.ramp, c.adapt.Limit, c.permits)
		}
	}
	c.cur = Window{}
	c.winStart = c.winStart.Add(now.Sub(c.winStart) / w * w)
}

func (c *Controller) limitLocked() int {
	l := c.permits
	if c.ramp.Active {
		l = min(l, c.ramp.Limit)
	}
	if c.cfg.Adaptive != nil {
		l = min(l, c.adapt.Limit)
	}
	return max(l, 0)
}
