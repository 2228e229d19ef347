package controller

import (
	"cmp"
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/apportion/demand"
	"github.com/apportion/apportion/internal/push"
	"github.com/apportion/apportion/internal/targets"
)

// DefaultQuotaWorkers is how many DownstreamQuotas are reconciled at once by default.
const DefaultQuotaWorkers = 32

// StatusRefreshDelay is how long a quota's status refresh for the push engine's changes (acks,
// failures, convergence) waits, gathering the changes that follow.
const StatusRefreshDelay = time.Second

// Pusher delivers each pod's permits to its agent and reports what the pods hold. The push
// engine (internal/push) implements it; nil means the manager only computes and reports.
type Pusher interface {
	SetQuota(push.DesiredQuota)
	DeleteQuota(types.NamespacedName)
	Report(types.NamespacedName) push.Report
}

// DownstreamQuotaReconciler recomputes every pod's share of a DownstreamQuota whenever the
// quota, a target workload, its HPA or its pods change, hands the shares to the Pusher and
// writes the status.
type DownstreamQuotaReconciler struct {
	client.Client
	Recorder events.EventRecorder
	Pusher   Pusher
	Clock    clock.PassiveClock
	// Changes carries quota keys whose push state changed (acks, failures) so that their
	// status is refreshed; may be nil.
	Changes <-chan event.GenericEvent
	// Workers bounds the quotas reconciled at once (0: DefaultQuotaWorkers). Run one at a time,
	// a change of many quotas at once (an HPA decision each) would reach the push engine one
	// reconcile after another. One quota is never reconciled twice at once (the work queue's
	// guarantee), and the engine keeps one ledger per quota under its lock.
	Workers int
	// StatusWriters, when positive, is how many status writes are in flight at once: the
	// reconcile hands its quota's status to a StatusWriter (set up by SetupWithManager, run on
	// the leader) and never waits on the API server — an API server that takes seconds per write
	// would otherwise hold every reconcile, and so every other quota's HPA decision, behind the
	// status writes. Zero writes the status inside the reconcile (a reconciler used without
	// SetupWithManager always does).
	StatusWriters int
	// Registry receives the status writer's counters; may be nil.
	Registry prometheus.Registerer
	// decided remembers, per quota, the last status this reconciler decided, and for which quota
	// (UID). It is the base of the next decision: the cached status lags behind a write just made,
	// and further behind a status still waiting for its writer, and the conditions' transition
	// times, the last rebalance time and the Events must follow from what was last decided
	// ("8→10 pods"), not from a stale read ("0→10").
	decided sync.Map // types.NamespacedName → decidedStatus
	// writer writes the statuses when StatusWriters is positive; statusWrite is the write of one
	// status, the writer's or the reconcile's own.
	writer      *StatusWriter[quotaStatusUpdate]
	statusOnce  sync.Once
	statusWrite *quotaStatusWriter

	// Demand-aware sharing (downstreamquota_sharing.go): how often a DemandAware quota is
	// re-evaluated, its demand's smoothing constant and its damping; zero values are the
	// defaults. sharing holds each DemandAware quota's *sharingMemory.
	SharingPeriod time.Duration
	DemandTau     time.Duration
	Damping       func(budget int64) demand.Damping
	sharing       sync.Map

	// Globals, in a member cluster, holds the slices of the quotas with spec.global
	// (downstreamquota_global.go); nil: such a quota holds nothing. GlobalChanges carries the
	// keys of those quotas whose grant or lease changed, reconciled at once; may be nil.
	Globals       GlobalSlices
	GlobalChanges <-chan event.GenericEvent

	// RemainderRotation is how often the permits left by rounding move to other pods
	// (downstreamquota_sharing.go; 0: DefaultRemainderRotation; negative: never).
	RemainderRotation time.Duration

	// incidents remembers, per quota, its budget and when it was last lowered
	// (downstreamquota_rampraise.go): types.NamespacedName → incidentMemory.
	incidents sync.Map

	// usage holds the quotas' usage gauges (downstreamquota_usage.go); nil until SetupWithManager
	// made them (a reconciler used without it exports none).
	usage *usageMetrics
}

// +kubebuilder:rbac:groups=apportion.io,resources=downstreamquotas,verbs=get;list;watch
// +kubebuilder:rbac:groups=apportion.io,resources=downstreamquotas/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=apportion.io,resources=degraderules,verbs=get;list;watch
// +kubebuilder:rbac:groups=apps,resources=deployments;statefulsets,verbs=get;list;watch
// +kubebuilder:rbac:groups=autoscaling,resources=horizontalpodautoscalers,verbs=get;list;watch
// +kubebuilder:rbac:groups="",resources=pods,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

var _ reconcile.Reconciler = (*DownstreamQuotaReconciler)(nil)

// Reconcile implements reconcile.Reconciler in three steps, as cert-manager's controllers do:
//
//   - gather (downstreamquota_gather.go): read everything the decision depends on into one
//     value: the quota, its targets' workloads, HPAs and pods, the degrade switches in force, the
//     engine's last report, the reconciler's own memory of the quota, the clock;
//   - decide, from that value alone, with no client and no clock: decideAssignment, what every
//     pod should hold (downstreamquota_assignment.go), then decideStatus, the status (Ready by
//     an explicit order of precedence), the Events and the requeue (downstreamquota_decide.go);
//   - act: the engine takes the assignment (assign); the status and its Events go to the status
//     writer (act).
//
// The engine takes the assignment between the two halves of the decision: the status reports
// what the engine holds once it has the new assignment (not converged while pods have not
// acknowledged it, the ledger of the new plan), which only the engine knows; a status decided on
// the report from before would call a quota Ready whose pods have not seen their new permits.
func (r *DownstreamQuotaReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	in, err := r.gather(ctx, req.NamespacedName)
	if err != nil {
		return ctrl.Result{}, err
	}
	if in == nil {
		r.forget(req.NamespacedName)
		return ctrl.Result{}, nil
	}
	policy := r.policy()
	a := decideAssignment(in, policy)
	rampUntil := r.flagRampRaise(req.NamespacedName, in.Quota, a.Desired, in.Now)
	report := r.assign(req.NamespacedName, a)
	if in.Global != nil && r.Globals != nil && a.Desired != nil {
		r.Globals.Assigned(req.NamespacedName, in.Global.Grant.Seq)
	}
	d := decideStatus(in, policy, a, report)
	if report != nil {
		r.usage.observe(req.NamespacedName, in.Quota, &d.Status)
	}
	res, err := r.act(ctx, req.NamespacedName, in.Quota.UID, d)
	if err != nil {
		return res, err
	}
	return requeueBy(res, rampUntil, in.Now), nil // back to clear the flag
}

// policy is the reconciler's settings as a decision reads them, defaults filled in.
func (r *DownstreamQuotaReconciler) policy() quotaPolicy {
	p := quotaPolicy{
		Push:              r.Pusher != nil,
		SharingPeriod:     r.SharingPeriod,
		Sharing:           r.sharingParams(),
		RemainderRotation: cmp.Or(r.RemainderRotation, DefaultRemainderRotation),
	}
	if p.SharingPeriod <= 0 {
		p.SharingPeriod = DefaultSharingPeriod
	}
	return p
}

// assign hands the assignment to the engine and returns the engine's report once it has it; nil
// without an engine.
func (r *DownstreamQuotaReconciler) assign(key types.NamespacedName, a quotaAssignment) *push.Report {
	if r.Pusher == nil || a.Desired == nil {
		return nil
	}
	if a.Shared == nil {
		r.sharing.Delete(key) // not (or no longer) DemandAware: its sharing memory goes
	}
	r.Pusher.SetQuota(*a.Desired)
	rep := r.Pusher.Report(key)
	return &rep
}

// act hands the decided status and its Events to the status writer — or, without one, writes
// them — and remembers the decision as the base of the next one.
func (r *DownstreamQuotaReconciler) act(ctx context.Context, key types.NamespacedName, uid types.UID, d quotaDecision) (ctrl.Result, error) {
	update := quotaStatusUpdate{UID: uid, Status: d.Status, Events: d.Events}
	requeue := ctrl.Result{RequeueAfter: d.Requeue}
	if r.writer != nil {
		// The writer writes it — unless the quota already has it — and records the Events after;
		// it keeps this decision until then, so it is the base of the next one.
		r.decided.Store(key, decidedStatus{UID: uid, Status: d.Status})
		r.writer.Set(key, update)
		return requeue, nil
	}
	if _, err := r.statusWriter().write(ctx, key, update); err != nil {
		// Nothing decided or recorded: the retry computes the same change again.
		return ctrl.Result{}, err
	}
	r.decided.Store(key, decidedStatus{UID: uid, Status: d.Status})
	return requeue, nil
}

// forget drops what the reconciler and the engine keep of a quota that is gone.
func (r *DownstreamQuotaReconciler) forget(key types.NamespacedName) {
	r.decided.Delete(key)
	r.sharing.Delete(key)
	r.incidents.Delete(key)
	r.statusWriter().forget(key)
	r.usage.forget(key)
	if r.Pusher != nil {
		r.Pusher.DeleteQuota(key)
	}
}

// decidedStatus is the last status decided for a quota, and the quota's UID.
type decidedStatus struct {
	UID    types.UID
	Status apportionv1.DownstreamQuotaStatus
}

// statusWriter is the write function of the quotas' statuses (made on first use, so that a
// reconciler used without SetupWithManager has one too).
func (r *DownstreamQuotaReconciler) statusWriter() *quotaStatusWriter {
	r.statusOnce.Do(func() {
		r.statusWrite = &quotaStatusWriter{Reader: r.Client, Client: r.Client, Recorder: r.Recorder}
	})
	return r.statusWrite
}

// SetupWithManager wires the watches. Pods, workloads and HPAs are mapped to the quotas that name
// them through field indexes (see SetupIndexes), so no event lists every quota.
func (r *DownstreamQuotaReconciler) SetupWithManager(mgr ctrl.Manager) error {
	if r.Pusher != nil {
		m, err := newUsageMetrics(r.Registry)
		if err != nil {
			return err
		}
		r.usage = m
	}
	if r.StatusWriters > 0 {
		w, err := NewStatusWriter(StatusWriterOptions[quotaStatusUpdate]{
			Name:     "downstreamquota_status",
			Workers:  r.StatusWriters,
			Write:    r.statusWriter().write,
			Merge:    mergeQuotaUpdates,
			Registry: r.Registry,
			Logger:   mgr.GetLogger().WithName("status"),
		})
		if err != nil {
			return err
		}
		if err := mgr.Add(w); err != nil {
			return err
		}
		r.writer = w
	}
	b := ctrl.NewControllerManagedBy(mgr).
		For(&apportionv1.DownstreamQuota{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Watches(&appsv1.Deployment{}, handler.EnqueueRequestsFromMapFunc(r.quotasForWorkload(apportionv1.KindDeployment)),
			builder.WithPredicates(workloadChanged{})).
		Watches(&appsv1.StatefulSet{}, handler.EnqueueRequestsFromMapFunc(r.quotasForWorkload(apportionv1.KindStatefulSet)),
			builder.WithPredicates(workloadChanged{})).
		Watches(&autoscalingv2.HorizontalPodAutoscaler{}, handler.EnqueueRequestsFromMapFunc(r.quotasForHPA)).
		Watches(&corev1.Pod{}, handler.EnqueueRequestsFromMapFunc(r.quotasForPod), builder.WithPredicates(podChanged{})).
		Watches(&apportionv1.DegradeRule{}, handler.EnqueueRequestsFromMapFunc(quotaForRule)).
		Named("downstreamquota").
		WithOptions(controller.Options{MaxConcurrentReconciles: cmp.Or(max(r.Workers, 0), DefaultQuotaWorkers)})
	if r.Changes != nil {
		// The engine's changes only refresh the status: they wait StatusRefreshDelay, so that the
		// acks of one rebalance make one status write rather than one each, and a change of many
		// quotas at once (HPA decisions, queued at once) reaches the engine before the status
		// refreshes of the quotas already pushed.
		b = b.WatchesRawSource(source.Channel(r.Changes, handler.Funcs{
			GenericFunc: func(_ context.Context, e event.GenericEvent, q workqueue.TypedRateLimitingInterface[reconcile.Request]) {
				q.AddAfter(reconcile.Request{NamespacedName: client.ObjectKeyFromObject(e.Object)}, StatusRefreshDelay)
			},
		}))
	}
	if r.GlobalChanges != nil {
		// A new grant, or a lease that ended: a new local limit, apportioned at once (a lowered
		// one must reach the pods within the member's drain bound).
		b = b.WatchesRawSource(source.Channel(r.GlobalChanges, &handler.EnqueueRequestForObject{}))
	}
	return b.Complete(r)
}

func requestsFor(list *apportionv1.DownstreamQuotaList) []reconcile.Request {
	out := make([]reconcile.Request, 0, len(list.Items))
	for _, dq := range list.Items {
		out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: dq.Namespace, Name: dq.Name}})
	}
	return out
}

func (r *DownstreamQuotaReconciler) quotasForWorkload(kind apportionv1.WorkloadKind) handler.MapFunc {
	return func(ctx context.Context, o client.Object) []reconcile.Request {
		var list apportionv1.DownstreamQuotaList
		if err := r.List(ctx, &list, client.InNamespace(o.GetNamespace()), client.MatchingFields{indexQuotaWorkload: workloadKey(string(kind), o.GetName())}); err != nil {
			log.FromContext(ctx).Error(err, "mapping workload to quotas")
			return nil
		}
		return requestsFor(&list)
	}
}

func (r *DownstreamQuotaReconciler) quotasForHPA(ctx context.Context, o client.Object) []reconcile.Request {
	hpa := o.(*autoscalingv2.HorizontalPodAutoscaler)
	seen := map[types.NamespacedName]bool{}
	var out []reconcile.Request
	for _, f := range []client.MatchingFields{
		{indexQuotaWorkload: workloadKey(hpa.Spec.ScaleTargetRef.Kind, hpa.Spec.ScaleTargetRef.Name)},
		{indexQuotaHPA: hpa.Name},
	} {
		var list apportionv1.DownstreamQuotaList
		if err := r.List(ctx, &list, client.InNamespace(hpa.Namespace), f); err != nil {
			log.FromContext(ctx).Error(err, "mapping HPA to quotas")
			return nil
		}
		for _, req := range requestsFor(&list) {
			if !seen[req.NamespacedName] {
				seen[req.NamespacedName] = true
				out = append(out, req)
			}
		}
	}
	return out
}

// quotasForPod maps a pod to the quotas of the workloads whose selector matches it
// (internal/targets, the rule the injection webhook uses too). The quotas of the pod's namespace
// are few; their workloads come from the cache.
func (r *DownstreamQuotaReconciler) quotasForPod(ctx context.Context, o client.Object) []reconcile.Request {
	list, err := targets.QuotasForPod(ctx, r.Client, o.GetNamespace(), o.GetLabels())
	if err != nil {
		log.FromContext(ctx).Error(err, "mapping pod to quotas")
		return nil
	}
	out := make([]reconcile.Request, 0, len(list))
	for _, dq := range list {
		out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: dq.Namespace, Name: dq.Name}})
	}
	return out
}

func quotaForRule(_ context.Context, o client.Object) []reconcile.Request {
	rule := o.(*apportionv1.DegradeRule)
	return []reconcile.Request{{NamespacedName: types.NamespacedName{Namespace: rule.Namespace, Name: rule.Spec.Downstream}}}
}

// workloadChanged passes workload events that can change a replica count or selector.
type workloadChanged struct{ predicate.Funcs }

func (workloadChanged) Update(e event.UpdateEvent) bool {
	return e.ObjectOld.GetGeneration() != e.ObjectNew.GetGeneration() ||
		e.ObjectOld.GetDeletionTimestamp().IsZero() != e.ObjectNew.GetDeletionTimestamp().IsZero()
}
func (workloadChanged) Create(event.CreateEvent) bool   { return true }
func (workloadChanged) Delete(event.DeleteEvent) bool   { return true }
func (workloadChanged) Generic(event.GenericEvent) bool { return true }

// podChanged passes pod events that change whether or where a pod may call: its labels, IP,
// phase, termination or agent port.
type podChanged struct{ predicate.Funcs }

func (podChanged) Update(e event.UpdateEvent) bool {
	a, b := e.ObjectOld.(*corev1.Pod), e.ObjectNew.(*corev1.Pod)
	return !labels.Equals(a.Labels, b.Labels) || a.Status.PodIP != b.Status.PodIP ||
		a.Status.Phase != b.Status.Phase || a.DeletionTimestamp.IsZero() != b.DeletionTimestamp.IsZero() ||
		agentOf(a) != agentOf(b)
}
func (podChanged) Create(event.CreateEvent) bool   { return true }
func (podChanged) Delete(event.DeleteEvent) bool   { return true }
func (podChanged) Generic(event.GenericEvent) bool { return true }
