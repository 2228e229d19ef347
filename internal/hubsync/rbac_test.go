package hubsync

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
	"github.com/apportion/apportion/internal/testing/testenv"
)

// hubManagerSA is the manager's ServiceAccount as config/hub binds it.
const hubManagerSA = "system:serviceaccount:apportion-system:apportion-controller-manager"

// applyFile creates every object of a YAML file of the repository on env, with the strings of
// replace replaced (old, new, old, new...).
func applyFile(t *testing.T, env *testenv.Env, rel string, replace ...string) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "..", rel))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(replace); i += 2 {
		raw = bytes.ReplaceAll(raw, []byte(replace[i]), []byte(replace[i+1]))
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(raw), 4096)
	for {
		var u unstructured.Unstructured
		if err := dec.Decode(&u.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return
			}
			t.Fatal(err)
		}
		if len(u.Object) == 0 {
			continue
		}
		if err := env.Client.Create(t.Context(), &u); err != nil {
			t.Fatal(err)
		}
	}
}

// as is env's configuration impersonating user (the API server authorizes it by RBAC alone).
func as(env *testenv.Env, user string) *rest.Config {
	c := rest.CopyConfig(env.Config)
	c.Impersonate = rest.ImpersonationConfig{UserName: user}
	return c
}

// TestLeastPrivilege runs one quota across clusters with the shipped rights only: the hub's
// manager as the ServiceAccount config/hub/hub_role.yaml binds (not cluster-admin), each member
// as the ServiceAccount of config/samples/hub_member_rbac.yaml. The hub adds its finalizer,
// writes the allocation, publishes the slices and, once the quota is deleted, removes them and
// its finalizer; each member reads its slice and answers in its status, and may not touch the
// other member's. Both members' DownstreamQuotas (one API server plays every cluster) show
// SliceLeased: True while they hold their lease, False (HubUnreachable) once a member cut off
// from the hub lost it, True again after.
func TestLeastPrivilege(t *testing.T) {
	env := startMemberEnv(t)
	g := NewWithT(t)
	ctx := t.Context()
	applyFile(t, env, "config/hub/hub_role.yaml")
	for _, c := range []string{"a", "b"} {
		applyFile(t, env, "config/samples/hub_member_rbac.yaml", "eu-1", c)
	}

	gq := &apportionv1.GlobalQuota{
		ObjectMeta: metav1.ObjectMeta{Namespace: "partners", Name: "partner"},
		Spec: apportionv1.GlobalQuotaSpec{
			MaxInFlight: global,
			Members:     []apportionv1.GlobalMember{{Name: "a", ReservedSlice: 3}, {Name: "b", ReservedSlice: 2}},
			Lease:       apportionv1.SliceLease{Duration: &metav1.Duration{Duration: lease}, ClockMargin: &metav1.Duration{Duration: margin}},
		},
	}
	g.Expect(env.Client.Create(ctx, gq)).To(Succeed())
	stopHub := startHubAs(t, env, as(env, hubManagerSA))
	defer stopHub()

	var cutB atomic.Bool
	members := map[string]*Member{}
	hubs := map[string]client.Client{}
	for _, c := range []string{"a", "b"} {
		cfg := as(env, "system:serviceaccount:partners:apportion-member-"+c)
		if c == "b" {
			cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { return cutTransport{rt: rt, cut: &cutB} }
		}
		hc, err := client.New(cfg, client.Options{Scheme: env.Scheme})
		g.Expect(err).NotTo(HaveOccurred())
		hubs[c] = hc
		dq := builders.MakeDownstreamQuota("partner-"+c, "app").Limit(100).Target(apportionv1.KindDeployment, "app").Obj()
		dq.Spec.Global = &apportionv1.GlobalRef{Hub: "hub", Namespace: "partners", Name: "partner", Cluster: c}
		g.Expect(env.Client.Create(ctx, dq)).To(Succeed())
		m := &Member{Hub: hc, Local: env.Client, Clock: clock.RealClock{}, Quota: client.ObjectKeyFromObject(dq), Ref: *dq.Spec.Global, Drain: drain}
		m.Inner = func() (int64, bool) { lim, _ := m.Limit(); return lim, true }
		members[c] = m
		go func() { _ = m.Start(ctx) }()
	}
	leased := func(c string) *metav1.Condition {
		var dq apportionv1.DownstreamQuota
		g.Expect(env.Client.Get(ctx, types.NamespacedName{Namespace: "app", Name: "partner-" + c}, &dq)).To(Succeed())
		return findCondition(dq.Status.Conditions, apportionv1.ConditionSliceLeased)
	}

	t.Log("the hub, with config/hub's rights only, grants the whole limit; the members acknowledge")
	start := time.Now()
	g.Eventually(func(g Gomega) {
		a, _ := members["a"].Limit()
		b, _ := members["b"].Limit()
		g.Expect(a + b).To(BeNumerically("==", global))
		var got apportionv1.GlobalQuota
		g.Expect(env.Client.Get(ctx, client.ObjectKeyFromObject(gq), &got)).To(Succeed())
		g.Expect(got.Finalizers).To(ContainElement(Finalizer))
		c := findCondition(got.Status.Conditions, apportionv1.ConditionReady)
		g.Expect(c).NotTo(BeNil())
		g.Expect(c.Status).To(Equal(metav1.ConditionTrue), c.Message)
	}, 30*time.Second, 20*time.Millisecond).Should(Succeed())
	t.Logf("granted and acknowledged after %v", time.Since(start).Round(time.Millisecond))
	for _, c := range []string{"a", "b"} {
		g.Eventually(func(g Gomega) {
			cond := leased(c)
			g.Expect(cond).NotTo(BeNil())
			g.Expect(cond.Status).To(Equal(metav1.ConditionTrue))
			g.Expect(cond.Reason).To(Equal(apportionv1.ReasonLeaseHeld))
			g.Expect(cond.Message).To(ContainSubstring("leased until"))
		}, 10*time.Second, 20*time.Millisecond).Should(Succeed())
		t.Logf("member %s: %s", c, leased(c).Message)
	}

	t.Log("a member may read its own slice and write its status, and nothing of the other member's")
	var own, other apportionv1.ClusterSlice
	g.Expect(hubs["b"].Get(ctx, types.NamespacedName{Namespace: "partners", Name: SliceName("partner", "b")}, &own)).To(Succeed())
	g.Expect(env.Client.Get(ctx, types.NamespacedName{Namespace: "partners", Name: SliceName("partner", "a")}, &other)).To(Succeed())
	other.Status.Demand = 1000
	for what, err := range map[string]error{
		"write a's status": hubs["b"].Status().Update(ctx, other.DeepCopy()),
		"read a's slice":   hubs["b"].Get(ctx, client.ObjectKeyFromObject(&other), &apportionv1.ClusterSlice{}),
		"write its spec":   hubs["b"].Update(ctx, own.DeepCopy()),
		"delete its slice": hubs["b"].Delete(ctx, own.DeepCopy()),
		"read the quota":   hubs["b"].Get(ctx, client.ObjectKeyFromObject(gq), &apportionv1.GlobalQuota{}),
		"create a slice": hubs["b"].Create(ctx, &apportionv1.ClusterSlice{ObjectMeta: metav1.ObjectMeta{Namespace: "partners", Name: "partner-c"},
			Spec: apportionv1.ClusterSliceSpec{GlobalQuota: "partner", Cluster: "c", LeaseDuration: metav1.Duration{Duration: lease}}}),
	} {
		g.Expect(apierrors.IsForbidden(err)).To(BeTrue(), "b could %s: %v", what, err)
	}

	t.Log("b is cut off from the hub: its lease ends, its quota says so; back, it leases again")
	cutB.Store(true)
	cutAt := time.Now()
	g.Eventually(func(g Gomega) {
		cond := leased("b")
		g.Expect(cond).NotTo(BeNil())
		g.Expect(cond.Status).To(Equal(metav1.ConditionFalse))
		g.Expect(cond.Reason).To(Equal(apportionv1.ReasonHubUnreachable))
	}, 10*time.Second, 20*time.Millisecond).Should(Succeed())
	t.Logf("b shown off its lease %v after the cut: %s", time.Since(cutAt).Round(time.Millisecond), leased("b").Message)
	lim, held := members["b"].Limit()
	g.Expect(held).To(BeFalse())
	g.Expect(lim).To(BeNumerically("<=", 2))
	cutB.Store(false)
	g.Eventually(func(g Gomega) {
		cond := leased("b")
		g.Expect(cond).NotTo(BeNil())
		g.Expect(cond.Status).To(Equal(metav1.ConditionTrue), cond.Message)
	}, 10*time.Second, 20*time.Millisecond).Should(Succeed())

	t.Log("the quota is deleted: the hub removes the slices and its finalizer with its rights")
	g.Expect(env.Client.Delete(ctx, gq)).To(Succeed())
	g.Eventually(func() bool {
		return apierrors.IsNotFound(env.Client.Get(ctx, client.ObjectKeyFromObject(gq), &apportionv1.GlobalQuota{}))
	}, 30*time.Second, 20*time.Millisecond).Should(BeTrue())
	var left apportionv1.ClusterSliceList
	g.Expect(env.Client.List(ctx, &left, client.InNamespace("partners"))).To(Succeed())
	g.Expect(left.Items).To(BeEmpty())
}
