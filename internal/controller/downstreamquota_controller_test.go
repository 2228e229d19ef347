package controller

import (
	"context"
	"strings"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"github.com/onsi/gomega/types"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
)

// perPod extracts (replicas, permitsPerPod) of target i.
func perPod(i int) func(*apportionv1.DownstreamQuota) []int32 {
	return func(dq *apportionv1.DownstreamQuota) []int32 {
		if len(dq.Status.Targets) <= i {
			return nil
		}
		t := dq.Status.Targets[i]
		return []int32{t.Replicas, t.PermitsPerPod}
	}
}

// eventNotes lists the notes of every Event in the namespace.
func eventNotes(ctx context.Context, ns string) func() []string {
	return func() []string {
		var evs eventsv1.EventList
		Expect(k8sClient.List(ctx, &evs, client.InNamespace(ns))).To(Succeed())
		var notes []string
		for _, e := range evs.Items {
			notes = append(notes, e.Note)
		}
		return notes
	}
}

func condition(t string) func(*apportionv1.DownstreamQuota) string {
	return func(dq *apportionv1.DownstreamQuota) string {
		c := meta.FindStatusCondition(dq.Status.Conditions, t)
		if c == nil || c.ObservedGeneration != dq.Generation {
			return ""
		}
		return string(c.Status) + ": " + c.Message
	}
}

var _ = Describe("DownstreamQuota apportioning", func() {
	var (
		ctx context.Context
		ns  string
	)
	BeforeEach(func() {
		ctx = context.Background()
		ns = newNamespace(ctx)
	})

	It("gives 5 permits per pod at HPA 8 and 4 at HPA 10, and says so in an Event", func() {
		Expect(k8sClient.Create(ctx, builders.MakeDeployment("gateway", ns).Replicas(8).Obj())).To(Succeed())
		h := builders.MakeHPA("gateway", ns).ScaleTarget("Deployment", "gateway").Replicas(8, 16).Obj()
		Expect(k8sClient.Create(ctx, h)).To(Succeed())
		setHPAStatus(ctx, h, 8, 8)
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())

		Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
			WithTransform(perPod(0), Equal([]int32{8, 5})),
			HaveField("Status.Assigned", BeEquivalentTo(40)),
			HaveField("Status.PerPod", Equal("5")),
			HaveField("Status.SafeDefaultPermits", BeEquivalentTo(2)), // 40 / maxReplicas 16
			HaveField("Status.Targets", ContainElement(HaveField("HPA", Equal(&apportionv1.HPAStatus{Name: "gateway", DesiredReplicas: 8, CurrentReplicas: 8, MaxReplicas: 16})))),
			WithTransform(condition(apportionv1.ConditionReady), HavePrefix("True")),
			WithTransform(condition(apportionv1.ConditionOversubscribed), HavePrefix("False")),
		))

		setHPAStatus(ctx, h, 10, 8)
		Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
			WithTransform(perPod(0), Equal([]int32{10, 4})),
			HaveField("Status.Assigned", BeEquivalentTo(40)),
		))
		Eventually(eventNotes(ctx, ns)).Should(ContainElement("rebalanced: gateway: 8→10 pods, 5→4 permits per pod"))
	})

	It("counts existing pods beyond the HPA's count, terminating ones included", func() {
		d := builders.MakeDeployment("gateway", ns).Replicas(8).Obj()
		Expect(k8sClient.Create(ctx, d)).To(Succeed())
		h := builders.MakeHPA("gateway", ns).ScaleTarget("Deployment", "gateway").Replicas(2, 16).Obj()
		Expect(k8sClient.Create(ctx, h)).To(Succeed())
		setHPAStatus(ctx, h, 8, 8)
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(WithTransform(perPod(0), Equal([]int32{8, 5})))

		pods := createPods(ctx, ns, "gateway", map[string]string{"app": "gateway"}, 10)
		Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
			WithTransform(perPod(0), Equal([]int32{10, 4})),
			HaveField("Status.Targets", ContainElement(HaveField("Pods", BeEquivalentTo(10)))),
		))

		// Scale-in: the HPA and the Deployment say 4, but a terminating pod may still be calling.
		setHPAStatus(ctx, h, 4, 4)
		Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
		d.Spec.Replicas = ptr.To[int32](4)
		Expect(k8sClient.Update(ctx, d)).To(Succeed())
		pods[9].Finalizers = []string{"test.apportion.io/hold"}
		Expect(k8sClient.Update(ctx, pods[9])).To(Succeed())
		for _, p := range pods[4:] {
			Expect(k8sClient.Delete(ctx, p)).To(Succeed())
		}
		Eventually(getQuota(ctx, ns, "logistics")).Should(WithTransform(perPod(0), Equal([]int32{5, 8})))

		// Once the last terminating pod is gone, 4 pods share 40.
		Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(pods[9]), pods[9])).To(Succeed())
		pods[9].Finalizers = nil
		Expect(k8sClient.Update(ctx, pods[9])).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(WithTransform(perPod(0), Equal([]int32{4, 10})))
	})

	It("splits by weight × replicas across two targets (3:1)", func() {
		Expect(k8sClient.Create(ctx, builders.MakeDeployment("checkout", ns).Replicas(2).Obj())).To(Succeed())
		Expect(k8sClient.Create(ctx, builders.MakeDeployment("reports", ns).Replicas(2).Obj())).To(Succeed())
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Targets(apportionv1.Target{Kind: "Deployment", Name: "checkout", Weight: 3}, apportionv1.Target{Kind: "Deployment", Name: "reports", Weight: 1}).Obj())).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
			WithTransform(perPod(0), Equal([]int32{2, 15})),
			WithTransform(perPod(1), Equal([]int32{2, 5})),
			HaveField("Status.PerPod", Equal("15,5")),
			HaveField("Status.Assigned", BeEquivalentTo(40)),
		))
	})

	It("uses the Deployment's replicas when no HPA scales it", func() {
		Expect(k8sClient.Create(ctx, builders.MakeDeployment("gateway", ns).Replicas(3).Obj())).To(Succeed())
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
			WithTransform(perPod(0), Equal([]int32{3, 13})),
			HaveField("Status.Targets", ConsistOf(HaveField("ExtraPermits", BeEquivalentTo(1)))), // 13 + 13 + 14
			HaveField("Status.PerPod", "13-14"),
			HaveField("Status.Assigned", BeEquivalentTo(40)),
			HaveField("Status.SafeDefaultPermits", BeEquivalentTo(13)),
		))
	})

	It("follows the HPA's maxReplicas in the safe default", func() {
		Expect(k8sClient.Create(ctx, builders.MakeDeployment("gateway", ns).Replicas(8).Obj())).To(Succeed())
		h := builders.MakeHPA("gateway", ns).ScaleTarget("Deployment", "gateway").Replicas(8, 16).Obj()
		Expect(k8sClient.Create(ctx, h)).To(Succeed())
		setHPAStatus(ctx, h, 8, 8)
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(HaveField("Status.SafeDefaultPermits", BeEquivalentTo(2)))

		Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(h), h)).To(Succeed())
		h.Spec.MaxReplicas = 10
		Expect(k8sClient.Update(ctx, h)).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
			HaveField("Status.SafeDefaultPermits", BeEquivalentTo(4)),
			HaveField("Status.Targets", ContainElement(HaveField("SafeDefaultPermits", BeEquivalentTo(4)))),
		))
	})

	It("never raises the safe default because an HPA was deleted; an HPA created again sets it anew, with an Event", func() {
		Expect(k8sClient.Create(ctx, builders.MakeDeployment("gateway", ns).Replicas(8).Obj())).To(Succeed())
		h := builders.MakeHPA("gateway", ns).ScaleTarget("Deployment", "gateway").Replicas(8, 16).Obj()
		Expect(k8sClient.Create(ctx, h)).To(Succeed())
		setHPAStatus(ctx, h, 8, 8)
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())
		safeDefault := func(permits, replicas int) types.GomegaMatcher {
			return SatisfyAll(
				HaveField("Status.SafeDefaultPermits", BeEquivalentTo(permits)),
				HaveField("Status.Targets", ConsistOf(SatisfyAll(
					HaveField("SafeDefaultPermits", BeEquivalentTo(permits)),
					HaveField("SafeDefaultReplicas", BeEquivalentTo(replicas)),
				))),
			)
		}
		Eventually(getQuota(ctx, ns, "logistics")).Should(safeDefault(2, 16)) // 40 / 16

		// Deleted: the workload keeps 8 replicas, and 40 / 8 would be 5; the kept 16 holds.
		Expect(k8sClient.Delete(ctx, h)).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
			HaveField("Status.Targets", ConsistOf(HaveField("HPA", BeNil()))),
			safeDefault(2, 16),
		))
		Consistently(getQuota(ctx, ns, "logistics"), "500ms").Should(safeDefault(2, 16))

		// Created again with a lower maximum: it bounds the replicas again, 40 / 10.
		h = builders.MakeHPA("gateway", ns).ScaleTarget("Deployment", "gateway").Replicas(8, 10).Obj()
		Expect(k8sClient.Create(ctx, h)).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(safeDefault(4, 10))

		// Deleted and created again with a higher maximum: 40 / 20.
		Expect(k8sClient.Delete(ctx, h)).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
			HaveField("Status.Targets", ConsistOf(HaveField("HPA", BeNil()))),
			safeDefault(4, 10),
		))
		h = builders.MakeHPA("gateway", ns).ScaleTarget("Deployment", "gateway").Replicas(8, 20).Obj()
		Expect(k8sClient.Create(ctx, h)).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(safeDefault(2, 20))

		Eventually(eventNotes(ctx, ns)).Should(SatisfyAll(
			ContainElement("safe default: gateway: 2→4 permits per pod (over 16→10 replicas)"),
			ContainElement("safe default: gateway: 4→2 permits per pod (over 10→20 replicas)"),
		))
		Expect(eventNotes(ctx, ns)()).NotTo(ContainElement(ContainSubstring("2→5 permits")))
	})

	It("reports pods without an agent in a condition and an Event, and still counts them", func() {
		Expect(k8sClient.Create(ctx, builders.MakeDeployment("gateway", ns).Replicas(3).Obj())).To(Succeed())
		always := corev1.ContainerRestartPolicyAlways
		pod := func(name string) *builders.PodWrapper {
			return builders.MakePod(name, ns).Label("app", "gateway").Running("10.0.0.1")
		}
		// An annotated pod, a pod whose agent is a native sidecar (as the injector puts it), and
		// one without any agent.
		createPod(ctx, pod("gateway-a").AgentPort(15000))
		createPod(ctx, pod("gateway-b").InitContainer(corev1.Container{
			Name: "apportion-agent", Image: "agent", RestartPolicy: &always,
			Ports: []corev1.ContainerPort{{Name: apportionv1.AgentPortName, ContainerPort: 15000}},
		}))
		createPod(ctx, pod("gateway-c"))
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())

		Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
			WithTransform(perPod(0), Equal([]int32{3, 13})), // gateway-c is counted
			WithTransform(condition(apportionv1.ConditionPodsWithoutAgent), SatisfyAll(HavePrefix("True"), ContainSubstring(": gateway-c;"))),
			WithTransform(condition(apportionv1.ConditionReady), SatisfyAll(HavePrefix("False"), ContainSubstring("gateway-c"))),
		))
		Eventually(eventNotes(ctx, ns)).Should(ContainElement(HavePrefix("1 pods have no agent the manager can find")))

		// Annotated after all: the condition clears.
		var c corev1.Pod
		Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: "gateway-c"}, &c)).To(Succeed())
		c.Annotations = map[string]string{apportionv1.AgentPortAnnotation: "15000"}
		Expect(k8sClient.Update(ctx, &c)).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
			WithTransform(condition(apportionv1.ConditionPodsWithoutAgent), HavePrefix("False")),
			WithTransform(condition(apportionv1.ConditionReady), HavePrefix("True")),
		))
	})

	It("reports a deleted target workload and assigns it nothing", func() {
		d := builders.MakeDeployment("gateway", ns).Replicas(4).Obj()
		Expect(k8sClient.Create(ctx, d)).To(Succeed())
		Expect(k8sClient.Create(ctx, builders.MakeDeployment("batch", ns).Replicas(4).Obj())).To(Succeed())
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Targets(apportionv1.Target{Kind: "Deployment", Name: "gateway"}, apportionv1.Target{Kind: "Deployment", Name: "batch"}).Obj())).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(WithTransform(perPod(0), Equal([]int32{4, 5})))

		Expect(k8sClient.Delete(ctx, d)).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
			WithTransform(perPod(0), Equal([]int32{0, 0})),
			WithTransform(perPod(1), Equal([]int32{4, 10})),
			HaveField("Status.Targets", ContainElement(SatisfyAll(HaveField("Name", "gateway"), HaveField("Found", false)))),
			WithTransform(condition(apportionv1.ConditionTargetsFound), Equal("False: Deployment/gateway not found; nothing is assigned to it")),
		))
	})

	It("assigns nothing above the quota when there are more pods than permits: one each while they last", func() {
		Expect(k8sClient.Create(ctx, builders.MakeDeployment("gateway", ns).Replicas(12).Obj())).To(Succeed())
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("tiny", ns).Limit(10).Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())
		Eventually(getQuota(ctx, ns, "tiny")).Should(SatisfyAll(
			WithTransform(perPod(0), Equal([]int32{12, 0})),
			HaveField("Status.Targets", ConsistOf(HaveField("ExtraPermits", BeEquivalentTo(8)))), // 8 pods 1, 4 pods 0
			HaveField("Status.PerPod", "0-1"),
			HaveField("Status.Assigned", BeEquivalentTo(8)),
			WithTransform(condition(apportionv1.ConditionOversubscribed), SatisfyAll(HavePrefix("True"), ContainSubstring("at most 8 fit"))),
			WithTransform(condition(apportionv1.ConditionReady), HavePrefix("False")),
		))
	})

	It("follows a StatefulSet", func() {
		Expect(k8sClient.Create(ctx, builders.MakeStatefulSet("ledger", ns).Replicas(5).Obj())).To(Succeed())
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("db", ns).Limit(100).Target(apportionv1.KindStatefulSet, "ledger").Obj())).To(Succeed())
		Eventually(getQuota(ctx, ns, "db")).Should(WithTransform(perPod(0), Equal([]int32{5, 16})))
	})
})

var _ = Describe("DownstreamQuota admission", func() {
	ctx := context.Background()
	var ns string
	BeforeEach(func() { ns = newNamespace(ctx) })

	valid := func() *apportionv1.DownstreamQuota {
		return builders.MakeDownstreamQuota("q", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj()
	}
	dur := func(s string) *metav1.Duration {
		d, err := timeParse(s)
		Expect(err).NotTo(HaveOccurred())
		return &metav1.Duration{Duration: d}
	}

	It("accepts a valid quota and fills the defaults", func() {
		dq := valid()
		Expect(k8sClient.Create(ctx, dq)).To(Succeed())
		Expect(dq.Spec.SafetyFactorPercent).To(BeEquivalentTo(80))
		Expect(dq.Spec.Targets[0].Weight).To(BeEquivalentTo(1))
		Expect(dq.Spec.Agent.AcquireTimeout).To(Equal(dur("200ms")))
		Expect(dq.Spec.Agent.FailurePolicy).To(Equal(apportionv1.FailureSafeDefault))
	})

	DescribeTable("rejects with the field path",
		func(mutate func(*apportionv1.DownstreamQuota), path string) {
			dq := valid()
			mutate(dq)
			err := k8sClient.Create(ctx, dq)
			Expect(err).To(HaveOccurred())
			Expect(err.Error()).To(ContainSubstring(path))
		},
		Entry("limit < 1", func(d *apportionv1.DownstreamQuota) { d.Spec.MaxInFlight = 0 }, "spec.maxInFlight"),
		Entry("factor 0", func(d *apportionv1.DownstreamQuota) { d.Spec.SafetyFactorPercent = -1 }, "spec.safetyFactorPercent"),
		Entry("factor above 1", func(d *apportionv1.DownstreamQuota) { d.Spec.SafetyFactorPercent = 101 }, "spec.safetyFactorPercent"),
		Entry("no targets", func(d *apportionv1.DownstreamQuota) { d.Spec.Targets = nil }, "spec.targets"),
		Entry("duplicate targets", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Targets = append(d.Spec.Targets, d.Spec.Targets[0])
		}, "spec.targets[1]"),
		Entry("17 targets", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Targets = nil
			for i := range 17 {
				d.Spec.Targets = append(d.Spec.Targets, apportionv1.Target{Kind: "Deployment", Name: strings.Repeat("a", i+1)})
			}
		}, "spec.targets"),
		Entry("weight < 1", func(d *apportionv1.DownstreamQuota) { d.Spec.Targets[0].Weight = -2 }, "spec.targets[0].weight"),
		Entry("unknown kind", func(d *apportionv1.DownstreamQuota) { d.Spec.Targets[0].Kind = "DaemonSet" }, "spec.targets[0].kind"),
		Entry("acquire timeout above 5s", func(d *apportionv1.DownstreamQuota) { d.Spec.Agent.AcquireTimeout = dur("6s") }, "spec.agent.acquireTimeout"),
		Entry("acquire timeout zero", func(d *apportionv1.DownstreamQuota) { d.Spec.Agent.AcquireTimeout = dur("0s") }, "spec.agent.acquireTimeout"),
		Entry("burst < 1", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Rate = &apportionv1.RateContract{RequestsPerSecond: 100, Burst: -1}
		}, "spec.rate.burst"),
		Entry("rate < 1", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Rate = &apportionv1.RateContract{RequestsPerSecond: 0}
		}, "spec.rate.requestsPerSecond"),
		Entry("rate mode", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Rate = &apportionv1.RateContract{RequestsPerSecond: 10, Mode: "Leaky"}
		}, "spec.rate.mode"),
		Entry("non-http URL", func(d *apportionv1.DownstreamQuota) { d.Spec.Upstream = "ftp://files.example.com/" }, "spec.upstream"),
		Entry("relative URL", func(d *apportionv1.DownstreamQuota) { d.Spec.Upstream = "/v2/orders" }, "spec.upstream"),
		Entry("probe count < 1", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Agent.CircuitBreaker = &apportionv1.CircuitBreaker{HalfOpenProbes: -1}
		}, "spec.agent.circuitBreaker.halfOpenProbes"),
		Entry("failure rate above 100%", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Agent.CircuitBreaker = &apportionv1.CircuitBreaker{FailureRatePercent: 101}
		}, "spec.agent.circuitBreaker.failureRatePercent"),
		Entry("slow-call rate below 1%", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Agent.CircuitBreaker = &apportionv1.CircuitBreaker{SlowCallRatePercent: -5}
		}, "spec.agent.circuitBreaker.slowCallRatePercent"),
		Entry("static fallback without a response", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Agent.Fallback = &apportionv1.Fallback{Action: apportionv1.FallbackStatic}
		}, "spec.agent.fallback"),
		Entry("unknown fallback", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Agent.Fallback = &apportionv1.Fallback{Action: "Retry"}
		}, "spec.agent.fallback.action"),
		Entry("unknown failure policy", func(d *apportionv1.DownstreamQuota) { d.Spec.Agent.FailurePolicy = "Open" }, "spec.agent.failurePolicy"),
	)
})
