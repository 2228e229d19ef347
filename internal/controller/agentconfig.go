package controller

import (
	"cmp"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
)

// The defaults below are the CRD's (apportionv1.Default*): the API server applies them on
// admission; they are applied here again for what can still be empty — an object built in
// memory, or a whole optional struct left out.

func durOr(d *metav1.Duration, def time.Duration) assignment.Duration {
	if d == nil || d.Duration <= 0 {
		return assignment.Duration(def)
	}
	return assignment.Duration(d.Duration)
}

func int32Or(v, def int32) int32 {
	if v <= 0 {
		return def
	}
	return v
}

// downstreamTemplate turns a quota's spec into the per-pod enforcement every agent gets;
// Permits, SafeDefaultPermits and the rate's PerSecond and Burst are filled per pod (the
// template's Rate carries only the contract's mode, see push.DesiredQuota).
func downstreamTemplate(dq *apportionv1.DownstreamQuota) assignment.Downstream {
	p := dq.Spec.Agent
	d := assignment.Downstream{
		Name:           dq.Name,
		Upstream:       dq.Spec.Upstream,
		FailClosed:     p.FailurePolicy == apportionv1.FailureClosed,
		AcquireTimeout: durOr(p.AcquireTimeout, apportionv1.DefaultAcquireTimeout),
		RequestTimeout: durOr(p.RequestTimeout, apportionv1.DefaultRequestTimeout),
		Fallback:       fallbackFor(p.Fallback),
		Lanes:          lanesFor(dq),
		Observe:        dq.Spec.Enforcement == apportionv1.EnforcementObserve,
	}
	if rc := dq.Spec.Rate; rc != nil {
		d.Rate = &assignment.Rate{Mode: string(cmp.Or(rc.Mode, apportionv1.DefaultRateMode))}
	}
	if b := p.CircuitBreaker; b != nil {
		d.Breaker = &assignment.Breaker{
			Window:              durOr(b.Window, apportionv1.DefaultBreakerWindow),
			FailureRatePercent:  int32Or(b.FailureRatePercent, apportionv1.DefaultBreakerFailureRatePercent),
			SlowCallThreshold:   durOr(b.SlowCallThreshold, apportionv1.DefaultBreakerSlowCallThreshold),
			SlowCallRatePercent: int32Or(b.SlowCallRatePercent, apportionv1.DefaultBreakerSlowCallRatePercent),
			MinimumCalls:        int32Or(b.MinimumCalls, apportionv1.DefaultBreakerMinimumCalls),
			OpenDuration:        durOr(b.OpenDuration, apportionv1.DefaultBreakerOpenDuration),
			HalfOpenProbes:      int32Or(b.HalfOpenProbes, apportionv1.DefaultBreakerHalfOpenProbes),
		}
	}
	d.Recovery = recoveryFor(p.Recovery)
	d.MaxWaiting = p.MaxWaiting
	d.DeadlineHeader = p.DeadlineHeader
	d.TLS = upstreamTLSFor(dq)
	if p.AbandonedCallHold != nil {
		h := assignment.Duration(max(p.AbandonedCallHold.Duration, 0))
		d.AbandonedHold = &h
	}
	return d
}

// recoveryFor converts the quota's recovery policy to the wire: the default Linear ramp when the
// policy or its ramp is absent, none with shape Off; adaptive concurrency only when asked for.
func recoveryFor(r *apportionv1.Recovery) *assignment.Recovery {
	if r == nil {
		r = &apportionv1.Recovery{}
	}
	out := &assignment.Recovery{Window: durOr(r.Window, apportionv1.DefaultRecoveryWindow)}
	ramp := r.Ramp
	if ramp == nil {
		ramp = &apportionv1.RecoveryRamp{}
	}
	if ramp.Shape != apportionv1.RampOff {
		shape := string(ramp.Shape)
		if shape == "" {
			shape = string(apportionv1.DefaultRampShape)
		}
		out.Ramp = &assignment.Ramp{
			Shape:          shape,
			InitialPercent: int32Or(ramp.InitialPercent, apportionv1.DefaultRampInitialPercent),
			StepPercent:    int32Or(ramp.StepPercent, apportionv1.DefaultRampStepPercent),
			HealthyWindows: int32Or(ramp.HealthyWindows, apportionv1.DefaultRampHealthyWindows),
		}
		if ramp.LatencyTarget != nil && ramp.LatencyTarget.Duration > 0 {
			out.Ramp.LatencyTarget = assignment.Duration(ramp.LatencyTarget.Duration)
		}
	}
	if a := r.Adaptive; a != nil {
		out.Adaptive = &assignment.Adaptive{
			TolerancePercent: int32Or(a.TolerancePercent, apportionv1.DefaultAdaptiveTolerancePercent),
			BaselineWindows:  int32Or(a.BaselineWindows, apportionv1.DefaultAdaptiveBaselineWindows),
			MinLimit:         int32Or(a.MinLimit, apportionv1.DefaultAdaptiveMinLimit),
		}
	}
	if out.Ramp == nil && out.Adaptive == nil {
		return nil
	}
	return out
}

// fallbackFor converts the API's fallback (shared by DownstreamQuota and DegradeRule) to the wire.
func fallbackFor(f *apportionv1.Fallback) assignment.Fallback {
	if f == nil {
		return assignment.Fallback{Action: string(apportionv1.DefaultFallbackAction)}
	}
	out := assignment.Fallback{Action: string(f.Action)}
	if out.Action == "" {
		out.Action = string(apportionv1.DefaultFallbackAction)
	}
	if f.Static != nil {
		out.Static = &assignment.StaticResponse{
			Status:  int32Or(f.Static.Status, apportionv1.DefaultStaticStatus),
			Headers: f.Static.Headers,
			Body:    f.Static.Body,
		}
	}
	if out.Action == string(apportionv1.FallbackServeStale) {
		out.MaxStaleness = durOr(f.MaxStaleness, apportionv1.DefaultMaxStaleness)
	}
	for _, m := range f.AllowedMethods {
		out.AllowedMethods = append(out.AllowedMethods, string(m))
	}
	return out
}

// safetyFactorPercent is the quota's share of maxInFlight (and of its rate contract) apportioned
// to pods, in percent.
func safetyFactorPercent(dq *apportionv1.DownstreamQuota) int32 {
	return int32Or(dq.Spec.SafetyFactorPercent, apportionv1.DefaultSafetyFactorPercent)
}

// weightOf is a target's weight.
func weightOf(t apportionv1.Target) int64 { return int64(int32Or(t.Weight, apportionv1.DefaultWeight)) }
