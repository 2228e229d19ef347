package controller

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
)

// InjectionNamespaceLabel opts a namespace in to agent injection (value "enabled"); the webhook
// configuration's namespaceSelector uses the same label.
const (
	InjectionNamespaceLabel      = "apportion.io/injection"
	InjectionNamespaceLabelValue = "enabled"
)

// InjectionNamespaceReconciler keeps the agents' trust material in every namespace labelled for
// injection, so that it exists before the first injected pod of the namespace starts: an
// injected pod mounts it, and a pod whose volume does not exist yet would wait in
// ContainerCreating. Namespaces with a DownstreamQuota get it from the DownstreamQuota
// reconciler as before; this one covers a namespace labelled before its first quota (or its
// first pod) exists.
type InjectionNamespaceReconciler struct {
	client.Client
	// EnsureTrust makes the trust material available in a namespace; idempotent.
	EnsureTrust func(ctx context.Context, namespace string) error
}

// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch

// Reconcile implements reconcile.Reconciler.
func (r *InjectionNamespaceReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	var ns corev1.Namespace
	if err := r.Get(ctx, req.NamespacedName, &ns); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if !injectionEnabled(&ns) || ns.DeletionTimestamp != nil {
		return ctrl.Result{}, nil
	}
	if err := r.EnsureTrust(ctx, ns.Name); err != nil {
		return ctrl.Result{}, fmt.Errorf("agent trust material for namespace %s: %w", ns.Name, err)
	}
	return ctrl.Result{}, nil
}

func injectionEnabled(o client.Object) bool {
	return o.GetLabels()[InjectionNamespaceLabel] == InjectionNamespaceLabelValue
}

// SetupWithManager watches namespaces that are labelled for injection.
func (r *InjectionNamespaceReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		For(&corev1.Namespace{}, builder.WithPredicates(predicate.NewPredicateFuncs(injectionEnabled))).
		Named("injectionnamespace").
		Complete(r)
}
