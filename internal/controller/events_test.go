package controller

import (
	"context"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
)

// staleEventsRecorder is the manager's Event recorder under a name of its own, so that a test
// tells its reconciler's Events from the suite's.
var staleEventsRecorder events.EventRecorder

const staleEventsController = "apportion-stale-cache-test"

func init() {
	extraControllers = append(extraControllers, func(mgr ctrl.Manager) error {
		staleEventsRecorder = mgr.GetEventRecorder(staleEventsController)
		return nil
	})
}

// staleQuota is a cache that lags: it keeps answering one version of one DownstreamQuota, as the
// manager's cache does for a while after the reconciler wrote the quota's status.
type staleQuota struct {
	client.Client
	key client.ObjectKey
	dq  *apportionv1.DownstreamQuota
}

func (s staleQuota) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	if dq, ok := obj.(*apportionv1.DownstreamQuota); ok && key == s.key {
		s.dq.DeepCopyInto(dq)
		return nil
	}
	return s.Client.Get(ctx, key, obj, opts...)
}

var _ = Describe("DownstreamQuota Events", func() {
	It("reports each of two rebalances decided on one cached version of the quota", func() {
		ctx := context.Background()
		ns := newNamespace(ctx)
		d := builders.MakeDeployment("gateway", ns).Replicas(8).Obj()
		Expect(k8sClient.Create(ctx, d)).To(Succeed())
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).
			Target(apportionv1.KindDeployment, "gateway").Obj())).To(Succeed())
		Eventually(getQuota(ctx, ns, "logistics")).Should(WithTransform(perPod(0), Equal([]int32{8, 5})))
		cached, err := getQuota(ctx, ns, "logistics")()
		Expect(err).NotTo(HaveOccurred())

		r := &DownstreamQuotaReconciler{
			Client:   staleQuota{Client: managerClient, key: client.ObjectKeyFromObject(cached), dq: cached},
			Recorder: staleEventsRecorder,
			Clock:    clock.RealClock{},
		}
		// scaleTo scales the Deployment and reconciles until this reconciler decided the new
		// share (the suite's own reconciler writes the same status, so the status cannot tell).
		key := client.ObjectKeyFromObject(cached)
		scaleTo := func(n int32, want []int32) {
			Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(d), d)).To(Succeed())
			d.Spec.Replicas = ptr.To(n)
			Expect(k8sClient.Update(ctx, d)).To(Succeed())
			Eventually(func() ([]int32, error) {
				if _, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key}); err != nil {
					return nil, err
				}
				decided, ok := r.decided.Load(key)
				if !ok {
					return nil, nil
				}
				t := decided.(decidedStatus).Status.Targets[0]
				return []int32{t.Replicas, t.PermitsPerPod}, nil
			}).Should(Equal(want))
		}
		scaleTo(10, []int32{10, 4})
		scaleTo(16, []int32{16, 2})

		Eventually(func() []string {
			var evs eventsv1.EventList
			Expect(k8sClient.List(ctx, &evs, client.InNamespace(ns))).To(Succeed())
			var notes []string
			for _, e := range evs.Items {
				if e.ReportingController == staleEventsController {
					notes = append(notes, e.Note)
				}
			}
			return notes
		}).Should(ConsistOf(
			"rebalanced: gateway: 8→10 pods, 5→4 permits per pod",
			"safe default: gateway: 5→4 permits per pod (over 8→10 replicas)",
			"rebalanced: gateway: 10→16 pods, 4→2-3 permits per pod",
			"safe default: gateway: 4→2 permits per pod (over 10→16 replicas)",
		))
	})
})
