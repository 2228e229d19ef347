package controller

import (
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
)

// Defaults for fields the API server did not default (a whole optional struct left out).
// They match the CRD's +kubebuilder:default markers.
const (
	defaultAcquireTimeout = 200 * time.Millisecond
	defaultRequestTimeout = 30 * time.Second
	defaultMaxStaleness   = 5 * time.Minute
)

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
// Permits, SafeDefaultPermits and Rate are filled per pod.
func downstreamTemplate(dq *apportionv1.DownstreamQuota) assignment.Downstream {
	p := dq.Spec.Agent
	d := assignment.Downstream{
		Name:           dq.Name,
		Upstream:       dq.Spec.Upstream,
		FailClosed:     p.FailurePolicy == apportionv1.FailureClosed,
		AcquireTimeout: durOr(p.AcquireTimeout, defaultAcquireTimeout),
		RequestTimeout: durOr(p.RequestTimeout, defaultRequestTimeout),
		Fallback:       fallbackFor(p.Fallback),
		Lanes:          lanesFor(dq),
	}
	if b := p.CircuitBreaker; b != nil {
		d.Breaker = &assignment.Breaker{
			Window:              durOr(b.Window, 10*time.Second),
			FailureRatePercent:  int32Or(b.FailureRatePercent, 50),
			SlowCallThreshold:   durOr(b.SlowCallThreshold, time.Second),
			SlowCallRatePercent: int32Or(b.SlowCallRatePercent, 100),
			MinimumCalls:        int32Or(b.MinimumCalls, 20),
			OpenDuration:        durOr(b.OpenDuration, 30*time.Second),
			HalfOpenProbes:      int32Or(b.HalfOpenProbes, 3),
		}
	}
	return d
}

// fallbackFor converts the API's fallback (shared by DownstreamQuota and DegradeRule) to the wire.
func fallbackFor(f *apportionv1.Fallback) assignment.Fallback {
	if f == nil {
		return assignment.Fallback{Action: string(apportionv1.FallbackReject)}
	}
	out := assignment.Fallback{Action: string(f.Action)}
	if out.Action == "" {
		out.Action = string(apportionv1.FallbackReject)
	}
	if f.Static != nil {
		out.Static = &assignment.StaticResponse{
			Status:  int32Or(f.Static.Status, 200),
			Headers: f.Static.Headers,
			Body:    f.Static.Body,
		}
	}
	if out.Action == string(apportionv1.FallbackServeStale) {
		out.MaxStaleness = durOr(f.MaxStaleness, defaultMaxStaleness)
	}
	for _, m := range f.AllowedMethods {
		out.AllowedMethods = append(out.AllowedMethods, string(m))
	}
	return out
}
