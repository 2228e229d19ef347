package e2e

import (
	"context"
	"io"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/clientcmd"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/hubsync"
	"github.com/apportion/apportion/test/e2e/harness"
)

// TestSeveralClusters runs one GlobalQuota over two clusters with the real binaries (issue #33,
// docs/protocol.md §16): the package's control plane is the hub and member "a" (its manager runs
// --hub), a second control plane is member "b"; each runs its own manager, workload, agents and
// load, and both call one test downstream whose limit is the global one. Member b reaches the hub
// through a TCP proxy the test can cut. Each cluster's monitor samples its agents at 25 Hz; the
// test sums the two (harness.SumAcross: at every sample instant of either, each cluster's
// bracketing samples and its largest within harness.AcrossWindow after it) and requires Σ ≤ global at every sample, and the judge's peak ≤ global with no 429. Then: a
// scales out while b scales in (the slice moves; the time until a's agents hold it is printed),
// and b is cut off from the hub for longer than its lease (it must fall to its reserved slice).
func TestSeveralClusters(t *testing.T) {
	const (
		global   = 40
		reserved = 4
		lease    = 3 * time.Second
	)
	if !full && os.Getenv("E2E_SEVERAL_CLUSTERS") != "1" {
		// About 75 s and a second control plane: the full form (E2E_FULL=1) only, or on demand.
		t.Skip("set E2E_SEVERAL_CLUSTERS=1 (or E2E_FULL=1) to run the several-clusters scenario")
	}
	e := env(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	start := time.Now()
	logf := func(format string, args ...any) {
		t.Logf("%7.3fs "+format, append([]any{time.Since(start).Seconds()}, args...)...)
	}

	// Member b's control plane.
	dirB := filepath.Join(e.Dir, "member-b")
	if err := os.MkdirAll(dirB, 0o755); err != nil {
		t.Fatal(err)
	}
	cpB, err := harness.StartControlPlane(dirB)
	if err != nil {
		t.Fatalf("member b's control plane: %v", err)
	}
	t.Cleanup(func() { _ = cpB.Stop() })
	envB := &harness.Env{CP: cpB, Bin: e.Bin, IPs: e.IPs, Dir: dirB}

	// The hub: the GlobalQuota, and a kubeconfig Secret in each manager's namespace (b's through
	// the proxy).
	hubURL, err := url.Parse(e.CP.Config.Host)
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := startCutProxy(hubURL.Host)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	const hubNS = "partners"
	if err := e.CP.CreateNamespace(ctx, hubNS); err != nil {
		t.Fatal(err)
	}
	gq := &apportionv1.GlobalQuota{
		ObjectMeta: metav1.ObjectMeta{Namespace: hubNS, Name: "logistics"},
		Spec: apportionv1.GlobalQuotaSpec{
			MaxInFlight: global,
			Members:     []apportionv1.GlobalMember{{Name: "a", ReservedSlice: reserved}, {Name: "b", ReservedSlice: reserved}},
			Lease:       apportionv1.SliceLease{Duration: &metav1.Duration{Duration: lease}, ClockMargin: &metav1.Duration{Duration: time.Second}},
			Sharing:     &apportionv1.GlobalSharing{Policy: apportionv1.SharingDemandAware},
		},
	}
	if err := e.CP.Client.Create(ctx, gq); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.CP.Client.Delete(context.Background(), gq) })
	for _, m := range []struct {
		cp   *harness.ControlPlane
		host string
	}{{e.CP, hubURL.Host}, {cpB, proxy.Addr()}} {
		kc, err := kubeconfigVia(e.CP.Kubeconfig, hubURL.Scheme+"://"+m.host)
		if err != nil {
			t.Fatal(err)
		}
		sec := &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Namespace: "apportion-system", Name: "hub", Labels: map[string]string{"apportion.io/hub": "true"}},
			Data:       map[string][]byte{hubsync.HubKubeconfigKey: kc},
		}
		if err := m.cp.Client.Create(ctx, sec); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = m.cp.Client.Delete(context.Background(), sec) })
	}

	ds, err := harness.StartDownstream(global, 100*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ds.Close() })
	cfgFor := func(cluster string) harness.ScenarioConfig {
		dq := harness.NewQuota(harness.QuotaConfig{Name: "logistics", Limit: global, FactorPercent: apportionv1.DefaultSafetyFactorPercent,
			Target: "gateway", AcquireTimeout: 200 * time.Millisecond, RequestTimeout: time.Second})
		dq.Spec.Global = &apportionv1.GlobalRef{Hub: "hub", Namespace: hubNS, Name: gq.Name, Cluster: cluster}
		return harness.ScenarioConfig{
			Namespace: "e2e-several-" + cluster, Limit: global, Replicas: 4, MinReplicas: 1, MaxReplicas: 8,
			QuotaObject: dq, Upstream: ds, KeepHistory: true, AllNamespaces: true, WorkersPerAgent: 6,
			Logf: func(format string, args ...any) { logf(cluster+": "+format, args...) },
		}
	}
	cfgA := cfgFor("a")
	cfgA.ManagerArgs = []string{"--hub"}
	sa, err := e.NewScenario(ctx, cfgA)
	if err != nil {
		t.Fatalf("member a: %v", err)
	}
	t.Cleanup(func() { sa.Close() })
	sb, err := envB.NewScenario(ctx, cfgFor("b"))
	if err != nil {
		t.Fatalf("member b: %v", err)
	}
	t.Cleanup(func() { sb.Close() })
	if t.Failed() {
		return
	}
	// The verdict — each cluster's monitor, the two summed, and the judge — also when a step
	// below fails (it runs before the scenarios' cleanups).
	defer func() {
		la, lb := sa.Load.Stop(), sb.Load.Stop()
		sta, stb := sa.Monitor.Stop(), sb.Monitor.Stop()
		sum := harness.SumAcross(map[string][]harness.Sample{"a": sa.Monitor.Samples(), "b": sb.Monitor.Samples()}, harness.AcrossWindow(25), global)
		dsStats := ds.Stats()
		t.Logf("several clusters in %s: Σ over both clusters' agents ≤ %d: %s; judge %+v\na: %s\nb: %s\nload a: %s\nload b: %s",
			time.Since(start).Round(time.Millisecond), global, sum, dsStats, sta, stb, la, lb)
		if sum.N < 100 {
			t.Errorf("only %d summed instants", sum.N)
		}
		if sum.Over > 0 {
			t.Errorf("Σ permits over both clusters exceeded the global limit %d at %d instants (worst %d: %s)", global, sum.Over, sum.Worst, sum.FirstOver)
		}
		if sta.PermitViolations+stb.PermitViolations > 0 || sta.InFlightViolations+stb.InFlightViolations > 0 {
			t.Errorf("a cluster's own monitor saw violations: a %s; b %s", sta, stb)
		}
		if sta.Downstream.TooMany429 > 0 || la.TooMany429 > 0 || lb.TooMany429 > 0 {
			t.Errorf("the downstream answered 429: judge %+v, load a %s, load b %s", dsStats, la, lb)
		}
	}()
	sliceOf := func(cluster string) apportionv1.ClusterSlice {
		var cs apportionv1.ClusterSlice
		_ = e.CP.Client.Get(ctx, types.NamespacedName{Namespace: hubNS, Name: hubsync.SliceName(gq.Name, cluster)}, &cs)
		return cs
	}
	held := func(s *harness.Scenario) int32 {
		cur, _ := s.Monitor.Current()
		return cur.SumPermits
	}
	waitFor := func(what string, timeout time.Duration, ok func() bool) time.Duration {
		t.Helper()
		begin := time.Now()
		for !ok() {
			if time.Since(begin) > timeout {
				t.Fatalf("%s: not within %v (a: slice %+v holds %d; b: slice %+v holds %d)", what, timeout,
					sliceOf("a").Spec, held(sa), sliceOf("b").Spec, held(sb))
			}
			time.Sleep(50 * time.Millisecond)
		}
		took := time.Since(begin)
		logf("%s after %.2fs (a: slice %d holds %d; b: slice %d holds %d)", what, took.Seconds(),
			sliceOf("a").Spec.Slice, held(sa), sliceOf("b").Spec.Slice, held(sb))
		return took
	}

	// Both members granted, and their agents holding their slices' permits.
	waitFor("both members hold a slice", time.Minute, func() bool {
		return sliceOf("a").Spec.Slice > reserved && sliceOf("b").Spec.Slice > reserved && held(sa) > 0 && held(sb) > 0
	})
	time.Sleep(5 * time.Second)

	// Skewed demand: a scales out to 8 pods, b in to 1; the hub moves b's slice to a.
	before := sliceOf("a").Spec.Slice
	go func() { _ = sb.Workload.ScaleTo(ctx, 1, harness.ScaleOptions{}) }()
	if err := sa.Workload.ScaleTo(ctx, 8, harness.ScaleOptions{}); err != nil {
		t.Fatal(err)
	}
	moved := waitFor("a's slice raised", 90*time.Second, func() bool { return sliceOf("a").Spec.Slice > before })
	usable := waitFor("a's agents hold the raised slice", 30*time.Second, func() bool {
		return held(sa) >= sliceOf("a").Spec.Slice*apportionv1.DefaultSafetyFactorPercent/100-1 && held(sa) > before*apportionv1.DefaultSafetyFactorPercent/100
	})
	logf("a moved slice: granted %.2fs after the scale, usable by a's agents %.2fs later", moved.Seconds(), usable.Seconds())
	time.Sleep(3 * time.Second)

	// Partition b from the hub for longer than its lease: it falls to its reserved slice.
	proxy.Cut(true)
	cut := time.Now()
	fell := waitFor("b cut off falls to its reserved slice", 30*time.Second, func() bool {
		return held(sb) <= reserved*apportionv1.DefaultSafetyFactorPercent/100
	})
	logf("b partitioned: at its reserved slice %.2fs after the cut (lease %v)", fell.Seconds(), lease)
	time.Sleep(max(0, 2*lease-time.Since(cut)))
	proxy.Cut(false)
	waitFor("b reads the hub again", 30*time.Second, func() bool {
		return held(sb) > reserved*apportionv1.DefaultSafetyFactorPercent/100
	})
	time.Sleep(2 * time.Second)
}

// kubeconfigVia is the kubeconfig at path with every cluster's server set to server.
func kubeconfigVia(path, server string) ([]byte, error) {
	cfg, err := clientcmd.LoadFromFile(path)
	if err != nil {
		return nil, err
	}
	for _, c := range cfg.Clusters {
		c.Server = server
	}
	return clientcmd.Write(*cfg)
}

// cutProxy forwards TCP connections on loopback to target; cut, it closes every connection and
// refuses new ones: a partition between a member and the hub.
type cutProxy struct {
	ln     net.Listener
	target string
	cut    atomic.Bool
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
}

func startCutProxy(target string) (*cutProxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &cutProxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	go p.serve()
	return p, nil
}

func (p *cutProxy) Addr() string { return p.ln.Addr().String() }

func (p *cutProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if p.cut.Load() {
			_ = c.Close()
			continue
		}
		up, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			_ = c.Close()
			continue
		}
		p.track(c, up)
		go func() { _, _ = io.Copy(up, c); _ = up.Close() }()
		go func() { _, _ = io.Copy(c, up); _ = c.Close() }()
	}
}

func (p *cutProxy) track(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
}

// Cut partitions (true) or heals (false).
func (p *cutProxy) Cut(cut bool) {
	p.cut.Store(cut)
	if !cut {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		_ = c.Close()
	}
	p.conns = map[net.Conn]struct{}{}
}

func (p *cutProxy) Close() {
	_ = p.ln.Close()
	p.Cut(true)
}
