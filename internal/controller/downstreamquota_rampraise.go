package controller

import (
	"time"

	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/push"
)

// This file decides when a quota's raises follow an incident (assignment.Downstream.RampRaise):
// the agents then climb to raised permits through their recovery ramp instead of at once
// (docs/agent.md, "Raises after an incident").
//
// The signal is the quota's budget, spec.maxInFlight × safetyFactorPercent: an operator lowers it
// during an incident (the partner is overloaded, or answers 429s) and raises it back when the
// incident is over, and raising it back in one step is what tips a partner still recovering over
// again. A raise of a pod's permits while the budget stands (a scale-in, a rotation of the
// remainder) or a new pod's first permits are not that, so the flag is set only for
// IncidentWindow after the budget was last lowered. The agents' own evidence of an incident —
// their breaker closing, their adaptive limit dropping — starts a ramp in the agent itself; the
// 429s and breaker states they report are not kept by the push engine's report, so they are not
// a signal here.

// IncidentWindow is how long after a quota's budget was lowered its raises still ramp: an
// incident's limit is typically raised back within minutes, and a raise later than this is a new
// decision, not the end of the incident.
const IncidentWindow = 5 * time.Minute

// incidentMemory is what the reconciler remembers of a quota's budget: the budget last seen and
// when it was last lowered. Kept in memory only: a manager that restarts forgets an incident, and
// its raises then apply at once, as they did before the flag existed.
type incidentMemory struct {
	UID       types.UID
	Budget    int64     // spec.maxInFlight × safetyFactorPercent last seen; 0: none seen
	LoweredAt time.Time // zero: not lowered since this reconciler first saw the quota
}

// noteBudget is m after the reconciler saw budget at now. Pure. A budget below the last one seen
// is a lowering (LoweredAt = now); the first budget seen, an equal one or a higher one lowers
// nothing. A new UID (the quota deleted and created again) starts afresh.
func noteBudget(m incidentMemory, uid types.UID, budget int64, now time.Time) incidentMemory {
	if m.UID != uid {
		m = incidentMemory{UID: uid}
	}
	if m.Budget > 0 && budget < m.Budget {
		m.LoweredAt = now
	}
	m.Budget = budget
	return m
}

// rampRaiseUntil is when the quota's raises stop following an incident: IncidentWindow after the
// budget was last lowered; zero when it never was. Pure.
func (m incidentMemory) rampRaiseUntil() time.Time {
	if m.LoweredAt.IsZero() {
		return time.Time{}
	}
	return m.LoweredAt.Add(IncidentWindow)
}

// budgetOf is the quota's budget as noteBudget compares it.
func budgetOf(dq *apportionv1.DownstreamQuota) int64 {
	return int64(dq.Spec.MaxInFlight) * int64(safetyFactorPercent(dq))
}

// flagRampRaise notes the quota's budget and sets d's RampRaise while its raises follow an
// incident — only when the quota has a ramp for the agents to climb (without one the flag would
// change nothing but cost a push to every pod). It returns when the flag is to be cleared (zero:
// it is not set), so that the reconcile comes back then.
func (r *DownstreamQuotaReconciler) flagRampRaise(key types.NamespacedName, dq *apportionv1.DownstreamQuota, d *push.DesiredQuota, now time.Time) time.Time {
	var m incidentMemory
	if v, ok := r.incidents.Load(key); ok {
		m = v.(incidentMemory)
	}
	m = noteBudget(m, dq.UID, budgetOf(dq), now)
	r.incidents.Store(key, m)
	until := m.rampRaiseUntil()
	if d == nil || d.Downstream.Recovery == nil || d.Downstream.Recovery.Ramp == nil || !now.Before(until) {
		return time.Time{}
	}
	d.Downstream.RampRaise = true
	return until
}

// requeueBy brings res's requeue forward to until (after now) when it is later or unset.
func requeueBy(res ctrl.Result, until, now time.Time) ctrl.Result {
	if until.IsZero() || !until.After(now) {
		return res
	}
	if after := until.Sub(now); res.RequeueAfter <= 0 || after < res.RequeueAfter {
		res.RequeueAfter = after
	}
	return res
}
