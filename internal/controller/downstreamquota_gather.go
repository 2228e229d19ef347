package controller

import (
	"context"
	"sort"
	"time"

	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/apportion"
	"github.com/apportion/apportion/internal/push"
	"github.com/apportion/apportion/internal/targets"
)

// This file is the gathering step of a DownstreamQuota reconcile (Reconcile gathers, decides,
// acts): every read of the API, the engine and the clock that the decision depends on, into one
// quotaInputs.

// gather reads what the decision about quota key depends on; nil when the quota is gone.
func (r *DownstreamQuotaReconciler) gather(ctx context.Context, key types.NamespacedName) (*quotaInputs, error) {
	var dq apportionv1.DownstreamQuota
	if err := r.Get(ctx, key, &dq); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil
		}
		return nil, err
	}
	in := &quotaInputs{Quota: &dq, Base: dq.Status, Now: r.Clock.Now()}
	if dq.Spec.Global != nil {
		// A member's quota: apportioned on its local limit (downstreamquota_global.go).
		in.Global = globalFor(&dq, r.Globals)
		in.Quota = onSlice(&dq, in.Global)
	}
	// The last status decided for this quota (the cached one can lag behind it).
	if d, ok := r.decided.Load(key); ok && d.(decidedStatus).UID == dq.UID {
		in.Base = d.(decidedStatus).Status
	}
	in.Targets = make([]targetObservation, len(dq.Spec.Targets))
	for i, t := range dq.Spec.Targets {
		o, err := r.observe(ctx, dq.Namespace, t)
		if err != nil {
			return nil, err
		}
		if p := findTarget(in.Base.Targets, t); p != nil {
			o.Kept = int64(p.SafeDefaultReplicas)
		}
		in.Targets[i] = o
	}
	if r.Pusher == nil {
		return in, nil
	}
	var err error
	if in.Switches, err = r.switchesAt(ctx, in.Quota, in.Now); err != nil {
		return nil, err
	}
	if demandAware(in.Quota) {
		last := r.Pusher.Report(key)
		in.LastReport, in.Sharing = &last, r.memoryFor(key)
	}
	return in, nil
}

// targetObservation is what the API says about one target.
type targetObservation struct {
	Target       apportionv1.Target
	Found        bool
	SpecReplicas int32
	HPA          *apportionv1.HPAStatus
	Pods         []corev1.Pod
	// Kept is the safeDefaultReplicas of the target's last status (0 if none).
	Kept int64
}

func (r *DownstreamQuotaReconciler) observe(ctx context.Context, ns string, t apportionv1.Target) (targetObservation, error) {
	o := targetObservation{Target: t}
	// The same rule as the injection webhook's (internal/targets): the workload's selector.
	w, err := targets.Get(ctx, r.Client, ns, t)
	if err != nil || !w.Exists {
		return o, err
	}
	o.Found, o.SpecReplicas = !w.Terminating, w.SpecReplicas

	hpa, err := r.hpaFor(ctx, ns, t)
	if err != nil {
		return o, err
	}
	if hpa != nil {
		o.HPA = &apportionv1.HPAStatus{
			Name:            hpa.Name,
			DesiredReplicas: hpa.Status.DesiredReplicas,
			CurrentReplicas: hpa.Status.CurrentReplicas,
			MaxReplicas:     hpa.Spec.MaxReplicas,
		}
	}

	if w.Selector == nil {
		return o, nil // never list without a selector: that would count every pod of the namespace
	}
	var pods corev1.PodList
	if err := r.List(ctx, &pods, client.InNamespace(ns), client.MatchingLabelsSelector{Selector: w.Selector}); err != nil {
		return o, err
	}
	for _, p := range pods.Items {
		if mayCall(&p) {
			o.Pods = append(o.Pods, p)
		}
	}
	sort.Slice(o.Pods, func(i, j int) bool { return o.Pods[i].Name < o.Pods[j].Name })
	return o, nil
}

// hpaFor finds the HPA that scales a target: the named one, or the one whose scaleTargetRef
// names the workload (the oldest when several claim it).
func (r *DownstreamQuotaReconciler) hpaFor(ctx context.Context, ns string, t apportionv1.Target) (*autoscalingv2.HorizontalPodAutoscaler, error) {
	if t.HPAName != "" {
		var hpa autoscalingv2.HorizontalPodAutoscaler
		if err := r.Get(ctx, types.NamespacedName{Namespace: ns, Name: t.HPAName}, &hpa); err != nil {
			if apierrors.IsNotFound(err) {
				return nil, nil
			}
			return nil, err
		}
		return &hpa, nil
	}
	var list autoscalingv2.HorizontalPodAutoscalerList
	if err := r.List(ctx, &list, client.InNamespace(ns), client.MatchingFields{indexHPATarget: workloadKey(string(t.Kind), t.Name)}); err != nil {
		return nil, err
	}
	if len(list.Items) == 0 {
		return nil, nil
	}
	sort.Slice(list.Items, func(i, j int) bool {
		a, b := list.Items[i], list.Items[j]
		if !a.CreationTimestamp.Equal(&b.CreationTimestamp) {
			return a.CreationTimestamp.Before(&b.CreationTimestamp)
		}
		return a.Name < b.Name
	})
	return &list.Items[0], nil
}

// replicas applies apportion.Replicas to an observation.
func (o targetObservation) replicas() int64 {
	if !o.Found {
		return 0
	}
	var desired, current int64
	if o.HPA != nil {
		desired, current = int64(o.HPA.DesiredReplicas), int64(o.HPA.CurrentReplicas)
	}
	return apportion.Replicas(desired, current, int64(o.SpecReplicas), int64(len(o.Pods)))
}

// maxReplicas is the replica count the safe default is split over (status
// targets[].safeDefaultReplicas): the HPA's maxReplicas while an HPA scales the target; without
// one, the highest count seen for the target (Kept, from the last status), so that neither a
// deleted HPA nor a scale-in raises the safe default — an agent falls back to it when it cannot
// hear from the manager, possibly while the workload is scaled by hand. An HPA created again
// sets it anew, lower or higher: it bounds the replicas again. Never below replicas.
func (o targetObservation) maxReplicas() int64 {
	if o.HPA != nil {
		return max(int64(o.HPA.MaxReplicas), o.replicas())
	}
	return max(o.Kept, o.replicas())
}

// mayCall says whether a listed pod may call the downstream: a pod that finished cannot call
// anything; every other pod, terminating ones included, may.
func mayCall(p *corev1.Pod) bool {
	return p.Status.Phase != corev1.PodSucceeded && p.Status.Phase != corev1.PodFailed
}

// switchesFor lists the degrade switches that are in force for this quota now.
func (r *DownstreamQuotaReconciler) switchesFor(ctx context.Context, dq *apportionv1.DownstreamQuota) ([]push.TargetedSwitch, error) {
	return r.switchesAt(ctx, dq, r.Clock.Now())
}

// switchesAt lists the degrade switches that are in force for this quota at now.
func (r *DownstreamQuotaReconciler) switchesAt(ctx context.Context, dq *apportionv1.DownstreamQuota, now time.Time) ([]push.TargetedSwitch, error) {
	var rules apportionv1.DegradeRuleList
	if err := r.List(ctx, &rules, client.InNamespace(dq.Namespace), client.MatchingFields{indexRuleDownstream: dq.Name}); err != nil {
		return nil, err
	}
	var out []push.TargetedSwitch
	for i := range rules.Items {
		if ts, ok := switchFor(&rules.Items[i], now); ok {
			out = append(out, ts)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Switch.Name < out[j].Switch.Name })
	return out, nil
}
