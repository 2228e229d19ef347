package hubsync

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/config"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/apportion/demand"
	"github.com/apportion/apportion/internal/testing/builders"
	"github.com/apportion/apportion/internal/testing/testenv"
)

// The test runs two real control planes (API server + etcd each): the hub, which is also the
// member cluster "a", and the member cluster "b". The hub's reconciler runs in a controller-
// runtime manager on the hub; each member's Member runs against the hub as that member and
// against its own cluster. What a member's pods use is the worst docs/protocol.md §16's Lemma H1
// allows (innerLedger): it rises with the member's local limit at once and falls to a lowered
// one only innerDrain later. A monitor sums both members at 200 Hz.

const (
	global     = 20
	lease      = time.Second
	margin     = 200 * time.Millisecond
	drain      = 700 * time.Millisecond
	innerDrain = 600 * time.Millisecond
)

// innerLedger is a member's own ledger, at its worst.
type innerLedger struct {
	m           *Member
	mu          sync.Mutex
	counted     int64
	lowerSince  time.Time
	lowerTarget int64
}

func (l *innerLedger) follow(now time.Time) int64 {
	lim, _ := l.m.Limit()
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case lim >= l.counted:
		l.counted, l.lowerSince = lim, time.Time{}
	case l.lowerSince.IsZero() || lim < l.lowerTarget:
		l.lowerSince, l.lowerTarget = now, lim
	case now.Sub(l.lowerSince) >= innerDrain:
		l.counted, l.lowerSince = lim, time.Time{}
	}
	return l.counted
}

func (l *innerLedger) Inner() (int64, bool) {
	lim, _ := l.m.Limit()
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.counted, l.counted <= lim
}

// cutTransport fails every request while cut: a partition between a member and the hub.
type cutTransport struct {
	rt  http.RoundTripper
	cut *atomic.Bool
}

func (c cutTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if c.cut.Load() {
		return nil, errors.New("partitioned from the hub")
	}
	return c.rt.RoundTrip(r)
}

func startHub(t *testing.T, env *testenv.Env) context.CancelFunc {
	t.Helper()
	return startHubAs(t, env, env.Config)
}

// startHubAs starts a hub manager on env that reaches the API server with cfg.
func startHubAs(t *testing.T, env *testenv.Env, cfg *rest.Config) context.CancelFunc {
	t.Helper()
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{
		Scheme: env.Scheme, Metrics: metricsserver.Options{BindAddress: "0"}, HealthProbeBindAddress: "0",
		// A restarted hub manager registers its controller again, in the same process.
		Controller: config.Controller{SkipNameValidation: ptr.To(true)},
	})
	if err != nil {
		t.Fatal(err)
	}
	// No damping: the test moves whole slices in one round (the dampers are internal/hub's and
	// internal/apportion/demand's, tested there).
	undamped := func(budget int64) demand.Damping { return demand.Damping{MaxMove: max(budget, 1)} }
	if err := (&HubReconciler{Client: mgr.GetClient(), Live: mgr.GetAPIReader(), Clock: clock.RealClock{}, Damping: undamped}).SetupWithManager(mgr); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := mgr.Start(ctx); err != nil {
			t.Errorf("hub manager: %v", err)
		}
	}()
	return func() { cancel(); <-done }
}

func TestTwoClusters(t *testing.T) {
	testenv.SkipWithoutAssets(t)
	ctrl.SetLogger(logr.Discard())
	g := NewWithT(t)
	hubEnv, err := testenv.Start(testenv.Options{})
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = hubEnv.Stop() })
	memberEnv, err := testenv.Start(testenv.Options{})
	g.Expect(err).NotTo(HaveOccurred())
	t.Cleanup(func() { _ = memberEnv.Stop() })
	ctx := t.Context()

	for _, e := range []*testenv.Env{hubEnv, memberEnv} {
		for _, ns := range []string{"partners", "app"} {
			g.Expect(client.IgnoreAlreadyExists(e.Client.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}))).To(Succeed())
		}
	}
	gq := &apportionv1.GlobalQuota{
		ObjectMeta: metav1.ObjectMeta{Namespace: "partners", Name: "partner"},
		Spec: apportionv1.GlobalQuotaSpec{
			MaxInFlight: global,
			Members:     []apportionv1.GlobalMember{{Name: "a", ReservedSlice: 2}, {Name: "b"}},
			Lease:       apportionv1.SliceLease{Duration: &metav1.Duration{Duration: lease}, ClockMargin: &metav1.Duration{Duration: margin}},
			Sharing:     &apportionv1.GlobalSharing{Policy: apportionv1.SharingDemandAware},
		},
	}
	g.Expect(hubEnv.Client.Create(ctx, gq)).To(Succeed())
	stopHub := startHub(t, hubEnv)
	defer func() { stopHub() }()

	// The members: a in the hub cluster, b in its own. b reaches the hub as the ServiceAccount
	// of config/samples/hub_member_rbac.yaml (for cluster b), through a transport the test can cut.
	applySample(t, hubEnv, "eu-1", "b")
	var cutB atomic.Bool
	bHubCfg := rest.CopyConfig(hubEnv.Config)
	bHubCfg.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:partners:apportion-member-b"}
	bHubCfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { return cutTransport{rt: rt, cut: &cutB} }
	bHub, err := client.New(bHubCfg, client.Options{Scheme: hubEnv.Scheme})
	g.Expect(err).NotTo(HaveOccurred())
	var demandA, demandB atomic.Int64
	demandA.Store(10)
	demandB.Store(10)
	type member struct {
		m     *Member
		inner *innerLedger
		local client.Client
	}
	members := map[string]*member{}
	for _, spec := range []struct {
		name       string
		hub, local client.Client
		demand     *atomic.Int64
	}{{"a", hubEnv.Client, hubEnv.Client, &demandA}, {"b", bHub, memberEnv.Client, &demandB}} {
		dq := builders.MakeDownstreamQuota("partner", "app").Limit(100).Target(apportionv1.KindDeployment, "app").Obj()
		dq.Spec.Global = &apportionv1.GlobalRef{Hub: "hub-kubeconfig", Namespace: "partners", Name: "partner", Cluster: spec.name}
		g.Expect(spec.local.Create(ctx, dq)).To(Succeed())
		m := &Member{
			Hub: spec.hub, Local: spec.local, Clock: clock.RealClock{},
			Quota: types.NamespacedName{Namespace: "app", Name: "partner"}, Ref: *dq.Spec.Global,
			Drain: drain, Demand: spec.demand.Load,
		}
		in := &innerLedger{m: m}
		m.Inner = in.Inner
		members[spec.name] = &member{m: m, inner: in, local: spec.local}
		go func() { _ = m.Start(ctx) }()
	}

	// The monitor: Σ of what both members' pods may use, at 200 Hz.
	var worst, violations atomic.Int64
	var samples, usedSum atomic.Int64
	monCtx, stopMon := context.WithCancel(ctx)
	monDone := make(chan struct{})
	go func() {
		defer close(monDone)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-monCtx.Done():
				return
			case now := <-tick.C:
				sum := members["a"].inner.follow(now) + members["b"].inner.follow(now)
				if sum > global {
					violations.Add(1)
					t.Errorf("at %s: Σ use %d > %d", now.Format(time.StampMilli), sum, global)
				}
				if sum > worst.Load() {
					worst.Store(sum)
				}
				samples.Add(1)
				usedSum.Add(sum)
			}
		}
	}()
	limits := func() (int64, int64) {
		a, _ := members["a"].m.Limit()
		b, _ := members["b"].m.Limit()
		return a, b
	}
	acknowledged := func(g Gomega) {
		var got apportionv1.GlobalQuota
		g.Expect(hubEnv.Client.Get(ctx, client.ObjectKeyFromObject(gq), &got)).To(Succeed())
		c := findCondition(got.Status.Conditions, apportionv1.ConditionReady)
		g.Expect(c).NotTo(BeNil())
		g.Expect(c.Status).To(Equal(metav1.ConditionTrue), c.Message)
	}

	t.Log("the members report their drain bound and get their slices")
	start := time.Now()
	g.Eventually(func(g Gomega) {
		a, b := limits()
		g.Expect(a + b).To(BeNumerically("==", global))
		g.Expect(a).To(BeNumerically(">=", 2))
		acknowledged(g)
	}, 20*time.Second, 20*time.Millisecond).Should(Succeed())
	a, b := limits()
	t.Logf("first slices usable after %v: a %d, b %d", time.Since(start).Round(time.Millisecond), a, b)

	t.Log("b may read its ClusterSlice and write its status on the hub, nothing else")
	var own, other apportionv1.ClusterSlice
	g.Expect(bHub.Get(ctx, types.NamespacedName{Namespace: "partners", Name: SliceName("partner", "b")}, &own)).To(Succeed())
	for name, err := range map[string]error{
		"read a's slice":     bHub.Get(ctx, types.NamespacedName{Namespace: "partners", Name: SliceName("partner", "a")}, &other),
		"list the slices":    bHub.List(ctx, &apportionv1.ClusterSliceList{}, client.InNamespace("partners")),
		"read the quota":     bHub.Get(ctx, client.ObjectKeyFromObject(gq), &apportionv1.GlobalQuota{}),
		"write its own spec": bHub.Update(ctx, own.DeepCopy()),
	} {
		g.Expect(apierrors.IsForbidden(err)).To(BeTrue(), "b could %s: %v", name, err)
	}

	t.Log("idle: the members renew by reading; nothing is written on the hub, and each member's quota only to move its leaseUntil")
	hubRVs := func() []string {
		var out []string
		var gq2 apportionv1.GlobalQuota
		g.Expect(hubEnv.Client.Get(ctx, client.ObjectKeyFromObject(gq), &gq2)).To(Succeed())
		out = append(out, gq2.ResourceVersion)
		for _, c := range []string{"a", "b"} {
			var cs apportionv1.ClusterSlice
			g.Expect(hubEnv.Client.Get(ctx, types.NamespacedName{Namespace: "partners", Name: SliceName("partner", c)}, &cs)).To(Succeed())
			out = append(out, cs.ResourceVersion)
		}
		return out
	}
	// The member's writes of its quota, counted from a watch: at most one per two thirds of a
	// lease (the leaseUntil moved half a lease), so at most 5 over 3 leases (every read, 9).
	writes := map[string]*atomic.Int64{}
	for _, c := range []string{"a", "b"} {
		writes[c] = &atomic.Int64{}
		env := map[string]*testenv.Env{"a": hubEnv, "b": memberEnv}[c]
		wc, err := client.NewWithWatch(env.Config, client.Options{Scheme: env.Scheme})
		g.Expect(err).NotTo(HaveOccurred())
		w, err := wc.Watch(ctx, &apportionv1.DownstreamQuotaList{}, client.InNamespace("app"))
		g.Expect(err).NotTo(HaveOccurred())
		defer w.Stop()
		go func() {
			for ev := range w.ResultChan() {
				if ev.Type == "MODIFIED" {
					writes[c].Add(1)
				}
			}
		}()
	}
	time.Sleep(200 * time.Millisecond) // the watches' initial events
	writes["a"].Store(0)
	writes["b"].Store(0)
	before := hubRVs()
	time.Sleep(3 * lease)
	g.Expect(hubRVs()).To(Equal(before), "an idle global quota wrote on the hub")
	t.Logf("idle for 3 leases: the members wrote their quota %d and %d times (leaseUntil)", writes["a"].Load(), writes["b"].Load())
	for _, c := range []string{"a", "b"} {
		g.Expect(writes[c].Load()).To(BeNumerically("<=", 5), "member %s rewrote its quota more often than every two thirds of a lease", c)
	}
	_, heldA := members["a"].m.Limit()
	_, heldB := members["b"].m.Limit()
	g.Expect(heldA && heldB).To(BeTrue(), "a lease lapsed while the hub was reachable")

	t.Log("demand moves from a to b: b's slice grows only as a gives its share back")
	demandA.Store(2)
	demandB.Store(18)
	start = time.Now()
	g.Eventually(func(g Gomega) {
		_, b := limits()
		g.Expect(b).To(BeNumerically(">=", 16))
		acknowledged(g)
	}, 20*time.Second, 10*time.Millisecond).Should(Succeed())
	a, b = limits()
	t.Logf("a moved slice usable after %v: a %d, b %d", time.Since(start).Round(time.Millisecond), a, b)

	t.Log("b asks for little, then is partitioned from the hub for 4 leases while a asks for much")
	demandA.Store(2)
	demandB.Store(2)
	g.Eventually(func(g Gomega) {
		var cs apportionv1.ClusterSlice
		g.Expect(hubEnv.Client.Get(ctx, types.NamespacedName{Namespace: "partners", Name: SliceName("partner", "b")}, &cs)).To(Succeed())
		g.Expect(cs.Status.Demand).To(BeNumerically("==", 2))
		a, _ := limits()
		g.Expect(a).To(BeNumerically(">=", 8)) // the spare split again
		acknowledged(g)
	}, 10*time.Second, 10*time.Millisecond).Should(Succeed())
	a, b = limits()
	t.Logf("before the cut: a %d, b %d", a, b)
	cutB.Store(true)
	cutAt := time.Now()
	demandA.Store(18)
	g.Eventually(func() bool { _, held := members["b"].m.Limit(); return held }, 5*time.Second, 10*time.Millisecond).Should(BeFalse())
	lapsed := time.Since(cutAt)
	bFallback, _ := members["b"].m.Limit()
	g.Eventually(func(g Gomega) {
		a, _ := limits()
		g.Expect(a).To(BeNumerically(">=", 16))
	}, 10*time.Second, 10*time.Millisecond).Should(Succeed())
	t.Logf("b's lease ended %v after the cut (falls to %d); a got the room %v after it", lapsed.Round(time.Millisecond), bFallback, time.Since(cutAt).Round(time.Millisecond))
	time.Sleep(time.Until(cutAt.Add(4 * lease)))
	cutB.Store(false)
	g.Eventually(acknowledged, 10*time.Second, 20*time.Millisecond).Should(Succeed())

	t.Log("a second hub manager starts beside the first (a leader change), demand moves, the first stops")
	stopSecond := startHub(t, hubEnv)
	demandA.Store(10)
	demandB.Store(10)
	time.Sleep(2 * lease)
	demandA.Store(14)
	time.Sleep(2 * lease)
	stopHub()
	stopHub = stopSecond
	demandA.Store(10)
	g.Eventually(func(g Gomega) {
		a, b := limits()
		g.Expect(a).To(BeNumerically("<", 16))
		g.Expect(b).To(BeNumerically(">", 2))
		acknowledged(g)
	}, 20*time.Second, 20*time.Millisecond).Should(Succeed())

	t.Log("the GlobalQuota is deleted: it goes only once no member holds anything of it")
	g.Expect(hubEnv.Client.Delete(ctx, gq)).To(Succeed())
	deleted := time.Now()
	g.Eventually(func() bool {
		return apierrors.IsNotFound(hubEnv.Client.Get(ctx, client.ObjectKeyFromObject(gq), &apportionv1.GlobalQuota{}))
	}, 20*time.Second, 10*time.Millisecond).Should(BeTrue())
	a, b = limits()
	t.Logf("deleted after %v; a holds %d, b %d", time.Since(deleted).Round(time.Millisecond), a, b)
	g.Expect(a + b).To(BeZero())

	t.Log("created again under its name, it grants from nothing held")
	gq.ResourceVersion, gq.UID, gq.Finalizers = "", "", nil
	g.Expect(hubEnv.Client.Create(ctx, gq)).To(Succeed())
	g.Eventually(func(g Gomega) {
		a, b := limits()
		g.Expect(a + b).To(BeNumerically("==", global))
		acknowledged(g)
	}, 20*time.Second, 20*time.Millisecond).Should(Succeed())

	stopMon()
	<-monDone
	t.Logf("monitor: %d samples, Σ use at most %d of %d, %.0f %% on average, %d violations",
		samples.Load(), worst.Load(), global, 100*float64(usedSum.Load())/float64(samples.Load()*global), violations.Load())
	g.Expect(violations.Load()).To(BeZero())
}

// applySample creates config/samples/hub_member_rbac.yaml on env, for member cluster (the
// sample's is from).
func applySample(t *testing.T, env *testenv.Env, from, cluster string) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "samples", "hub_member_rbac.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(bytes.ReplaceAll(raw, []byte(from), []byte(cluster))), 4096)
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

func findCondition(cs []metav1.Condition, typ string) *metav1.Condition {
	for i := range cs {
		if cs[i].Type == typ {
			return &cs[i]
		}
	}
	return nil
}
