package hubsync

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
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

// countingClient counts the reads it makes, and fails them all while broken.
type countingClient struct {
	client.Client
	reads  atomic.Int64
	broken bool
}

func (c *countingClient) Get(ctx context.Context, key client.ObjectKey, obj client.Object, opts ...client.GetOption) error {
	c.reads.Add(1)
	if c.broken {
		return errors.New("this kubeconfig's credential was revoked")
	}
	return c.Client.Get(ctx, key, obj, opts...)
}

// TestMembersRotateKubeconfig: the hub Secret's kubeconfig changes; the running Member reads the
// hub through the new one from the next resync on, without a restart: its lease holds
// throughout and its slice is not lowered. A rotation to a kubeconfig that cannot read the hub
// lets the lease end (the reserved slice), and the next rotation brings it back.
func TestMembersRotateKubeconfig(t *testing.T) {
	env := startMemberEnv(t)
	g := NewWithT(t)
	ctx := t.Context()
	const lease = 3 * time.Second
	cs := &apportionv1.ClusterSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: "partners", Name: SliceName("partner", "eu-1")},
		Spec: apportionv1.ClusterSliceSpec{GlobalQuota: "partner", Cluster: "eu-1", Seq: 1, Slice: 12, ReservedSlice: 4,
			LeaseDuration: metav1.Duration{Duration: lease}},
	}
	g.Expect(env.Client.Create(ctx, cs)).To(Succeed())
	dq := builders.MakeDownstreamQuota("partner", "app").Limit(30).Target(apportionv1.KindDeployment, "gateway").Obj()
	dq.Spec.Global = &apportionv1.GlobalRef{Hub: "hub", Namespace: "partners", Name: "partner", Cluster: "eu-1"}
	g.Expect(env.Client.Create(ctx, dq)).To(Succeed())
	key := client.ObjectKeyFromObject(dq)
	sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "apportion-system", Name: "hub"},
		Data: map[string][]byte{HubKubeconfigKey: []byte("one")}}
	g.Expect(env.Client.Create(ctx, sec)).To(Succeed())

	// Each kubeconfig is a client of its own; "revoked" is one whose every read fails.
	var mu sync.Mutex
	clients := map[string]*countingClient{}
	s := &Members{
		Local: env.Client, Secrets: env.Client, Namespace: "apportion-system", Scheme: env.Scheme, Clock: clock.RealClock{},
		Engine: ledgerOf{push.Report{Converged: true}}, Window: time.Second, Resync: 100 * time.Millisecond,
		NewHub: func(kc []byte) (client.Client, error) {
			mu.Lock()
			defer mu.Unlock()
			c := &countingClient{Client: env.Client, broken: string(kc) == "revoked"}
			clients[string(kc)] = c
			return c, nil
		},
	}
	go func() { _ = s.Start(ctx) }()
	reads := func(kc string) int64 {
		mu.Lock()
		defer mu.Unlock()
		if c := clients[kc]; c != nil {
			return c.reads.Load()
		}
		return 0
	}
	g.Eventually(func() int64 { _, lim, _ := s.Slice(key); return lim }, 10*time.Second).Should(Equal(int64(12)))
	member := func() *Member {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.running[key].m
	}
	first := member()

	// A monitor of the local limit at 100 Hz while the kubeconfig rotates.
	var lowered, samples atomic.Int64
	monCtx, stopMon := context.WithCancel(ctx)
	monDone := make(chan struct{})
	go func() {
		defer close(monDone)
		for monCtx.Err() == nil {
			if _, lim, _ := s.Slice(key); lim < 12 {
				lowered.Add(1)
			}
			samples.Add(1)
			time.Sleep(10 * time.Millisecond)
		}
	}()
	setKubeconfig := func(kc string) time.Time {
		g.Expect(env.Client.Get(ctx, client.ObjectKeyFromObject(sec), sec)).To(Succeed())
		sec.Data[HubKubeconfigKey] = []byte(kc)
		g.Expect(env.Client.Update(ctx, sec)).To(Succeed())
		return time.Now()
	}
	at := setKubeconfig("two")
	g.Eventually(func() int64 { return reads("two") }, 10*time.Second, 10*time.Millisecond).Should(BeNumerically(">", 0))
	t.Logf("the first read through the rotated kubeconfig %v after the Secret changed", time.Since(at).Round(time.Millisecond))
	before := reads("one")
	time.Sleep(3 * lease)
	g.Expect(reads("one")).To(Equal(before), "the old kubeconfig is still used")
	g.Expect(reads("two")).To(BeNumerically(">=", 3), "the new kubeconfig renews the lease")
	stopMon()
	<-monDone
	// A Member started again would start from its record, on the reserved slice, with no lease;
	// the same Member keeps its lease. (A sample below the slice is a lease that lapsed because
	// reads were slower than a third of the lease on a busy machine, not the rotation: printed.)
	t.Logf("during the rotation: %d samples of the local limit, %d below the slice", samples.Load(), lowered.Load())
	g.Expect(member()).To(BeIdenticalTo(first), "the rotation restarted the quota's Member")

	// A kubeconfig that cannot read the hub: the lease ends, the member falls to its reserved
	// slice and says why; the next rotation brings the slice back.
	at = setKubeconfig("revoked")
	g.Eventually(func() int64 { _, lim, _ := s.Slice(key); return lim }, 10*time.Second, 10*time.Millisecond).Should(Equal(int64(4)))
	t.Logf("with a revoked kubeconfig the lease ended %v after the rotation", time.Since(at).Round(time.Millisecond))
	g.Eventually(func(g Gomega) {
		var got apportionv1.DownstreamQuota
		g.Expect(env.Client.Get(ctx, key, &got)).To(Succeed())
		c := findCondition(got.Status.Conditions, apportionv1.ConditionSliceLeased)
		g.Expect(c).NotTo(BeNil())
		g.Expect(c.Status).To(Equal(metav1.ConditionFalse))
		g.Expect(c.Reason).To(Equal(apportionv1.ReasonHubUnreachable))
		g.Expect(c.Message).To(ContainSubstring("revoked"))
	}, 10*time.Second, 20*time.Millisecond).Should(Succeed())
	setKubeconfig("three")
	g.Eventually(func() int64 { _, lim, _ := s.Slice(key); return lim }, 10*time.Second, 10*time.Millisecond).Should(Equal(int64(12)))
	g.Eventually(func(g Gomega) {
		var got apportionv1.DownstreamQuota
		g.Expect(env.Client.Get(ctx, key, &got)).To(Succeed())
		c := findCondition(got.Status.Conditions, apportionv1.ConditionSliceLeased)
		g.Expect(c).NotTo(BeNil())
		g.Expect(c.Status).To(Equal(metav1.ConditionTrue), c.Message)
		g.Expect(got.Status.Global.LeaseUntil.Time).To(BeTemporally(">", time.Now().Add(-time.Second)))
	}, 10*time.Second, 20*time.Millisecond).Should(Succeed())
}

// startMemberEnv starts an API server for a test of the member side (skipped without envtest's
// assets) with the namespaces those tests use: the manager's, the app's and the hub's.
func startMemberEnv(t *testing.T) *testenv.Env {
	t.Helper()
	testenv.SkipWithoutAssets(t)
	ctrl.SetLogger(logr.Discard())
	g := NewWithT(t)
	env, err := testenv.Start(testenv.Options{})
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = env.Stop() })
	for _, ns := range []string{"apportion-system", "app", "partners"} {
		g.Expect(env.Client.Create(t.Context(), &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}})).To(Succeed())
	}
	return env
}
