// Package hubscale measures what one hub costs (`make bench-hub`, issue 33 item 5): one real API
// server (envtest's kube-apiserver and etcd) as the hub cluster, the real manager binary with
// --hub against it, and N member clusters × G GlobalQuotas of simulated members. A simulated
// member is the real hubsync.Member — the code a member cluster's manager runs per quota — against
// the hub's API server as that member's ServiceAccount (impersonated, with the RBAC of
// config/samples/hub_member_rbac.yaml), with its own cluster's API replaced by an in-memory
// client and its pods by a ledger that follows the slice at once. The API server's own request
// counters (apiserver_request_total) and the resourceVersions it hands out are what the figures
// come from. Nothing here runs in `go test ./...` but TestTraffic (benchmarks only), but it
// compiles there.
package hubscale

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/go-logr/logr/funcr"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/rest"
	"k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/hubsync"
	"github.com/apportion/apportion/internal/testing/builders"
	"github.com/apportion/apportion/internal/testing/procfs"
	"github.com/apportion/apportion/test/e2e/harness"
)

const hubNS = "partners"

// config is one size: members (member clusters) × quotas (GlobalQuotas, each spanning every member).
type config struct{ members, quotas int }

func (c config) String() string { return fmt.Sprintf("%dx%d", c.members, c.quotas) }

func configs(b *testing.B) []config {
	spec := os.Getenv("HUB_CONFIGS")
	if spec == "" {
		spec = "3x1,10x10"
	}
	var out []config
	for _, s := range strings.Split(spec, ",") {
		m, q, ok := strings.Cut(strings.TrimSpace(s), "x")
		members, err1 := strconv.Atoi(m)
		quotas, err2 := strconv.Atoi(q)
		if !ok || err1 != nil || err2 != nil || members < 2 || quotas < 1 {
			b.Fatalf("HUB_CONFIGS: %q is not MEMBERSxQUOTAS with at least 2 members", s)
		}
		out = append(out, config{members, quotas})
	}
	return out
}

func envDuration(b *testing.B, name string, def time.Duration) time.Duration {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		b.Fatalf("%s: %v", name, err)
	}
	return d
}

// BenchmarkHub runs each configuration once (-benchtime=1x) and prints, per configuration: the
// time until every member holds its first grant and until every GlobalQuota is Ready (every grant
// acknowledged); while idle, the API requests per second by verb, the writes per member cluster
// per minute (goal 0), the etcd revisions written, and the hub manager's, API server's and etcd's
// CPU; then after a demand shift (in every quota the first half of the members ask for the whole
// global limit, the others for 1), the time until the first moved slice is usable and until the
// slices stop moving, and the same rates while they move; the hub manager's RSS at the end.
// Throughout, every 50 ms, Σ of each quota's members' limits is checked against its global limit
// (a violation fails the benchmark) and lapsed leases are counted.
//
// Knobs (environment): HUB_CONFIGS (default 3x1,10x10: at a 30 s lease 50x100 would want about
// 1.5 cores of API server, docs/benchmarks.md), HUB_IDLE (the idle window, default 60s),
// HUB_LEASE (the GlobalQuotas' lease duration; default the API's, 30 s: members read every third
// of it), HUB_QUIET (how long no slice may move for the shift to count as settled,
// default the lease), HUB_MIN_INTERVAL (the hub manager's --sharing-min-interval, default 0: see
// runConfig), HUB_SETUP_TIMEOUT, HUB_SHIFT_TIMEOUT, HUB_DEBUG (log the Members' failed rounds),
// HUB_KEEP (keep the work directory with the manager's log).
func BenchmarkHub(b *testing.B) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		b.Skip(harness.ErrNoAssets.Error())
	}
	ctrl.SetLogger(logr.Discard())
	bin, err := harness.Build(b.Context())
	if err != nil {
		b.Fatal(err)
	}
	var rows []result
	for _, c := range configs(b) {
		b.Run(c.String(), func(b *testing.B) {
			r := runConfig(b, bin, c)
			rows = append(rows, r)
			b.ReportMetric(r.firstMax.Seconds(), "first-grant-s")
			b.ReportMetric(r.idle.memberWritesPerMin, "member-writes/min")
			b.ReportMetric(r.idle.managerCPU*1000, "idle-mCPU")
			b.ReportMetric(0, "ns/op")
		})
	}
	fmt.Println(table(rows))
}

// window is what one measured window cost.
type window struct {
	sec                        float64
	tr                         traffic
	revisions                  int64 // etcd revisions (every write in the cluster) in the window
	objectsChanged             int   // ClusterSlices and GlobalQuotas whose resourceVersion moved
	managerCPU, apiCPU, etcCPU float64
	memberWritesPerMin         float64 // per member cluster
	loads                      string
}

type result struct {
	cfg                    config
	lease, minInterval     time.Duration
	firstP50, firstMax     time.Duration // every member holds its first grant
	ready                  time.Duration // every GlobalQuota Ready
	idle, shift            window
	moveP50, moveMax       time.Duration // first raised slice usable, per quota
	settleP50, settleMax   time.Duration // last slice change, per quota
	highShare              float64       // of the global limit held by the high-demand members at the end
	settledAll             bool
	rss, hwm               int64
	samples, lapsed, worst int64 // monitor samples; member-samples with a lapsed lease; max Σ/global ‰
}

// sim is one simulated member: the real Member, its demand and what the monitor saw of it.
type sim struct {
	m      *hubsync.Member
	demand atomic.Int64
	high   bool
}

type quota struct {
	name    string
	global  int64
	members []*sim
	// Written by the monitor only.
	firstRaise, lastChange time.Time
	highBefore             int64
	last                   []int64
}

func runConfig(b *testing.B, bin *harness.Binaries, c config) result {
	ctx, cancel := context.WithCancel(b.Context())
	defer cancel()
	dir := b.TempDir()
	if os.Getenv("HUB_KEEP") != "" {
		var err error
		if dir, err = os.MkdirTemp("", "hubscale-"+c.String()+"-"); err != nil {
			b.Fatal(err)
		}
		b.Logf("work directory %s", dir)
	}
	cp, err := harness.StartControlPlane(dir)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cp.Stop() })
	procs := procfs.Children("kube-apiserver", "etcd")
	// The manager as it is installed (dist/install.yaml: --leader-elect), with the hub role. Its
	// damped rounds are not spaced by default (HUB_MIN_INTERVAL, --sharing-min-interval): with
	// the manager's 10 s a DemandAware GlobalQuota stops after its first damped round until
	// something else writes (HubReconciler requeues for lease bounds, not for the next damped
	// round; docs/benchmarks.md, "The hub's cost").
	minInterval := envDuration(b, "HUB_MIN_INTERVAL", 0)
	mgr, err := harness.NewManager(bin, cp, dir, harness.ManagerOptions{NoWebhook: true,
		ExtraArgs: []string{"--hub", "--leader-elect", "--sharing-min-interval=" + minInterval.String()}})
	if err != nil {
		b.Fatal(err)
	}
	if err := mgr.Start(ctx); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = mgr.Stop(10 * time.Second) })
	r := result{cfg: c, lease: envDuration(b, "HUB_LEASE", 30*time.Second), minInterval: minInterval}

	if err := cp.CreateNamespace(ctx, hubNS); err != nil {
		b.Fatal(err)
	}
	clusters := make([]string, c.members)
	for i := range clusters {
		clusters[i] = fmt.Sprintf("m%03d", i)
	}
	quotas := make([]*quota, c.quotas)
	for i := range quotas {
		quotas[i] = &quota{name: fmt.Sprintf("gq-%03d", i), global: int64(10 * c.members)}
	}
	for _, cl := range clusters {
		if err := memberRBAC(ctx, cp.Client, cl, quotas); err != nil {
			b.Fatal(err)
		}
	}
	if err := parallel(ctx, len(quotas), 16, func(i int) error { return createGlobalQuota(ctx, cp.Client, quotas[i], clusters, r.lease) }); err != nil {
		b.Fatal(err)
	}

	// The members: per member cluster an in-memory API of its own holding its DownstreamQuotas;
	// per quota a Member with a hub client of its own, as hubsync.Members makes one per quota
	// from the kubeconfig Secret (client-go's default rate limits, 5/s and bursts of 10, each).
	scheme := cp.Scheme
	t0 := time.Now()
	for _, cl := range clusters {
		var dqs []client.Object
		for _, q := range quotas {
			dq := builders.MakeDownstreamQuota(q.name, "app").Limit(int32(q.global)).Target(apportionv1.KindDeployment, "app").Obj()
			dq.Spec.Global = &apportionv1.GlobalRef{Hub: "hub", Namespace: hubNS, Name: q.name, Cluster: cl}
			dqs = append(dqs, dq)
		}
		local := fake.NewClientBuilder().WithScheme(scheme).WithObjects(dqs...).WithStatusSubresource(&apportionv1.DownstreamQuota{}).Build()
		cfg := rest.CopyConfig(cp.Config)
		cfg.QPS, cfg.Burst = 0, 0
		cfg.Impersonate = rest.ImpersonationConfig{UserName: "system:serviceaccount:" + hubNS + ":apportion-member-" + cl}
		// A dialer of its own keeps client-go from sharing one transport between the member
		// clusters (it caches transports by TLS configuration): each member cluster's manager
		// has its own connections to the hub, shared by its quotas' clients.
		cfg.Dial = (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext
		httpClient, err := rest.HTTPClientFor(cfg)
		if err != nil {
			b.Fatal(err)
		}
		for _, q := range quotas {
			hc, err := client.New(cfg, client.Options{Scheme: scheme, HTTPClient: httpClient})
			if err != nil {
				b.Fatal(err)
			}
			s := &sim{}
			s.demand.Store(10) // the equal share: 10 per member
			s.m = &hubsync.Member{
				Hub: hc, Local: local, Clock: clock.RealClock{},
				Quota: types.NamespacedName{Namespace: "app", Name: q.name},
				Ref:   apportionv1.GlobalRef{Hub: "hub", Namespace: hubNS, Name: q.name, Cluster: cl},
				// About a real member's with the default timings (hubsync.DrainBound: the
				// engine's lease window, its reaction and the request timeout).
				Drain:  30 * time.Second,
				Demand: s.demand.Load,
			}
			// Its pods follow the local limit at once and every push is acknowledged: the
			// member acknowledges a grant as soon as it recorded it.
			m := s.m
			s.m.Inner = func() (int64, bool) { lim, _ := m.Limit(); return lim, true }
			q.members = append(q.members, s)
		}
	}
	mctx := ctx
	if os.Getenv("HUB_DEBUG") != "" {
		// The Members' failed rounds (logged at V(1)).
		mctx = logf.IntoContext(ctx, funcr.New(func(prefix, args string) { b.Logf("%s %s", prefix, args) }, funcr.Options{Verbosity: 1}))
	}
	var wg sync.WaitGroup
	for _, q := range quotas {
		for _, s := range q.members {
			wg.Go(func() { _ = s.m.Start(mctx) })
		}
	}
	defer func() { cancel(); wg.Wait() }()

	// Every member's first grant, then every quota Ready.
	first := make([]time.Duration, 0, c.members*c.quotas)
	held := map[*sim]bool{}
	setupTimeout := envDuration(b, "HUB_SETUP_TIMEOUT", 10*time.Minute)
	nextSay := time.Now().Add(30 * time.Second)
	for len(held) < c.members*c.quotas {
		if time.Now().After(nextSay) {
			b.Logf("%s: %d of %d members hold a grant after %s", c, len(held), c.members*c.quotas, time.Since(t0).Round(time.Second))
			nextSay = nextSay.Add(30 * time.Second)
		}
		if time.Since(t0) > setupTimeout {
			dumpHub(ctx, b, cp.Client)
			b.Fatalf("%d of %d members hold no grant after %s", c.members*c.quotas-len(held), c.members*c.quotas, setupTimeout)
		}
		for _, q := range quotas {
			for _, s := range q.members {
				if held[s] {
					continue
				}
				if _, ok := s.m.Limit(); ok && s.m.Grant().Seq > 0 {
					held[s] = true
					first = append(first, time.Since(t0))
				}
			}
		}
		sleep(ctx, 20*time.Millisecond)
	}
	slices.Sort(first)
	r.firstP50, r.firstMax = pct(first, 0.5), pct(first, 1)
	b.Logf("%s: every member holds its first grant %s after the start (p50 %s)", c, r.firstMax, r.firstP50)
	for {
		n, err := readyQuotas(ctx, cp.Client)
		if err == nil && n == c.quotas {
			break
		}
		if time.Since(t0) > setupTimeout {
			b.Fatalf("%d of %d GlobalQuotas Ready after %s (%v)", n, c.quotas, setupTimeout, err)
		}
		sleep(ctx, 200*time.Millisecond)
	}
	r.ready = time.Since(t0).Round(time.Millisecond)
	b.Logf("%s: every GlobalQuota Ready %s after the start", c, r.ready)

	mon := startMonitor(ctx, quotas)
	defer mon.stop()

	// Idle: two read rounds to settle, then the window.
	sleep(ctx, 2*r.lease/3+5*time.Second)
	idle := envDuration(b, "HUB_IDLE", time.Minute)
	s0, err := take(ctx, cp, mgr.Pid(), procs, false)
	if err != nil {
		b.Fatal(err)
	}
	sleep(ctx, idle)
	s1, err := take(ctx, cp, mgr.Pid(), procs, true)
	if err != nil {
		b.Fatal(err)
	}
	r.idle = s1.sub(s0, c.members)
	b.Logf("%s idle %s: %s", c, idle, r.idle)

	// The demand shift: in every quota the first half of the members ask for the whole global
	// limit, the others for 1.
	mon.mark(func(q *quota) {
		q.highBefore, q.firstRaise, q.lastChange = 0, time.Time{}, time.Time{}
		for i, s := range q.members {
			s.high = i < max(1, len(q.members)/2)
			if s.high {
				lim, _ := s.m.Limit()
				q.highBefore += lim
			}
		}
	})
	quiet := envDuration(b, "HUB_QUIET", r.lease)
	s0, err = take(ctx, cp, mgr.Pid(), procs, false)
	if err != nil {
		b.Fatal(err)
	}
	shiftAt := time.Now()
	for _, q := range quotas {
		for _, s := range q.members {
			if s.high {
				s.demand.Store(q.global)
			} else {
				s.demand.Store(1)
			}
		}
	}
	shiftTimeout := envDuration(b, "HUB_SHIFT_TIMEOUT", 5*time.Minute)
	for {
		sleep(ctx, time.Second)
		last := mon.lastChange()
		if !last.IsZero() && time.Since(last) >= quiet {
			r.settledAll = true
			break
		}
		if time.Since(shiftAt) > shiftTimeout {
			b.Logf("%s: the slices still move %s after the shift", c, shiftTimeout)
			break
		}
	}
	s1, err = take(ctx, cp, mgr.Pid(), procs, true)
	if err != nil {
		b.Fatal(err)
	}
	r.shift = s1.sub(s0, c.members)
	var moves, settles []time.Duration
	var share float64
	mon.mark(func(q *quota) {
		var high int64
		for _, s := range q.members {
			if s.high {
				lim, _ := s.m.Limit()
				high += lim
			}
		}
		share += float64(high) / float64(q.global) / float64(len(quotas))
		if !q.firstRaise.IsZero() {
			moves = append(moves, q.firstRaise.Sub(shiftAt))
		}
		if !q.lastChange.IsZero() {
			settles = append(settles, q.lastChange.Sub(shiftAt))
		}
	})
	slices.Sort(moves)
	slices.Sort(settles)
	if len(moves) < len(quotas) {
		b.Errorf("%s: in %d of %d quotas no high-demand member's slice was raised", c, len(quotas)-len(moves), len(quotas))
	}
	r.moveP50, r.moveMax, r.settleP50, r.settleMax, r.highShare = pct(moves, 0.5), pct(moves, 1), pct(settles, 0.5), pct(settles, 1), share
	b.Logf("%s shift: first raise usable p50 %s max %s; settled p50 %s max %s; high-demand members hold %.0f %% of the global limit; %s",
		c, r.moveP50, r.moveMax, r.settleP50, r.settleMax, 100*share, r.shift)

	mon.stop()
	r.samples, r.lapsed, r.worst = mon.samples.Load(), mon.lapsed.Load(), mon.worst.Load()
	if v := mon.violations.Load(); v > 0 {
		b.Errorf("%s: Σ of a quota's members' limits above its global limit in %d samples", c, v)
	}
	r.rss, r.hwm, _ = procfs.Mem(mgr.Pid())
	if !mgr.Running() {
		b.Fatalf("the hub manager exited: %v (see %s)", mgr.ExitErr(), mgr.LogPath)
	}
	return r
}

// memberRBAC gives member cluster cl what config/samples/hub_member_rbac.yaml gives one member,
// for every quota: get its ClusterSlices, update their status.
func memberRBAC(ctx context.Context, c client.Client, cl string, quotas []*quota) error {
	var names []string
	for _, q := range quotas {
		names = append(names, hubsync.SliceName(q.name, cl))
	}
	name := "apportion-member-" + cl
	role := &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Namespace: hubNS, Name: name},
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{apportionv1.GroupVersion.Group}, Resources: []string{"clusterslices"}, ResourceNames: names, Verbs: []string{"get"}},
			{APIGroups: []string{apportionv1.GroupVersion.Group}, Resources: []string{"clusterslices/status"}, ResourceNames: names, Verbs: []string{"update"}},
		},
	}
	if err := c.Create(ctx, role); err != nil {
		return err
	}
	return c.Create(ctx, &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Namespace: hubNS, Name: name},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: name},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: hubNS, Name: name}},
	})
}

// createGlobalQuota creates q over every cluster: global 10 per member, DemandAware, no reserved
// slice.
func createGlobalQuota(ctx context.Context, c client.Client, q *quota, clusters []string, lease time.Duration) error {
	gq := &apportionv1.GlobalQuota{
		ObjectMeta: metav1.ObjectMeta{Namespace: hubNS, Name: q.name},
		Spec: apportionv1.GlobalQuotaSpec{
			MaxInFlight: int32(q.global),
			Lease:       apportionv1.SliceLease{Duration: &metav1.Duration{Duration: lease}},
			Sharing:     &apportionv1.GlobalSharing{Policy: apportionv1.SharingDemandAware},
		},
	}
	for _, cl := range clusters {
		gq.Spec.Members = append(gq.Spec.Members, apportionv1.GlobalMember{Name: cl})
	}
	return c.Create(ctx, gq)
}

func readyQuotas(ctx context.Context, c client.Client) (int, error) {
	var list apportionv1.GlobalQuotaList
	if err := c.List(ctx, &list, client.InNamespace(hubNS)); err != nil {
		return 0, err
	}
	n := 0
	for _, gq := range list.Items {
		if meta.IsStatusConditionTrue(gq.Status.Conditions, apportionv1.ConditionReady) {
			n++
		}
	}
	return n, nil
}

// monitor samples every member's limit every 50 ms: Σ per quota against its global limit, lapsed
// leases, and when each quota's slices moved.
type monitor struct {
	mu                                 sync.Mutex
	quotas                             []*quota
	cancel                             context.CancelFunc
	done                               chan struct{}
	samples, lapsed, violations, worst atomic.Int64
	last                               time.Time
	stopOnce                           sync.Once
}

func startMonitor(ctx context.Context, quotas []*quota) *monitor {
	ctx, cancel := context.WithCancel(ctx)
	m := &monitor{quotas: quotas, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(m.done)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case now := <-tick.C:
				m.sample(now)
			}
		}
	}()
	return m
}

func (m *monitor) sample(now time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, q := range m.quotas {
		var sum, high int64
		changed := false
		if q.last == nil {
			q.last = make([]int64, len(q.members))
			for i, s := range q.members {
				q.last[i], _ = s.m.Limit()
			}
		}
		for i, s := range q.members {
			lim, ok := s.m.Limit()
			if !ok {
				m.lapsed.Add(1)
			}
			sum += lim
			if s.high {
				high += lim
			}
			if lim != q.last[i] {
				q.last[i], changed = lim, true
			}
		}
		if sum > q.global {
			m.violations.Add(1)
		}
		if w := sum * 1000 / q.global; w > m.worst.Load() {
			m.worst.Store(w)
		}
		if changed {
			q.lastChange, m.last = now, now
		}
		if high > q.highBefore && q.firstRaise.IsZero() {
			q.firstRaise = now
		}
	}
	m.samples.Add(1)
}

// mark runs f on every quota between two samples.
func (m *monitor) mark(f func(*quota)) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.last = time.Time{}
	for _, q := range m.quotas {
		f(q)
	}
}

func (m *monitor) lastChange() time.Time {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.last
}

func (m *monitor) stop() {
	m.stopOnce.Do(func() { m.cancel(); <-m.done })
}

// snapshot is the counters at one moment.
type snapshot struct {
	at                         time.Time
	requests                   requestCounts
	revision                   int64
	rvs                        map[string]string
	managerCPU, apiCPU, etcCPU time.Duration
	load                       string
}

// take reads the API server's request counters, the cluster's etcd revision and the
// resourceVersions of every ClusterSlice and GlobalQuota (one list each), and the processes' CPU.
// At a window's start the lists come before the counters, at its end after them: the
// benchmark's own two lists are never in a window.
func take(ctx context.Context, cp *harness.ControlPlane, manager int, procs map[string]int, end bool) (snapshot, error) {
	s := snapshot{load: procfs.LoadAvg(), rvs: map[string]string{}}
	if !end {
		if err := s.list(ctx, cp); err != nil {
			return s, err
		}
	}
	if err := s.scrape(ctx, cp); err != nil {
		return s, err
	}
	s.at = time.Now()
	s.managerCPU, _ = procfs.CPU(manager)
	s.apiCPU, _ = procfs.CPU(procs["kube-apiserver"])
	s.etcCPU, _ = procfs.CPU(procs["etcd"])
	if end {
		if err := s.list(ctx, cp); err != nil {
			return s, err
		}
	}
	return s, nil
}

func (s *snapshot) list(ctx context.Context, cp *harness.ControlPlane) error {
	var slices apportionv1.ClusterSliceList
	if err := cp.Client.List(ctx, &slices, client.InNamespace(hubNS)); err != nil {
		return err
	}
	for _, cs := range slices.Items {
		s.rvs["cs/"+cs.Name] = cs.ResourceVersion
	}
	var gqs apportionv1.GlobalQuotaList
	if err := cp.Client.List(ctx, &gqs, client.InNamespace(hubNS)); err != nil {
		return err
	}
	for _, gq := range gqs.Items {
		s.rvs["gq/"+gq.Name] = gq.ResourceVersion
	}
	// A list's resourceVersion is etcd's revision at the read: it grows by one per write of
	// any object in the cluster.
	rev, err := strconv.ParseInt(gqs.ResourceVersion, 10, 64)
	if err != nil {
		return fmt.Errorf("the list's resourceVersion %q: %w", gqs.ResourceVersion, err)
	}
	s.revision = rev
	return nil
}

func (s *snapshot) scrape(ctx context.Context, cp *harness.ControlPlane) error {
	hc, err := rest.HTTPClientFor(cp.Config)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(cp.Config.Host, "/")+"/metrics", nil)
	if err != nil {
		return err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("the API server's /metrics: %s", resp.Status)
	}
	s.requests, err = parseRequestTotal(string(body))
	return err
}

func (s1 snapshot) sub(s0 snapshot, members int) window {
	w := window{sec: s1.at.Sub(s0.at).Seconds(), tr: diffTraffic(s0.requests, s1.requests), loads: s0.load + "→" + s1.load}
	// From the start's list to the end's: the window and the two reads of the counters.
	w.revisions = s1.revision - s0.revision
	for k, v := range s1.rvs {
		if s0.rvs[k] != v {
			w.objectsChanged++
		}
	}
	w.managerCPU = (s1.managerCPU - s0.managerCPU).Seconds() / w.sec
	w.apiCPU = (s1.apiCPU - s0.apiCPU).Seconds() / w.sec
	w.etcCPU = (s1.etcCPU - s0.etcCPU).Seconds() / w.sec
	w.memberWritesPerMin = w.tr.memberWrites / float64(members) / (w.sec / 60)
	return w
}

func (w window) String() string {
	return fmt.Sprintf("%.0f s: %.1f API req/s (%s); writes/s: members %.2f, hub slices %.2f, hub quotas %.2f, other %.2f (%.0f conflicts); %d etcd revisions, %d slices/quotas changed; CPU milli-cores: manager %.1f, kube-apiserver %.1f, etcd %.1f; load %s",
		w.sec, w.tr.total()/w.sec, verbs(w.tr, w.sec), w.tr.memberWrites/w.sec, w.tr.sliceWrites/w.sec, w.tr.quotaWrites/w.sec, w.tr.otherWrites/w.sec, w.tr.conflicts,
		w.revisions, w.objectsChanged, 1000*w.managerCPU, 1000*w.apiCPU, 1000*w.etcCPU, w.loads)
}

func verbs(t traffic, sec float64) string {
	var out []string
	for _, v := range []string{"GET", "LIST", "WATCH", "POST", "PUT", "PATCH", "DELETE"} {
		out = append(out, fmt.Sprintf("%s %.2f", v, t.byVerb[v]/sec))
	}
	return strings.Join(out, " ")
}

func table(rows []result) string {
	var s strings.Builder
	s.WriteString("\nSetup and idle (members × quotas; member = member cluster; one Member per member and quota):\n")
	fmt.Fprintf(&s, "%-9s %6s %9s %9s %8s %8s %8s %8s %9s %8s %8s %8s %8s %7s %s\n", "m×q", "lease", "1st p50", "1st max", "ready",
		"req/s", "GET/s", "wr/s", "wr/mem/m", "etcd rev", "mgr mCPU", "api mCPU", "etcd mCPU", "RSS MB", "load")
	for _, r := range rows {
		w := r.idle
		fmt.Fprintf(&s, "%-9s %6s %9s %9s %8s %8.1f %8.1f %8.3f %9.3f %8d %8.1f %8.1f %8.1f %7.0f %s\n", r.cfg, r.lease, r.firstP50, r.firstMax, r.ready,
			w.tr.total()/w.sec, w.tr.byVerb["GET"]/w.sec, w.tr.writes()/w.sec, w.memberWritesPerMin, w.revisions,
			1000*w.managerCPU, 1000*w.apiCPU, 1000*w.etcCPU, float64(r.rss)/(1<<20), w.loads)
	}
	s.WriteString("\nIdle requests per second by verb, and the writes (members = ClusterSlice status; hub = ClusterSlice and GlobalQuota; other = leader election, Events):\n")
	for _, r := range rows {
		w := r.idle
		fmt.Fprintf(&s, "%-9s %s | writes/s members %.3f, hub %.3f, other %.3f | %d of %d slices/quotas changed\n", r.cfg, verbs(w.tr, w.sec),
			w.tr.memberWrites/w.sec, (w.tr.sliceWrites+w.tr.quotaWrites)/w.sec, w.tr.otherWrites/w.sec, w.objectsChanged, r.cfg.quotas*(r.cfg.members+1))
	}
	s.WriteString("\nDemand shift (in every quota half the members ask for the whole limit, the others for 1); move = the first\n" +
		"raised slice usable, settle = the last slice change (per quota); high% = the high-demand members' part of the\n" +
		"global limit at the end; wr/slice = ClusterSlice status writes per member and quota in the window:\n")
	fmt.Fprintf(&s, "%-9s %9s %9s %9s %9s %6s %8s %9s %8s %8s %s\n", "m×q", "move p50", "move max", "settle50", "settle", "high%", "req/s", "wr/slice", "conflict", "mgr mCPU", "verbs")
	for _, r := range rows {
		w := r.shift
		settle := r.settleMax.String()
		if !r.settledAll {
			settle = ">" + settle
		}
		fmt.Fprintf(&s, "%-9s %9s %9s %9s %9s %6.0f %8.1f %9.2f %8.0f %8.1f %s\n", r.cfg, r.moveP50, r.moveMax, r.settleP50, settle, 100*r.highShare,
			w.tr.total()/w.sec, w.tr.memberWrites/float64(r.cfg.members*r.cfg.quotas), w.tr.conflicts, 1000*w.managerCPU, verbs(w.tr, w.sec))
	}
	s.WriteString("\nMonitor (every 50 ms, every member): Σ of a quota's limits never above its global limit:\n")
	for _, r := range rows {
		fmt.Fprintf(&s, "%-9s %d samples, highest Σ/global %.1f %%, %d member-samples with a lapsed lease; manager RSS %.0f MB (peak %.0f)\n", r.cfg, r.samples,
			float64(r.worst)/10, r.lapsed, float64(r.rss)/(1<<20), float64(r.hwm)/(1<<20))
	}
	s.WriteString("\nGoal: no write while idle.\n")
	for _, r := range rows {
		v := "NOT MET"
		if r.idle.tr.memberWrites == 0 && r.idle.tr.sliceWrites == 0 && r.idle.tr.quotaWrites == 0 {
			v = "met"
		}
		fmt.Fprintf(&s, "  %-7s %s: %.3f member writes per member per minute, %.0f hub writes of slices and quotas in %.0f s\n", v, r.cfg,
			r.idle.memberWritesPerMin, r.idle.tr.sliceWrites+r.idle.tr.quotaWrites, r.idle.sec)
	}
	return s.String()
}

func pct(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)].Round(time.Millisecond)
}

func sleep(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// parallel runs f(0..n-1), at most width at once, and returns the first error.
func parallel(ctx context.Context, n, width int, f func(i int) error) error {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var first error
	sem := make(chan struct{}, width)
	for i := range n {
		if ctx.Err() != nil {
			break
		}
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if err := f(i); err != nil {
				mu.Lock()
				if first == nil {
					first = err
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if first == nil {
		first = ctx.Err()
	}
	return first
}

// dumpHub logs the first GlobalQuota's status and its ClusterSlices: what a failed setup left.
func dumpHub(ctx context.Context, b *testing.B, c client.Client) {
	var gqs apportionv1.GlobalQuotaList
	var css apportionv1.ClusterSliceList
	if err := c.List(ctx, &gqs, client.InNamespace(hubNS)); err != nil || len(gqs.Items) == 0 {
		b.Logf("GlobalQuotas: %v", err)
		return
	}
	if err := c.List(ctx, &css, client.InNamespace(hubNS), client.MatchingLabels{hubsync.LabelGlobalQuota: gqs.Items[0].Name}); err != nil {
		b.Logf("ClusterSlices: %v", err)
	}
	st, _ := json.Marshal(gqs.Items[0].Status)
	b.Logf("%s status: %s", gqs.Items[0].Name, st)
	for _, cs := range css.Items {
		spec, _ := json.Marshal(cs.Spec)
		status, _ := json.Marshal(cs.Status)
		b.Logf("%s spec %s status %s", cs.Name, spec, status)
	}
}
