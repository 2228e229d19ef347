package builders

import (
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
)

// DefaultUpstream is the upstream URL MakeDownstreamQuota starts with.
const DefaultUpstream = "https://api.logistics.example.com/v2"

// DownstreamQuotaWrapper builds a DownstreamQuota.
type DownstreamQuotaWrapper struct{ apportionv1.DownstreamQuota }

// MakeDownstreamQuota is a quota with no targets, maxInFlight 0 and DefaultUpstream: set its
// limit and targets.
func MakeDownstreamQuota(name, ns string) *DownstreamQuotaWrapper {
	return &DownstreamQuotaWrapper{apportionv1.DownstreamQuota{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec:       apportionv1.DownstreamQuotaSpec{Upstream: DefaultUpstream},
	}}
}

// Obj returns a copy of the quota.
func (w *DownstreamQuotaWrapper) Obj() *apportionv1.DownstreamQuota { return w.DeepCopy() }

// Generation sets metadata.generation (for objects that are never sent to an API server).
func (w *DownstreamQuotaWrapper) Generation(g int64) *DownstreamQuotaWrapper {
	w.ObjectMeta.Generation = g
	return w
}

// Limit sets spec.maxInFlight.
func (w *DownstreamQuotaWrapper) Limit(n int32) *DownstreamQuotaWrapper {
	w.Spec.MaxInFlight = n
	return w
}

// Factor sets spec.safetyFactorPercent.
func (w *DownstreamQuotaWrapper) Factor(percent int32) *DownstreamQuotaWrapper {
	w.Spec.SafetyFactorPercent = percent
	return w
}

// Upstream sets spec.upstream.
func (w *DownstreamQuotaWrapper) Upstream(url string) *DownstreamQuotaWrapper {
	w.Spec.Upstream = url
	return w
}

// Target adds a target of weight 0 (the API server defaults it to 1).
func (w *DownstreamQuotaWrapper) Target(kind apportionv1.WorkloadKind, name string) *DownstreamQuotaWrapper {
	return w.Targets(apportionv1.Target{Kind: kind, Name: name})
}

// Targets adds targets as given.
func (w *DownstreamQuotaWrapper) Targets(ts ...apportionv1.Target) *DownstreamQuotaWrapper {
	w.Spec.Targets = append(w.Spec.Targets, ts...)
	return w
}

// Rate sets the rate contract: requestsPerSecond and burst (mode left to its default).
func (w *DownstreamQuotaWrapper) Rate(perSecond, burst int32) *DownstreamQuotaWrapper {
	w.Spec.Rate = &apportionv1.RateContract{RequestsPerSecond: perSecond, Burst: burst}
	return w
}

// RateMode sets the rate contract's mode (after Rate).
func (w *DownstreamQuotaWrapper) RateMode(m apportionv1.RateMode) *DownstreamQuotaWrapper {
	w.Spec.Rate.Mode = m
	return w
}

// Timeouts sets the agents' acquire and request timeouts.
func (w *DownstreamQuotaWrapper) Timeouts(acquire, request time.Duration) *DownstreamQuotaWrapper {
	w.Spec.Agent.AcquireTimeout = &metav1.Duration{Duration: acquire}
	w.Spec.Agent.RequestTimeout = &metav1.Duration{Duration: request}
	return w
}

// FailurePolicy sets the agents' failure policy.
func (w *DownstreamQuotaWrapper) FailurePolicy(p apportionv1.FailurePolicy) *DownstreamQuotaWrapper {
	w.Spec.Agent.FailurePolicy = p
	return w
}

// Fallback sets the agents' fallback.
func (w *DownstreamQuotaWrapper) Fallback(f apportionv1.Fallback) *DownstreamQuotaWrapper {
	w.Spec.Agent.Fallback = &f
	return w
}

// Breaker sets the agents' circuit breaker.
func (w *DownstreamQuotaWrapper) Breaker(b apportionv1.CircuitBreaker) *DownstreamQuotaWrapper {
	w.Spec.Agent.CircuitBreaker = &b
	return w
}

// DegradeRuleWrapper builds a DegradeRule.
type DegradeRuleWrapper struct{ apportionv1.DegradeRule }

// MakeDegradeRule is a rule for downstream that rejects all of its traffic until expiresAt, with
// a reason on record.
func MakeDegradeRule(name, ns, downstream string, expiresAt time.Time) *DegradeRuleWrapper {
	return &DegradeRuleWrapper{apportionv1.DegradeRule{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: apportionv1.DegradeRuleSpec{
			Downstream: downstream,
			Action:     apportionv1.Fallback{Action: apportionv1.FallbackReject},
			Reason:     "test: " + name,
			ExpiresAt:  metav1.NewTime(expiresAt),
		},
	}}
}

// Obj returns a copy of the rule.
func (w *DegradeRuleWrapper) Obj() *apportionv1.DegradeRule { return w.DeepCopy() }

// Generation sets metadata.generation (for objects that are never sent to an API server).
func (w *DegradeRuleWrapper) Generation(g int64) *DegradeRuleWrapper {
	w.ObjectMeta.Generation = g
	return w
}

// UID sets metadata.uid (for objects that are never sent to an API server).
func (w *DegradeRuleWrapper) UID(uid types.UID) *DegradeRuleWrapper {
	w.ObjectMeta.UID = uid
	return w
}

// Reason sets spec.reason.
func (w *DegradeRuleWrapper) Reason(r string) *DegradeRuleWrapper {
	w.Spec.Reason = r
	return w
}

// Target narrows the rule to one of the quota's targets.
func (w *DegradeRuleWrapper) Target(kind apportionv1.WorkloadKind, name string) *DegradeRuleWrapper {
	w.Spec.Target = &apportionv1.DegradeTarget{Kind: kind, Name: name}
	return w
}

// Action sets spec.action.
func (w *DegradeRuleWrapper) Action(f apportionv1.Fallback) *DegradeRuleWrapper {
	w.Spec.Action = f
	return w
}

// Static sets the action to a canned answer.
func (w *DegradeRuleWrapper) Static(status int32, headers map[string]string, body string) *DegradeRuleWrapper {
	return w.Action(apportionv1.Fallback{Action: apportionv1.FallbackStatic, Static: &apportionv1.StaticResponse{
		Status: status, Headers: headers, Body: body,
	}})
}

// Active sets spec.active.
func (w *DegradeRuleWrapper) Active(on bool) *DegradeRuleWrapper {
	w.Spec.Active = ptr.To(on)
	return w
}

// Percent scopes the rule to percent of the traffic, picked by the value of keyHeader.
func (w *DegradeRuleWrapper) Percent(percent int32, keyHeader string) *DegradeRuleWrapper {
	if w.Spec.Scope == nil {
		w.Spec.Scope = &apportionv1.DegradeScope{}
	}
	w.Spec.Scope.Percent, w.Spec.Scope.KeyHeader = ptr.To(percent), keyHeader
	return w
}

// Scope sets spec.scope.
func (w *DegradeRuleWrapper) Scope(s apportionv1.DegradeScope) *DegradeRuleWrapper {
	w.Spec.Scope = &s
	return w
}

// DownstreamWrapper builds the per-downstream part of an agent's assignment (the wire form
// internal/assignment defines), as the manager's push template holds it.
type DownstreamWrapper struct{ assignment.Downstream }

// MakeDownstream is a downstream with upstream http://upstream.example, acquire timeout 200ms,
// request timeout 30s and the Reject fallback; permits are set per pod.
func MakeDownstream(name string) *DownstreamWrapper {
	return &DownstreamWrapper{assignment.Downstream{
		Name:           name,
		Upstream:       "http://upstream.example",
		AcquireTimeout: assignment.Duration(apportionv1.DefaultAcquireTimeout),
		RequestTimeout: assignment.Duration(apportionv1.DefaultRequestTimeout),
		Fallback:       assignment.Fallback{Action: assignment.ActionReject},
	}}
}

// Obj returns the downstream (a copy: its slices and pointers are copied too).
func (w *DownstreamWrapper) Obj() assignment.Downstream {
	d := w.Downstream
	if w.Rate != nil {
		r := *w.Rate
		d.Rate = &r
	}
	if w.Breaker != nil {
		b := *w.Breaker
		d.Breaker = &b
	}
	return d
}

// RequestTimeout sets the request timeout.
func (w *DownstreamWrapper) RequestTimeout(d time.Duration) *DownstreamWrapper {
	w.Downstream.RequestTimeout = assignment.Duration(d)
	return w
}

// Upstream sets the upstream URL.
func (w *DownstreamWrapper) Upstream(url string) *DownstreamWrapper {
	w.Downstream.Upstream = url
	return w
}
