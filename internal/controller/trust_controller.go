package controller

import (
	"context"
	"fmt"
	"maps"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/manager"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// Trust distribution: the ConfigMap of the manager's public keys in every namespace where an
// agent may run.
const (
	// TrustLabel marks the trust ConfigMaps; the manager caches only ConfigMaps with it.
	TrustLabel = "apportion.io/trust"

	trustManagedBy = "apportion"
	trustPurpose   = "public keys the apportion agents of this namespace verify the manager's control requests with: one <key id>.pem per key. Public: not a secret."
)

// TrustCacheOptions restricts the manager's ConfigMap cache to the trust ConfigMaps (label
// TrustLabel=true): watching every ConfigMap of the cluster would cost memory and grant nothing.
func TrustCacheOptions() map[client.Object]cache.ByObject {
	return map[client.Object]cache.ByObject{
		&corev1.ConfigMap{}: {Label: labels.SelectorFromSet(labels.Set{TrustLabel: "true"})},
	}
}

// TrustReconciler keeps the trust ConfigMap (Name, e.g. "apportion-trust") in every namespace
// that has a DownstreamQuota or the label apportion.io/injection=enabled, with the data Data
// returns ("<key id>.pem" → PEM public key). It reconciles Namespaces.
//
// Outcomes per namespace:
//   - wanted (a quota or the label) or already holding our ConfigMap: the ConfigMap is created,
//     or its data replaced when it differs (a new key published, one withdrawn, a hand edit);
//   - neither: nothing (a namespace that no longer wants agents keeps the public keys it had,
//     updated; they are not secret);
//   - a ConfigMap of that name that the manager did not create (no TrustLabel): left alone, the
//     reconcile fails with an error naming it (agents there cannot verify until it is renamed);
//   - Data not known yet (the key keeper has not run): requeued after a second.
type TrustReconciler struct {
	Client client.Client
	// Name of the ConfigMap.
	Name string
	// Data is the ConfigMap's data now; nil while unknown.
	Data func() map[string]string
	// Changes receives an event whenever Data changes; every namespace is reconciled.
	Changes <-chan event.GenericEvent
	// Namespace, when set, is the only namespace the manager serves (its --namespace): its cache
	// holds no other namespace's ConfigMaps or quotas, so every other namespace is left alone.
	Namespace string
}

// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=get;list;watch;create;update

var _ reconcile.Reconciler = (*TrustReconciler)(nil)

// Reconcile implements reconcile.Reconciler; the request names a namespace.
func (r *TrustReconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	if r.Namespace != "" && req.Name != r.Namespace {
		return reconcile.Result{}, nil
	}
	var ns corev1.Namespace
	if err := r.Client.Get(ctx, types.NamespacedName{Name: req.Name}, &ns); err != nil {
		return reconcile.Result{}, client.IgnoreNotFound(err)
	}
	if !ns.DeletionTimestamp.IsZero() {
		return reconcile.Result{}, nil
	}
	var cm corev1.ConfigMap
	err := r.Client.Get(ctx, types.NamespacedName{Namespace: ns.Name, Name: r.Name}, &cm)
	exists := err == nil
	if err != nil && !apierrors.IsNotFound(err) {
		return reconcile.Result{}, err
	}
	if !exists {
		wanted, err := r.wanted(ctx, &ns)
		if err != nil || !wanted {
			return reconcile.Result{}, err
		}
	}
	data := r.Data()
	if data == nil {
		return reconcile.Result{RequeueAfter: time.Second}, nil
	}
	if exists && cm.Labels[TrustLabel] != "true" {
		return reconcile.Result{}, foreignTrust(ns.Name, r.Name)
	}
	if exists {
		if maps.Equal(cm.Data, data) && len(cm.BinaryData) == 0 {
			return reconcile.Result{}, nil
		}
		cm.Data, cm.BinaryData = maps.Clone(data), nil
		if err := r.Client.Update(ctx, &cm); err != nil {
			return reconcile.Result{}, fmt.Errorf("updating ConfigMap %s/%s: %w", ns.Name, r.Name, err)
		}
		log.FromContext(ctx).Info("trust ConfigMap updated", "namespace", ns.Name, "keys", len(data))
		return reconcile.Result{}, nil
	}
	cm = corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: ns.Name, Name: r.Name,
			Labels:      map[string]string{TrustLabel: "true", "app.kubernetes.io/managed-by": trustManagedBy},
			Annotations: map[string]string{"apportion.io/purpose": trustPurpose},
		},
		Data: maps.Clone(data),
	}
	if err := r.Client.Create(ctx, &cm); err != nil {
		if apierrors.IsAlreadyExists(err) {
			// Not in the cache, so it lacks TrustLabel: someone else's ConfigMap.
			return reconcile.Result{}, foreignTrust(ns.Name, r.Name)
		}
		return reconcile.Result{}, fmt.Errorf("creating ConfigMap %s/%s: %w", ns.Name, r.Name, err)
	}
	log.FromContext(ctx).Info("trust ConfigMap created", "namespace", ns.Name, "keys", len(data))
	return reconcile.Result{}, nil
}

func foreignTrust(namespace, name string) error {
	return fmt.Errorf("ConfigMap %s/%s exists and was not created by the manager (no %s label); not overwriting it: agents of this namespace cannot verify pushes until it is moved away",
		namespace, name, TrustLabel)
}

func (r *TrustReconciler) wanted(ctx context.Context, ns *corev1.Namespace) (bool, error) {
	if ns.Labels[apportionv1.InjectionLabel] == apportionv1.InjectionEnabled {
		return true, nil
	}
	var dqs apportionv1.DownstreamQuotaList
	if err := r.Client.List(ctx, &dqs, client.InNamespace(ns.Name), client.Limit(1)); err != nil {
		return false, err
	}
	return len(dqs.Items) > 0, nil
}

// SetupWithManager registers the reconciler: Namespaces, quotas and trust ConfigMaps map to
// their namespace; a key change reconciles every namespace.
func (r *TrustReconciler) SetupWithManager(mgr manager.Manager) error {
	toNamespace := handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
		return []reconcile.Request{{NamespacedName: types.NamespacedName{Name: o.GetNamespace()}}}
	})
	b := ctrl.ControllerManagedBy(mgr).
		Named("trust").
		For(&corev1.Namespace{}).
		Watches(&apportionv1.DownstreamQuota{}, toNamespace).
		Watches(&corev1.ConfigMap{}, handler.EnqueueRequestsFromMapFunc(func(_ context.Context, o client.Object) []reconcile.Request {
			if o.GetName() != r.Name {
				return nil
			}
			return []reconcile.Request{{NamespacedName: types.NamespacedName{Name: o.GetNamespace()}}}
		}))
	if r.Changes != nil {
		b = b.WatchesRawSource(source.Channel(r.Changes, handler.EnqueueRequestsFromMapFunc(
			func(ctx context.Context, _ client.Object) []reconcile.Request {
				var list corev1.NamespaceList
				if err := mgr.GetClient().List(ctx, &list); err != nil {
					log.FromContext(ctx).Error(err, "listing namespaces for a trust update")
					return nil
				}
				reqs := make([]reconcile.Request, 0, len(list.Items))
				for _, ns := range list.Items {
					if r.Namespace != "" && ns.Name != r.Namespace {
						continue
					}
					reqs = append(reqs, reconcile.Request{NamespacedName: types.NamespacedName{Name: ns.Name}})
				}
				return reqs
			})))
	}
	return b.Complete(r)
}
