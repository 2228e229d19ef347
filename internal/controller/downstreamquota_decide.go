package controller

import (
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/apportion"
	"github.com/apportion/apportion/internal/push"
)

// This file is the decision of a DownstreamQuota reconcile (Reconcile gathers, decides, acts):
// what it reads (quotaInputs, quotaPolicy) and its second half, the status with Ready's order of
// precedence, the Events and the requeue, from what was gathered, the assignment
// (downstreamquota_assignment.go) and the engine's report. Nothing here reads the API or the
// clock: the time is an input.

// quotaInputs is what one reconcile gathered: everything its decision reads.
type quotaInputs struct {
	// Quota is the quota as read.
	Quota *apportionv1.DownstreamQuota
	// Base is the last status decided for the quota, ahead of the cached one (which lags behind a
	// write just made, and further behind a status still waiting for its writer): the base of the
	// new status (transition times, the last rebalance time), of the safe default's kept replica
	// bound (Targets[].Kept) and of the Events ("8→10 pods", not "0→10").
	Base apportionv1.DownstreamQuotaStatus
	// Targets is what the API says about each of the quota's targets, in spec order.
	Targets []targetObservation
	// Switches are the degrade switches in force at Now (gathered only with an engine).
	Switches []push.TargetedSwitch
	// LastReport is the engine's report from before this reconcile's assignment, whose holdings
	// DemandAware sharing samples; nil without an engine or for an Equal quota.
	LastReport *push.Report
	// Sharing is what DemandAware sharing remembers of the quota between rounds; decideAssignment
	// advances it. Nil for an Equal quota (a DemandAware one then starts afresh).
	Sharing *sharingMemory
	// Now is the time of the reconcile.
	Now time.Time
	// Global is the slice a quota with spec.global is apportioned on (downstreamquota_global.go);
	// Quota then carries the local limit as its maxInFlight. Nil without spec.global.
	Global *globalInput
}

// quotaPolicy is the reconciler's settings as a decision reads them, defaults filled in.
type quotaPolicy struct {
	// Push: an engine takes the assignments; without one the manager only computes and reports.
	Push bool
	// SharingPeriod is how often a DemandAware quota is re-evaluated.
	SharingPeriod time.Duration
	// Sharing tunes DemandAware sharing.
	Sharing sharingParams
	// RemainderRotation is how often the remainder moves to other pods (negative: never).
	RemainderRotation time.Duration
}

// quotaDecision is the second half: the status to write, the Events that describe its change
// from Base, and when to reconcile again without any change (0: never).
type quotaDecision struct {
	Status  apportionv1.DownstreamQuotaStatus
	Events  []statusEvent
	Requeue time.Duration
}

// decideStatus decides the status (computeStatus, with the lanes and the sharing the engine
// reports), the Events that describe its change from in.Base (quotaEventRules) and the requeue,
// from what was gathered, the assignment and the engine's report once it took the assignment
// (nil without an engine).
func decideStatus(in *quotaInputs, p quotaPolicy, a quotaAssignment, report *push.Report) quotaDecision {
	// Whole seconds: the API server keeps a time to the second, and a status is written only
	// when it differs from what the quota has.
	now := metav1.NewTime(in.Now).Rfc3339Copy()
	cur := *in.Quota
	cur.Status = in.Base
	st := computeStatus(&cur, in.Targets, a.Split, report, now)
	st.Lanes = lanesStatus(in.Quota, report)
	if a.Shared != nil {
		st.Sharing = a.Shared.Status
	}
	if rebalanceMessage(in.Base.Targets, st.Targets) != "" {
		st.LastRebalanceTime = &now
	}
	c := eventContext{Quota: in.Quota, Before: &in.Base, After: &st, Shared: a.Shared, Report: report, Now: in.Now}
	var events []statusEvent
	for _, rule := range quotaEventRules {
		if e, ok := rule(&c); ok {
			events = append(events, e)
		}
	}
	return quotaDecision{Status: st, Events: events, Requeue: requeueFor(in.Quota, p, a.Split, a.Rotation)}
}

// eventContext is what the Event rules read: the status decided before and the one decided now.
type eventContext struct {
	Quota         *apportionv1.DownstreamQuota
	Before, After *apportionv1.DownstreamQuotaStatus
	Shared        *shareResult // nil unless DemandAware with an engine
	Report        *push.Report // nil without an engine
	Now           time.Time    // the decision's time
}

// quotaEventRules are the Events a decision records, each a rule over the change of status, in
// the order they are recorded. A rule that reports a set (pods without an agent, unreachable
// pods) fires each time the set changes, not on every reconcile.
var quotaEventRules = [...]func(*eventContext) (statusEvent, bool){
	sharesMovedEvent,
	rebalancedEvent,
	safeDefaultChangedEvent,
	podsWithoutAgentEvent,
	podsUnreachableEvent,
	insecureTLSEvent,
	nearLimitEvent,
}

// sharesMovedEvent: a DemandAware round moved more than the quota's threshold of the budget.
func sharesMovedEvent(c *eventContext) (statusEvent, bool) {
	if c.Shared == nil {
		return statusEvent{}, false
	}
	msg := sharesMovedMessage(c.Quota, *c.Shared)
	return statusEvent{corev1.EventTypeNormal, apportionv1.ReasonSharesMoved, "Rebalance", msg}, msg != ""
}

// rebalancedEvent: a target's pods or permits per pod changed (rebalanceMessage).
func rebalancedEvent(c *eventContext) (statusEvent, bool) {
	msg := rebalanceMessage(c.Before.Targets, c.After.Targets)
	return statusEvent{corev1.EventTypeNormal, apportionv1.ReasonRebalanced, "Rebalance", "rebalanced: " + msg}, msg != ""
}

// safeDefaultChangedEvent: a target's safe default changed (safeDefaultMessage).
func safeDefaultChangedEvent(c *eventContext) (statusEvent, bool) {
	msg := safeDefaultMessage(c.Before.Targets, c.After.Targets)
	return statusEvent{corev1.EventTypeNormal, apportionv1.ReasonSafeDefaultChanged, "Rebalance", "safe default: " + msg}, msg != ""
}

// podsWithoutAgentEvent: a Warning each time the set of pods without an agent changes; the
// condition's message names them.
func podsWithoutAgentEvent(c *eventContext) (statusEvent, bool) {
	now := meta.FindStatusCondition(c.After.Conditions, apportionv1.ConditionPodsWithoutAgent)
	if now == nil || now.Status != metav1.ConditionTrue {
		return statusEvent{}, false
	}
	if old := meta.FindStatusCondition(c.Before.Conditions, apportionv1.ConditionPodsWithoutAgent); old != nil && old.Message == now.Message {
		return statusEvent{}, false
	}
	return statusEvent{corev1.EventTypeWarning, apportionv1.ReasonPodsWithoutAgent, "Apportion", now.Message}, true
}

// podsUnreachableEvent: a Warning each time the set of unreachable pods changes; the condition's
// message names them.
func podsUnreachableEvent(c *eventContext) (statusEvent, bool) {
	now := meta.FindStatusCondition(c.After.Conditions, apportionv1.ConditionPodsReachable)
	if c.Report == nil || now == nil || now.Status != metav1.ConditionFalse || now.Reason != apportionv1.ReasonAgentsUnreachable {
		return statusEvent{}, false
	}
	if old := meta.FindStatusCondition(c.Before.Conditions, apportionv1.ConditionPodsReachable); old != nil && old.Message == now.Message {
		return statusEvent{}, false
	}
	return statusEvent{corev1.EventTypeWarning, apportionv1.ReasonPodsUnreachable, "Push",
		"could not reach the agents of " + strings.Join(c.Report.Unreachable, ", ")}, true
}

// readyFacts is what Ready's rules read, from one computeStatus.
type readyFacts struct {
	// Targets is how many targets the quota names, Missing how many of them do not exist.
	Targets, Missing int
	// Oversubscribed: the budget cannot give each weighted pod one permit.
	Oversubscribed bool
	// NoAgent is the PodsWithoutAgent condition's message; "" when every pod has an agent.
	NoAgent string
	// Report is the engine's; nil without an engine.
	Report *push.Report
}

// readyRule is one cause for Ready to be False: its reason, and whether it holds (with the
// condition's message).
type readyRule struct {
	Reason string
	Holds  func(*readyFacts) (msg string, ok bool)
}

// readyPrecedence is Ready's order of precedence: the first rule that holds makes Ready False with
// its reason and message; when none holds Ready is True (Apportioned). From the first:
//
//  1. TargetMissing: no target workload exists; there is nothing to apportion, whatever else
//     holds.
//  2. Oversubscribed: the quota cannot give every pod a permit; the spec (or the replicas) must
//     change, no push mends it.
//  3. PodsWithoutAgent: pods are counted at their share but nothing enforces it; the promise
//     does not hold for them however the push goes.
//  4. Recovering: the engine waits out a previous manager's leases before raising any pod.
//  5. Pushing: some pods have not acknowledged their permits yet.
//
// Unreachable agents make PodsReachable False, not Ready: their permits stay counted until their
// lease passes, so the limit holds.
var readyPrecedence = [...]readyRule{
	{apportionv1.ReasonTargetMissing, func(f *readyFacts) (string, bool) {
		return "no target workload exists", f.Missing == f.Targets
	}},
	{apportionv1.ReasonOversubscribed, func(f *readyFacts) (string, bool) {
		return "the quota is smaller than the pods that share it", f.Oversubscribed
	}},
	{apportionv1.ReasonPodsWithoutAgent, func(f *readyFacts) (string, bool) {
		return f.NoAgent, f.NoAgent != ""
	}},
	{apportionv1.ReasonRecovering, func(f *readyFacts) (string, bool) {
		return "the manager is waiting out the leases of a previous manager before raising any pod", f.Report != nil && f.Report.Recovering
	}},
	{apportionv1.ReasonPushing, func(f *readyFacts) (string, bool) {
		return "some pods have not acknowledged their permits yet", f.Report != nil && !f.Report.Converged
	}},
}

// readyCause is the first rule of readyPrecedence that holds: its reason and message, ok false
// when none holds.
func readyCause(f *readyFacts) (reason, msg string, ok bool) {
	for _, r := range readyPrecedence {
		if msg, holds := r.Holds(f); holds {
			return r.Reason, msg, true
		}
	}
	return "", "", false
}

// computeStatus is the status of a quota from what was observed, how the budget split and what
// the Pusher reports (nil without one), over the status dq has (its conditions keep their
// LastTransitionTime when their status did not change): the targets, the holdings and the
// conditions, Ready by readyPrecedence.
func computeStatus(dq *apportionv1.DownstreamQuota, obs []targetObservation, split apportion.Result,
	report *push.Report, now metav1.Time) apportionv1.DownstreamQuotaStatus {
	st := apportionv1.DownstreamQuotaStatus{
		ObservedGeneration: dq.Generation,
		Conditions:         append([]metav1.Condition(nil), dq.Status.Conditions...),
		Assigned:           int32(split.Assigned),
		LastRebalanceTime:  dq.Status.LastRebalanceTime,
	}
	synced := map[string]int32{}
	if report != nil {
		st.Ledger = report.Ledger
		for _, h := range report.Holdings {
			if h.Synced {
				synced[h.Target]++
			}
		}
		st.Holdings, st.HoldingsOmitted = summarizeHoldings(report.Holdings, MaxHoldingsInStatus)
		if d := report.LastRebalanceDuration; d > 0 {
			st.LastRebalanceDuration = d.Round(100_000).String()
		} else {
			st.LastRebalanceDuration = dq.Status.LastRebalanceDuration
		}
	}

	rates := rateSplitFor(dq, obs)
	var missing, perPod, noAgent []string
	for i, o := range obs {
		ts := apportionv1.TargetStatus{
			Kind:                o.Target.Kind,
			Name:                o.Target.Name,
			Found:               o.Found,
			Replicas:            int32(o.replicas()),
			Pods:                int32(len(o.Pods)),
			HPA:                 o.HPA,
			PermitsPerPod:       int32(split.PerPod[i]),
			ExtraPermits:        int32(split.Extra[i]),
			SafeDefaultPermits:  int32(split.SafeDefault[i]),
			SafeDefaultReplicas: int32(o.maxReplicas()),
			PodsSynced:          synced[o.Target.Name],
		}
		if rates != nil {
			ts.RatePerPod = &apportionv1.RateShare{
				RequestsPerSecond: formatRate(rates.PerPod[i].PerSecond),
				Burst:             int32(rates.PerPod[i].Burst),
			}
		}
		for j := range o.Pods {
			if withoutAgent(&o.Pods[j]) {
				noAgent = append(noAgent, o.Pods[j].Name)
			}
		}
		if !o.Found {
			missing = append(missing, fmt.Sprintf("%s/%s", o.Target.Kind, o.Target.Name))
		}
		st.Targets = append(st.Targets, ts)
		st.Pods += ts.Replicas
		perPod = append(perPod, permitsText(ts))
	}
	st.PerPod = strings.Join(perPod, ",")
	if split.Weighted > 0 || len(split.SafeDefault) > 0 {
		// The weight-1 safe default: Budget / Σ weight × safeDefaultReplicas.
		var weightedMax int64
		for _, o := range obs {
			weightedMax += weightOf(o.Target) * o.maxReplicas()
		}
		if weightedMax > 0 {
			st.SafeDefaultPermits = int32(split.Budget / weightedMax)
		}
	}

	set := func(t string, ok bool, reason, msg string) { st.SetCondition(t, ok, reason, msg, now) }

	setUpstreamTLSCondition(dq, &st, set)

	if len(missing) > 0 {
		set(apportionv1.ConditionTargetsFound, false, apportionv1.ReasonTargetMissing,
			fmt.Sprintf("%s not found; nothing is assigned to it", strings.Join(missing, ", ")))
	} else {
		set(apportionv1.ConditionTargetsFound, true, apportionv1.ReasonAllTargetsFound, "every target workload exists")
	}

	if split.Oversubscribed {
		set(apportionv1.ConditionOversubscribed, true, apportionv1.ReasonTooManyPods, fmt.Sprintf(
			"%d × %d%% = %d permits cannot give one permit to each of %d weighted pods; at most %d fit (Σ weight × replicas); pods with 0 permits answer with the fallback",
			dq.Spec.MaxInFlight, safetyFactorPercent(dq), split.Budget, split.Weighted, split.FitWeighted))
	} else {
		set(apportionv1.ConditionOversubscribed, false, apportionv1.ReasonWithinQuota, fmt.Sprintf(
			"%d of %d permits assigned to %d pods", split.Assigned, dq.Spec.MaxInFlight, st.Pods))
	}

	sort.Strings(noAgent)
	noAgentMsg := ""
	if len(noAgent) > 0 {
		noAgentMsg = fmt.Sprintf("%d pods have no agent the manager can find (no %s annotation, no container port %s): %s; they are counted at their share, but nothing enforces it",
			len(noAgent), apportionv1.AgentPortAnnotation, apportionv1.AgentPortName, capNames(noAgent, maxNamesInMessage))
		set(apportionv1.ConditionPodsWithoutAgent, true, apportionv1.ReasonAgentNotFound, noAgentMsg)
	} else {
		set(apportionv1.ConditionPodsWithoutAgent, false, apportionv1.ReasonEveryPodHasAgent, "every pod with an IP has an agent")
	}

	if report != nil {
		setUsage(&st, usageOf(dq, split.Budget, report, now.Time), split.Budget,
			int32Or(dq.Spec.WarnAtPercent, apportionv1.DefaultWarnAtPercent), now)
		switch {
		case len(report.Unreachable) > 0:
			msg := fmt.Sprintf("agents not reachable: %s; their permits stay counted until their lease passes", strings.Join(report.Unreachable, ", "))
			if len(report.Misbehaving) > 0 {
				// Pods answering with an epoch no manager holds (push.Report.Misbehaving): say so,
				// they are the tenant's to fix.
				msg += fmt.Sprintf("; of those, %s answered with an epoch newer than any manager's (misbehaving: not believed, see the AgentClaimsNewerEpoch Events)",
					strings.Join(report.Misbehaving, ", "))
			}
			set(apportionv1.ConditionPodsReachable, false, apportionv1.ReasonAgentsUnreachable, msg)
		case len(noAgent) > 0:
			set(apportionv1.ConditionPodsReachable, false, apportionv1.ReasonAgentNotFound,
				fmt.Sprintf("%d pods have no agent to reach: %s", len(noAgent), capNames(noAgent, maxNamesInMessage)))
		default:
			set(apportionv1.ConditionPodsReachable, true, apportionv1.ReasonAllReachable, "every pod's agent answered")
		}
	}
	if reason, msg, notReady := readyCause(&readyFacts{Targets: len(obs), Missing: len(missing),
		Oversubscribed: split.Oversubscribed, NoAgent: noAgentMsg, Report: report}); notReady {
		set(apportionv1.ConditionReady, false, reason, msg)
	} else {
		set(apportionv1.ConditionReady, true, apportionv1.ReasonApportioned, fmt.Sprintf("%d pods, %s permits per pod", st.Pods, st.PerPod))
	}
	return st
}

// permitsText is a target's permits per pod as status.perPod shows them: "5", or "2-3" when
// some pods get one more.
func permitsText(t apportionv1.TargetStatus) string {
	if t.ExtraPermits > 0 {
		return fmt.Sprintf("%d-%d", t.PermitsPerPod, t.PermitsPerPod+1)
	}
	return strconv.Itoa(int(t.PermitsPerPod))
}

// rebalanceMessage describes a change of pods or per-pod permits, e.g.
// "gateway: 8→10 pods, 5→4 permits per pod" or "gateway: 12→16 pods, 3-4→2-3 permits per pod";
// "" when nothing changed. Only a change of replicas or of the floor is one: which pods hold the
// remainder's one more rotates, and with several targets so may how many of a target's pods do,
// every few minutes — not a rebalance worth an Event.
func rebalanceMessage(before, after []apportionv1.TargetStatus) string {
	prev := map[string]apportionv1.TargetStatus{}
	for _, t := range before {
		prev[string(t.Kind)+"/"+t.Name] = t
	}
	var parts []string
	for _, t := range after {
		p, ok := prev[string(t.Kind)+"/"+t.Name]
		if ok && p.Replicas == t.Replicas && p.PermitsPerPod == t.PermitsPerPod {
			continue
		}
		if !ok && t.Replicas == 0 {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s: %d→%d pods, %s→%s permits per pod", t.Name, p.Replicas, t.Replicas, permitsText(p), permitsText(t)))
	}
	return strings.Join(parts, "; ")
}

// maxNamesInMessage caps the pod names a condition message lists (the count is always given).
const maxNamesInMessage = 10

// capNames joins names, at most n of them, and says how many more there are.
func capNames(names []string, n int) string {
	if len(names) <= n {
		return strings.Join(names, ", ")
	}
	return fmt.Sprintf("%s and %d more", strings.Join(names[:n], ", "), len(names)-n)
}

// findTarget is the status of target t in ts, or nil.
func findTarget(ts []apportionv1.TargetStatus, t apportionv1.Target) *apportionv1.TargetStatus {
	for i := range ts {
		if ts[i].Kind == t.Kind && ts[i].Name == t.Name {
			return &ts[i]
		}
	}
	return nil
}

// safeDefaultMessage describes a change of safe defaults, e.g.
// "gateway: 2→3 permits per pod (over 16→12 replicas)"; "" when nothing changed or there was
// no earlier status.
func safeDefaultMessage(before, after []apportionv1.TargetStatus) string {
	var parts []string
	for _, t := range after {
		var p *apportionv1.TargetStatus
		for i := range before {
			if before[i].Kind == t.Kind && before[i].Name == t.Name {
				p = &before[i]
			}
		}
		if p == nil || p.SafeDefaultPermits == t.SafeDefaultPermits {
			continue
		}
		parts = append(parts, fmt.Sprintf("%s: %d→%d permits per pod (over %d→%d replicas)",
			t.Name, p.SafeDefaultPermits, t.SafeDefaultPermits, p.SafeDefaultReplicas, t.SafeDefaultReplicas))
	}
	return strings.Join(parts, "; ")
}

// formatRate shows a per-pod rate in status: a decimal rounded down to thousandths, so that
// the figure shown never exceeds the share the agent enforces.
func formatRate(perSecond float64) string {
	return strconv.FormatFloat(math.Floor(perSecond*1000)/1000, 'f', -1, 64)
}

// MaxHoldingsInStatus bounds status.holdings, so that a quota of thousands of pods keeps its
// status far below the API server's object size limit and its writes small.
const MaxHoldingsInStatus = 100

// summarizeHoldings is status.holdings for the engine's holdings (sorted by pod): all of them
// up to limit, else the limit most telling — pods not synced, gone, or counted above their grant
// first, then by name — and how many were left out.
func summarizeHoldings(hs []push.Holding, limit int) ([]apportionv1.PodHolding, int32) {
	telling := func(h push.Holding) bool { return !h.Synced || h.Gone || h.Counted > h.Granted }
	pick := hs
	if len(hs) > limit {
		pick = make([]push.Holding, 0, limit)
		for _, pass := range []bool{true, false} {
			for _, h := range hs {
				if len(pick) < limit && telling(h) == pass {
					pick = append(pick, h)
				}
			}
		}
		sort.SliceStable(pick, func(i, j int) bool { return pick[i].Pod < pick[j].Pod })
	}
	var out []apportionv1.PodHolding
	for _, h := range pick {
		out = append(out, apportionv1.PodHolding{
			Pod: h.Pod, Target: h.Target, Granted: h.Granted, Counted: h.Counted, InFlight: h.InFlight, Synced: h.Synced,
		})
	}
	return out, int32(len(hs) - len(pick))
}
