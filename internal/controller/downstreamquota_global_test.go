package controller

import (
	"reflect"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/hub"
	"github.com/apportion/apportion/internal/push"
	"github.com/apportion/apportion/internal/testing/builders"
)

// slicesOf answers GlobalSlices with one grant and local limit for every quota (ok false: the
// member holds nothing yet).
type slicesOf struct {
	g     hub.Grant
	limit int64
	ok    bool
}

func (s slicesOf) Slice(types.NamespacedName) (hub.Grant, int64, bool) { return s.g, s.limit, s.ok }
func (slicesOf) Assigned(types.NamespacedName, int64)                  {}

// TestDecideOnSlice: a quota with spec.global is apportioned on its local limit — min(maxInFlight,
// the slice while the lease holds, its fallback after, 0 with nothing held) — with the factor
// applied once, its pods' safe defaults split from the reserved slice, and under DemandAware a
// per-pod floor at least the safe default (docs/protocol.md §16, "Inside a member").
func TestDecideOnSlice(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	base := builders.MakeDownstreamQuota("logistics", "shop").Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
	base.Spec.Global = &apportionv1.GlobalRef{Hub: "hub", Namespace: "partners", Name: "logistics", Cluster: "eu-1"}
	demandQuota := base.DeepCopy()
	demandQuota.Spec.Sharing = &apportionv1.Sharing{Policy: apportionv1.SharingDemandAware}
	for _, tc := range []struct {
		name   string
		quota  *apportionv1.DownstreamQuota
		slices GlobalSlices
		// want: the engine's limit, each pod's permits (Equal) or least permits (DemandAware), and
		// each pod's safe default.
		limit, perPod, safeDefault int32
	}{
		// 20 × 0.8 = 16 over 8 pods; the safe default from the reserved 10: 8 over 8.
		{"lease held", base, slicesOf{hub.Grant{Seq: 3, Slice: 20, Reserved: 10}, 20, true}, 20, 2, 1},
		{"slice above maxInFlight", base, slicesOf{hub.Grant{Seq: 3, Slice: 100, Reserved: 10}, 100, true}, 50, 5, 1},
		{"lease ended: the fallback", base, slicesOf{hub.Grant{Seq: 3, Slice: 20, Reserved: 10}, 10, true}, 10, 1, 1},
		{"reserved above maxInFlight", base, slicesOf{hub.Grant{Seq: 3, Slice: 90, Reserved: 80}, 90, true}, 50, 5, 5},
		{"nothing held yet", base, slicesOf{}, 0, 0, 0},
		{"no member integration", base, nil, 0, 0, 0},
		// 40 × 0.8 = 32; the reserved 20 gives 16 over 8 = 2 a pod: the floor, though no pod asks.
		{"DemandAware floor", demandQuota, slicesOf{hub.Grant{Seq: 1, Slice: 40, Reserved: 20}, 40, true}, 40, 2, 2},
	} {
		g := globalFor(tc.quota, tc.slices)
		in := &quotaInputs{Quota: onSlice(tc.quota, g), Global: g, Targets: gatewayObs(decidePods(8, 8)), Now: now,
			LastReport: &push.Report{Converged: true}}
		p := quotaPolicy{Push: true, SharingPeriod: DefaultSharingPeriod, RemainderRotation: DefaultRemainderRotation,
			Sharing: (&DownstreamQuotaReconciler{}).sharingParams()}
		if demandAware(tc.quota) {
			// Rounds where one pod asks for everything: the damped steps bring the others down
			// to the floor.
			in.Sharing = newSharingMemory()
			in.LastReport = &push.Report{Converged: true, Holdings: []push.Holding{{Pod: "gateway-0", InFlight: 32, Waiting: 200}}}
			for _, pod := range in.Targets[0].Pods[1:] {
				in.LastReport.Holdings = append(in.LastReport.Holdings, push.Holding{Pod: pod.Name})
			}
			for range 30 {
				decideAssignment(in, p)
				in.Now = in.Now.Add(time.Minute)
			}
		}
		a := decideAssignment(in, p)
		if a.Desired.Limit != tc.limit {
			t.Errorf("%s: engine limit %d, want %d", tc.name, a.Desired.Limit, tc.limit)
		}
		var sum int64
		for _, pod := range a.Desired.Pods {
			sum += int64(pod.Permits)
			if pod.Permits < tc.perPod || (tc.quota == base && pod.Permits != tc.perPod) {
				t.Errorf("%s: pod %s holds %d, want %d", tc.name, pod.Name, pod.Permits, tc.perPod)
			}
			if pod.SafeDefault != tc.safeDefault {
				t.Errorf("%s: pod %s safe default %d, want %d", tc.name, pod.Name, pod.SafeDefault, tc.safeDefault)
			}
		}
		if sum > int64(tc.limit) {
			t.Errorf("%s: Σ permits %d above the local limit %d", tc.name, sum, tc.limit)
		}
		if tc.quota.Spec.MaxInFlight != 50 || ptr.Deref(tc.quota.Spec.Sharing, apportionv1.Sharing{}).FloorPermits != nil {
			t.Errorf("%s: the quota read was changed: %+v", tc.name, tc.quota.Spec)
		}
	}
}

// TestKeepCondition: the status writer puts the member's SliceLeased back as it read it — in
// place, added, or removed — and leaves the other conditions as decided.
func TestKeepCondition(t *testing.T) {
	c := func(typ, reason string) metav1.Condition { return metav1.Condition{Type: typ, Reason: reason} }
	ready, leased, lapsed := c("Ready", "Apportioned"), c(apportionv1.ConditionSliceLeased, "LeaseHeld"), c(apportionv1.ConditionSliceLeased, "HubUnreachable")
	for _, tc := range []struct {
		name         string
		decided, has []metav1.Condition
		want         []metav1.Condition
	}{
		{"replaced in place", []metav1.Condition{leased, ready}, []metav1.Condition{ready, lapsed}, []metav1.Condition{lapsed, ready}},
		{"added", []metav1.Condition{ready}, []metav1.Condition{lapsed}, []metav1.Condition{ready, lapsed}},
		{"removed", []metav1.Condition{ready, leased}, []metav1.Condition{ready}, []metav1.Condition{ready}},
		{"none", nil, nil, nil},
	} {
		if got := keepCondition(tc.decided, tc.has, apportionv1.ConditionSliceLeased); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: got %v, want %v", tc.name, got, tc.want)
		}
	}
}
