package controller

import (
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
)

// The pure part of the DegradeRule controller: computeRuleStatus, ruleRequeue and switchFor's
// gate, without an API server.

var (
	t0     = time.Date(2026, 11, 28, 10, 0, 0, 0, time.UTC)
	t0m    = metav1.NewTime(t0)
	before = metav1.NewTime(t0.Add(-time.Hour))
)

func drRule(gen int64, expiresIn time.Duration, mutate ...func(*apportionv1.DegradeRule)) *apportionv1.DegradeRule {
	r := builders.MakeDegradeRule("recommend-sale", "shop", "recommend", t0.Add(expiresIn)).
		Generation(gen).
		Static(200, map[string]string{"Content-Type": "application/json"}, "[]").
		Active(true).
		Reason("Black Friday: recommend is saturated").
		Percent(10, "X-User-Id").
		Obj()
	for _, m := range mutate {
		m(r)
	}
	return r
}

// judged gives a rule the status a previous reconcile wrote for its current generation.
func judged(phase apportionv1.DegradePhase, validReason string, conds ...metav1.Condition) func(*apportionv1.DegradeRule) {
	return func(r *apportionv1.DegradeRule) {
		r.Status.ObservedGeneration = r.Generation
		r.Status.Phase = phase
		valid := metav1.ConditionTrue
		if validReason != apportionv1.ReasonRuleValid {
			valid = metav1.ConditionFalse
		}
		r.Status.Conditions = append([]metav1.Condition{
			{Type: "Valid", Status: valid, Reason: validReason, Message: "earlier", ObservedGeneration: r.Generation, LastTransitionTime: before},
		}, conds...)
	}
}

func withActiveSince(t metav1.Time) func(*apportionv1.DegradeRule) {
	return func(r *apportionv1.DegradeRule) { r.Status.ActiveSince = &t }
}

func cond(typ string, ok bool, reason, msg string, gen int64, at metav1.Time) metav1.Condition {
	s := metav1.ConditionFalse
	if ok {
		s = metav1.ConditionTrue
	}
	return metav1.Condition{Type: typ, Status: s, Reason: reason, Message: msg, ObservedGeneration: gen, LastTransitionTime: at}
}

func recommendQuota(targets ...string) *apportionv1.DownstreamQuota {
	w := builders.MakeDownstreamQuota("recommend", "shop").Upstream("")
	for _, t := range targets {
		w.Target(apportionv1.KindDeployment, t)
	}
	return w.Obj()
}

const (
	validMsg  = "the rule can be applied"
	untilHour = "2026-11-28T11:00:00Z"
)

func TestComputeRuleStatus(t *testing.T) {
	quota := recommendQuota("storefront", "checkout")
	noEngine := func(now time.Time) ruleInputs {
		return ruleInputs{Now: now, Horizon: 24 * time.Hour, Quota: quota}
	}
	engine := func(applied, total int32) ruleInputs {
		return ruleInputs{Now: t0, Horizon: 24 * time.Hour, Quota: quota, Engine: true, Applied: applied, Total: total}
	}
	activeNoEngine := "in force until " + untilHour + "; no push engine is wired, so no pod confirmed it (podsTotal 0)"
	expiredMsg := "expired at 2026-11-28T10:00:00Z; kept as an audit record until deleted (set a future expiresAt to apply it again)"

	tests := []struct {
		name string
		rule *apportionv1.DegradeRule
		in   ruleInputs
		want apportionv1.DegradeRuleStatus
	}{
		{
			name: "new valid rule without an engine is Active at once, podsTotal 0",
			rule: drRule(1, time.Hour),
			in:   noEngine(t0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseActive, Message: activeNoEngine,
				ActiveSince: &t0m, Scope: "10% by X-User-Id",
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 1, t0m),
					cond("Ready", true, "Active", activeNoEngine, 1, t0m),
				},
			},
		},
		{
			name: "new valid rule with an engine is Pending: the engine cannot hold its form yet",
			rule: drRule(1, time.Hour),
			in:   engine(5, 5),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhasePending,
				Message: "accepted; waiting for the push engine to deliver it to the affected pods",
				Scope:   "10% by X-User-Id",
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 1, t0m),
					cond("Ready", false, "Pending", "accepted; waiting for the push engine to deliver it to the affected pods", 1, t0m),
				},
			},
		},
		{
			name: "Pending while some pods have not confirmed",
			rule: drRule(1, time.Hour, judged(apportionv1.PhasePending, apportionv1.ReasonRuleValid)),
			in:   engine(2, 3),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhasePending, Message: "2 of 3 affected pods confirmed it",
				Scope: "10% by X-User-Id", PodsApplied: 2, PodsTotal: 3,
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 1, before),
					cond("Ready", false, "Pending", "2 of 3 affected pods confirmed it", 1, t0m),
				},
			},
		},
		{
			name: "Pending → Active once every affected pod confirmed it",
			rule: drRule(1, time.Hour, judged(apportionv1.PhasePending, apportionv1.ReasonRuleValid,
				cond("Ready", false, "Pending", "2 of 3 affected pods confirmed it", 1, before))),
			in: engine(3, 3),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseActive,
				Message: "in force until " + untilHour + "; 3 of 3 affected pods confirmed it",
				Scope:   "10% by X-User-Id", PodsApplied: 3, PodsTotal: 3, ActiveSince: &t0m,
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 1, before),
					cond("Ready", true, "Active", "in force until "+untilHour+"; 3 of 3 affected pods confirmed it", 1, t0m),
				},
			},
		},
		{
			name: "an Active rule stays Active while a new pod has not confirmed it yet",
			rule: drRule(1, time.Hour, judged(apportionv1.PhaseActive, apportionv1.ReasonRuleValid,
				cond("Ready", true, "Active", "x", 1, before)), withActiveSince(before)),
			in: engine(3, 4),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseActive,
				Message: "in force until " + untilHour + "; 3 of 4 affected pods confirmed it",
				Scope:   "10% by X-User-Id", PodsApplied: 3, PodsTotal: 4, ActiveSince: &before,
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 1, before),
					cond("Ready", true, "Active", "in force until "+untilHour+"; 3 of 4 affected pods confirmed it", 1, before),
				},
			},
		},
		{
			name: "an edit of an Active rule is Pending again but keeps activeSince",
			rule: drRule(2, time.Hour, func(r *apportionv1.DegradeRule) {
				judged(apportionv1.PhaseActive, apportionv1.ReasonRuleValid, cond("Ready", true, "Active", "x", 1, before))(r)
				r.Status.ObservedGeneration = 1
				r.Status.Conditions[0].ObservedGeneration = 1
				r.Spec.Scope.Percent = ptr.To[int32](50)
			}, withActiveSince(before)),
			in: engine(10, 10),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 2, Phase: apportionv1.PhasePending,
				Message: "accepted; waiting for the push engine to deliver it to the affected pods",
				Scope:   "50% by X-User-Id", ActiveSince: &before,
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 2, before),
					cond("Ready", false, "Pending", "accepted; waiting for the push engine to deliver it to the affected pods", 2, t0m),
				},
			},
		},
		{
			name: "an Active rule that reaches its expiry is Expired, not Invalid; activeSince stays on record",
			rule: drRule(1, 0, judged(apportionv1.PhaseActive, apportionv1.ReasonRuleValid,
				cond("Ready", true, "Active", "x", 1, before)), withActiveSince(before)),
			in: noEngine(t0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseExpired, Message: expiredMsg,
				Scope: "10% by X-User-Id", ActiveSince: &before,
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 1, before),
					cond("Ready", false, "Expired", expiredMsg, 1, t0m),
				},
			},
		},
		{
			name: "an expired rule whose quota was deleted stays Expired",
			rule: drRule(1, -time.Minute, judged(apportionv1.PhaseExpired, apportionv1.ReasonRuleValid)),
			in:   ruleInputs{Now: t0, Horizon: 24 * time.Hour},
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseExpired,
				Message: strings.Replace(expiredMsg, "10:00:00", "09:59:00", 1),
				Scope:   "10% by X-User-Id",
				Conditions: []metav1.Condition{
					cond("Valid", false, "DownstreamNotFound", `DownstreamQuota "recommend" does not exist in namespace "shop"; the rule is not pushed until it does`, 1, t0m),
					cond("Ready", false, "Expired", strings.Replace(expiredMsg, "10:00:00", "09:59:00", 1), 1, t0m),
				},
			},
		},
		{
			name: "created with its expiry already past: Invalid",
			rule: drRule(1, -time.Minute),
			in:   noEngine(t0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseInvalid,
				Message: "expiresAt 2026-11-28T09:59:00Z was already past when the rule was written; set a future expiresAt (at most 24h ahead) to apply it",
				Scope:   "10% by X-User-Id",
				Conditions: []metav1.Condition{
					cond("Valid", false, "ExpiryPast", "expiresAt 2026-11-28T09:59:00Z was already past when the rule was written; set a future expiresAt (at most 24h ahead) to apply it", 1, t0m),
					cond("Ready", false, "Invalid", "expiresAt 2026-11-28T09:59:00Z was already past when the rule was written; set a future expiresAt (at most 24h ahead) to apply it", 1, t0m),
				},
			},
		},
		{
			name: "created beyond the horizon: Invalid",
			rule: drRule(1, 25*time.Hour),
			in:   noEngine(t0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseInvalid,
				Message: "expiresAt 2026-11-29T11:00:00Z is 25h ahead, beyond the manager's maximum horizon of 24h (--max-degrade-horizon); set an earlier expiresAt",
				Scope:   "10% by X-User-Id",
				Conditions: []metav1.Condition{
					cond("Valid", false, "BeyondHorizon", "expiresAt 2026-11-29T11:00:00Z is 25h ahead, beyond the manager's maximum horizon of 24h (--max-degrade-horizon); set an earlier expiresAt", 1, t0m),
					cond("Ready", false, "Invalid", "expiresAt 2026-11-29T11:00:00Z is 25h ahead, beyond the manager's maximum horizon of 24h (--max-degrade-horizon); set an earlier expiresAt", 1, t0m),
				},
			},
		},
		{
			name: "an expiry judged beyond the horizon stays Invalid when it comes within it, until the spec is edited",
			rule: drRule(1, 2*time.Hour, judged(apportionv1.PhaseInvalid, apportionv1.ReasonBeyondHorizon,
				cond("Ready", false, "Invalid", "earlier", 1, before))),
			in: noEngine(t0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseInvalid, Message: "earlier", Scope: "10% by X-User-Id",
				Conditions: []metav1.Condition{
					cond("Valid", false, "BeyondHorizon", "earlier", 1, before),
					cond("Ready", false, "Invalid", "earlier", 1, before),
				},
			},
		},
		{
			name: "editing the expiry of an Expired rule to a valid future time switches it on again",
			rule: drRule(2, time.Hour, func(r *apportionv1.DegradeRule) {
				judged(apportionv1.PhaseExpired, apportionv1.ReasonRuleValid, cond("Ready", false, "Expired", "x", 1, before))(r)
				r.Status.ObservedGeneration = 1
				r.Status.Conditions[0].ObservedGeneration = 1
			}, withActiveSince(before)),
			in: noEngine(t0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 2, Phase: apportionv1.PhaseActive, Message: activeNoEngine,
				Scope: "10% by X-User-Id", ActiveSince: &t0m,
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 2, before),
					cond("Ready", true, "Active", activeNoEngine, 2, t0m),
				},
			},
		},
		{
			name: "editing an Expired rule without moving its expiry makes it Invalid",
			rule: drRule(2, -time.Minute, func(r *apportionv1.DegradeRule) {
				judged(apportionv1.PhaseExpired, apportionv1.ReasonRuleValid)(r)
				r.Status.ObservedGeneration = 1
				r.Status.Conditions[0].ObservedGeneration = 1
			}),
			in: noEngine(t0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 2, Phase: apportionv1.PhaseInvalid,
				Message: "expiresAt 2026-11-28T09:59:00Z was already past when the rule was written; set a future expiresAt (at most 24h ahead) to apply it",
				Scope:   "10% by X-User-Id",
				Conditions: []metav1.Condition{
					cond("Valid", false, "ExpiryPast", "expiresAt 2026-11-28T09:59:00Z was already past when the rule was written; set a future expiresAt (at most 24h ahead) to apply it", 2, t0m),
					cond("Ready", false, "Invalid", "expiresAt 2026-11-28T09:59:00Z was already past when the rule was written; set a future expiresAt (at most 24h ahead) to apply it", 2, t0m),
				},
			},
		},
		{
			name: "a missing DownstreamQuota: Invalid",
			rule: drRule(1, time.Hour),
			in:   ruleInputs{Now: t0, Horizon: 24 * time.Hour},
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseInvalid,
				Message: `DownstreamQuota "recommend" does not exist in namespace "shop"; the rule is not pushed until it does`,
				Scope:   "10% by X-User-Id",
				Conditions: []metav1.Condition{
					cond("Valid", false, "DownstreamNotFound", `DownstreamQuota "recommend" does not exist in namespace "shop"; the rule is not pushed until it does`, 1, t0m),
					cond("Ready", false, "Invalid", `DownstreamQuota "recommend" does not exist in namespace "shop"; the rule is not pushed until it does`, 1, t0m),
				},
			},
		},
		{
			name: "the DownstreamQuota appears later: valid then, its expiry judged at creation still holds",
			rule: drRule(1, time.Hour, judged(apportionv1.PhaseInvalid, apportionv1.ReasonDownstreamNotFound,
				cond("Ready", false, "Invalid", "earlier", 1, before))),
			in: noEngine(t0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseActive, Message: activeNoEngine,
				Scope: "10% by X-User-Id", ActiveSince: &t0m,
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 1, t0m),
					cond("Ready", true, "Active", activeNoEngine, 1, t0m),
				},
			},
		},
		{
			name: "the DownstreamQuota appears later, with an engine: Pending until the engine has the switch",
			rule: drRule(1, time.Hour, judged(apportionv1.PhaseInvalid, apportionv1.ReasonDownstreamNotFound,
				cond("Ready", false, "Invalid", "earlier", 1, before))),
			in: engine(0, 0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhasePending,
				Message: "accepted; waiting for the push engine to deliver it to the affected pods",
				Scope:   "10% by X-User-Id",
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 1, t0m),
					cond("Ready", false, "Pending", "accepted; waiting for the push engine to deliver it to the affected pods", 1, before),
				},
			},
		},
		{
			name: "Pending with an engine and no affected pod: Active",
			rule: drRule(1, time.Hour, judged(apportionv1.PhasePending, apportionv1.ReasonRuleValid)),
			in:   engine(0, 0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseActive,
				Message: "in force until " + untilHour + "; no affected pod is running",
				Scope:   "10% by X-User-Id", ActiveSince: &t0m,
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 1, before),
					cond("Ready", true, "Active", "in force until "+untilHour+"; no affected pod is running", 1, t0m),
				},
			},
		},
		{
			name: "a target that is not one of the quota's: Invalid",
			rule: drRule(1, time.Hour, func(r *apportionv1.DegradeRule) {
				r.Spec.Target = &apportionv1.DegradeTarget{Kind: apportionv1.KindStatefulSet, Name: "storefront"}
			}),
			in: noEngine(t0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseInvalid,
				Message: `StatefulSet/storefront is not a target of DownstreamQuota "recommend" (its targets: Deployment/storefront, Deployment/checkout)`,
				Scope:   "10% by X-User-Id",
				Conditions: []metav1.Condition{
					cond("Valid", false, "TargetNotFound", `StatefulSet/storefront is not a target of DownstreamQuota "recommend" (its targets: Deployment/storefront, Deployment/checkout)`, 1, t0m),
					cond("Ready", false, "Invalid", `StatefulSet/storefront is not a target of DownstreamQuota "recommend" (its targets: Deployment/storefront, Deployment/checkout)`, 1, t0m),
				},
			},
		},
		{
			name: "a static answer the agents would refuse: Invalid with the field path",
			rule: drRule(1, time.Hour, func(r *apportionv1.DegradeRule) {
				r.Spec.Action.Static.Headers = map[string]string{"Content Type": "application/json"}
			}),
			in: noEngine(t0),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseInvalid,
				Message: `the agents would refuse this switch: spec.action.static.headers["Content Type"]: is not a valid header name`,
				Scope:   "10% by X-User-Id",
				Conditions: []metav1.Condition{
					cond("Valid", false, "AgentWouldRefuse", `the agents would refuse this switch: spec.action.static.headers["Content Type"]: is not a valid header name`, 1, t0m),
					cond("Ready", false, "Invalid", `the agents would refuse this switch: spec.action.static.headers["Content Type"]: is not a valid header name`, 1, t0m),
				},
			},
		},
		{
			name: "switched off: Inactive",
			rule: drRule(1, time.Hour, func(r *apportionv1.DegradeRule) {
				r.Spec.Active = ptr.To(false)
				r.Spec.Scope = &apportionv1.DegradeScope{Percent: ptr.To[int32](100), Methods: []apportionv1.HTTPMethod{"GET", "HEAD"},
					Headers: []apportionv1.HeaderMatch{{Name: "X-Tenant", Value: "acme"}}}
			}),
			in: engine(0, 3),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseInactive,
				Message: "switched off (spec.active is false); set it to true to apply the rule until " + untilHour,
				Scope:   "100%, X-Tenant=acme, GET|HEAD",
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 1, t0m),
					cond("Ready", false, "Inactive", "switched off (spec.active is false); set it to true to apply the rule until "+untilHour, 1, t0m),
				},
			},
		},
		{
			name: "an unchanged status keeps every LastTransitionTime",
			rule: drRule(1, time.Hour, judged(apportionv1.PhaseActive, apportionv1.ReasonRuleValid,
				cond("Ready", true, "Active", activeNoEngine, 1, before)), func(r *apportionv1.DegradeRule) {
				r.Status.Conditions[0].Message = validMsg
				r.Status.Message = activeNoEngine
				r.Status.Scope = "10% by X-User-Id"
			}, withActiveSince(before)),
			in: noEngine(t0.Add(time.Minute)),
			want: apportionv1.DegradeRuleStatus{
				ObservedGeneration: 1, Phase: apportionv1.PhaseActive, Message: activeNoEngine,
				Scope: "10% by X-User-Id", ActiveSince: &before,
				Conditions: []metav1.Condition{
					cond("Valid", true, "Valid", validMsg, 1, before),
					cond("Ready", true, "Active", activeNoEngine, 1, before),
				},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := computeRuleStatus(tt.rule, tt.in)
			if d := cmp.Diff(tt.want, got); d != "" {
				t.Errorf("computeRuleStatus (-want +got):\n%s", d)
			}
			// Without an engine, a second pass over its own result changes nothing, so the
			// reconciler stops writing. (With one, Pending moves on with the engine's answer.)
			if !tt.in.Engine {
				again := tt.rule.DeepCopy()
				again.Status = got
				if d := cmp.Diff(got, computeRuleStatus(again, tt.in)); d != "" {
					t.Errorf("not a fixed point (-first +second):\n%s", d)
				}
			}
		})
	}
}

func TestRuleRequeue(t *testing.T) {
	const poll, resync = 250 * time.Millisecond, 10 * time.Second
	st := func(phase apportionv1.DegradePhase, validReason string) *apportionv1.DegradeRuleStatus {
		r := drRule(1, 0, judged(phase, validReason))
		return &r.Status
	}
	tests := []struct {
		name      string
		expiresIn time.Duration
		status    *apportionv1.DegradeRuleStatus
		engine    bool
		want      time.Duration
	}{
		{"Active without an engine: exactly at the expiry", 90 * time.Minute, st(apportionv1.PhaseActive, apportionv1.ReasonRuleValid), false, 90 * time.Minute},
		{"Active with an engine: refresh the counts", 90 * time.Minute, st(apportionv1.PhaseActive, apportionv1.ReasonRuleValid), true, resync},
		{"Active with an engine, expiry sooner than the refresh", 3 * time.Second, st(apportionv1.PhaseActive, apportionv1.ReasonRuleValid), true, 3 * time.Second},
		{"Pending: poll", time.Hour, st(apportionv1.PhasePending, apportionv1.ReasonRuleValid), true, poll},
		{"Pending, expiry sooner than the poll", 100 * time.Millisecond, st(apportionv1.PhasePending, apportionv1.ReasonRuleValid), true, 100 * time.Millisecond},
		{"Inactive: at the expiry, to mark it Expired", time.Hour, st(apportionv1.PhaseInactive, apportionv1.ReasonRuleValid), false, time.Hour},
		{"Invalid for a missing quota: at the expiry", time.Hour, st(apportionv1.PhaseInvalid, apportionv1.ReasonDownstreamNotFound), false, time.Hour},
		{"Invalid beyond the horizon: never", 30 * time.Hour, st(apportionv1.PhaseInvalid, apportionv1.ReasonBeyondHorizon), false, 0},
		{"Expired: never", -time.Second, st(apportionv1.PhaseExpired, apportionv1.ReasonRuleValid), false, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := ruleRequeue(drRule(1, tt.expiresIn), tt.status, t0, poll, resync, tt.engine)
			if got != tt.want {
				t.Errorf("ruleRequeue = %s, want %s", got, tt.want)
			}
		})
	}
}

// switchFor pushes only what the DegradeRule controller judged valid for the current generation.
func TestSwitchForGate(t *testing.T) {
	tests := []struct {
		name string
		rule *apportionv1.DegradeRule
		want bool
	}{
		{"just created, not judged yet", drRule(1, time.Hour), false},
		{"judged Pending", drRule(1, time.Hour, judged(apportionv1.PhasePending, apportionv1.ReasonRuleValid)), true},
		{"judged Active", drRule(1, time.Hour, judged(apportionv1.PhaseActive, apportionv1.ReasonRuleValid)), true},
		{"edited since it was judged Active", drRule(1, time.Hour, judged(apportionv1.PhaseActive, apportionv1.ReasonRuleValid),
			func(r *apportionv1.DegradeRule) { r.Generation = 2 }), false},
		{"judged Invalid", drRule(1, time.Hour, judged(apportionv1.PhaseInvalid, apportionv1.ReasonBeyondHorizon)), false},
		{"judged Inactive", drRule(1, time.Hour, judged(apportionv1.PhaseInactive, apportionv1.ReasonRuleValid)), false},
		{"judged Expired", drRule(1, time.Hour, judged(apportionv1.PhaseExpired, apportionv1.ReasonRuleValid)), false},
		{"Active but past its expiry, not yet marked Expired", drRule(1, 0, judged(apportionv1.PhaseActive, apportionv1.ReasonRuleValid)), false},
		{"Active but switched off, not yet judged", drRule(1, time.Hour, judged(apportionv1.PhaseActive, apportionv1.ReasonRuleValid),
			func(r *apportionv1.DegradeRule) { r.Spec.Active = ptr.To(false) }), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ts, ok := switchFor(tt.rule, t0)
			if ok != tt.want {
				t.Fatalf("switchFor = %v, want %v", ok, tt.want)
			}
			if ok && (ts.Switch.Name != "shop/recommend-sale" || ts.Switch.Percent != 10 || ts.Switch.KeyHeader != "X-User-Id" ||
				ts.Switch.Action.Action != "Static" || ts.Switch.Action.Static.Body != "[]") {
				t.Errorf("switch = %+v", ts)
			}
		})
	}
}

func TestAgentRefusalPaths(t *testing.T) {
	if got := agentRefusal(drRule(1, time.Hour)); got != "" {
		t.Errorf("valid rule refused: %s", got)
	}
	r := drRule(1, time.Hour, func(r *apportionv1.DegradeRule) {
		r.Spec.Scope = &apportionv1.DegradeScope{Percent: ptr.To[int32](10), KeyHeader: "X User",
			Headers: []apportionv1.HeaderMatch{{Name: "bad:name", Value: "v"}}}
		r.Spec.Action = apportionv1.Fallback{Action: apportionv1.FallbackStatic}
	})
	want := `spec.scope.keyHeader: must be a valid header name of at most 256 characters; ` +
		`spec.scope.headers[0].name: must be a valid header name of at most 256 characters; ` +
		`spec.action.static: is required when action is Static`
	if got := agentRefusal(r); got != want {
		t.Errorf("agentRefusal =\n%s\nwant\n%s", got, want)
	}
}

func TestFmtHorizon(t *testing.T) {
	for d, want := range map[time.Duration]string{24 * time.Hour: "24h", 90 * time.Minute: "1h30m", 10 * time.Minute: "10m",
		90 * time.Second: "1m30s", 30 * time.Second: "30s", 36*time.Hour + 30*time.Second: "36h0m30s"} {
		if got := fmtHorizon(d); got != want {
			t.Errorf("fmtHorizon(%s) = %q, want %q", d, got, want)
		}
	}
}
