package controller

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/push"
	"github.com/apportion/apportion/internal/testing/builders"
)

// decidePods is n running pods of target gateway (gateway-0..), the first withAgent of them with
// an agent.
func decidePods(n, withAgent int) []corev1.Pod {
	var out []corev1.Pod
	for i := range n {
		p := builders.MakePod(fmt.Sprintf("gateway-%d", i), "shop").UID(types.UID(fmt.Sprintf("uid-%d", i))).
			Running(fmt.Sprintf("10.0.0.%d", i+1))
		if i < withAgent {
			p.AgentPort(15000)
		}
		out = append(out, *p.Obj())
	}
	return out
}

// gatewayObs is what the API says of a Deployment gateway with these pods.
func gatewayObs(pods []corev1.Pod) []targetObservation {
	return []targetObservation{{Target: apportionv1.Target{Kind: apportionv1.KindDeployment, Name: "gateway"},
		Found: true, SpecReplicas: int32(len(pods)), Pods: pods}}
}

// TestDecide runs the decision of a quota reconcile — decideAssignment, then decideStatus on the
// engine's report — over gathered inputs, without an API server. Each row names the cause Ready
// must report and the lower causes of readyPrecedence that hold in the row as well (outranked):
// the row checks that they do hold, and that Ready reports the higher one.
func TestDecide(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	quota := builders.MakeDownstreamQuota("logistics", "shop").Generation(3).Limit(50).Target(apportionv1.KindDeployment, "gateway")
	degrade := switchOf(builders.MakeDegradeRule("brownout", "shop", "logistics", now.Add(time.Hour)).Obj())
	converged := &push.Report{Converged: true}
	eight := gatewayObs(decidePods(8, 8)) // 8 pods with an agent: 5 permits each of the 40
	fives := slices.Repeat([]int32{5}, 8)
	const apportioned, allReachable = "True: Apportioned", "True: AllReachable"
	for _, tc := range []struct {
		name   string
		quota  *apportionv1.DownstreamQuota
		obs    []targetObservation
		noPush bool // no engine: the manager only computes and reports
		// switches are the degrade switches in force; report is the engine's once it took the
		// assignment.
		switches []push.TargetedSwitch
		report   *push.Report
		// prior, when set, is decided first (with priorReport, a minute earlier): the base of the
		// decision the row checks.
		prior       []targetObservation
		priorReport *push.Report

		ready     string   // "<status>: <reason>"
		outranked []string // the reasons of lower causes that hold too
		reachable string   // PodsReachable: "<status>: <reason>", or "" (no condition)
		reachSays string   // in PodsReachable's message
		events    []string // "<reason>: <note>"
		// permits are the desired permits per pod (nil: not checked), assigned their sum.
		permits  []int32
		assigned int32
		requeue  func(time.Duration) bool // nil: every usageStatusPeriod (with an engine, as here)
	}{
		{
			name: "healthy, first decision", quota: quota.Obj(), obs: eight, report: converged,
			ready: apportioned, reachable: allReachable,
			events:   []string{"Rebalanced: rebalanced: gateway: 0→8 pods, 0→5 permits per pod"},
			permits:  fives,
			assigned: 40,
		},
		{
			name: "healthy, steady: nothing changed, no Event", quota: quota.Obj(), obs: eight, report: converged,
			prior: eight, priorReport: converged,
			ready: apportioned, reachable: allReachable,
			permits:  fives,
			assigned: 40,
		},
		{
			name: "scaled 8 → 10: rebalanced, safe default lowered", quota: quota.Obj(), obs: gatewayObs(decidePods(10, 10)), report: converged,
			prior: eight, priorReport: converged,
			ready: apportioned, reachable: allReachable,
			events: []string{
				"Rebalanced: rebalanced: gateway: 8→10 pods, 5→4 permits per pod",
				"SafeDefaultChanged: safe default: gateway: 5→4 permits per pod (over 8→10 replicas)",
			},
			permits:  []int32{4, 4, 4, 4, 4, 4, 4, 4, 4, 4},
			assigned: 40,
		},
		{
			name: "converged, no engine", quota: quota.Obj(), obs: eight, noPush: true,
			ready:  apportioned,
			events: []string{"Rebalanced: rebalanced: gateway: 0→8 pods, 0→5 permits per pod"},
		},
		{
			name: "not converged: pushing", quota: quota.Obj(), obs: eight, report: &push.Report{},
			ready: "False: Pushing", reachable: allReachable,
			events:   []string{"Rebalanced: rebalanced: gateway: 0→8 pods, 0→5 permits per pod"},
			permits:  fives,
			assigned: 40,
		},
		{
			name: "unreachable pods: a Warning naming them", quota: quota.Obj(), obs: eight,
			report: &push.Report{Unreachable: []string{"gateway-1", "gateway-2"}},
			prior:  eight, priorReport: converged,
			ready: "False: Pushing", reachable: "False: AgentsUnreachable", reachSays: "agents not reachable: gateway-1, gateway-2;",
			events:   []string{"PodsUnreachable: could not reach the agents of gateway-1, gateway-2"},
			permits:  fives,
			assigned: 40,
		},
		{
			name: "unreachable pods, the same set again: no Event", quota: quota.Obj(), obs: eight,
			report: &push.Report{Unreachable: []string{"gateway-1", "gateway-2"}},
			prior:  eight, priorReport: &push.Report{Unreachable: []string{"gateway-1", "gateway-2"}},
			ready: "False: Pushing", reachable: "False: AgentsUnreachable",
			permits:  fives,
			assigned: 40,
		},
		{
			name: "misbehaving pods: unreachable, Ready unaffected once converged", quota: quota.Obj(), obs: eight,
			report: &push.Report{Converged: true, Unreachable: []string{"gateway-2"}, Misbehaving: []string{"gateway-2"}},
			prior:  eight, priorReport: converged,
			ready: apportioned, reachable: "False: AgentsUnreachable",
			reachSays: "of those, gateway-2 answered with an epoch newer than any manager's (misbehaving",
			events:    []string{"PodsUnreachable: could not reach the agents of gateway-2"},
			permits:   fives,
			assigned:  40,
		},
		{
			name: "recovering: a new manager waits out the leases", quota: quota.Obj(), obs: eight,
			report: &push.Report{Recovering: true},
			prior:  eight, priorReport: converged,
			ready: "False: Recovering", outranked: []string{apportionv1.ReasonPushing}, reachable: allReachable,
			permits:  fives,
			assigned: 40,
		},
		{
			name: "pods without an agent", quota: quota.Obj(), obs: gatewayObs(decidePods(8, 5)),
			report: &push.Report{Recovering: true},
			prior:  eight, priorReport: converged,
			ready: "False: PodsWithoutAgent", outranked: []string{apportionv1.ReasonRecovering, apportionv1.ReasonPushing},
			reachable: "False: AgentNotFound",
			events: []string{"PodsWithoutAgent: 3 pods have no agent the manager can find (no apportion.io/agent-port annotation, " +
				"no container port apportion-ctl): gateway-5, gateway-6, gateway-7; they are counted at their share, but nothing enforces it"},
			permits:  fives,
			assigned: 40,
		},
		{
			name: "oversubscribed: one permit each while they last", quota: builders.MakeDownstreamQuota("logistics", "shop").Generation(3).Limit(5).
				Target(apportionv1.KindDeployment, "gateway").Obj(),
			obs: gatewayObs(decidePods(8, 6)), report: &push.Report{Recovering: true},
			prior: gatewayObs(decidePods(8, 6)), priorReport: &push.Report{Recovering: true},
			ready:     "False: Oversubscribed",
			outranked: []string{apportionv1.ReasonPodsWithoutAgent, apportionv1.ReasonRecovering, apportionv1.ReasonPushing},
			reachable: "False: AgentNotFound",
			// which 4 of the 8 pods get the one permit each follows the rotation
			requeue:  func(d time.Duration) bool { return d > 0 && d <= usageStatusPeriod },
			assigned: 4,
		},
		{
			name: "target missing: nothing assigned", quota: quota.Obj(),
			obs:    []targetObservation{{Target: apportionv1.Target{Kind: apportionv1.KindDeployment, Name: "gateway"}}},
			report: &push.Report{Converged: true},
			ready:  "False: TargetMissing", reachable: allReachable,
			permits:  []int32{},
			assigned: 0,
		},
		{
			name: "degraded: the switch in force goes to every pod, Ready unaffected", quota: quota.Obj(), obs: eight,
			switches: []push.TargetedSwitch{degrade}, report: converged,
			prior: eight, priorReport: converged,
			ready: apportioned, reachable: allReachable,
			permits:  fives,
			assigned: 40,
		},
		{
			name: "a remainder: reconciled again when it rotates", quota: quota.Obj(), obs: gatewayObs(decidePods(12, 12)), report: converged,
			prior: gatewayObs(decidePods(12, 12)), priorReport: converged,
			ready: apportioned, reachable: allReachable,
			// which 4 of the 12 pods hold one more (4) follows the rotation
			requeue:  func(d time.Duration) bool { return d > 0 && d <= usageStatusPeriod },
			assigned: 40,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := quotaPolicy{Push: !tc.noPush, SharingPeriod: DefaultSharingPeriod, RemainderRotation: DefaultRemainderRotation}
			in := &quotaInputs{Quota: tc.quota, Targets: tc.obs, Switches: tc.switches, Now: now}
			if tc.prior != nil {
				first := &quotaInputs{Quota: tc.quota, Targets: tc.prior, Switches: tc.switches, Now: now.Add(-time.Minute)}
				a := decideAssignment(first, p)
				in.Base = decideStatus(first, p, a, tc.priorReport).Status
			}
			report := tc.report
			if tc.noPush {
				report = nil
			}
			a := decideAssignment(in, p)
			d := decideStatus(in, p, a, report)

			cond := func(typ string) string {
				if c := meta.FindStatusCondition(d.Status.Conditions, typ); c != nil {
					return string(c.Status) + ": " + c.Reason
				}
				return ""
			}
			if got := cond(apportionv1.ConditionReady); got != tc.ready {
				t.Errorf("Ready = %q, want %q (%s)", got, tc.ready, meta.FindStatusCondition(d.Status.Conditions, apportionv1.ConditionReady).Message)
			}
			if got := cond(apportionv1.ConditionPodsReachable); got != tc.reachable {
				t.Errorf("PodsReachable = %q, want %q", got, tc.reachable)
			}
			if c := meta.FindStatusCondition(d.Status.Conditions, apportionv1.ConditionPodsReachable); tc.reachSays != "" && !strings.Contains(c.Message, tc.reachSays) {
				t.Errorf("PodsReachable says %q, want it to say %q", c.Message, tc.reachSays)
			}
			// Ready's precedence: every outranked cause holds in this row, and comes after the
			// reported one in readyPrecedence.
			reason := strings.TrimPrefix(tc.ready, "False: ")
			rank := slices.IndexFunc(readyPrecedence[:], func(r readyRule) bool { return r.Reason == reason })
			for _, o := range tc.outranked {
				if i := slices.IndexFunc(readyPrecedence[:], func(r readyRule) bool { return r.Reason == o }); i <= rank {
					t.Errorf("%s outranked by %s, but it comes first in readyPrecedence", o, reason)
				}
				holds := false
				switch o {
				case apportionv1.ReasonPodsWithoutAgent:
					holds = cond(apportionv1.ConditionPodsWithoutAgent) == "True: "+apportionv1.ReasonAgentNotFound
				case apportionv1.ReasonRecovering:
					holds = report != nil && report.Recovering
				case apportionv1.ReasonPushing:
					holds = report != nil && !report.Converged
				}
				if !holds {
					t.Errorf("outranked cause %s does not hold in this row", o)
				}
			}
			if tc.ready == "False: Oversubscribed" && cond(apportionv1.ConditionOversubscribed) != "True: "+apportionv1.ReasonTooManyPods {
				t.Errorf("Oversubscribed = %q", cond(apportionv1.ConditionOversubscribed))
			}

			var events []string
			for _, e := range d.Events {
				events = append(events, e.Reason+": "+e.Note)
			}
			if !slices.Equal(events, tc.events) {
				t.Errorf("Events:\n got %q\nwant %q", events, tc.events)
			}

			// status.lastRebalanceTime is when the last Rebalanced Event was decided.
			wantLast := in.Base.LastRebalanceTime
			if slices.ContainsFunc(d.Events, func(e statusEvent) bool { return e.Reason == apportionv1.ReasonRebalanced }) {
				wantLast = &metav1.Time{Time: now}
			}
			if !equality.Semantic.DeepEqual(d.Status.LastRebalanceTime, wantLast) {
				t.Errorf("lastRebalanceTime %v, want %v", d.Status.LastRebalanceTime, wantLast)
			}

			if tc.noPush {
				if a.Desired != nil {
					t.Fatalf("an assignment without an engine: %+v", a.Desired)
				}
				return
			}
			if a.Desired == nil {
				t.Fatal("no assignment with an engine")
			}
			var permits []int32
			var sum int32
			for _, pod := range a.Desired.Pods {
				permits = append(permits, pod.Permits)
				sum += pod.Permits
			}
			if tc.permits != nil && !slices.Equal(permits, tc.permits) {
				t.Errorf("desired permits %v, want %v", permits, tc.permits)
			}
			if sum != tc.assigned || d.Status.Assigned != sum {
				t.Errorf("desired Σ permits %d, status assigned %d, want %d", sum, d.Status.Assigned, tc.assigned)
			}
			if !equality.Semantic.DeepEqual(a.Desired.Switches, tc.switches) {
				t.Errorf("desired switches %+v, want %+v", a.Desired.Switches, tc.switches)
			}
			if a.Desired.Limit != tc.quota.Spec.MaxInFlight || a.Desired.Generation != tc.quota.Generation {
				t.Errorf("desired limit %d generation %d", a.Desired.Limit, a.Desired.Generation)
			}
			wantRequeue := tc.requeue
			if wantRequeue == nil {
				wantRequeue = func(d time.Duration) bool { return d == usageStatusPeriod }
			}
			if !wantRequeue(d.Requeue) {
				t.Errorf("requeue after %v", d.Requeue)
			}
		})
	}
}

// Ready reports the first cause of readyPrecedence that holds, whichever of the later ones hold
// too: with causes k.. all holding, Ready is rule k's.
func TestReadyPrecedence(t *testing.T) {
	for k, rule := range readyPrecedence {
		f := readyFacts{Targets: 1, Report: &push.Report{Converged: true}}
		for _, later := range readyPrecedence[k:] {
			switch later.Reason {
			case apportionv1.ReasonTargetMissing:
				f.Missing = 1
			case apportionv1.ReasonOversubscribed:
				f.Oversubscribed = true
			case apportionv1.ReasonPodsWithoutAgent:
				f.NoAgent = "pods without an agent"
			case apportionv1.ReasonRecovering:
				f.Report.Recovering = true
			case apportionv1.ReasonPushing:
				f.Report.Converged = false
			default:
				t.Fatalf("rule %s: this test does not know how to make it hold", later.Reason)
			}
		}
		if reason, _, notReady := readyCause(&f); !notReady || reason != rule.Reason {
			t.Errorf("causes from %s on: Ready reports %q (%v)", rule.Reason, reason, notReady)
		}
	}
	if reason, _, notReady := readyCause(&readyFacts{Targets: 1, Report: &push.Report{Converged: true}}); notReady {
		t.Errorf("no cause holds, yet Ready is False: %s", reason)
	}
}

// A DemandAware quota is looked at again every sharing period and its shares stay within the
// budget; a quota with lanes every lanes' status period; any other every usage period; none
// without an engine.
func TestDecideRequeue(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	demandAwareQuota := builders.MakeDownstreamQuota("logistics", "shop").Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
	demandAwareQuota.Spec.Sharing = &apportionv1.Sharing{Policy: apportionv1.SharingDemandAware}
	lanesQuota := builders.MakeDownstreamQuota("logistics", "shop").Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
	lanesQuota.Spec.Lanes = []apportionv1.Lane{{Name: "checkout", ReservedPercent: 20}}
	for _, tc := range []struct {
		name  string
		quota *apportionv1.DownstreamQuota
		push  bool
		want  time.Duration
	}{
		{"DemandAware", demandAwareQuota, true, 3 * time.Second},
		{"DemandAware without an engine", demandAwareQuota, false, 0},
		{"lanes", lanesQuota, true, lanesStatusPeriod},
		{"Equal, no lanes: the usage's period", builders.MakeDownstreamQuota("logistics", "shop").Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj(), true, usageStatusPeriod},
		{"Equal without an engine", builders.MakeDownstreamQuota("logistics", "shop").Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj(), false, 0},
	} {
		p := quotaPolicy{Push: tc.push, SharingPeriod: 3 * time.Second, RemainderRotation: DefaultRemainderRotation,
			Sharing: (&DownstreamQuotaReconciler{}).sharingParams()}
		in := &quotaInputs{Quota: tc.quota, Targets: gatewayObs(decidePods(8, 8)), Now: now}
		if tc.push {
			in.LastReport = &push.Report{Converged: true}
		}
		a := decideAssignment(in, p)
		report := in.LastReport
		d := decideStatus(in, p, a, report)
		if d.Requeue != tc.want {
			t.Errorf("%s: requeue after %v, want %v", tc.name, d.Requeue, tc.want)
		}
		if (a.Shared != nil) != (tc.push && tc.quota == demandAwareQuota) || (d.Status.Sharing != nil) != (a.Shared != nil) {
			t.Errorf("%s: shares %+v, status.sharing %+v", tc.name, a.Shared, d.Status.Sharing)
		}
		if a.Desired != nil {
			var sum int64
			for _, pod := range a.Desired.Pods {
				sum += int64(pod.Permits)
			}
			if sum > int64(tc.quota.Spec.MaxInFlight) {
				t.Errorf("%s: desired Σ permits %d above the limit %d", tc.name, sum, tc.quota.Spec.MaxInFlight)
			}
		}
	}
}
