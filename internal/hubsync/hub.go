package hubsync

import (
	"context"
	"fmt"
	"sync"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/apportion/demand"
	"github.com/apportion/apportion/internal/hub"
)

// LabelGlobalQuota on a ClusterSlice names its GlobalQuota (the hub lists a quota's slices by it).
const LabelGlobalQuota = "apportion.io/global-quota"

// SliceName is the name of a member's ClusterSlice: <quota>-<cluster>.
func SliceName(quota, cluster string) string { return quota + "-" + cluster }

// The hub role's rights are not kubebuilder markers, which would grant them to every manager:
// config/hub/hub_role.yaml holds them (bound only where the manager runs with --hub), and
// TestHubRole runs the HubReconciler with them alone. A change of what it does with the API
// changes that file.

// HubReconciler keeps every GlobalQuota's allocation on the hub (docs/protocol.md §16, "A
// grant's life"): it reads the members' ClusterSlices (acknowledgements, drains, demand), plans
// with the quota's hub.Ledger, writes the allocation with the resourceVersion it planned from,
// and only then publishes the grants, each in its member's ClusterSlice.
type HubReconciler struct {
	// Client reads from the manager's cache and writes.
	Client client.Client
	// Live reads the API server directly: the GlobalQuota's resourceVersion when the cache's
	// differs from the one the ledger stands on.
	Live  client.Reader
	Clock clock.PassiveClock
	// Damping of DemandAware quotas (nil: demand.DefaultDamping, as between pods).
	Damping func(budget int64) demand.Damping

	mu     sync.Mutex
	quotas map[types.NamespacedName]*hubQuota
}

type hubQuota struct {
	uid        types.UID
	ledger     *hub.Ledger
	opts       hub.Options
	rv         string // the GlobalQuota resourceVersion the ledger stands on
	lastDamped time.Time
}

// SetupWithManager registers the reconciler: a GlobalQuota and its ClusterSlices.
func (r *HubReconciler) SetupWithManager(mgr ctrl.Manager) error {
	return ctrl.NewControllerManagedBy(mgr).
		Named("globalquota").
		For(&apportionv1.GlobalQuota{}).
		Watches(&apportionv1.ClusterSlice{}, handler.EnqueueRequestForOwner(mgr.GetScheme(), mgr.GetRESTMapper(), &apportionv1.GlobalQuota{})).
		Complete(r)
}

func leaseOptions(gq *apportionv1.GlobalQuota) hub.Options {
	o := hub.Options{LeaseDuration: 30 * time.Second, ClockMargin: 5 * time.Second}
	if d := gq.Spec.Lease.Duration; d != nil {
		o.LeaseDuration = d.Duration
	}
	if m := gq.Spec.Lease.ClockMargin; m != nil {
		o.ClockMargin = m.Duration
	}
	return o
}

func (r *HubReconciler) state(key types.NamespacedName) *hubQuota {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.quotas == nil {
		r.quotas = map[types.NamespacedName]*hubQuota{}
	}
	q := r.quotas[key]
	if q == nil {
		q = &hubQuota{}
		r.quotas[key] = q
	}
	return q
}

func (r *HubReconciler) forget(key types.NamespacedName) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.quotas, key)
}

// Reconcile plans one GlobalQuota and publishes its grants.
func (r *HubReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	log := logf.FromContext(ctx)
	var gq apportionv1.GlobalQuota
	if err := r.Client.Get(ctx, req.NamespacedName, &gq); err != nil {
		if apierrors.IsNotFound(err) {
			r.forget(req.NamespacedName)
			return ctrl.Result{}, nil
		}
		return ctrl.Result{}, err
	}
	if gq.DeletionTimestamp.IsZero() && !controllerutil.ContainsFinalizer(&gq, Finalizer) {
		// Once, at creation: a deleted quota goes only when no member may hold anything of it.
		controllerutil.AddFinalizer(&gq, Finalizer)
		if err := r.Client.Update(ctx, &gq); err != nil {
			return ctrl.Result{}, err
		}
		r.forget(req.NamespacedName) // its resourceVersion moved: read the allocation back
		return ctrl.Result{}, nil
	}
	q := r.state(req.NamespacedName)
	if err := r.standOn(ctx, q, &gq); err != nil {
		return ctrl.Result{}, err
	}
	slices, err := r.slices(ctx, &gq)
	if err != nil {
		return ctrl.Result{}, err
	}
	now := r.Clock.Now()
	// What the members said: drains, acknowledgements, grants already visible to them.
	for _, cs := range slices {
		c := cs.Spec.Cluster
		if d := cs.Status.Drain; d != nil {
			q.ledger.SetDrain(c, d.Duration)
		}
		if cur := q.ledger.Current(c); cur.Seq > 0 && cs.Spec.Seq == cur.Seq {
			q.ledger.Published(c, cur.Seq, now) // a read that returned showing it: committed by now
		}
		q.ledger.Acknowledged(c, cs.Status.AcknowledgedSeq)
	}
	changes, damped, err := r.plan(q, &gq, slices, now)
	if err != nil {
		return ctrl.Result{}, err
	}
	status := statusOf(q.ledger, &gq, slices)
	if len(changes) > 0 || !statusEqual(status, gq.Status) {
		gq.Status = status
		// The precondition: the resourceVersion the ledger stands on.
		gq.ResourceVersion = q.rv
		if err := r.Client.Status().Update(ctx, &gq); err != nil {
			q.ledger = nil // read it back (a conflict, or a write that may have landed)
			if apierrors.IsConflict(err) {
				return ctrl.Result{RequeueAfter: 10 * time.Millisecond}, nil
			}
			return ctrl.Result{}, err
		}
		q.rv = gq.ResourceVersion
		if damped {
			q.lastDamped = now
		}
	}
	if err := r.publish(ctx, q, &gq, slices); err != nil {
		return ctrl.Result{}, err
	}
	if !gq.DeletionTimestamp.IsZero() && q.ledger.Sum(r.Clock.Now()) == 0 && controllerutil.ContainsFinalizer(&gq, Finalizer) {
		// Every member acknowledged 0 (or its grants' bounds passed at a fallback of 0): the
		// quota and its ClusterSlices may go (deleted here rather than left to the garbage
		// collector, so that none is left for a quota created again under the name), and one
		// created again starts from nothing held.
		for _, cs := range slices {
			if err := r.Client.Delete(ctx, cs); err != nil && !apierrors.IsNotFound(err) {
				return ctrl.Result{}, err
			}
		}
		controllerutil.RemoveFinalizer(&gq, Finalizer)
		if err := r.Client.Update(ctx, &gq); err != nil {
			return ctrl.Result{}, err
		}
		r.forget(req.NamespacedName)
		return ctrl.Result{}, nil
	}
	var res ctrl.Result
	if next := q.ledger.NextBound(r.Clock.Now()); !next.IsZero() {
		log.V(1).Info("waiting for a bound", "at", next)
		res.RequeueAfter = next.Sub(r.Clock.Now()) + 10*time.Millisecond
	}
	if d := r.roundEvery(&gq); d > 0 && (res.RequeueAfter == 0 || d < res.RequeueAfter) {
		res.RequeueAfter = d
	}
	return res, nil
}

// roundEvery is how soon a DemandAware quota is planned again when nothing else wakes it: its
// next damped round. A damped round moves at most part of the way to the demand's target, and
// idle members write nothing, so without it the slices stopped after the first round (measured
// by bench-hub: 5 of 30 granted after 60 s with --sharing-min-interval=10s). A round that finds
// nothing to move writes nothing: an idle quota still costs the hub no write.
func (r *HubReconciler) roundEvery(gq *apportionv1.GlobalQuota) time.Duration {
	if policyOf(gq) != hub.DemandAware || !gq.DeletionTimestamp.IsZero() {
		return 0
	}
	damping := r.Damping
	if damping == nil {
		damping = demand.DefaultDamping
	}
	// At least a second: with no minimum interval (--sharing-min-interval=0) every change
	// already wakes the reconciler; this is only the fallback.
	return max(damping(int64(gq.Spec.MaxInFlight)).MinInterval, time.Second) + 10*time.Millisecond
}

// standOn makes q's ledger the one gq's allocation is: kept when gq is at the resourceVersion the
// ledger stands on (the cache may lag behind the ledger's own last write: the API server says),
// restored from the allocation, forgetting every bound, otherwise.
func (r *HubReconciler) standOn(ctx context.Context, q *hubQuota, gq *apportionv1.GlobalQuota) error {
	opts := leaseOptions(gq)
	if q.ledger != nil && q.uid == gq.UID && q.opts == opts {
		if gq.ResourceVersion == q.rv {
			return nil
		}
		var live apportionv1.GlobalQuota
		if err := r.Live.Get(ctx, client.ObjectKeyFromObject(gq), &live); err != nil {
			return err
		}
		if live.ResourceVersion == q.rv {
			return nil // the cache lags; the ledger is current
		}
		*gq = live
	} else {
		// A restore reads the allocation from the API server, not from a cache that may lag.
		var live apportionv1.GlobalQuota
		if err := r.Live.Get(ctx, client.ObjectKeyFromObject(gq), &live); err != nil {
			return err
		}
		*gq = live
	}
	l, err := hub.Restore(opts, allocationOf(gq.Status.Allocation))
	if err != nil {
		return fmt.Errorf("global quota %s/%s: %w", gq.Namespace, gq.Name, err)
	}
	q.ledger, q.opts, q.uid, q.rv = l, opts, gq.UID, gq.ResourceVersion
	return nil
}

// slices lists the quota's ClusterSlices, creating the missing ones of listed members (seq 0:
// a member reports its drain bound there before it is granted anything).
func (r *HubReconciler) slices(ctx context.Context, gq *apportionv1.GlobalQuota) (map[string]*apportionv1.ClusterSlice, error) {
	var list apportionv1.ClusterSliceList
	if err := r.Client.List(ctx, &list, client.InNamespace(gq.Namespace), client.MatchingLabels{LabelGlobalQuota: gq.Name}); err != nil {
		return nil, err
	}
	out := map[string]*apportionv1.ClusterSlice{}
	for i := range list.Items {
		cs := &list.Items[i]
		if cs.Spec.GlobalQuota == gq.Name && metav1.IsControlledBy(cs, gq) {
			out[cs.Spec.Cluster] = cs
		}
	}
	lease := leaseOptions(gq).LeaseDuration
	for _, m := range gq.Spec.Members {
		if out[m.Name] != nil || !gq.DeletionTimestamp.IsZero() {
			continue
		}
		cs := &apportionv1.ClusterSlice{
			ObjectMeta: metav1.ObjectMeta{Namespace: gq.Namespace, Name: SliceName(gq.Name, m.Name), Labels: map[string]string{LabelGlobalQuota: gq.Name}},
			Spec:       apportionv1.ClusterSliceSpec{GlobalQuota: gq.Name, Cluster: m.Name, LeaseDuration: metav1.Duration{Duration: lease}},
		}
		if err := controllerutil.SetControllerReference(gq, cs, r.Client.Scheme()); err != nil {
			return nil, err
		}
		if err := r.Client.Create(ctx, cs); err != nil && !apierrors.IsAlreadyExists(err) {
			return nil, err
		}
		out[m.Name] = cs
	}
	return out, nil
}

// Finalizer keeps a deleted GlobalQuota (and so its ClusterSlices) until every member was
// lowered to 0, reserved slice included, and acknowledged it or its bounds passed.
const Finalizer = "apportion.io/slices-drained"

func policyOf(gq *apportionv1.GlobalQuota) hub.Policy {
	if gq.Spec.Sharing != nil && gq.Spec.Sharing.Policy == apportionv1.SharingDemandAware {
		return hub.DemandAware
	}
	return hub.Equal
}

// plan decides the members' slices and moves the ledger towards them. The rotation counter is
// fixed: a rotating remainder would move a permit between members, a write, every few minutes
// of an idle quota.
func (r *HubReconciler) plan(q *hubQuota, gq *apportionv1.GlobalQuota, slices map[string]*apportionv1.ClusterSlice, now time.Time) ([]hub.Change, bool, error) {
	shares := make([]hub.Share, 0, len(gq.Spec.Members))
	members := gq.Spec.Members
	if !gq.DeletionTimestamp.IsZero() {
		members = nil // deleted: every member goes to 0 (Plan lowers a member it is not given)
	}
	for _, m := range members {
		var d int64
		if cs := slices[m.Name]; cs != nil {
			d = int64(cs.Status.Demand)
		}
		shares = append(shares, hub.Share{Cluster: m.Name, Reserved: int64(m.ReservedSlice), Demand: d, Current: q.ledger.Current(m.Name).Slice})
	}
	want, damped, err := hub.Slices(int64(gq.Spec.MaxInFlight), policyOf(gq), shares, 0, r.Damping, now, q.lastDamped)
	if err != nil {
		return nil, false, err
	}
	targets := make([]hub.Target, len(shares))
	for i, s := range shares {
		targets[i] = hub.Target{Cluster: s.Cluster, Reserved: s.Reserved, Want: want[i]}
	}
	changes, err := q.ledger.Plan(now, int64(gq.Spec.MaxInFlight), targets)
	if err != nil {
		q.ledger = nil
		return nil, false, err
	}
	return changes, damped && len(changes) > 0, nil
}

// publish writes every grant the allocation holds and a ClusterSlice does not show yet, with the
// ClusterSlice's resourceVersion as precondition (the API server also refuses a lower seq), and
// records when each write returned as the grant's publish time. ClusterSlices of clusters the
// ledger no longer knows are deleted.
func (r *HubReconciler) publish(ctx context.Context, q *hubQuota, gq *apportionv1.GlobalQuota, slices map[string]*apportionv1.ClusterSlice) error {
	lease := metav1.Duration{Duration: q.opts.LeaseDuration}
	known := map[string]bool{}
	for _, a := range q.ledger.Allocation().Members {
		known[a.Cluster] = true
		g, cs := a.Grant, slices[a.Cluster]
		if cs == nil || g.Seq <= cs.Spec.Seq {
			continue
		}
		cs = cs.DeepCopy()
		cs.Spec.Seq, cs.Spec.Slice, cs.Spec.ReservedSlice, cs.Spec.LeaseDuration = g.Seq, int32(g.Slice), int32(g.Reserved), lease
		if err := r.Client.Update(ctx, cs); err != nil {
			if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
				continue // the next reconcile (the watch brings it) publishes it
			}
			return err
		}
		q.ledger.Published(a.Cluster, g.Seq, r.Clock.Now())
	}
	for c, cs := range slices {
		if !known[c] && !listed(gq, c) && gq.DeletionTimestamp.IsZero() {
			if err := r.Client.Delete(ctx, cs); err != nil && !apierrors.IsNotFound(err) {
				return err
			}
		}
	}
	return nil
}

func listed(gq *apportionv1.GlobalQuota, cluster string) bool {
	for _, m := range gq.Spec.Members {
		if m.Name == cluster {
			return true
		}
	}
	return false
}

func allocationOf(lines []apportionv1.SliceAllocation) hub.Allocation {
	var a hub.Allocation
	for _, l := range lines {
		ms := hub.MemberSlice{
			Cluster: l.Cluster,
			Grant:   hub.Grant{Seq: l.Seq, Slice: int64(l.Slice), Reserved: int64(l.ReservedSlice)},
			Former:  int64(l.Former), FormerReserved: int64(l.FormerReservedSlice),
		}
		if l.Drain != nil {
			ms.Drain = l.Drain.Duration
		}
		a.Members = append(a.Members, ms)
	}
	return a
}

// statusOf is the GlobalQuota status the ledger stands for: the allocation, Σ granted, and Ready
// (every listed member acknowledged its current grant).
func statusOf(l *hub.Ledger, gq *apportionv1.GlobalQuota, slices map[string]*apportionv1.ClusterSlice) apportionv1.GlobalQuotaStatus {
	st := apportionv1.GlobalQuotaStatus{ObservedGeneration: gq.Generation, Conditions: append([]metav1.Condition(nil), gq.Status.Conditions...)}
	for _, m := range l.Allocation().Members {
		line := apportionv1.SliceAllocation{
			Cluster: m.Cluster, Seq: m.Grant.Seq, Slice: int32(m.Grant.Slice), ReservedSlice: int32(m.Grant.Reserved),
			Former: int32(m.Former), FormerReservedSlice: int32(m.FormerReserved),
		}
		// A restored ledger takes the larger of this and what the member reports again; a
		// drain alone never writes (statusEqual), it rides along with the next write.
		if m.Drain > 0 {
			line.Drain = &metav1.Duration{Duration: m.Drain}
		}
		st.Allocation = append(st.Allocation, line)
		st.Granted += int32(m.Grant.Slice)
	}
	ready, reason, msg := metav1.ConditionTrue, "Acknowledged", "every member acknowledged its slice"
	for _, m := range gq.Spec.Members {
		cs := slices[m.Name]
		switch {
		case cs == nil || cs.Status.Drain == nil:
			ready, reason, msg = metav1.ConditionFalse, "NoDrain", fmt.Sprintf("member %s has not reported its drain bound", m.Name)
		case cs.Status.AcknowledgedSeq < l.Current(m.Name).Seq || l.Current(m.Name).Seq == 0:
			if ready == metav1.ConditionTrue {
				ready, reason, msg = metav1.ConditionFalse, "Moving", fmt.Sprintf("member %s has not acknowledged its slice", m.Name)
			}
		}
	}
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{Type: apportionv1.ConditionReady, Status: ready, Reason: reason, Message: msg, ObservedGeneration: gq.Generation})
	return st
}

// statusEqual compares what a status write would change (condition times aside).
func statusEqual(a, b apportionv1.GlobalQuotaStatus) bool {
	if a.ObservedGeneration != b.ObservedGeneration || a.Granted != b.Granted || len(a.Allocation) != len(b.Allocation) || len(a.Conditions) != len(b.Conditions) {
		return false
	}
	for i := range a.Allocation {
		x, y := a.Allocation[i], b.Allocation[i]
		if x.Cluster != y.Cluster || x.Seq != y.Seq || x.Slice != y.Slice || x.ReservedSlice != y.ReservedSlice ||
			x.Former != y.Former || x.FormerReservedSlice != y.FormerReservedSlice || (x.Drain == nil) != (y.Drain == nil) {
			return false
		}
	}
	for _, c := range a.Conditions {
		o := meta.FindStatusCondition(b.Conditions, c.Type)
		if o == nil || o.Status != c.Status || o.Reason != c.Reason || o.Message != c.Message || o.ObservedGeneration != c.ObservedGeneration {
			return false
		}
	}
	return true
}
