package controller

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
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

// Trust distribution: the ConfigMap apportionv1.TrustConfigMap of the manager's public keys in
// every namespace where an agent may run (docs/protocol.md §10).
const (
	// TrustLabel marks the trust ConfigMaps, for people and `kubectl delete -l`. The manager
	// finds them by name, never by this label: a namespace editor can remove a label.
	TrustLabel = "apportion.io/trust"

	// TrustRestoredReason is the reason of the Warning Event recorded on a trust ConfigMap the
	// manager found changed by someone else and put back.
	TrustRestoredReason = "TrustConfigMapRestored"

	trustManagedBy = "apportion"
	trustPurpose   = "public keys the apportion agents of this namespace verify the manager's control requests with: one <key id>.pem per key. Public: not a secret. Kept by the manager: any change is undone."
)

// TrustCacheOptions restricts the manager's ConfigMap cache to the trust ConfigMaps, by name
// (a field selector on metadata.name): a ConfigMap a tenant re-creates without the manager's
// label is still seen, watching every ConfigMap of the cluster would cost memory and grant
// nothing, and the manager's RBAC lets it list and watch ConfigMaps of that name only (a list
// or watch is authorized against resourceNames when it selects metadata.name).
func TrustCacheOptions() map[client.Object]cache.ByObject {
	return map[client.Object]cache.ByObject{
		&corev1.ConfigMap{}: {Field: fields.OneTermEqualSelector("metadata.name", apportionv1.TrustConfigMap)},
	}
}

// TrustReconciler keeps the trust ConfigMap apportionv1.TrustConfigMap in every namespace that
// has a DownstreamQuota or the label apportion.io/injection=enabled, exactly as the manager
// publishes it: the data Data returns ("<key id>.pem" → PEM public key), no binaryData, the
// TrustLabel, mutable. It reconciles Namespaces.
//
// Outcomes per namespace:
//   - wanted (a quota or the label), or holding a ConfigMap of that name with TrustLabel (one
//     the manager made earlier): the ConfigMap is created, or put back to what the manager
//     publishes when it differs in any of those — a key published or withdrawn (Normal: the
//     manager's own change), or anything else: a key or value the manager never published,
//     binaryData, the label removed, a ConfigMap of that name made by someone else, made
//     immutable (deleted and created anew: an immutable ConfigMap cannot be changed), or
//     deleted but held by finalizers (they are removed so it goes and is created anew). The
//     name is the manager's in those namespaces: what it finds there is taken over, and each
//     such repair is a Warning Event (TrustRestoredReason) on the ConfigMap naming what was
//     found;
//   - neither: nothing; an unlabelled ConfigMap of that name there is not the manager's;
//   - Data not known yet (the key keeper has not run): requeued after a second.
//
// The repair takes as long as a watch event and one or two writes (well under a second on an
// idle API server; a failed write is retried with the controller's backoff). Tenants are kept
// from changing the ConfigMap at all by the admission policy of config/rbac
// (trust_guard.yaml); the repair is what bounds the harm where the policy is not installed or
// someone allowed to bypass it made the change (docs/protocol.md §10, §15).
type TrustReconciler struct {
	Client client.Client
	// Recorder records the Warning Events of repairs; nil records none.
	Recorder events.EventRecorder
	// Data is the ConfigMap's data now; nil while unknown.
	Data func() map[string]string
	// Changes receives an event whenever Data changes; every namespace is reconciled.
	Changes <-chan event.GenericEvent
	// Namespace, when set, is the only namespace the manager serves (its --namespace): its cache
	// holds no other namespace's ConfigMaps or quotas, so every other namespace is left alone.
	Namespace string

	mu sync.Mutex
	// published is every "<key>\n<value>" Data has returned since the manager started: a key
	// the ConfigMap holds that is not among them was written by someone else.
	published map[string]struct{}
}

// The ConfigMap writes are limited by resourceNames to the trust ConfigMap's name (create cannot
// be: the API server authorizes a create before the object has a name); list and watch with it
// need the field selector of TrustCacheOptions. The custom verb "publish" on
// trustconfigmaps.apportion.io is no API: the admission policy (config/rbac/trust_guard.yaml)
// lets only who holds it write a trust ConfigMap.
//
// +kubebuilder:rbac:groups="",resources=namespaces,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=configmaps,resourceNames=apportion-trust,verbs=get;list;watch;update;delete
// +kubebuilder:rbac:groups="",resources=configmaps,verbs=create
// +kubebuilder:rbac:groups=apportion.io,resources=trustconfigmaps,verbs=publish
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

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
	key := types.NamespacedName{Namespace: ns.Name, Name: apportionv1.TrustConfigMap}
	var cm corev1.ConfigMap
	err := r.Client.Get(ctx, key, &cm)
	exists := err == nil
	if err != nil && !apierrors.IsNotFound(err) {
		return reconcile.Result{}, err
	}
	if !exists || cm.Labels[TrustLabel] != "true" {
		wanted, err := r.wanted(ctx, &ns)
		if err != nil || !wanted {
			return reconcile.Result{}, err
		}
	}
	data := r.Data()
	if data == nil {
		return reconcile.Result{RequeueAfter: time.Second}, nil
	}
	r.remember(data)
	if !exists {
		return reconcile.Result{}, r.create(ctx, key, data, nil)
	}
	found := r.tampering(&cm)
	switch {
	case !cm.DeletionTimestamp.IsZero():
		// Deleted but held by finalizers (someone else's: the manager sets none). Removing them
		// lets it go; its deletion event brings the next reconcile, which creates it anew.
		if len(cm.Finalizers) == 0 {
			return reconcile.Result{RequeueAfter: time.Second}, nil
		}
		cm.Finalizers = nil
		if err := r.Client.Update(ctx, &cm); err != nil {
			return reconcile.Result{}, fmt.Errorf("removing the finalizers of ConfigMap %s: %w", key, err)
		}
		r.warn(ctx, &cm, found, "removed its finalizers so that it is deleted and created anew")
		return reconcile.Result{}, nil
	case ptrTrue(cm.Immutable):
		// An immutable ConfigMap cannot be changed, only replaced. The preconditions make sure
		// the one deleted is the one looked at.
		if err := r.Client.Delete(ctx, &cm, client.Preconditions{UID: &cm.UID, ResourceVersion: &cm.ResourceVersion}); err != nil && !apierrors.IsNotFound(err) {
			return reconcile.Result{}, fmt.Errorf("deleting immutable ConfigMap %s: %w", key, err)
		}
		return reconcile.Result{}, r.create(ctx, key, data, found)
	case len(found) == 0 && trustIsAsPublished(&cm, data):
		return reconcile.Result{}, nil
	}
	setTrust(&cm, data)
	if err := r.Client.Update(ctx, &cm); err != nil {
		return reconcile.Result{}, fmt.Errorf("updating ConfigMap %s: %w", key, err)
	}
	if len(found) > 0 {
		r.warn(ctx, &cm, found, fmt.Sprintf("put back the %d published keys", len(data)))
	} else {
		log.FromContext(ctx).Info("trust ConfigMap updated", "namespace", ns.Name, "keys", len(data))
	}
	return reconcile.Result{}, nil
}

// create creates the trust ConfigMap with data; found, when not empty, is what was wrong with
// the one it replaces (for the Warning). A ConfigMap of that name still there (the cache has not
// seen it yet, or its deletion is held up) is retried after a moment.
func (r *TrustReconciler) create(ctx context.Context, key types.NamespacedName, data map[string]string, found []string) error {
	cm := corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}}
	setTrust(&cm, data)
	if err := r.Client.Create(ctx, &cm); err != nil {
		return fmt.Errorf("creating ConfigMap %s: %w", key, err)
	}
	if len(found) > 0 {
		r.warn(ctx, &cm, found, fmt.Sprintf("deleted it and created it anew with the %d published keys", len(data)))
	} else {
		log.FromContext(ctx).Info("trust ConfigMap created", "namespace", key.Namespace, "keys", len(data))
	}
	return nil
}

// setTrust makes cm what the manager publishes: data, no binaryData, mutable, its label and
// purpose annotation (other labels and annotations are left as they are).
func setTrust(cm *corev1.ConfigMap, data map[string]string) {
	cm.Data, cm.BinaryData, cm.Immutable = maps.Clone(data), nil, nil
	if cm.Labels == nil {
		cm.Labels = map[string]string{}
	}
	cm.Labels[TrustLabel] = "true"
	cm.Labels["app.kubernetes.io/managed-by"] = trustManagedBy
	if cm.Annotations == nil {
		cm.Annotations = map[string]string{}
	}
	cm.Annotations["apportion.io/purpose"] = trustPurpose
}

// trustIsAsPublished says whether cm is exactly what setTrust would make of it.
func trustIsAsPublished(cm *corev1.ConfigMap, data map[string]string) bool {
	want := cm.DeepCopy()
	setTrust(want, data)
	return maps.Equal(cm.Data, want.Data) && len(cm.BinaryData) == 0 && cm.Immutable == nil &&
		maps.Equal(cm.Labels, want.Labels) && maps.Equal(cm.Annotations, want.Annotations)
}

// remember adds data to what the manager has published.
func (r *TrustReconciler) remember(data map[string]string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.published == nil {
		r.published = map[string]struct{}{}
	}
	for k, v := range data {
		r.published[k+"\n"+v] = struct{}{}
	}
}

// tampering lists what about cm the manager did not do: every way in which it differs from what
// the manager publishes, except keys the manager published and since withdrew or not yet wrote
// (its own changes). Empty when nothing else is wrong.
func (r *TrustReconciler) tampering(cm *corev1.ConfigMap) []string {
	var found []string
	if cm.Labels[TrustLabel] != "true" {
		found = append(found, fmt.Sprintf("it lacked the label %s=true (removed, or the ConfigMap was made by someone else)", TrustLabel))
	}
	r.mu.Lock()
	var foreign []string
	for k, v := range cm.Data {
		if _, ok := r.published[k+"\n"+v]; !ok {
			foreign = append(foreign, k)
		}
	}
	r.mu.Unlock()
	if len(foreign) > 0 {
		slices.Sort(foreign)
		found = append(found, fmt.Sprintf("it held %d keys the manager never published: %s", len(foreign), capNames(foreign, maxKeysInMessage)))
	}
	if len(cm.BinaryData) > 0 {
		found = append(found, fmt.Sprintf("it held %d binaryData keys: %s", len(cm.BinaryData), capNames(slices.Sorted(maps.Keys(cm.BinaryData)), maxKeysInMessage)))
	}
	if ptrTrue(cm.Immutable) {
		found = append(found, "it was made immutable: a kubelet stops refreshing an immutable ConfigMap, so pods of this namespace that mounted it keep what it held until they are re-created (kubectl rollout restart)")
	}
	if !cm.DeletionTimestamp.IsZero() && len(cm.Finalizers) > 0 {
		found = append(found, fmt.Sprintf("it was deleted but held by the finalizers %s", strings.Join(cm.Finalizers, ", ")))
	}
	return found
}

// warn records what was found on cm and what the manager did about it.
func (r *TrustReconciler) warn(ctx context.Context, cm *corev1.ConfigMap, found []string, did string) {
	msg := fmt.Sprintf("ConfigMap %s/%s was changed by someone other than the manager: %s. The manager %s. Agents of this namespace trust what it holds until their kubelet refreshes it (about a minute) and they re-read it (30 s). The admission policy apportion-trust-guard refuses such changes to anyone not allowed to publish trustconfigmaps.apportion.io: check that it is installed, and who changed it.",
		cm.Namespace, cm.Name, strings.Join(found, "; "), did)
	log.FromContext(ctx).Info("trust ConfigMap restored", "namespace", cm.Namespace, "found", found, "did", did)
	if r.Recorder != nil {
		r.Recorder.Eventf(cm, nil, corev1.EventTypeWarning, TrustRestoredReason, "Restore", "%s", msg)
	}
}

// maxKeysInMessage caps the keys a repair's Warning lists (the count is always given): the
// Event's note is bounded, whatever was planted.
const maxKeysInMessage = 5

func ptrTrue(b *bool) bool { return b != nil && *b }

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
			if o.GetName() != apportionv1.TrustConfigMap {
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
