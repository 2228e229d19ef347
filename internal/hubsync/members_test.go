package hubsync

import (
	"testing"
	"time"

	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/push"
	"github.com/apportion/apportion/internal/testing/builders"
	"github.com/apportion/apportion/internal/testing/testenv"
)

// ledgerOf is a member's engine that reports one ledger for every quota.
type ledgerOf struct{ rep push.Report }

func (l ledgerOf) Report(types.NamespacedName) push.Report { return l.rep }

// TestMembers: a Member starts for a quota with spec.global once its hub Secret is there (before:
// the quota holds nothing), takes the grant the hub publishes (the quota is notified), and stops
// when the quota goes. One API server plays both the hub and the member cluster.
func TestMembers(t *testing.T) {
	testenv.SkipWithoutAssets(t)
	g := NewWithT(t)
	env, err := testenv.Start(testenv.Options{})
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = env.Stop() })
	ctx := t.Context()
	for _, ns := range []string{"apportion-system", "app", "partners"} {
		g.Expect(env.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})).To(Succeed())
	}
	dq := builders.MakeDownstreamQuota("partner", "app").Limit(30).Target(apportionv1.KindDeployment, "gateway").Obj()
	dq.Spec.Global = &apportionv1.GlobalRef{Hub: "hub", Namespace: "partners", Name: "partner", Cluster: "eu-1"}
	g.Expect(env.Client.Create(ctx, dq)).To(Succeed())
	key := client.ObjectKeyFromObject(dq)

	changes := make(chan event.GenericEvent, 16)
	s := &Members{
		Local: env.Client, Secrets: env.Client, Namespace: "apportion-system", Scheme: env.Scheme, Clock: clock.RealClock{},
		Engine: ledgerOf{push.Report{Converged: true}}, Window: time.Second, Changes: changes, Resync: 100 * time.Millisecond,
		NewHub: func([]byte) (client.Client, error) { return env.Client, nil },
	}
	go func() { _ = s.Start(ctx) }()

	// No Secret: nothing held, no Member.
	time.Sleep(500 * time.Millisecond)
	_, _, ok := s.Slice(key)
	g.Expect(ok).To(BeFalse())

	g.Expect(env.Client.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "apportion-system", Name: "hub"},
		Data: map[string][]byte{HubKubeconfigKey: []byte("unused: NewHub")}})).To(Succeed())
	g.Eventually(func() bool { _, _, ok := s.Slice(key); return ok }, 10*time.Second).Should(BeTrue())
	_, lim, _ := s.Slice(key)
	g.Expect(lim).To(BeZero(), "no grant, no record: 0")

	// The hub publishes a grant: the member takes it, records it and is notified.
	cs := &apportionv1.ClusterSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: "partners", Name: SliceName("partner", "eu-1")},
		Spec: apportionv1.ClusterSliceSpec{GlobalQuota: "partner", Cluster: "eu-1", Seq: 1, Slice: 12, ReservedSlice: 4,
			LeaseDuration: metav1.Duration{Duration: 3 * time.Second}},
	}
	g.Expect(env.Client.Create(ctx, cs)).To(Succeed())
	g.Eventually(func() int64 { _, lim, _ := s.Slice(key); return lim }, 10*time.Second).Should(Equal(int64(12)))
	g.Eventually(changes).Should(Receive())
	g.Eventually(func() *apportionv1.GlobalSliceStatus {
		var got apportionv1.DownstreamQuota
		_ = env.Client.Get(ctx, key, &got)
		return got.Status.Global
	}, 10*time.Second).Should(HaveField("Seq", int64(1)))
	// Not before the engine was handed an assignment planned on grant 1 (its converged ledger
	// may still be the plan of before).
	g.Consistently(func() int64 {
		_ = env.Client.Get(ctx, client.ObjectKeyFromObject(cs), cs)
		return cs.Status.AcknowledgedSeq
	}, 2500*time.Millisecond).Should(BeZero())
	// The engine planned on grant 1 and converged under it: the member acknowledges it.
	s.Assigned(key, 1)
	g.Eventually(func() int64 {
		_ = env.Client.Get(ctx, client.ObjectKeyFromObject(cs), cs)
		return cs.Status.AcknowledgedSeq
	}, 10*time.Second).Should(Equal(int64(1)))

	// The quota goes: its Member stops.
	g.Expect(env.Client.Delete(ctx, dq)).To(Succeed())
	g.Eventually(func() bool { _, _, ok := s.Slice(key); return ok }, 10*time.Second).Should(BeFalse())
}
