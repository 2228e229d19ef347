package v1alpha1

import (
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Reasons of a DownstreamQuota's conditions, by condition.
const (
	// TargetsFound.
	ReasonAllTargetsFound = "AllFound"
	ReasonTargetMissing   = "TargetMissing"

	// Oversubscribed: TooManyPods when maxInFlight × factor cannot give every weighted pod one
	// permit, WithinQuota otherwise.
	ReasonTooManyPods = "TooManyPods"
	ReasonWithinQuota = "WithinQuota"

	// PodsWithoutAgent: AgentNotFound when pods with an IP have no agent the manager can find.
	ReasonAgentNotFound    = "AgentNotFound"
	ReasonEveryPodHasAgent = "EveryPodHasAgent"

	// PodsReachable: AgentsUnreachable when pushes to some agents fail, AgentNotFound when some
	// pods have no agent to reach.
	ReasonAgentsUnreachable = "AgentsUnreachable"
	ReasonAllReachable      = "AllReachable"

	// Ready: Apportioned when every pod holds its share; Pushing while some have not
	// acknowledged it; Recovering while a newly started manager waits out a previous manager's
	// leases (it raises nobody, and its ledger may count what it cannot see yet above the
	// limit); PodsWithoutAgent, TargetMissing (no target exists) and Oversubscribed otherwise.
	ReasonApportioned      = "Apportioned"
	ReasonPushing          = "Pushing"
	ReasonRecovering       = "Recovering"
	ReasonPodsWithoutAgent = ConditionPodsWithoutAgent
	ReasonOversubscribed   = ConditionOversubscribed

	// NearLimit: AtWarnThreshold while the calls in flight across the pods are at or above
	// spec.warnAtPercent of the budget; BelowWarnThreshold when they have not been since the
	// manager started; Receded once they fell back below it (the condition's transition time
	// then says when, which rate-limits the Warning Event, see ReasonNearLimit).
	ReasonAtWarnThreshold    = "AtWarnThreshold"
	ReasonBelowWarnThreshold = "BelowWarnThreshold"
	ReasonReceded            = "Receded"
)

// Reasons of the Events the manager records about a DownstreamQuota.
const (
	// ReasonRebalanced: pods or permits per pod changed.
	ReasonRebalanced = "Rebalanced"
	// ReasonSafeDefaultChanged: a target's safe default changed.
	ReasonSafeDefaultChanged = "SafeDefaultChanged"
	// ReasonSharesMoved: a DemandAware sharing round moved more than the quota's
	// eventThresholdPercent of the budget.
	ReasonSharesMoved = "SharesMoved"
	// ReasonNearLimit: the calls in flight across the pods reached spec.warnAtPercent of the
	// budget (Warning), recorded when NearLimit turns true, unless it receded less than
	// NearLimitEventQuiet before: a quota that hovers at the threshold warns once, not at every
	// crossing.
	ReasonNearLimit = "NearLimit"
	// ReasonPodsUnreachable: the set of pods whose agents cannot be reached changed (Warning).
	ReasonPodsUnreachable = "PodsUnreachable"
	// ReasonPodsWithoutAgent (above) is also the reason of the Warning recorded each time the
	// set of pods without an agent changes.
)

// Reasons of a DegradeRule's Valid condition. Its Ready condition's reason is its phase.
const (
	ReasonRuleValid          = "Valid"
	ReasonExpiryPast         = "ExpiryPast"
	ReasonBeyondHorizon      = "BeyondHorizon"
	ReasonAgentWouldRefuse   = "AgentWouldRefuse"
	ReasonDownstreamNotFound = "DownstreamNotFound"
	ReasonTargetNotFound     = "TargetNotFound"
)

// Reasons of the Events the manager records about a DegradeRule.
const (
	ReasonRuleActivated   = "Activated"
	ReasonRuleAccepted    = "Accepted"
	ReasonRuleExpired     = "Expired"
	ReasonRuleDeactivated = "Deactivated"
	ReasonRuleInvalid     = "Invalid"
)

// SetCondition sets condition typ in conds to True when ok and False otherwise, with the reason
// and message, for the object generation gen. As meta.SetStatusCondition does, it keeps the
// condition's LastTransitionTime when its status does not change, and sets it to now when it
// does (or when the condition is new).
func SetCondition(conds *[]metav1.Condition, typ string, ok bool, reason, msg string, gen int64, now metav1.Time) {
	s := metav1.ConditionFalse
	if ok {
		s = metav1.ConditionTrue
	}
	meta.SetStatusCondition(conds, metav1.Condition{
		Type: typ, Status: s, Reason: reason, Message: msg, ObservedGeneration: gen, LastTransitionTime: now,
	})
}

// SetCondition sets one of the quota's conditions for its status's observedGeneration; see the
// package function SetCondition.
func (s *DownstreamQuotaStatus) SetCondition(typ string, ok bool, reason, msg string, now metav1.Time) {
	SetCondition(&s.Conditions, typ, ok, reason, msg, s.ObservedGeneration, now)
}

// SetCondition sets one of the rule's conditions for its status's observedGeneration; see the
// package function SetCondition.
func (s *DegradeRuleStatus) SetCondition(typ string, ok bool, reason, msg string, now metav1.Time) {
	SetCondition(&s.Conditions, typ, ok, reason, msg, s.ObservedGeneration, now)
}
