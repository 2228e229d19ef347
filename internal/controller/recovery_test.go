package controller

import (
	"context"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/builders"
)

var _ = Describe("DownstreamQuota recovery, queue and deadline settings", func() {
	var (
		ctx context.Context
		ns  string
	)
	BeforeEach(func() {
		ctx = context.Background()
		ns = newNamespace(ctx)
	})

	It("defaults the Linear ramp, and the agent gets it with the other settings validated by assignment", func() {
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())
		dq, err := getQuota(ctx, ns, "logistics")()
		Expect(err).NotTo(HaveOccurred())
		r := dq.Spec.Agent.Recovery
		Expect(r).NotTo(BeNil())
		Expect(r.Window).To(Equal(&metav1.Duration{Duration: time.Second}))
		Expect(r.Ramp).To(Equal(&apportionv1.RecoveryRamp{Shape: apportionv1.RampLinear, InitialPercent: 10, StepPercent: 10, HealthyWindows: 2}))
		Expect(r.Adaptive).To(BeNil())

		d := downstreamTemplate(dq)
		Expect(d.Recovery).To(Equal(&assignment.Recovery{Window: assignment.Duration(time.Second),
			Ramp: &assignment.Ramp{Shape: "Linear", InitialPercent: 10, StepPercent: 10, HealthyWindows: 2}}))
		Expect(d.MaxWaiting).To(BeNil())
		Expect(d.AbandonedHold).To(BeNil())
		d.Permits, d.SafeDefaultPermits = 5, 2
		a := assignment.Assignment{Epoch: 1, Generation: 1, LeaseTTL: assignment.Duration(time.Second), Downstreams: []assignment.Downstream{d}}
		Expect(a.Validate()).To(Succeed())
	})

	It("carries every setting, adaptive on and the ramp off", func() {
		q := builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
		q.Spec.Agent.Recovery = &apportionv1.Recovery{
			Window:   &metav1.Duration{Duration: 500 * time.Millisecond},
			Ramp:     &apportionv1.RecoveryRamp{Shape: apportionv1.RampOff},
			Adaptive: &apportionv1.AdaptiveConcurrency{},
		}
		q.Spec.Agent.MaxWaiting = ptr.To[int32](0)
		q.Spec.Agent.DeadlineHeader = "grpc-timeout"
		q.Spec.Agent.AbandonedCallHold = &metav1.Duration{Duration: 2 * time.Second}
		Expect(k8sClient.Create(ctx, q)).To(Succeed())
		dq, err := getQuota(ctx, ns, "logistics")()
		Expect(err).NotTo(HaveOccurred())
		Expect(dq.Spec.Agent.Recovery.Adaptive).To(Equal(&apportionv1.AdaptiveConcurrency{TolerancePercent: 150, BaselineWindows: 60, MinLimit: 1}))
		d := downstreamTemplate(dq)
		Expect(d.Recovery).To(Equal(&assignment.Recovery{Window: assignment.Duration(500 * time.Millisecond),
			Adaptive: &assignment.Adaptive{TolerancePercent: 150, BaselineWindows: 60, MinLimit: 1}}))
		Expect(d.MaxWaiting).To(Equal(ptr.To[int32](0)))
		Expect(d.DeadlineHeader).To(Equal("grpc-timeout"))
		Expect(d.AbandonedHold).To(Equal(ptr.To(assignment.Duration(2 * time.Second))))
	})

	It("refuses what cannot be meant, naming each field", func() {
		// The schema's checks (the API server runs CEL rules only on an object that passed them).
		q := builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
		q.Spec.Agent.Recovery = &apportionv1.Recovery{
			Ramp:     &apportionv1.RecoveryRamp{Shape: "Cubic", InitialPercent: 101, HealthyWindows: 101},
			Adaptive: &apportionv1.AdaptiveConcurrency{TolerancePercent: 100, BaselineWindows: 1},
		}
		q.Spec.Agent.MaxWaiting = ptr.To[int32](-1)
		q.Spec.Agent.DeadlineHeader = "x timeout"
		err := k8sClient.Create(ctx, q)
		Expect(err).To(HaveOccurred())
		for _, want := range []string{
			`spec.agent.recovery.ramp.shape: Unsupported value: "Cubic"`,
			"spec.agent.recovery.ramp.initialPercent: Invalid value: 101",
			"spec.agent.recovery.ramp.healthyWindows: Invalid value: 101",
			"spec.agent.recovery.adaptive.tolerancePercent: Invalid value: 100",
			"spec.agent.recovery.adaptive.baselineWindows: Invalid value: 1",
			"spec.agent.maxWaiting: Invalid value: -1",
			"spec.agent.deadlineHeader: Invalid value",
		} {
			Expect(err.Error()).To(ContainSubstring(want))
		}
		// The CEL rules.
		q = builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
		q.Spec.Agent.Recovery = &apportionv1.Recovery{
			Window: &metav1.Duration{Duration: 10 * time.Millisecond},
			Ramp:   &apportionv1.RecoveryRamp{LatencyTarget: &metav1.Duration{}},
		}
		q.Spec.Agent.DeadlineHeader = "Content-Length"
		q.Spec.Agent.AbandonedCallHold = &metav1.Duration{Duration: time.Hour}
		err = k8sClient.Create(ctx, q)
		Expect(err).To(HaveOccurred())
		for _, want := range []string{
			"window must be between 100ms and 1m",
			"latencyTarget must be between 1ms and 10m",
			"deadlineHeader names a field the agent or HTTP itself sets",
			"abandonedCallHold must be between 0s and 10m",
		} {
			Expect(err.Error()).To(ContainSubstring(want))
		}
	})
})
