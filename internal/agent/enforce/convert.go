package enforce

import (
	"net/http"
	"slices"
	"time"

	"github.com/apportion/apportion/internal/agent/breaker"
	"github.com/apportion/apportion/internal/agent/degrade"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/agent/ratelimit"
	"github.com/apportion/apportion/internal/agent/recovery"
	"github.com/apportion/apportion/internal/assignment"
)

func convertRate(r assignment.Rate) ratelimit.Config {
	mode := ratelimit.TokenBucket
	if r.Mode == assignment.ModePacing {
		mode = ratelimit.Pacing
	}
	return ratelimit.Config{PerSecond: r.PerSecond, Burst: int(r.Burst), Mode: mode}
}

func convertBreaker(b assignment.Breaker) breaker.Config {
	return breaker.Config{
		Window:              b.Window.D(),
		MinCalls:            int(b.MinimumCalls),
		FailureRatePercent:  int(b.FailureRatePercent),
		SlowCallThreshold:   b.SlowCallThreshold.D(),
		SlowCallRatePercent: int(b.SlowCallRatePercent),
		OpenDuration:        b.OpenDuration.D(),
		HalfOpenProbes:      int(b.HalfOpenProbes),
	}
}

// convertRecovery is the recovery configuration of a downstream, nil without one. A window is
// healthy under the breaker's thresholds (package recovery's defaults without a breaker).
func convertRecovery(r *assignment.Recovery, b *breaker.Config) *recovery.Config {
	if r == nil || (r.Ramp == nil && r.Adaptive == nil) {
		return nil
	}
	c := &recovery.Config{Window: r.Window.D()}
	if b != nil {
		c.Health = recovery.Health{FailureRatePercent: b.FailureRatePercent, SlowCallThreshold: b.SlowCallThreshold, SlowCallRatePercent: b.SlowCallRatePercent}
	}
	if rr := r.Ramp; rr != nil {
		c.Ramp = &recovery.RampConfig{Shape: recovery.Shape(rr.Shape), InitialPercent: int(rr.InitialPercent),
			StepPercent: int(rr.StepPercent), HealthyWindows: int(rr.HealthyWindows)}
		c.Health.LatencyTarget = rr.LatencyTarget.D()
	}
	if a := r.Adaptive; a != nil {
		c.Adaptive = &recovery.AdaptiveConfig{TolerancePercent: int(a.TolerancePercent), BaselineWindows: int(a.BaselineWindows), MinLimit: int(a.MinLimit)}
	}
	return c
}

func (d *Downstream) newBreaker(cfg breaker.Config) *breaker.Breaker {
	b := breaker.New(cfg)
	b.SetOnTransition(func(from, to breaker.State) {
		d.Metrics.Transition(from.String(), to.String())
		if from == breaker.HalfOpen && to == breaker.Closed {
			d.StartRamp() // the downstream answered its probes: recover gradually
		}
	})
	return b
}

// breakerGauge is the breaker_state gauge value: 0 closed, 1 open, 2 half-open.
func breakerGauge(b *breaker.Breaker, now time.Time) int {
	switch b.State(now) {
	case breaker.Open:
		return 1
	case breaker.HalfOpen:
		return 2
	}
	return 0
}

// ConvertFallback turns a wire fallback into the fallback package's configuration.
func ConvertFallback(f assignment.Fallback) fallback.Config {
	c := fallback.Config{
		Action:         fallback.Action(f.Action),
		MaxStaleness:   f.MaxStaleness.D(),
		AllowedMethods: slices.Clone(f.AllowedMethods),
	}
	if f.Static != nil {
		h := make(http.Header, len(f.Static.Headers))
		for k, v := range f.Static.Headers {
			h.Set(k, v)
		}
		c.Static = fallback.Response{Status: int(f.Static.Status), Header: h, Body: []byte(f.Static.Body)}
	}
	return c
}

func convertSwitch(s assignment.Switch) degrade.Switch {
	sw := degrade.Switch{
		Name: s.Name, Downstream: s.Downstream, ExpiresAt: s.ExpiresAt, Percent: int(s.Percent),
		Methods: slices.Clone(s.Methods),
		Action:  ConvertFallback(s.Action),
	}
	if s.KeyHeader != "" {
		sw.KeyHeader = http.CanonicalHeaderKey(s.KeyHeader)
	}
	for _, h := range s.Headers {
		sw.HeaderMatches = append(sw.HeaderMatches, degrade.HeaderMatch{Name: http.CanonicalHeaderKey(h.Name), Value: h.Value})
	}
	return sw
}
