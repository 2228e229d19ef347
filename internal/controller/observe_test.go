package controller

import (
	"context"
	"testing"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/push"
	"github.com/apportion/apportion/internal/testing/builders"
)

var _ = Describe("DownstreamQuota enforcement and warning threshold", func() {
	var (
		ctx context.Context
		ns  string
	)
	BeforeEach(func() {
		ctx = context.Background()
		ns = newNamespace(ctx)
	})

	It("defaults Enforce and 80 %, and an Observe quota's agents are told to observe", func() {
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())
		dq, err := getQuota(ctx, ns, "logistics")()
		Expect(err).NotTo(HaveOccurred())
		Expect(dq.Spec.Enforcement).To(Equal(apportionv1.EnforcementEnforce))
		Expect(dq.Spec.WarnAtPercent).To(Equal(int32(80)))
		Expect(downstreamTemplate(dq).Observe).To(BeFalse())

		q := builders.MakeDownstreamQuota("observed", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
		q.Spec.Enforcement = apportionv1.EnforcementObserve
		q.Spec.WarnAtPercent = 100
		Expect(k8sClient.Create(ctx, q)).To(Succeed())
		dq, err = getQuota(ctx, ns, "observed")()
		Expect(err).NotTo(HaveOccurred())
		Expect(downstreamTemplate(dq).Observe).To(BeTrue())
	})

	It("refuses an unknown enforcement and a threshold outside 1–100, naming each field", func() {
		for _, tc := range []struct {
			mode apportionv1.Enforcement
			warn int32
			want []string
		}{
			{"Shadow", 0, []string{`spec.enforcement: Unsupported value: "Shadow": supported values: "Enforce", "Observe"`}},
			{"observe", 101, []string{`spec.enforcement: Unsupported value: "observe"`, "spec.warnAtPercent: Invalid value: 101"}},
			{"", -5, []string{"spec.warnAtPercent: Invalid value: -5"}},
		} {
			q := builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
			q.Spec.Enforcement, q.Spec.WarnAtPercent = tc.mode, tc.warn
			err := k8sClient.Create(ctx, q)
			Expect(err).To(HaveOccurred(), "enforcement %q, warnAtPercent %d", tc.mode, tc.warn)
			for _, want := range tc.want {
				Expect(err.Error()).To(ContainSubstring(want))
			}
		}
	})

	It("keeps a DegradeRule's dryRun and sends its switch as a dry run", func() {
		r := builders.MakeDegradeRule("pause", ns, "logistics", time.Now().Add(time.Hour)).Obj()
		r.Spec.DryRun = true
		Expect(k8sClient.Create(ctx, r)).To(Succeed())
		got, err := getRule(ctx, ns, "pause")()
		Expect(err).NotTo(HaveOccurred())
		Expect(got.Spec.DryRun).To(BeTrue())
		Expect(switchOf(got).Switch.DryRun).To(BeTrue())
	})
})

// usageReport is an engine report of pods holding granted permits with inFlight calls each.
func usageReport(granted, inFlight []int32) *push.Report {
	r := &push.Report{Converged: true}
	for i := range granted {
		r.Holdings = append(r.Holdings, push.Holding{Pod: string(rune('a' + i)), Target: "gateway",
			Granted: granted[i], Counted: max(granted[i], inFlight[i]), InFlight: inFlight[i], Synced: true})
	}
	return r
}

// NearLimit turns true at warnAtPercent of the budget (limit 50 × 80 % = 40; 80 % of it is 32),
// with one Warning; it recedes, and a crossing again within NearLimitEventQuiet records none, one
// after it records one. Utilization is in flight ÷ granted.
func TestNearLimitConditionAndEvent(t *testing.T) {
	dq := builders.MakeDownstreamQuota("logistics", "ns").Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
	t0 := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	step := func(before apportionv1.DownstreamQuotaStatus, inFlight int32, at time.Time) (apportionv1.DownstreamQuotaStatus, bool) {
		st := apportionv1.DownstreamQuotaStatus{Conditions: append([]metav1.Condition(nil), before.Conditions...)}
		setUsage(&st, usageOf(dq, 40, usageReport([]int32{20, 20}, []int32{inFlight, 0}), at), 40, 80, metav1.NewTime(at))
		_, ev := nearLimitEvent(&eventContext{Quota: dq, Before: &before, After: &st, Now: at})
		return st, ev
	}
	st, ev := step(apportionv1.DownstreamQuotaStatus{}, 31, t0)
	if c := meta.FindStatusCondition(st.Conditions, apportionv1.ConditionNearLimit); c == nil || c.Status != metav1.ConditionFalse ||
		c.Reason != apportionv1.ReasonBelowWarnThreshold || ev || st.InFlight != 31 || st.UtilizationPercent != 77 {
		t.Fatalf("31 of 40 in flight: %+v, event %v", st, ev)
	}
	st, ev = step(st, 32, t0.Add(time.Minute))
	if !meta.IsStatusConditionTrue(st.Conditions, apportionv1.ConditionNearLimit) || !ev {
		t.Fatalf("32 in flight (80 %% of 40): %+v, event %v; want NearLimit and a Warning", st.Conditions, ev)
	}
	st, ev = step(st, 33, t0.Add(2*time.Minute))
	if ev {
		t.Fatal("a Warning again while NearLimit stays true")
	}
	st, _ = step(st, 10, t0.Add(3*time.Minute))
	if c := meta.FindStatusCondition(st.Conditions, apportionv1.ConditionNearLimit); c.Status != metav1.ConditionFalse || c.Reason != apportionv1.ReasonReceded {
		t.Fatalf("receded: %+v", c)
	}
	if st, ev = step(st, 40, t0.Add(4*time.Minute)); ev {
		t.Fatal("a Warning 1 min after it receded, within NearLimitEventQuiet")
	}
	st, _ = step(st, 0, t0.Add(5*time.Minute))
	if _, ev = step(st, 50, t0.Add(5*time.Minute+NearLimitEventQuiet)); !ev {
		t.Fatal("no Warning NearLimitEventQuiet after it receded")
	}
	// Under Observe in flight may exceed the permits: utilization above 100 %.
	if u := usageOf(dq, 40, usageReport([]int32{20, 20}, []int32{45, 15}), t0); u.utilizationPercent() != 150 {
		t.Fatalf("60 in flight of 40 granted: utilization %d %%, want 150", u.utilizationPercent())
	}
}

// status.peakSecond is the busiest second summed across the pods' reported counts, over the
// seconds every pod has reported.
func TestPeakSecondInStatus(t *testing.T) {
	dq := builders.MakeDownstreamQuota("logistics", "ns").Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
	now := time.Unix(1_000_000, 500_000_000)
	r := usageReport([]int32{20, 20}, []int32{0, 0})
	r.Holdings[0].SecondsEnd, r.Holdings[0].Seconds = 1_000_000, []int32{4, 30, 2}
	r.Holdings[1].SecondsEnd, r.Holdings[1].Seconds = 1_000_000, []int32{9, 1, 0}
	u := usageOf(dq, 40, r, now)
	if u.Peak == nil || u.Peak.Calls != 31 || u.Peak.At.Unix() != 999_998 {
		t.Fatalf("peak %+v, want 31 calls in second 999998", u.Peak)
	}
	st := apportionv1.DownstreamQuotaStatus{}
	setUsage(&st, u, 40, 80, metav1.NewTime(now))
	if st.PeakSecond == nil || st.PeakSecond.Calls != 31 {
		t.Fatalf("status.peakSecond %+v", st.PeakSecond)
	}
}
