package controller

import (
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/push"
	"github.com/apportion/apportion/internal/testing/builders"
)

// TestRampRaiseFollowsALowering walks one quota's budget through an incident: the flag is off
// while the budget stands or rises, on from the moment it is lowered (through the raise back)
// for IncidentWindow, off after; off for a quota without a ramp; and a quota created again
// starts afresh. The reconcile comes back when the flag is to be cleared.
func TestRampRaiseFollowsALowering(t *testing.T) {
	r := &DownstreamQuotaReconciler{}
	key := types.NamespacedName{Namespace: "ns", Name: "logistics"}
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	dq := builders.MakeDownstreamQuota("logistics", "ns").Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
	dq.UID = "uid-1"
	withRamp := func() *push.DesiredQuota {
		return &push.DesiredQuota{Downstream: assignment.Downstream{Recovery: &assignment.Recovery{
			Window: assignment.Duration(time.Second), Ramp: &assignment.Ramp{Shape: assignment.ShapeLinear}}}}
	}
	step := func(what string, limit int32, at time.Duration, wantFlag bool) time.Time {
		t.Helper()
		dq.Spec.MaxInFlight = limit
		d := withRamp()
		until := r.flagRampRaise(key, dq, d, t0.Add(at))
		if d.Downstream.RampRaise != wantFlag || until.IsZero() == wantFlag {
			t.Fatalf("%s: limit %d at +%v: RampRaise %v until %v, want the flag %v", what, limit, at, d.Downstream.RampRaise, until, wantFlag)
		}
		return until
	}
	step("first seen", 50, 0, false)
	step("unchanged", 50, time.Minute, false)
	step("raised without an incident", 60, 2*time.Minute, false)
	until := step("lowered: the incident", 20, 3*time.Minute, true)
	if want := t0.Add(3*time.Minute + IncidentWindow); !until.Equal(want) {
		t.Fatalf("flag until %v, want %v", until, want)
	}
	step("raised back within the window", 60, 4*time.Minute, true)
	step("still within the window", 60, 3*time.Minute+IncidentWindow-time.Second, true)
	step("the window passed", 60, 3*time.Minute+IncidentWindow, false)

	// Lowered again: a new window; a quota without a ramp is never flagged (its memory still
	// follows the budget); created again (a new UID) it starts afresh.
	step("lowered again", 30, 20*time.Minute, true)
	d := &push.DesiredQuota{}
	if until := r.flagRampRaise(key, dq, d, t0.Add(21*time.Minute)); d.Downstream.RampRaise || !until.IsZero() {
		t.Fatalf("a quota without a ramp flagged: until %v", until)
	}
	dq.UID = "uid-2"
	step("created again", 60, 22*time.Minute, false)

	// The requeue comes forward to the end of the window, never back.
	now := t0
	for _, tc := range []struct {
		res   ctrl.Result
		until time.Time
		want  time.Duration
	}{
		{ctrl.Result{}, time.Time{}, 0},
		{ctrl.Result{}, now.Add(IncidentWindow), IncidentWindow},
		{ctrl.Result{RequeueAfter: time.Minute}, now.Add(IncidentWindow), time.Minute},
		{ctrl.Result{RequeueAfter: time.Hour}, now.Add(IncidentWindow), IncidentWindow},
		{ctrl.Result{RequeueAfter: time.Hour}, now, time.Hour},
	} {
		if got := requeueBy(tc.res, tc.until, now).RequeueAfter; got != tc.want {
			t.Fatalf("requeueBy(%v, now+%v) = %v, want %v", tc.res.RequeueAfter, tc.until.Sub(now), got, tc.want)
		}
	}
}
