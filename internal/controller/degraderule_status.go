package controller

import (
	"fmt"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// DefaultMaxDegradeHorizon is how far in the future a DegradeRule's expiresAt may lie when the
// manager's --max-degrade-horizon is not set.
const DefaultMaxDegradeHorizon = 24 * time.Hour

// ruleInputs is what one DegradeRule reconcile observed.
type ruleInputs struct {
	// Now is the reconciler's clock.
	Now time.Time
	// Horizon is the furthest expiresAt may lie from Now when a spec is first judged.
	Horizon time.Duration
	// Quota is the DownstreamQuota the rule names; nil when it does not exist (or is being deleted).
	Quota *apportionv1.DownstreamQuota
	// Engine is true when a push engine is wired; Applied and Total are then its answer for the
	// rule's switch: affected pods that confirmed its current form, and affected pods.
	Engine         bool
	Applied, Total int32
}

// timeVerdict reports whether a rule's expiry was judged past or beyond the horizon. The expiry
// is judged once per spec generation, when the controller first sees it (creation or edit): an
// expiry that is merely reached later makes the rule Expired, not Invalid, and a verdict of
// Invalid stands until the spec is edited, even once the expiry comes within the horizon.
func timeVerdict(rule *apportionv1.DegradeRule, now time.Time, horizon time.Duration) (firstSight bool, reason, msg string) {
	if prev := meta.FindStatusCondition(rule.Status.Conditions, apportionv1.ConditionValid); prev != nil &&
		prev.ObservedGeneration == rule.Generation && rule.Status.ObservedGeneration == rule.Generation {
		if prev.Reason == apportionv1.ReasonExpiryPast || prev.Reason == apportionv1.ReasonBeyondHorizon {
			return false, prev.Reason, prev.Message
		}
		return false, "", ""
	}
	exp := rule.Spec.ExpiresAt.Time
	switch {
	case !now.Before(exp):
		return true, apportionv1.ReasonExpiryPast, fmt.Sprintf(
			"expiresAt %s was already past when the rule was written; set a future expiresAt (at most %s ahead) to apply it",
			fmtRuleTime(exp), fmtHorizon(horizon))
	case exp.Sub(now) > horizon:
		return true, apportionv1.ReasonBeyondHorizon, fmt.Sprintf(
			"expiresAt %s is %s ahead, beyond the manager's maximum horizon of %s (--max-degrade-horizon); set an earlier expiresAt",
			fmtRuleTime(exp), fmtHorizon(exp.Sub(now).Round(time.Second)), fmtHorizon(horizon))
	}
	return true, "", ""
}

// refVerdict checks what a rule refers to and what the agents accept; it is judged anew on every
// reconcile, so a rule becomes valid once its DownstreamQuota appears.
func refVerdict(rule *apportionv1.DegradeRule, dq *apportionv1.DownstreamQuota) (reason, msg string) {
	if refusal := agentRefusal(rule); refusal != "" {
		return apportionv1.ReasonAgentWouldRefuse, "the agents would refuse this switch: " + refusal
	}
	if dq == nil {
		return apportionv1.ReasonDownstreamNotFound, fmt.Sprintf(
			"DownstreamQuota %q does not exist in namespace %q; the rule is not pushed until it does",
			rule.Spec.Downstream, rule.Namespace)
	}
	if t := rule.Spec.Target; t != nil {
		names := make([]string, 0, len(dq.Spec.Targets))
		for _, qt := range dq.Spec.Targets {
			if qt.Kind == t.Kind && qt.Name == t.Name {
				return "", ""
			}
			names = append(names, string(qt.Kind)+"/"+qt.Name)
		}
		return apportionv1.ReasonTargetNotFound, fmt.Sprintf("%s/%s is not a target of DownstreamQuota %q (its targets: %s)",
			t.Kind, t.Name, dq.Name, strings.Join(names, ", "))
	}
	return "", ""
}

// computeRuleStatus is the pure part of a DegradeRule reconcile: from the rule and what was
// observed, the status to write. Conditions keep their LastTransitionTime while their status
// does not change.
//
// Phases, first match wins:
//   - Invalid: expiresAt was past or beyond the horizon when the spec was written (sticky for
//     the generation);
//   - Expired: now is at or past expiresAt;
//   - Invalid: the agents would refuse the switch, or the DownstreamQuota or target is missing;
//   - Inactive: spec.active is false;
//   - Active without an engine (nothing confirms anything: podsTotal 0, said in the message);
//   - Pending: the rule was not pushable before this reconcile (new or edited spec, or it was
//     Invalid, Inactive or Expired), so the engine cannot hold its form yet; or fewer affected
//     pods confirmed it than there are;
//   - Active: every affected pod confirmed it. Once Active, a rule stays Active for its
//     generation while pods come and go; podsApplied/podsTotal tell the current counts.
func computeRuleStatus(rule *apportionv1.DegradeRule, in ruleInputs) apportionv1.DegradeRuleStatus {
	prev := rule.Status
	now := metav1.NewTime(in.Now)
	exp := rule.Spec.ExpiresAt.Time
	st := apportionv1.DegradeRuleStatus{
		ObservedGeneration: rule.Generation,
		ActiveSince:        prev.ActiveSince,
		Scope:              scopeSummary(rule.Spec.Scope),
		Conditions:         append([]metav1.Condition(nil), prev.Conditions...),
	}

	firstSight, timeReason, timeMsg := timeVerdict(rule, in.Now, in.Horizon)
	var refReason, refMsg string
	if timeReason == "" {
		refReason, refMsg = refVerdict(rule, in.Quota)
	}

	active := rule.Spec.Active == nil || *rule.Spec.Active
	until := fmtRuleTime(exp)
	switch {
	case timeReason != "":
		st.Phase, st.Message = apportionv1.PhaseInvalid, timeMsg
	case !in.Now.Before(exp):
		st.Phase, st.Message = apportionv1.PhaseExpired,
			fmt.Sprintf("expired at %s; kept as an audit record until deleted (set a future expiresAt to apply it again)", until)
	case refReason != "":
		st.Phase, st.Message = apportionv1.PhaseInvalid, refMsg
	case !active:
		st.Phase, st.Message = apportionv1.PhaseInactive,
			fmt.Sprintf("switched off (spec.active is false); set it to true to apply the rule until %s", until)
	case !in.Engine:
		st.Phase, st.Message = apportionv1.PhaseActive,
			fmt.Sprintf("in force until %s; no push engine is wired, so no pod confirmed it (podsTotal 0)", until)
	case firstSight || (prev.Phase != apportionv1.PhasePending && prev.Phase != apportionv1.PhaseActive):
		// The DownstreamQuota reconciler pushes a rule only once its status says Pending or Active
		// for the current generation (see switchFor): until then, whatever the engine reports is
		// about an earlier form, or about nothing.
		st.Phase, st.Message = apportionv1.PhasePending,
			"accepted; waiting for the push engine to deliver it to the affected pods"
	default:
		st.PodsApplied, st.PodsTotal = in.Applied, in.Total
		wasActive := prev.Phase == apportionv1.PhaseActive
		switch {
		case in.Applied < in.Total && !wasActive:
			st.Phase, st.Message = apportionv1.PhasePending,
				fmt.Sprintf("%d of %d affected pods confirmed it", in.Applied, in.Total)
		case in.Total == 0:
			st.Phase, st.Message = apportionv1.PhaseActive,
				fmt.Sprintf("in force until %s; no affected pod is running", until)
		default:
			st.Phase, st.Message = apportionv1.PhaseActive,
				fmt.Sprintf("in force until %s; %d of %d affected pods confirmed it", until, in.Applied, in.Total)
		}
	}

	// activeSince: when the rule last became Active. It survives an edit of an Active rule (the
	// Pending while its new form is delivered) and stays on record once the rule ends; it is
	// cleared when a rule that had ended starts over.
	switch st.Phase {
	case apportionv1.PhaseActive:
		if prev.ActiveSince == nil || (prev.Phase != apportionv1.PhaseActive && prev.Phase != apportionv1.PhasePending) {
			st.ActiveSince = &now
		}
	case apportionv1.PhasePending:
		if prev.Phase != apportionv1.PhaseActive && prev.Phase != apportionv1.PhasePending {
			st.ActiveSince = nil
		}
	}

	set := func(t string, ok bool, reason, msg string) { st.SetCondition(t, ok, reason, msg, now) }
	switch {
	case timeReason != "":
		set(apportionv1.ConditionValid, false, timeReason, timeMsg)
	case refReason != "":
		set(apportionv1.ConditionValid, false, refReason, refMsg)
	default:
		set(apportionv1.ConditionValid, true, apportionv1.ReasonRuleValid, "the rule can be applied")
	}
	set(apportionv1.ConditionReady, st.Phase == apportionv1.PhaseActive, string(st.Phase), st.Message)
	return st
}

// ruleRequeue is when the rule must be looked at again without any event: at its expiry (to
// mark it Expired), sooner while Pending (to follow the pods' confirmations) and, with an
// engine, every activeResync while Active (to refresh podsApplied/podsTotal). Zero means never.
func ruleRequeue(rule *apportionv1.DegradeRule, st *apportionv1.DegradeRuleStatus, now time.Time, poll, activeResync time.Duration, engine bool) time.Duration {
	untilExpiry := rule.Spec.ExpiresAt.Sub(now)
	if untilExpiry <= 0 {
		return 0
	}
	switch st.Phase {
	case apportionv1.PhasePending:
		return min(poll, untilExpiry)
	case apportionv1.PhaseActive:
		if engine {
			return min(activeResync, untilExpiry)
		}
		return untilExpiry
	case apportionv1.PhaseInactive:
		return untilExpiry
	case apportionv1.PhaseInvalid:
		// An invalid expiry stands until the spec is edited; a missing quota or target is
		// re-judged on the quota's events, but the rule still ends at its expiry.
		if c := meta.FindStatusCondition(st.Conditions, apportionv1.ConditionValid); c != nil &&
			(c.Reason == apportionv1.ReasonExpiryPast || c.Reason == apportionv1.ReasonBeyondHorizon) {
			return 0
		}
		return untilExpiry
	}
	return 0
}

func fmtRuleTime(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// fmtHorizon prints 24h0m0s as 24h and 1h30m0s as 1h30m.
func fmtHorizon(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}
