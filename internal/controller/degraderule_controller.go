package controller

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/builder"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/controller-runtime/pkg/predicate"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"
	"sigs.k8s.io/controller-runtime/pkg/source"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// SwitchReporter tells how far a degrade switch got. The push engine (internal/push) implements
// it: SwitchApplied returns how many affected pods confirmed the switch "<namespace>/<rule>" in
// its current form, and how many pods it affects.
type SwitchReporter interface {
	SwitchApplied(name string) (applied, total int)
}

// Defaults of DegradeRuleReconciler's timings.
const (
	DefaultDegradePendingPoll  = 250 * time.Millisecond
	DefaultDegradeActiveResync = 10 * time.Second
)

// DegradeRuleReconciler judges DegradeRules and keeps their status: it validates what the API
// server cannot (the expiry against the clock and the manager's horizon, the DownstreamQuota and
// target the rule names, what the agents accept), follows the pods' confirmations from Pending to
// Active, and marks the rule Expired at its expiry, with an Event. It never pushes anything
// itself: the DownstreamQuota reconciler pushes every rule this one judged valid (see switchFor),
// and re-reconciles its quota on every change of a rule, status included.
type DegradeRuleReconciler struct {
	client.Client
	Recorder events.EventRecorder
	// Clock gives now for the expiry checks and the requeue at the expiry.
	Clock clock.PassiveClock
	// Applied reports the pods' confirmations; nil when no push engine is wired, in which case a
	// valid rule is Active at once, with podsTotal 0. Do not set it to a typed nil pointer.
	Applied SwitchReporter
	// MaxHorizon is the furthest a rule's expiresAt may lie ahead when its spec is written
	// (the manager's --max-degrade-horizon); zero means DefaultMaxDegradeHorizon.
	MaxHorizon time.Duration
	// PendingPoll is how often a Pending rule asks Applied again; zero means
	// DefaultDegradePendingPoll. ActiveResync is how often an Active rule refreshes its pod
	// counts when an engine is wired; zero means DefaultDegradeActiveResync.
	PendingPoll, ActiveResync time.Duration
	// Changes optionally carries DownstreamQuotas whose push state changed (the engine's
	// OnChange); their rules are re-evaluated at once instead of at the next poll. May be nil.
	// It must be a channel of its own: a channel's event reaches only one receiver.
	Changes <-chan event.GenericEvent
}

// +kubebuilder:rbac:groups=apportion.io,resources=degraderules,verbs=get;list;watch
// +kubebuilder:rbac:groups=apportion.io,resources=degraderules/status,verbs=get;update;patch
// +kubebuilder:rbac:groups=apportion.io,resources=downstreamquotas,verbs=get;list;watch
// +kubebuilder:rbac:groups=events.k8s.io,resources=events,verbs=create;patch

var _ reconcile.Reconciler = (*DegradeRuleReconciler)(nil)

// Reconcile implements reconcile.Reconciler.
func (r *DegradeRuleReconciler) Reconcile(ctx context.Context, req ctrl.Request) (ctrl.Result, error) {
	var rule apportionv1.DegradeRule
	if err := r.Get(ctx, req.NamespacedName, &rule); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	if rule.DeletionTimestamp != nil {
		return ctrl.Result{}, nil
	}

	in := ruleInputs{Now: r.Clock.Now(), Horizon: r.MaxHorizon}
	if in.Horizon <= 0 {
		in.Horizon = DefaultMaxDegradeHorizon
	}
	var dq apportionv1.DownstreamQuota
	switch err := r.Get(ctx, types.NamespacedName{Namespace: rule.Namespace, Name: rule.Spec.Downstream}, &dq); {
	case err == nil && dq.DeletionTimestamp == nil:
		in.Quota = &dq
	case err != nil && !apierrors.IsNotFound(err):
		return ctrl.Result{}, err
	}
	if r.Applied != nil {
		applied, total := r.Applied.SwitchApplied(switchName(&rule))
		in.Engine, in.Applied, in.Total = true, int32(applied), int32(total)
	}

	status := computeRuleStatus(&rule, in)
	requeue := ruleRequeue(&rule, &status, in.Now, durOrDefault(r.PendingPoll, DefaultDegradePendingPoll),
		durOrDefault(r.ActiveResync, DefaultDegradeActiveResync), in.Engine)
	if equality.Semantic.DeepEqual(rule.Status, status) {
		return ctrl.Result{RequeueAfter: requeue}, nil
	}
	// Written here, not by a StatusWriter as the quotas' statuses are: a rule's status is an input
	// of the protocol (switchFor pushes a rule only once its written status says Pending or Active
	// for its generation), and its next judgement reads it back (first sight of a spec, the phase
	// it comes from); rules are few, and their reconciles hold no quota's reconcile back.
	prevPhase := rule.Status.Phase
	orig := rule.DeepCopy()
	rule.Status = status
	if err := r.Status().Patch(ctx, &rule, client.MergeFrom(orig)); err != nil {
		return ctrl.Result{}, client.IgnoreNotFound(err)
	}
	log.FromContext(ctx).V(1).Info("status updated", "phase", status.Phase, "message", status.Message)
	if status.Phase != prevPhase {
		r.recordPhase(&rule, in.Quota)
	}
	return ctrl.Result{RequeueAfter: requeue}, nil
}

// recordPhase emits the Event of a phase change.
func (r *DegradeRuleReconciler) recordPhase(rule *apportionv1.DegradeRule, dq *apportionv1.DownstreamQuota) {
	var related runtime.Object
	if dq != nil {
		related = dq
	}
	st := &rule.Status
	switch st.Phase {
	case apportionv1.PhaseActive:
		r.Recorder.Eventf(rule, related, corev1.EventTypeNormal, apportionv1.ReasonRuleActivated, "Activate",
			"degrading %s for %s: %s (%s)", rule.Spec.Downstream, st.Scope, st.Message, rule.Spec.Reason)
	case apportionv1.PhasePending:
		r.Recorder.Eventf(rule, related, corev1.EventTypeNormal, apportionv1.ReasonRuleAccepted, "Push", "%s", st.Message)
	case apportionv1.PhaseExpired:
		r.Recorder.Eventf(rule, related, corev1.EventTypeNormal, apportionv1.ReasonRuleExpired, "Expire", "%s", st.Message)
	case apportionv1.PhaseInactive:
		r.Recorder.Eventf(rule, related, corev1.EventTypeNormal, apportionv1.ReasonRuleDeactivated, "Deactivate", "%s", st.Message)
	case apportionv1.PhaseInvalid:
		r.Recorder.Eventf(rule, related, corev1.EventTypeWarning, apportionv1.ReasonRuleInvalid, "Validate", "%s", st.Message)
	}
}

func durOrDefault(d, def time.Duration) time.Duration {
	if d <= 0 {
		return def
	}
	return d
}

// SetupWithManager wires the watches: the rules themselves (spec changes; status writes do not
// come back), and DownstreamQuotas (created, deleted, targets edited), mapped to the rules that
// name them through the indexRuleDownstream index (see SetupIndexes).
func (r *DegradeRuleReconciler) SetupWithManager(mgr ctrl.Manager) error {
	b := ctrl.NewControllerManagedBy(mgr).
		For(&apportionv1.DegradeRule{}, builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Watches(&apportionv1.DownstreamQuota{}, handler.EnqueueRequestsFromMapFunc(r.rulesForQuota),
			builder.WithPredicates(predicate.GenerationChangedPredicate{})).
		Named("degraderule")
	if r.Changes != nil {
		b = b.WatchesRawSource(source.Channel(r.Changes, handler.EnqueueRequestsFromMapFunc(r.rulesForQuota)))
	}
	return b.Complete(r)
}

// rulesForQuota maps a DownstreamQuota to the rules that name it.
func (r *DegradeRuleReconciler) rulesForQuota(ctx context.Context, o client.Object) []reconcile.Request {
	var rules apportionv1.DegradeRuleList
	if err := r.List(ctx, &rules, client.InNamespace(o.GetNamespace()), client.MatchingFields{indexRuleDownstream: o.GetName()}); err != nil {
		log.FromContext(ctx).Error(err, "mapping DownstreamQuota to DegradeRules")
		return nil
	}
	out := make([]reconcile.Request, 0, len(rules.Items))
	for _, rule := range rules.Items {
		out = append(out, reconcile.Request{NamespacedName: types.NamespacedName{Namespace: rule.Namespace, Name: rule.Name}})
	}
	return out
}
