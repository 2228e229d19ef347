package controller

import (
	"context"
	"fmt"
	"slices"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/apportion"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/builders"
)

var _ = Describe("DownstreamQuota remainder", func() {
	var (
		ctx context.Context
		ns  string
	)
	BeforeEach(func() {
		ctx = context.Background()
		ns = newNamespace(ctx)
	})

	// What status shows at limit 50 (budget 40) and an HPA's count of 8 to 32: the floor per pod,
	// how many pods get one more, and the whole budget assigned.
	It("assigns the whole budget and shows the floor and how many get one more", func() {
		Expect(k8sClient.Create(ctx, builders.MakeDeployment("gateway", ns).Replicas(8).Obj())).To(Succeed())
		h := builders.MakeHPA("gateway", ns).ScaleTarget("Deployment", "gateway").Replicas(8, 32).Obj()
		Expect(k8sClient.Create(ctx, h)).To(Succeed())
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())
		for _, tc := range []struct {
			pods, floor, extra int32
			perPod             string
		}{
			{8, 5, 0, "5"},
			{12, 3, 4, "3-4"},
			{16, 2, 8, "2-3"},
			{21, 1, 19, "1-2"},
			{32, 1, 8, "1-2"},
		} {
			setHPAStatus(ctx, h, tc.pods, tc.pods)
			Eventually(getQuota(ctx, ns, "logistics")).Should(SatisfyAll(
				HaveField("Status.Targets", ConsistOf(SatisfyAll(
					HaveField("Replicas", tc.pods), HaveField("PermitsPerPod", tc.floor), HaveField("ExtraPermits", tc.extra)))),
				HaveField("Status.PerPod", tc.perPod),
				HaveField("Status.Assigned", BeEquivalentTo(40)),
				HaveField("Status.SafeDefaultPermits", BeEquivalentTo(1)), // 40 / maxReplicas 32: no remainder
				WithTransform(condition(apportionv1.ConditionReady), Equal(fmt.Sprintf("True: %d pods, %s permits per pod", tc.pods, tc.perPod))),
			), "%d pods", tc.pods)
		}
		Eventually(eventNotes(ctx, ns)).Should(SatisfyAll(
			ContainElement(ContainSubstring("gateway: 8→12 pods, 5→3-4 permits per pod")),
			ContainElement(ContainSubstring("gateway: 21→32 pods, 1-2→1-2 permits per pod")),
		))
	})

	// The pods' agents (played by recordingAgents behind a real push engine) hold the whole
	// budget at every pod count, each pod the floor or one more; a new rotation counter moves the
	// one-mores to the pods it ranks first, and at no accepted push do the pods' permits sum above
	// the limit. Prints Σ permits / budget before (the floor alone) and now.
	It("pushes the whole budget to the pods and rotates who gets one more, never above the limit", func() {
		agents := &summingAgents{recordingAgents: newRecordingAgents(), ds: "logistics"}
		engine := startTestEngine(ctx, agents)
		clk := clocktesting.NewFakePassiveClock(time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC))
		r := &DownstreamQuotaReconciler{Client: managerClient, Recorder: events.NewFakeRecorder(1000), Pusher: engine, Clock: clk}
		key := types.NamespacedName{Namespace: ns, Name: "logistics"}

		d := builders.MakeDeployment("gateway", ns).Replicas(8).Obj()
		Expect(k8sClient.Create(ctx, d)).To(Succeed())
		dq := builders.MakeDownstreamQuota("logistics", ns).Limit(50).Timeouts(200*time.Millisecond, 500*time.Millisecond).
			Target(apportionv1.KindDeployment, "gateway").Obj()
		Expect(k8sClient.Create(ctx, dq)).To(Succeed())

		var uids []string // by pod index
		scale := func(n int) {
			Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
			d.Spec.Replicas = ptr.To(int32(n))
			Expect(k8sClient.Update(ctx, d)).To(Succeed())
			for i := len(uids); i < n; i++ {
				p := createPod(ctx, builders.MakePod(fmt.Sprintf("gateway-%02d", i), ns).Label("app", "gateway").AgentPort(15000).
					Running(fmt.Sprintf("10.0.1.%d", 10+i)))
				uids = append(uids, string(p.UID))
			}
		}
		// pushed is every pod's last pushed permits, by pod index, once the engine converged on
		// what the reconciler decides now.
		pushed := func(n int) []int32 {
			var got []int32
			Eventually(func() error {
				if _, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key}); err != nil {
					return err
				}
				if rep := engine.Report(key); !rep.Converged || rep.Recovering {
					return fmt.Errorf("engine not converged: %+v", rep.Converged)
				}
				got = agents.permits(ns, n)
				if slices.Contains(got, -1) {
					return fmt.Errorf("some pods pushed nothing: %v", got)
				}
				return nil
			}, 30*time.Second, 50*time.Millisecond).Should(Succeed())
			return got
		}
		// want is the split package apportion makes for these pods at the reconciler's counter.
		want := func(n int) []int32 {
			Expect(k8sClient.Get(ctx, key, dq)).To(Succeed())
			counter, _ := apportion.Rotation(clk.Now(), DefaultRemainderRotation, string(dq.UID))
			s := apportion.Split(50, 80, []apportion.Target{{Weight: 1, Replicas: int64(n), Pods: uids[:n]}}, counter)
			out := make([]int32, n)
			for i, p := range s.Permits[0] {
				out[i] = int32(p)
			}
			return out
		}

		// rotate moves the reconciler's clock on by one rotation period, three times: each new
		// counter hands the one-mores to the pods it ranks first.
		rotate := func(n int) {
			prev := pushed(n)
			for range 3 {
				clk.SetTime(clk.Now().Add(DefaultRemainderRotation))
				next := pushed(n)
				Expect(next).To(Equal(want(n)))
				moved := 0
				for i := range next {
					if next[i] > prev[i] {
						moved++
					}
				}
				GinkgoWriter.Printf("rotation at %d pods: %d of %d one-mores moved to other pods: %v → %v\n", n, moved, 40%n, prev, next)
				prev = next
			}
		}

		GinkgoWriter.Printf("%5s  %27s  %27s\n", "pods", "before (floor): Σ / budget", "now: Σ pushed / budget")
		for _, n := range []int{8, 12, 16, 21, 32} {
			scale(n)
			got := pushed(n)
			floor := int32(40 / n)
			var sum int32
			for _, p := range got {
				Expect(p).To(BeElementOf(floor, floor+1), "%d pods: %v", n, got)
				sum += p
			}
			Expect(sum).To(BeEquivalentTo(40), "%d pods: %v", n, got)
			Expect(got).To(Equal(want(n)))
			GinkgoWriter.Printf("%5d  %15d / 40 = %3.0f%%  %15d / 40 = %3.0f%%\n", n, int(floor)*n, float64(int(floor)*n)/0.4, sum, float64(sum)/0.4)
			if n == 16 {
				rotate(n)
			}
		}
		Expect(agents.maxSum()).To(BeNumerically("<=", 50))
		GinkgoWriter.Printf("highest Σ of the pods' accepted permits at any push: %d (limit 50)\n", agents.maxSum())
	})
})

// summingAgents records, at every accepted push, Σ of the permits the pods last accepted for
// downstream ds: what they may use at that instant.
type summingAgents struct {
	*recordingAgents
	ds  string
	max int32
}

func (s *summingAgents) Push(ctx context.Context, to assignment.Endpoint, a *assignment.Assignment) (*assignment.State, error) {
	st, err := s.recordingAgents.Push(ctx, to, a)
	s.mu.Lock()
	defer s.mu.Unlock()
	var sum int32
	for _, h := range s.held {
		for _, d := range h.Downstreams {
			if d.Name == s.ds {
				sum += d.Permits
			}
		}
	}
	s.max = max(s.max, sum)
	return st, err
}

func (s *summingAgents) maxSum() int32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.max
}

// permits is the last permits pushed to pods gateway-00… of namespace ns for ds (-1: none).
func (s *summingAgents) permits(ns string, n int) []int32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]int32, n)
	for i := range out {
		out[i] = -1
		if a := s.held[fmt.Sprintf("%s/gateway-%02d", ns, i)]; a != nil {
			for _, d := range a.Downstreams {
				if d.Name == s.ds {
					out[i] = d.Permits
				}
			}
		}
	}
	return out
}
