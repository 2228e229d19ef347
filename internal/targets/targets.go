// Package targets holds the one rule that decides which pods belong to a DownstreamQuota's target.
// The DownstreamQuota controller counts and pushes to the pods it selects, and the injection
// webhook gives exactly those pods an agent: both call this package, so a pod the controller
// counts is a pod the webhook injects.
//
// The rule: a pod belongs to target {Kind, Name} of a quota when the workload of that kind and name
// exists in the quota's namespace and its spec.selector (non-empty) matches the pod's labels. The
// owner chain is not used, on purpose: at CREATE a Deployment's pod names only its ReplicaSet as
// owner (the Deployment is one more read away), a pod created by hand that carries the workload's
// labels calls the downstream just like the workload's own, and the workload API already requires
// its selector to match its template. A terminating workload still selects its pods: they may
// still call.
package targets

import (
	"context"
	"sort"

	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// Workload is what the API says about one target's workload.
type Workload struct {
	// Exists is true when the workload was found (terminating or not).
	Exists bool
	// Terminating is true when it has a deletion timestamp.
	Terminating bool
	// SpecReplicas is spec.replicas (1 when unset, as the API defaults it).
	SpecReplicas int32
	// Selector is the workload's pod selector; nil when it has none or it is empty or invalid:
	// an empty selector would select every pod of the namespace, and the workload API forbids it.
	Selector labels.Selector
}

// Get reads target t's workload in namespace ns. A missing workload is not an error: it
// returns Exists false and no selector.
func Get(ctx context.Context, r client.Reader, ns string, t apportionv1.Target) (Workload, error) {
	var w Workload
	var selector *metav1.LabelSelector
	var replicas *int32
	var deleted *metav1.Time
	key := types.NamespacedName{Namespace: ns, Name: t.Name}
	switch t.Kind {
	case apportionv1.KindDeployment:
		var d appsv1.Deployment
		if err := r.Get(ctx, key, &d); err != nil {
			return w, client.IgnoreNotFound(err)
		}
		selector, replicas, deleted = d.Spec.Selector, d.Spec.Replicas, d.DeletionTimestamp
	case apportionv1.KindStatefulSet:
		var s appsv1.StatefulSet
		if err := r.Get(ctx, key, &s); err != nil {
			return w, client.IgnoreNotFound(err)
		}
		selector, replicas, deleted = s.Spec.Selector, s.Spec.Replicas, s.DeletionTimestamp
	default:
		return w, nil
	}
	w.Exists, w.Terminating, w.SpecReplicas = true, deleted != nil, 1
	if replicas != nil {
		w.SpecReplicas = *replicas
	}
	if sel, err := metav1.LabelSelectorAsSelector(selector); err == nil && !sel.Empty() {
		w.Selector = sel
	}
	return w, nil
}

// Selects reports whether the workload's selector matches a pod with podLabels.
func (w Workload) Selects(podLabels map[string]string) bool {
	return w.Exists && w.Selector != nil && w.Selector.Matches(labels.Set(podLabels))
}

// QuotasForPod lists the DownstreamQuotas of namespace ns with a target whose workload selects a
// pod with podLabels, sorted by name. A workload that cannot be read is an error: the caller
// must not guess.
func QuotasForPod(ctx context.Context, r client.Reader, ns string, podLabels map[string]string) ([]apportionv1.DownstreamQuota, error) {
	var list apportionv1.DownstreamQuotaList
	if err := r.List(ctx, &list, client.InNamespace(ns)); err != nil {
		return nil, err
	}
	var out []apportionv1.DownstreamQuota
	for _, dq := range list.Items {
		for _, t := range dq.Spec.Targets {
			w, err := Get(ctx, r, ns, t)
			if err != nil {
				return nil, err
			}
			if w.Selects(podLabels) {
				out = append(out, dq)
				break
			}
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}
