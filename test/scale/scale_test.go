// Package scale measures one manager against many pods and quotas (`make bench-scale`): the real
// manager binary against a local control plane (envtest's kube-apiserver and etcd), N pods across
// Q DownstreamQuotas, and N agents that are the real enforcer behind the real control API with
// Ed25519 verification, many of them in this process, each on its own loopback address. The
// manager's network, signing, ledger and status paths are all real; its API traffic goes through
// a counting proxy. Nothing here runs in `go test ./...` (benchmarks only), but it compiles there.
package scale

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/procfs"
	"github.com/apportion/apportion/test/e2e/harness"
)

// config is one size: pods spread evenly over quotas, one quota (with its Deployment and HPA)
// per namespace.
type config struct{ pods, quotas int }

func (c config) String() string { return fmt.Sprintf("%dx%d", c.pods, c.quotas) }

// configs are the sizes of SCALE_CONFIGS ("100x1,1000x100,10000x1000" by default).
func configs(b *testing.B) []config {
	spec := os.Getenv("SCALE_CONFIGS")
	if spec == "" {
		spec = "100x1,1000x100,10000x1000"
	}
	var out []config
	for _, s := range strings.Split(spec, ",") {
		p, q, ok := strings.Cut(strings.TrimSpace(s), "x")
		pods, err1 := strconv.Atoi(p)
		quotas, err2 := strconv.Atoi(q)
		if !ok || err1 != nil || err2 != nil || pods < 1 || quotas < 1 || pods%quotas != 0 {
			b.Fatalf("SCALE_CONFIGS: %q is not PODSxQUOTAS with PODS a multiple of QUOTAS", s)
		}
		out = append(out, config{pods, quotas})
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

func envInt(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil {
		b.Fatalf("%s: %v", name, err)
	}
	return n
}

// BenchmarkScale runs each configuration once (run it with -benchtime=1x) and prints, per
// configuration: the convergence after a simultaneous HPA change of every quota (p50/p99/max
// over every agent of SCALE_EVENTS events, from its quota's HPA status write to the agent
// enforcing its new permits), the manager's RSS (now and peak), its CPU per second idle and
// during the changes, the API requests per second it caused (all, writes, status writes,
// Events) and the pushes per second the agents received, with the 1-minute load average at each
// measurement. Then the targets, met or not.
//
// Knobs (environment): SCALE_CONFIGS, SCALE_IDLE (idle window, default 30s), SCALE_EVENTS
// (default 3), SCALE_PUSH_WORKERS (the manager's --push-workers), SCALE_PPROF (an address: the
// manager serves net/http/pprof there; default a free loopback port, from which the Go memory
// figures are read at the end), SCALE_MEMORY_LIMIT (the manager's --memory-limit: default the
// shipped manifest's, "off" for no soft memory limit; see memoryLimit), SCALE_METRICS (an
// address: the manager serves its metrics there, and the DownstreamQuota work queue's figures
// are logged), SCALE_KEEP (keep the work directory with the manager's log).
func BenchmarkScale(b *testing.B) {
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		b.Skip(harness.ErrNoAssets.Error())
	}
	ctrllog.SetLogger(logr.Discard())
	bin, err := harness.Build(b.Context())
	if err != nil {
		b.Fatal(err)
	}
	var rows []result
	for _, c := range configs(b) {
		b.Run(c.String(), func(b *testing.B) {
			r := runConfig(b, bin, c)
			rows = append(rows, r)
			b.ReportMetric(r.p99.Seconds()*1000, "p99-ms")
			b.ReportMetric(float64(r.rss)/(1<<20), "rss-MB")
			b.ReportMetric(r.idleCPU*1000, "idle-mCPU")
			b.ReportMetric(0, "ns/op")
		})
	}
	fmt.Println(table(rows))
}

type result struct {
	cfg                       config
	setup                     time.Duration
	p50, p99, max             time.Duration
	n                         int
	rss, hwm                  int64
	idleCPU, changeCPU        float64 // CPU-seconds per second
	idleAPI, changeAPI        rate
	idlePushes, changePushes  float64 // per second
	idleGets                  float64
	idleSignedPerSig          float64 // requests signed per Ed25519 signature while idle
	statusBytes               int
	statusWritesPerQuotaEvent float64
	loadIdle, loadChange      string
	timeouts                  int // events in which some agent never got there (SCALE_EVENT_TIMEOUT)
	memLimit, softLimit       string
	mem                       goMemory
}

type rate struct{ total, writes, status, events float64 }

func runConfig(b *testing.B, bin *harness.Binaries, c config) result {
	ctx := b.Context()
	dir := b.TempDir()
	if os.Getenv("SCALE_KEEP") != "" {
		var err error
		if dir, err = os.MkdirTemp("", "scale-"+c.String()+"-"); err != nil {
			b.Fatal(err)
		}
		b.Logf("work directory %s", dir)
	}
	cp, err := harness.StartControlPlane(dir)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cp.Stop() })
	proxy, err := startAPIProxy(cp.Config)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(proxy.close)
	kc, err := proxy.kubeconfig(dir)
	if err != nil {
		b.Fatal(err)
	}
	var extra []string
	if n := os.Getenv("SCALE_PUSH_WORKERS"); n != "" {
		extra = append(extra, "--push-workers="+n)
	}
	// net/http/pprof on loopback, for the Go memory figures read at the end.
	pprofAddr := os.Getenv("SCALE_PPROF")
	if pprofAddr == "" {
		if pprofAddr, err = freeAddr(); err != nil {
			b.Fatal(err)
		}
	}
	if !bin.ManagerHas("pprof-bind-address") {
		pprofAddr = ""
	} else {
		extra = append(extra, "--pprof-bind-address="+pprofAddr)
	}
	memArgs, memSay, err := memoryLimit(bin)
	if err != nil {
		b.Fatal(err)
	}
	extra = append(extra, memArgs...)
	// The manager's metrics on loopback: signatures per signed request are read from them, and
	// with SCALE_METRICS (an address) the work queue's figures are logged at the end.
	metricsAddr := os.Getenv("SCALE_METRICS")
	if metricsAddr != "" {
		defer func() { logMetrics(b, metricsAddr) }()
	} else if metricsAddr, err = freeAddr(); err != nil {
		b.Fatal(err)
	}
	extra = append(extra, "--metrics-bind-address="+metricsAddr, "--metrics-secure=false")
	mgr, err := harness.NewManager(bin, cp, dir, harness.ManagerOptions{
		LeaseTTL: 10 * time.Second, RenewEvery: 3 * time.Second, PushTimeout: time.Second,
		NoWebhook: true, ExtraArgs: extra, Env: []string{"KUBECONFIG=" + kc},
	})
	if err != nil {
		b.Fatal(err)
	}
	if err := mgr.Start(ctx); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = mgr.Stop(10 * time.Second) })
	pid := mgr.Pid()
	r := result{cfg: c, memLimit: memSay, softLimit: softLimitFromLog(mgr.LogPath)}
	b.Logf("%s: %s; soft limit %s", c, memSay, r.softLimit)

	fleet, err := newFleet()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(fleet.stop)
	perQuota := c.pods / c.quotas
	up := int32(perQuota + max(perQuota/4, 1))
	// Limit 10n at 80 %: a budget of 8n split over desired replicas, the floor for every pod and
	// one more for some when it leaves a remainder (internal/apportion).
	permits := func(desired int32) int32 { return int32(8 * perQuota / int(desired)) }
	remainder := func(desired int32) bool { return 8*perQuota%int(desired) != 0 }

	t0 := time.Now()
	ns := func(q int) string { return fmt.Sprintf("scale-%04d", q) }
	if err := parallel(ctx, c.quotas, 32, func(q int) error {
		return createQuota(ctx, cp.Client, ns(q), int32(perQuota))
	}); err != nil {
		b.Fatal(err)
	}
	trust, err := waitTrust(ctx, cp.Client, ns(0), 2*time.Minute)
	if err != nil {
		b.Fatal(err)
	}
	fleet.setTrust(trust)
	agents := make([]*simAgent, c.pods)
	for i := range c.pods {
		q := i / perQuota
		if agents[i], err = fleet.start(i, ns(q), fmt.Sprintf("app-%05d", i), "dq"); err != nil {
			b.Fatalf("agent %d: %v", i, err)
		}
	}
	for _, a := range agents {
		a.expect(permits(int32(perQuota)), remainder(int32(perQuota)))
	}
	if err := parallel(ctx, c.pods, 48, func(i int) error { return createPod(ctx, cp.Client, agents[i]) }); err != nil {
		b.Fatal(err)
	}
	b.Logf("%s: %d pods and %d quotas created in %s", c, c.pods, c.quotas, time.Since(t0).Round(time.Millisecond))
	if _, err := waitAgents(ctx, agents, envDuration(b, "SCALE_SETUP_TIMEOUT", 10*time.Minute)); err != nil {
		b.Fatalf("initial permits: %v", err)
	}
	r.setup = time.Since(t0)
	b.Logf("%s: every agent enforces its first permits %s after the start", c, r.setup.Round(time.Millisecond))

	// Idle: renewals only. Two renewal periods to settle first.
	_ = sleep(ctx, 2*3*time.Second+time.Second)
	idle := envDuration(b, "SCALE_IDLE", 30*time.Second)
	m0 := measure(pid, proxy, fleet, metricsAddr)
	_ = sleep(ctx, idle)
	m1 := measure(pid, proxy, fleet, metricsAddr)
	r.idleCPU, r.idleAPI, r.idlePushes, r.idleGets = m1.sub(m0)
	if m1.sigs > m0.sigs {
		r.idleSignedPerSig = float64(m1.signed-m0.signed) / float64(m1.sigs-m0.sigs)
	}
	r.loadIdle = m0.load + "→" + m1.load
	b.Logf("%s idle %s: manager %.4f CPU-s/s, API %.1f req/s (%.2f writes/s), %.1f pushes/s, %.1f state reads/s, load %s",
		c, idle, r.idleCPU, r.idleAPI.total, r.idleAPI.writes, r.idlePushes, r.idleGets, r.loadIdle)

	// Simultaneous HPA changes of every quota.
	events := envInt(b, "SCALE_EVENTS", 3)
	var lat []time.Duration
	var changeTime time.Duration
	var cm rateSum
	for ev := range events + 1 { // the first one warms up and is not counted
		desired := up
		if ev%2 == 1 {
			desired = int32(perQuota)
		}
		want := permits(desired)
		for _, a := range agents {
			a.expect(want, remainder(desired))
		}
		m0 := measure(pid, proxy, fleet, metricsAddr)
		start := time.Now()
		if err := parallel(ctx, c.quotas, 64, func(q int) error {
			qa := agents[q*perQuota : (q+1)*perQuota]
			at := time.Now()
			for _, a := range qa {
				a.setSince(at)
			}
			err := setHPA(ctx, cp.Client, ns(q), desired, int32(perQuota))
			done := time.Now()
			for _, a := range qa {
				a.setWritten(done)
			}
			return err
		}); err != nil {
			b.Fatal(err)
		}
		evTimeout := envDuration(b, "SCALE_EVENT_TIMEOUT", 2*time.Minute)
		conv, err := waitAgents(ctx, agents, evTimeout)
		if err != nil {
			// Measured as it stands: an agent not there yet counts as the timeout (a lower bound).
			b.Logf("%s event %d: %v; counted at %s", c, ev, err, evTimeout)
			r.timeouts++
			conv = evTimeout
		}
		// The window closes 3 s after the last agent: the status writes and Events that follow
		// the acks belong to the change.
		_ = sleep(ctx, time.Until(start.Add(conv+3*time.Second)))
		m1 := measure(pid, proxy, fleet, metricsAddr)
		var evLat, first, write []time.Duration
		for _, a := range agents {
			d, ok := a.latency()
			if !ok {
				d = evTimeout
			}
			evLat = append(evLat, d)
			f, w := a.firstPush()
			first, write = append(first, f), append(write, w)
		}
		slices.Sort(evLat)
		slices.Sort(first)
		slices.Sort(write)
		b.Logf("%s event %d (%d→%d permits): p50 %s p99 %s max %s (of which the HPA write p50 %s p99 %s; from its answer to the first push p50 %s p99 %s); write phase %s; load %s",
			c, ev, permits(int32(perQuota)+up-desired), want, pct(evLat, 0.5), pct(evLat, 0.99), pct(evLat, 1), pct(write, 0.5), pct(write, 0.99),
			pct(first, 0.5), pct(first, 0.99), conv.Round(time.Millisecond), m1.load)
		if ev == 0 {
			_ = sleep(ctx, 2*time.Second)
			continue
		}
		lat = append(lat, evLat...)
		cm.add(m0, m1)
		changeTime += m1.at.Sub(m0.at)
		r.loadChange = m1.load
		_ = sleep(ctx, 2*time.Second)
	}
	slices.Sort(lat)
	r.n = len(lat)
	r.p50, r.p99, r.max = pct(lat, 0.5), pct(lat, 0.99), pct(lat, 1)
	r.changeCPU, r.changeAPI, r.changePushes = cm.rates()
	r.statusWritesPerQuotaEvent = float64(cm.api.statusWrites) / float64(events*c.quotas)
	r.rss, r.hwm, _ = procfs.Mem(pid)
	if pprofAddr != "" {
		if r.mem, err = readGoMemory(pprofAddr); err != nil {
			b.Logf("%s: Go memory figures: %v", c, err)
		}
	}
	var dq apportionv1.DownstreamQuota
	if err := cp.Client.Get(ctx, types.NamespacedName{Namespace: ns(0), Name: "dq"}, &dq); err == nil {
		r.statusBytes = jsonSize(dq.Status)
	}
	if !mgr.Running() {
		b.Fatalf("the manager exited: %v (see %s)", mgr.ExitErr(), mgr.LogPath)
	}
	return r
}

// sample is the counters at one moment.
type sample struct {
	at           time.Time
	cpu          time.Duration
	api          map[string]int64
	puts, gets   int64
	signed, sigs int64 // the manager's signed requests and signatures (0 when it does not say)
	load         string
}

func measure(pid int, p *apiProxy, f *agentFleet, metricsAddr string) sample {
	cpu, _ := procfs.CPU(pid)
	puts, gets := f.requests()
	s := sample{at: time.Now(), cpu: cpu, api: p.snapshot(), puts: puts, gets: gets, load: procfs.LoadAvg()}
	s.signed, s.sigs = signCounts(metricsAddr)
	return s
}

// signCounts reads apportion_manager_signed_requests_total and apportion_manager_signatures_total
// from the manager's metrics; zeros when it cannot.
func signCounts(addr string) (signed, sigs int64) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, 0
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	for l := range strings.SplitSeq(string(data), "\n") {
		name, v, ok := strings.Cut(l, " ")
		if !ok {
			continue
		}
		f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil {
			continue
		}
		switch name {
		case "apportion_manager_signed_requests_total":
			signed = int64(f)
		case "apportion_manager_signatures_total":
			sigs = int64(f)
		}
	}
	return signed, sigs
}

func (s1 sample) sub(s0 sample) (cpu float64, api rate, pushes, gets float64) {
	sec := s1.at.Sub(s0.at).Seconds()
	d := diffAPI(s0.api, s1.api)
	return (s1.cpu - s0.cpu).Seconds() / sec,
		rate{float64(d.total) / sec, float64(d.writes) / sec, float64(d.statusWrites) / sec, float64(d.events) / sec},
		float64(s1.puts-s0.puts) / sec, float64(s1.gets-s0.gets) / sec
}

// rateSum adds up windows.
type rateSum struct {
	sec    float64
	cpu    time.Duration
	api    apiDelta
	pushes int64
}

func (r *rateSum) add(s0, s1 sample) {
	r.sec += s1.at.Sub(s0.at).Seconds()
	r.cpu += s1.cpu - s0.cpu
	d := diffAPI(s0.api, s1.api)
	r.api.total += d.total
	r.api.writes += d.writes
	r.api.statusWrites += d.statusWrites
	r.api.events += d.events
	r.pushes += s1.puts - s0.puts
}

func (r *rateSum) rates() (cpu float64, api rate, pushes float64) {
	if r.sec == 0 {
		return 0, rate{}, 0
	}
	return r.cpu.Seconds() / r.sec,
		rate{float64(r.api.total) / r.sec, float64(r.api.writes) / r.sec, float64(r.api.statusWrites) / r.sec, float64(r.api.events) / r.sec},
		float64(r.pushes) / r.sec
}

func pct(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(q*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)].Round(100 * time.Microsecond)
}

// waitAgents waits until every agent reached what it expects; it returns the time from the
// earliest HPA write to the last agent reaching it.
func waitAgents(ctx context.Context, agents []*simAgent, timeout time.Duration) (time.Duration, error) {
	deadline := time.Now().Add(timeout)
	for {
		pending := 0
		var first *simAgent
		for _, a := range agents {
			if !a.done() {
				pending++
				if first == nil {
					first = a
				}
			}
		}
		if pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("%d of %d agents do not enforce their permits after %s, e.g. %s/%s", pending, len(agents), timeout, first.ns, first.pod)
		}
		if err := sleep(ctx, 20*time.Millisecond); err != nil {
			return 0, err
		}
	}
	var start, end time.Time
	for _, a := range agents {
		a.mu.Lock()
		if !a.since.IsZero() && (start.IsZero() || a.since.Before(start)) {
			start = a.since
		}
		if a.reached.After(end) {
			end = a.reached
		}
		a.mu.Unlock()
	}
	if start.IsZero() {
		return 0, nil
	}
	return end.Sub(start), nil
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
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

// createQuota creates a namespace with a Deployment "app" of n replicas, its HPA (status
// desired = current = n) and the DownstreamQuota "dq" (limit 10 n, 80 %: 8 permits per pod).
func createQuota(ctx context.Context, c client.Client, ns string, n int32) error {
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		return err
	}
	labels := map[string]string{"app": "app"}
	d := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: "app", Namespace: ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(n),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app:scale"}}},
			},
		},
	}
	if err := c.Create(ctx, d); err != nil {
		return err
	}
	h := &autoscalingv2.HorizontalPodAutoscaler{
		ObjectMeta: metav1.ObjectMeta{Name: "app", Namespace: ns},
		Spec: autoscalingv2.HorizontalPodAutoscalerSpec{
			ScaleTargetRef: autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1", Kind: "Deployment", Name: "app"},
			MinReplicas:    ptr.To(n),
			MaxReplicas:    2 * n,
			Metrics: []autoscalingv2.MetricSpec{{
				Type: autoscalingv2.ResourceMetricSourceType,
				Resource: &autoscalingv2.ResourceMetricSource{
					Name:   corev1.ResourceCPU,
					Target: autoscalingv2.MetricTarget{Type: autoscalingv2.UtilizationMetricType, AverageUtilization: ptr.To(int32(70))},
				},
			}},
		},
	}
	if err := c.Create(ctx, h); err != nil {
		return err
	}
	if err := setHPA(ctx, c, ns, n, n); err != nil {
		return err
	}
	q := harness.NewQuota(harness.QuotaConfig{Namespace: ns, Name: "dq", Limit: 10 * n, FactorPercent: 80,
		Upstream: "http://127.0.0.1:1", Target: "app"})
	return c.Create(ctx, q)
}

// setHPA writes the HPA's decision, as the HPA controller does.
func setHPA(ctx context.Context, c client.Client, ns string, desired, current int32) error {
	patch := fmt.Sprintf(`{"status":{"desiredReplicas":%d,"currentReplicas":%d,"lastScaleTime":%q}}`,
		desired, current, time.Now().UTC().Format(time.RFC3339))
	h := &autoscalingv2.HorizontalPodAutoscaler{ObjectMeta: metav1.ObjectMeta{Name: "app", Namespace: ns}}
	return c.Status().Patch(ctx, h, client.RawPatch(types.MergePatchType, []byte(patch)))
}

// createPod creates the agent's Pod object and writes its status as a kubelet would: Running,
// Ready, with the agent's address as its IP and its control port in the annotation.
func createPod(ctx context.Context, c client.Client, a *simAgent) error {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: a.pod, Namespace: a.ns,
			Labels:      map[string]string{"app": "app"},
			Annotations: map[string]string{apportionv1.AgentPortAnnotation: a.port()},
		},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app:scale"}}},
	}
	if err := c.Create(ctx, pod); err != nil {
		return err
	}
	now := metav1.Now()
	pod.Status = corev1.PodStatus{
		Phase:     corev1.PodRunning,
		PodIP:     a.ip(),
		PodIPs:    []corev1.PodIP{{IP: a.ip()}},
		HostIP:    "127.0.0.1",
		StartTime: &now,
		Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
		},
	}
	return c.Status().Update(ctx, pod)
}

// waitTrust reads the manager's public keys from the trust ConfigMap it keeps in ns.
func waitTrust(ctx context.Context, c client.Client, ns string, timeout time.Duration) (assignment.TrustSet, error) {
	deadline := time.Now().Add(timeout)
	for {
		var cm corev1.ConfigMap
		err := c.Get(ctx, types.NamespacedName{Namespace: ns, Name: harness.TrustConfigMap}, &cm)
		if err == nil && len(cm.Data) > 0 {
			var keys []assignment.PublicKey
			for name, pem := range cm.Data {
				k, err := assignment.ParsePublicKey([]byte(pem))
				if err != nil {
					return assignment.TrustSet{}, fmt.Errorf("trust ConfigMap key %s: %w", name, err)
				}
				keys = append(keys, assignment.PublicKey{ID: strings.TrimSuffix(name, assignment.TrustFileSuffix), Key: k})
			}
			return assignment.NewTrustSet(keys...)
		}
		if time.Now().After(deadline) {
			return assignment.TrustSet{}, fmt.Errorf("no trust ConfigMap in %s after %s (last error: %w)", ns, timeout, err)
		}
		if err := sleep(ctx, 100*time.Millisecond); err != nil {
			return assignment.TrustSet{}, err
		}
	}
}

// table formats the results and the targets.
func table(rows []result) string {
	var s strings.Builder
	fmt.Fprintf(&s, "\n%-11s %8s %8s %8s %5s %7s %7s %9s %9s %9s %9s %9s %9s %8s %7s %8s %7s %7s %s\n",
		"pods×quotas", "p50", "p99", "max", "n", "RSS MB", "peak MB", "idle mCPU", "mCPU/pod", "chg mCPU", "idle API", "chg API", "st.w/q/ev", "idle psh", "req/sig", "chg psh", "stat KB", "setup", "load idle | change")
	for _, r := range rows {
		fmt.Fprintf(&s, "%-11s %8s %8s %8s %5d %7.0f %7.0f %9.1f %9.4f %9.1f %9.2f %9.1f %9.2f %8.1f %7.2f %8.1f %7.1f %7s %s | %s\n",
			r.cfg, r.p50, r.p99, r.max, r.n, float64(r.rss)/(1<<20), float64(r.hwm)/(1<<20), r.idleCPU*1000,
			r.idleCPU*1000/float64(r.cfg.pods), r.changeCPU*1000, r.idleAPI.total, r.changeAPI.total,
			r.statusWritesPerQuotaEvent, r.idlePushes, r.idleSignedPerSig, r.changePushes, float64(r.statusBytes)/1024, r.setup.Round(time.Second), r.loadIdle, r.loadChange)
	}
	for _, r := range rows {
		if r.timeouts > 0 {
			fmt.Fprintf(&s, "%s: in %d events some agents did not get their permits within SCALE_EVENT_TIMEOUT; counted at it (a lower bound)\n", r.cfg, r.timeouts)
		}
	}
	s.WriteString("\nAPI columns are requests/s caused by the manager (watches count once, when opened); st.w/q/ev is\n" +
		"status writes per quota per event; psh is pushes/s the agents received; req/sig is requests signed per\n" +
		"Ed25519 signature while idle (batch signatures); stat KB is one quota's status.\n\n")
	s.WriteString("Manager memory at the end (RSS first, then from its pprof endpoint): heap = HeapInuse, stacks =\n" +
		"goroutine stacks in use, live = HeapAlloc just after a forced collection (what the collector keeps at best).\n")
	fmt.Fprintf(&s, "%-11s %7s %7s %7s %7s %8s %9s %9s %s\n", "pods×quotas", "RSS MB", "heap MB", "stk MB", "live MB", "gorout.", "live/pod", "soft lim", "memory limit")
	for _, r := range rows {
		fmt.Fprintf(&s, "%-11s %7.0f %7.0f %7.0f %7.0f %8d %8.1fK %9s %s\n", r.cfg, float64(r.rss)/(1<<20), float64(r.mem.heapInuse)/(1<<20),
			float64(r.mem.stackInuse)/(1<<20), float64(r.mem.live)/(1<<20), r.mem.goroutines, float64(r.mem.live)/1024/float64(r.cfg.pods), r.softLimit, r.memLimit)
	}
	s.WriteString("\nTargets:\n")
	for _, r := range rows {
		if r.cfg.pods == 1000 && r.cfg.quotas == 100 {
			s.WriteString(verdict(r.p99 <= time.Second, "convergence p99 ≤ 1 s at 1,000 pods × 100 quotas", r.p99.String()))
		}
		// Renewals every 3 s less up to a quarter: 1/2.625 per pod and second when they keep up.
		keptUp := r.idlePushes >= 0.9*float64(r.cfg.pods)/2.625
		s.WriteString(verdict(keptUp && r.idleCPU*1000/float64(r.cfg.pods) <= 0.05, "idle manager CPU ≤ 0.05 milli-CPU per pod at "+r.cfg.String(),
			fmt.Sprintf("%.4f, renewals at %.0f %% of their due rate", r.idleCPU*1000/float64(r.cfg.pods), 100*r.idlePushes*2.625/float64(r.cfg.pods))))
		if r.cfg.pods >= 10000 {
			s.WriteString(verdict(r.rss <= 300<<20, "RSS ≤ 300 MB at "+r.cfg.String(), fmt.Sprintf("%.0f MB", float64(r.rss)/(1<<20))))
		}
		s.WriteString(verdict(r.idleAPI.status == 0, "no status write while idle (renewals only) at "+r.cfg.String(),
			fmt.Sprintf("%.3f/s", r.idleAPI.status)))
	}
	return s.String()
}

func verdict(ok bool, what, got string) string {
	v := "NOT MET"
	if ok {
		v = "met"
	}
	return fmt.Sprintf("  %-7s %s (measured %s)\n", v, what, got)
}

func jsonSize(v any) int {
	b, err := json.Marshal(v)
	if err != nil {
		return 0
	}
	return len(b)
}

// logMetrics logs the manager's work queue and reconcile figures of the DownstreamQuota
// controller and of its status writer (SCALE_METRICS).
func logMetrics(b *testing.B, addr string) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		b.Logf("metrics: %v", err)
		return
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	var lines []string
	for _, l := range strings.Split(string(data), "\n") {
		queue := strings.Contains(l, `"downstreamquota"`) || strings.Contains(l, `"downstreamquota_status"`)
		if (queue && (strings.Contains(l, "_sum") || strings.Contains(l, "_count") || strings.HasPrefix(l, "workqueue_retries_total"))) ||
			strings.HasPrefix(l, "apportion_manager_pushes_total") || strings.HasPrefix(l, "apportion_manager_quiet") ||
			strings.HasPrefix(l, "apportion_manager_status_") || strings.HasPrefix(l, "apportion_manager_sign") {
			lines = append(lines, l)
		}
	}
	b.Logf("manager metrics:\n%s", strings.Join(lines, "\n"))
}
