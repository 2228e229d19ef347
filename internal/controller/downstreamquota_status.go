package controller

import (
	"fmt"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/api/meta"
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
			st.Holdings = append(st.Holdings, apportionv1.PodHolding{
				Pod: h.Pod, Target: h.Target, Granted: h.Granted, Counted: h.Counted, InFlight: h.InFlight, Synced: h.Synced,
			})
			if h.Synced {
				synced[h.Target]++
			}
		}
		if d := report.LastRebalanceDuration; d > 0 {
			st.LastRebalanceDuration = d.Round(100_000).String()
		} else {
			st.LastRebalanceDuration = dq.Status.LastRebalanceDuration
		}
	}

	var missing, perPod []string
	for i, o := range obs {
		ts := apportionv1.TargetStatus{
			Kind:               o.Target.Kind,
			Name:               o.Target.Name,
			Found:              o.Found,
			Replicas:           int32(o.replicas()),
			Pods:               int32(len(o.Pods)),
			HPA:                o.HPA,
			PermitsPerPod:      int32(split.PerPod[i]),
			SafeDefaultPermits: int32(split.SafeDefault[i]),
			PodsSynced:         synced[o.Target.Name],
		}
		if !o.Found {
			missing = append(missing, fmt.Sprintf("%s/%s", o.Target.Kind, o.Target.Name))
		}
		st.Targets = append(st.Targets, ts)
		st.Pods += ts.Replicas
		perPod = append(perPod, strconv.FormatInt(split.PerPod[i], 10))
	}
	st.PerPod = strings.Join(perPod, ",")
	if split.Weighted > 0 || len(split.SafeDefault) > 0 {
		// The weight-1 safe default: Budget / Σ weight × maxReplicas.
		var weightedMax int64
		for _, o := range obs {
			weightedMax += int64(int32Or(o.Target.Weight, 1)) * o.maxReplicas()
		}
		if weightedMax > 0 {
			st.SafeDefaultPermits = int32(split.Budget / weightedMax)
		}
	}

	set := func(t string, ok bool, reason, msg string) {
		s := metav1.ConditionFalse
		if ok {
			s = metav1.ConditionTrue
		}
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{
			Type: t, Status: s, Reason: reason, Message: msg, ObservedGeneration: dq.Generation, LastTransitionTime: now,
		})
	}

	if len(missing) > 0 {
		set(apportionv1.ConditionTargetsFound, false, "TargetMissing",
			fmt.Sprintf("%s not found; nothing is assigned to it", strings.Join(missing, ", ")))
	} else {
		set(apportionv1.ConditionTargetsFound, true, "AllFound", "every target workload exists")
	}

	if split.Oversubscribed {
		set(apportionv1.ConditionOversubscribed, true, "TooManyPods", fmt.Sprintf(
			"%d × %d%% = %d permits cannot give one permit to each of %d weighted pods; at most %d fit (Σ weight × replicas); pods with 0 permits answer with the fallback",
			dq.Spec.MaxInFlight, int32Or(dq.Spec.SafetyFactorPercent, 80), split.Budget, split.Weighted, split.FitWeighted))
	} else {
		set(apportionv1.ConditionOversubscribed, false, "WithinQuota", fmt.Sprintf(
			"%d of %d permits assigned to %d pods", split.Assigned, dq.Spec.MaxInFlight, st.Pods))
	}

	ready, reason, msg := true, "Apportioned", fmt.Sprintf("%d pods, %s permits per pod", st.Pods, st.PerPod)
	if report != nil {
		if len(report.Unreachable) > 0 {
			set(apportionv1.ConditionPodsReachable, false, "AgentsUnreachable",
				fmt.Sprintf("agents not reachable: %s; their permits stay counted until their lease passes", strings.Join(report.Unreachable, ", ")))
		} else {
			set(apportionv1.ConditionPodsReachable, true, "AllReachable", "every pod's agent answered")
		}
		switch {
		case report.Recovering:
			ready, reason, msg = false, apportionv1.ReasonRecovering, "the manager is waiting out the leases of a previous manager before raising any pod"
		case !report.Converged:
			ready, reason, msg = false, "Pushing", "some pods have not acknowledged their permits yet"
		}
	}
	switch {
	case len(missing) == len(obs):
		ready, reason, msg = false, "TargetMissing", "no target workload exists"
	case split.Oversubscribed:
		ready, reason, msg = false, "Oversubscribed", "the quota is smaller than the pods that share it"
	}
	set(apportionv1.ConditionReady, ready, reason, msg)
	return st
}

// rebalanceMessage describes a change of pods or per-pod permits, e.g.
// "gateway: 8→10 pods, 5→4 permits per pod"; "" when nothing changed.
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
		parts = append(parts, fmt.Sprintf("%s: %d→%d pods, %d→%d permits per pod", t.Name, p.Replicas, t.Replicas, p.PermitsPerPod, t.PermitsPerPod))
	}
	return strings.Join(parts, "; ")
}
