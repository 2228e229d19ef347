package controller

import (
	"context"
	"fmt"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	clocktesting "k8s.io/utils/clock/testing"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/builders"
)

// rampRaiseAgents are recordingAgents that advertise CapabilityRampRaise, as the agent does.
type rampRaiseAgents struct{ *recordingAgents }

func (r rampRaiseAgents) Push(ctx context.Context, to assignment.Endpoint, a *assignment.Assignment) (*assignment.State, error) {
	st, err := r.recordingAgents.Push(ctx, to, a)
	if st != nil {
		st.Capabilities = []string{assignment.CapabilityRampRaise}
	}
	return st, err
}

func (r rampRaiseAgents) State(ctx context.Context, to assignment.Endpoint, epoch int64) (*assignment.State, error) {
	st, err := r.recordingAgents.State(ctx, to, epoch)
	if st != nil {
		st.Capabilities = []string{assignment.CapabilityRampRaise}
	}
	return st, err
}

var _ = Describe("DownstreamQuota raises after an incident", func() {
	// Through a real push engine: a quota's budget lowered and raised back is pushed with
	// RampRaise (the default ramp is on) until IncidentWindow after the lowering, then without.
	It("flags the pods' downstream from the lowering until the window passed", func() {
		ctx := context.Background()
		ns := newNamespace(ctx)
		agents := rampRaiseAgents{newRecordingAgents()}
		engine := startTestEngine(ctx, agents)
		clk := clocktesting.NewFakePassiveClock(time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC))
		r := &DownstreamQuotaReconciler{Client: managerClient, Recorder: events.NewFakeRecorder(100), Pusher: engine, Clock: clk}
		key := types.NamespacedName{Namespace: ns, Name: "logistics"}

		Expect(k8sClient.Create(ctx, builders.MakeDeployment("gateway", ns).Replicas(2).Obj())).To(Succeed())
		for i := range 2 {
			createPod(ctx, builders.MakePod(fmt.Sprintf("gateway-%d", i), ns).Label("app", "gateway").AgentPort(15000).
				Running(fmt.Sprintf("10.0.2.%d", 10+i)))
		}
		dq := builders.MakeDownstreamQuota("logistics", ns).Limit(50).Timeouts(200*time.Millisecond, 500*time.Millisecond).
			Target(apportionv1.KindDeployment, "gateway").Obj()
		Expect(k8sClient.Create(ctx, dq)).To(Succeed())

		// held reconciles until both pods hold permits (each) and the flag as wanted, and returns
		// the last reconcile's requeue.
		held := func(what string, permits int32, flag bool) time.Duration {
			var requeue time.Duration
			Eventually(func() error {
				res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
				if err != nil {
					return err
				}
				requeue = res.RequeueAfter
				agents.mu.Lock()
				defer agents.mu.Unlock()
				for i := range 2 {
					a := agents.held[fmt.Sprintf("%s/gateway-%d", ns, i)]
					if a == nil || len(a.Downstreams) != 1 {
						return fmt.Errorf("gateway-%d holds %+v", i, a)
					}
					if d := a.Downstreams[0]; d.Permits != permits || d.RampRaise != flag {
						return fmt.Errorf("gateway-%d holds %d permits, rampRaise %v", i, d.Permits, d.RampRaise)
					}
				}
				return nil
			}, 30*time.Second, 50*time.Millisecond).Should(Succeed(), what)
			return requeue
		}
		setLimit := func(limit int32) {
			Expect(k8sClient.Get(ctx, key, dq)).To(Succeed())
			before := dq.DeepCopy()
			dq.Spec.MaxInFlight = limit
			// A patch: the status writes move the object on under an update.
			Expect(k8sClient.Patch(ctx, dq, client.MergeFrom(before))).To(Succeed())
			// The manager's cache has it before the reconcile reads it.
			Eventually(func() (int32, error) {
				var got apportionv1.DownstreamQuota
				err := managerClient.Get(ctx, client.ObjectKeyFromObject(dq), &got)
				return got.Spec.MaxInFlight, err
			}).Should(Equal(limit))
		}

		held("first permits", 20, false) // 50 × 80 % over 2 pods
		clk.SetTime(clk.Now().Add(time.Minute))
		setLimit(20)
		Expect(held("lowered: the incident", 8, true)).To(BeNumerically("<=", IncidentWindow))
		clk.SetTime(clk.Now().Add(time.Minute))
		setLimit(50)
		Expect(held("raised back", 20, true)).To(BeNumerically("<=", IncidentWindow-time.Minute))
		clk.SetTime(clk.Now().Add(IncidentWindow - time.Minute))
		held("the window passed", 20, false)
	})
})
