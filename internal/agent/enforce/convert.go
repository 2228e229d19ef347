package enforce

import (
	"crypto/tls"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/apportion/apportion/internal/agent/breaker"
	"github.com/apportion/apportion/internal/agent/degrade"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/agent/ratelimit"
	"github.com/apportion/apportion/internal/agent/recovery"
	"github.com/apportion/apportion/internal/agent/upstreamtls"
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

// tlsSettings are an https upstream's TLS settings: the assignment's, with the URL's host as the
// server name when it names none; nil for http.
func tlsSettings(u *url.URL, t *assignment.UpstreamTLS) *upstreamtls.Settings {
	if u.Scheme != "https" {
		return nil
	}
	s := upstreamtls.Settings{ServerName: u.Hostname(), MinVersion: tls.VersionTLS12}
	if t != nil {
		if t.ServerName != "" {
			s.ServerName = t.ServerName
		}
		s.CAFile, s.CertFile, s.KeyFile = t.CAFile, t.CertFile, t.KeyFile
		if t.MinVersion == assignment.TLSVersion13 {
			s.MinVersion = tls.VersionTLS13
		}
		s.InsecureSkipVerify = t.InsecureSkipVerify
	}
	return &s
}

// resolveTLS gives every https downstream of cfgs its Upstream: the one held for the same
// settings, or a new one (whose files are read now). It returns the Upstreams cfgs use, which
// replace the ones held once the assignment is applied; an Upstream no longer used is dropped
// (its connections close when idle).
func (e *Enforcer) resolveTLS(cfgs []*Config) (map[upstreamtls.Settings]*upstreamtls.Upstream, error) {
	out := map[upstreamtls.Settings]*upstreamtls.Upstream{}
	for _, c := range cfgs {
		if c.TLSSettings == nil {
			continue
		}
		s := *c.TLSSettings
		up := out[s]
		if up == nil {
			up = e.upstreams[s]
		}
		if up == nil {
			var err error
			if up, err = upstreamtls.New(s, upstreamtls.Options{Clock: e.clock}); err != nil {
				return nil, fmt.Errorf("downstream %s: tls: %w", c.Name, err)
			}
			if err := up.Err(); err != nil {
				e.log.Warn("the TLS material of a downstream cannot be used yet; its calls are refused until it can",
					"downstream", c.Name, "err", err)
			}
		}
		out[s] = up
		c.TLS = up
	}
	return out, nil
}
