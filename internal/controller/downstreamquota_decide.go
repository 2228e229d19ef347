package controller

import (
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/apportion"
	"github.com/apportion/apportion/internal/push"
)

// computeStatus is the pure part of a DownstreamQuota reconcile: from what was observed, how the
// budget split and what the Pusher reports, the status to write. Conditions keep their
// LastTransitionTime when their status did not change.
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

	ready, reason, msg := true, apportionv1.ReasonApportioned, fmt.Sprintf("%d pods, %s permits per pod", st.Pods, st.PerPod)
	if report != nil {
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
		switch {
		case report.Recovering:
			ready, reason, msg = false, apportionv1.ReasonRecovering, "the manager is waiting out the leases of a previous manager before raising any pod"
		case !report.Converged:
			ready, reason, msg = false, apportionv1.ReasonPushing, "some pods have not acknowledged their permits yet"
		}
	}
	if len(noAgent) > 0 {
		ready, reason, msg = false, apportionv1.ReasonPodsWithoutAgent, noAgentMsg
	}
	switch {
	case len(missing) == len(obs):
		ready, reason, msg = false, apportionv1.ReasonTargetMissing, "no target workload exists"
	case split.Oversubscribed:
		ready, reason, msg = false, apportionv1.ReasonOversubscribed, "the quota is smaller than the pods that share it"
	}
	set(apportionv1.ConditionReady, ready, reason, msg)
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
