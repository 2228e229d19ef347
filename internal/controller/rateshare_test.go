package controller

import (
	"context"
	"fmt"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/builders"
)

// recordingAgents plays the pods' agents for a real push engine: it checks every assignment as
// an agent does (Validate), holds it from acceptance for its lease, and keeps the last one per
// pod, so a test reads what each pod was pushed.
type recordingAgents struct {
	mu         sync.Mutex
	held       map[string]*assignment.Assignment // by pod, "namespace/name"
	acceptedAt map[string]time.Time
}

func newRecordingAgents() *recordingAgents {
	return &recordingAgents{held: map[string]*assignment.Assignment{}, acceptedAt: map[string]time.Time{}}
}

func (r *recordingAgents) Push(_ context.Context, to assignment.Endpoint, a *assignment.Assignment) (*assignment.State, error) {
	if err := a.Validate(); err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if old := r.held[to.Pod]; old != nil && assignment.ComparePair(a.Epoch, a.Generation, old.Epoch, old.Generation) < 0 {
		return r.stateLocked(to.Pod), fmt.Errorf("%w: pushed %d/%d", assignment.ErrStale, a.Epoch, a.Generation)
	}
	r.held[to.Pod], r.acceptedAt[to.Pod] = a, time.Now()
	return r.stateLocked(to.Pod), nil
}

func (r *recordingAgents) State(_ context.Context, to assignment.Endpoint, _ int64) (*assignment.State, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stateLocked(to.Pod), nil
}

func (r *recordingAgents) stateLocked(pod string) *assignment.State {
	a := r.held[pod]
	if a == nil {
		return &assignment.State{}
	}
	st := &assignment.State{Epoch: a.Epoch, Generation: a.Generation, Configured: true,
		LeaseExpiresAt: r.acceptedAt[pod].Add(a.LeaseTTL.D())}
	for _, d := range a.Downstreams {
		st.Downstreams = append(st.Downstreams, assignment.DownstreamState{Name: d.Name, Permits: d.Permits, EffectivePermits: d.Permits})
	}
	return st
}

// rates is the rate each pod was last pushed for downstream ds (nil for a pod pushed none).
func (r *recordingAgents) rates(ns, ds string, pods ...string) []*assignment.Rate {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]*assignment.Rate, len(pods))
	for i, p := range pods {
		if a := r.held[ns+"/"+p]; a != nil {
			for _, d := range a.Downstreams {
				if d.Name == ds && d.Rate != nil {
					rate := *d.Rate
					out[i] = &rate
				}
			}
		}
	}
	return out
}

var _ = Describe("DownstreamQuota rate shares", func() {
	It("apportions the rate and the burst like permits, in status and in every pod's pushed assignment", func() {
		ctx := context.Background()
		ns := newNamespace(ctx)

		// A real push engine, its agents played by recordingAgents; its windows are short so
		// that its recovery after start (PushTimeout + AcceptGrace + LeaseTTL + the quota's
		// requestTimeout) is over in about 2 s.
		agents := newRecordingAgents()
		engine := startTestEngine(ctx, agents)
		// This reconciler pushes through the engine; it runs when the test says, over the
		// manager's cache, as pushedSwitches does for switches.
		r := &DownstreamQuotaReconciler{Client: managerClient, Recorder: events.NewFakeRecorder(100), Pusher: engine, Clock: clock.RealClock{}}
		key := types.NamespacedName{Namespace: ns, Name: "logistics"}
		reconcileNow := func() error {
			_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
			return err
		}

		// 100/s with a burst of 4, at the default factor 80 %: 80/s and a burst of 3 to share.
		d := builders.MakeDeployment("gateway", ns).Replicas(2).Obj()
		Expect(k8sClient.Create(ctx, d)).To(Succeed())
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).
			Rate(100, 4).Timeouts(200*time.Millisecond, 500*time.Millisecond).
			Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())
		pod := func(i int) string { return fmt.Sprintf("gateway-%d", i) }
		for i := range 2 {
			createPod(ctx, builders.MakePod(pod(i), ns).Label("app", "gateway").AgentPort(15000).Running(fmt.Sprintf("10.0.0.%d", 10+i)))
		}

		// Two pods: 40/s and a burst of 1 each (Σ 80 ≤ 100, Σ 2 ≤ 4).
		Eventually(getQuota(ctx, ns, "logistics")).Should(HaveField("Status.Targets", ConsistOf(SatisfyAll(
			HaveField("Replicas", BeEquivalentTo(2)),
			HaveField("RatePerPod", Equal(&apportionv1.RateShare{RequestsPerSecond: "40", Burst: 1})),
		))))
		two := &assignment.Rate{PerSecond: 40, Burst: 1, Mode: assignment.ModeTokenBucket}
		Eventually(func() ([]*assignment.Rate, error) {
			return agents.rates(ns, "logistics", pod(0), pod(1)), reconcileNow()
		}).Should(Equal([]*assignment.Rate{two, two}))

		// Five pods: more pods than the burst to share, so each is paced (burst 0) at 16/s
		// (Σ 80 ≤ 100, Σ 0 ≤ 4); the old formula gave each a burst of 1 (Σ 5 > 4).
		Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
		d.Spec.Replicas = ptr.To[int32](5)
		Expect(k8sClient.Update(ctx, d)).To(Succeed())
		for i := 2; i < 5; i++ {
			createPod(ctx, builders.MakePod(pod(i), ns).Label("app", "gateway").AgentPort(15000).Running(fmt.Sprintf("10.0.0.%d", 10+i)))
		}
		Eventually(getQuota(ctx, ns, "logistics")).Should(HaveField("Status.Targets", ConsistOf(SatisfyAll(
			HaveField("Replicas", BeEquivalentTo(5)),
			HaveField("RatePerPod", Equal(&apportionv1.RateShare{RequestsPerSecond: "16", Burst: 0})),
		))))
		five := &assignment.Rate{PerSecond: 16, Burst: 0, Mode: assignment.ModeTokenBucket}
		Eventually(func() ([]*assignment.Rate, error) {
			return agents.rates(ns, "logistics", pod(0), pod(1), pod(2), pod(3), pod(4)), reconcileNow()
		}).Should(Equal([]*assignment.Rate{five, five, five, five, five}))
	})
})
