package harness

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/tlstest"
)

// Env is what scenarios share: the control plane, the binaries and the loopback addresses.
type Env struct {
	CP  *ControlPlane
	Bin *Binaries
	IPs *IPPool
	// Dir is where scenarios put their logs.
	Dir string
	// Cluster, when set, runs every scenario's workload on the real controllers, scheduler and
	// kwok nodes (cluster.go) instead of the simulated ones (workload.go).
	Cluster *Cluster
}

// ScenarioConfig sets up one downstream shared by one autoscaled Deployment.
type ScenarioConfig struct {
	Namespace string
	// Quota is the DownstreamQuota's name, also the downstream's name (default "logistics").
	Quota string
	// Workload is the Deployment's name (default "gateway").
	Workload string
	// Limit is the global in-flight limit of the quota and of the test downstream (default 50).
	Limit int32
	// FactorPercent is safetyFactorPercent (default 80).
	FactorPercent int32
	// Replicas, MinReplicas, MaxReplicas: initial pods and the HPA's bounds (8, 4, 16).
	Replicas, MinReplicas, MaxReplicas int32
	// Latency of the test downstream (default 100ms).
	Latency time.Duration
	// Manager timings (defaults 2s, 500ms, 500ms) and extra flags.
	LeaseTTL, RenewEvery, PushTimeout time.Duration
	ManagerArgs                       []string
	// AllNamespaces runs the manager without --namespace: it serves every namespace, as one
	// manager does for a whole cluster — for a scenario with a second namespace of its own
	// (the package's tests run one at a time, and each deletes its quotas when it ends).
	AllNamespaces bool
	// AcquireTimeout and RequestTimeout of the quota (200ms, 1s).
	AcquireTimeout, RequestTimeout time.Duration
	// WorkersPerAgent of the load (default 6; no load with NoLoad).
	WorkersPerAgent int
	NoLoad          bool
	// CallSuspended: the app keeps calling a SIGSTOPped agent (see LoadConfig).
	CallSuspended bool
	// Protocol the load speaks to the agents (LoadConfig.Protocol; default HTTP/1.1).
	Protocol string
	// Bootstrap starts every agent with --bootstrap: the quota's downstream at its safe default
	// (limit × factor / maxReplicas), as a pod configured to work without a manager would.
	Bootstrap bool
	// UpstreamTLS serves the test downstream over TLS with a private CA: the quota's
	// spec.upstreamTLS names the CA's ConfigMap, which the webhook mounts into the agents and
	// the "kubelet" materializes (kubelet.go, mountProjected).
	UpstreamTLS bool
	// NoMonitor skips the invariant monitor.
	NoMonitor bool
	// MonitorHz (default 25).
	MonitorHz float64
	// KeepHistory keeps the monitor's samples.
	KeepHistory bool
	// Record keeps the monitor's record for the offline check (MonitorConfig.Record).
	Record bool
	// PodStartDelay and Terminating pace the "kubelet" (defaults 0 and 300ms).
	PodStartDelay, Terminating time.Duration
	// Deployment and HPA override the generated ones (the demo passes the sample's).
	Deployment *appsv1.Deployment
	HPA        *autoscalingv2.HorizontalPodAutoscaler
	// QuotaObject overrides the generated DownstreamQuota (its upstream is set to the test
	// downstream's URL).
	QuotaObject *apportionv1.DownstreamQuota
	// Logf logs the scenario's actions; nil discards.
	Logf func(format string, args ...any)
	// Upstream, when set, is the test downstream the quota calls, shared with other scenarios
	// (several clusters calling one partner); the scenario neither starts nor closes it.
	Upstream *Downstream
}

func (c *ScenarioConfig) defaults() {
	def32 := func(v *int32, d int32) {
		if *v == 0 {
			*v = d
		}
	}
	defD := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	if c.Quota == "" {
		c.Quota = "logistics"
	}
	if c.Workload == "" {
		c.Workload = "gateway"
	}
	def32(&c.Limit, 50)
	def32(&c.FactorPercent, apportionv1.DefaultSafetyFactorPercent)
	def32(&c.Replicas, 8)
	def32(&c.MinReplicas, 4)
	def32(&c.MaxReplicas, 16)
	defD(&c.Latency, 100*time.Millisecond)
	defD(&c.LeaseTTL, 2*time.Second)
	defD(&c.RenewEvery, 500*time.Millisecond)
	defD(&c.PushTimeout, 500*time.Millisecond)
	defD(&c.AcquireTimeout, 200*time.Millisecond)
	defD(&c.RequestTimeout, time.Second)
	defD(&c.Terminating, 300*time.Millisecond)
	if c.WorkersPerAgent == 0 {
		c.WorkersPerAgent = 6
	}
	if c.Logf == nil {
		c.Logf = func(string, ...any) {}
	}
}

// Scenario is one running setup: manager, downstream, quota, workload, load and monitor.
type Scenario struct {
	Env      *Env
	Cfg      ScenarioConfig
	Dir      string
	Manager  *Manager
	DS       *Downstream
	Keys     *TrustDir
	Workload *Workload
	Load     *Load
	Monitor  *Monitor
	// Started is when NewScenario returned.
	Started time.Time
	// Pushing is false when the manager has no push engine or there is no agent binary: the
	// scenario then only computes (no agents, load or monitor).
	Pushing bool

	safeDefault atomic.Int32
	failClosed  atomic.Bool
	cancel      context.CancelFunc
	ctx         context.Context
}

// NewScenario starts everything in order: namespace, downstream, manager, the agents' keys, the
// quota, the workload with its pods and agents, then the monitor and the load.
func (e *Env) NewScenario(ctx context.Context, cfg ScenarioConfig) (_ *Scenario, err error) {
	cfg.defaults()
	s := &Scenario{Env: e, Cfg: cfg, Dir: filepath.Join(e.Dir, cfg.Namespace)}
	s.ctx, s.cancel = context.WithCancel(ctx)
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if err := os.MkdirAll(s.Dir, 0o755); err != nil {
		return nil, err
	}
	s.Pushing = e.Bin.Pushes() && e.Bin.HasAgent()
	if err := e.CP.CreatePodNamespace(ctx, cfg.Namespace); err != nil {
		return nil, err
	}
	var caPEM []byte
	if cfg.Upstream != nil {
		s.DS = cfg.Upstream
	} else if cfg.UpstreamTLS {
		ca, err := tlstest.NewCA("e2e partner CA")
		if err != nil {
			return nil, err
		}
		leaf, err := ca.Issue(tlstest.LeafOptions{Names: []string{"127.0.0.1"}})
		if err != nil {
			return nil, err
		}
		caPEM = ca.PEM
		if s.DS, err = StartDownstreamTLS(int64(cfg.Limit), cfg.Latency, leaf.Cert); err != nil {
			return nil, err
		}
	} else if s.DS, err = StartDownstream(int64(cfg.Limit), cfg.Latency); err != nil {
		return nil, err
	}
	watch := cfg.Namespace
	if cfg.AllNamespaces {
		watch = ""
	}
	if s.Manager, err = NewManager(e.Bin, e.CP, s.Dir, ManagerOptions{
		Namespace: watch, LeaseTTL: cfg.LeaseTTL, RenewEvery: cfg.RenewEvery, PushTimeout: cfg.PushTimeout,
		ExtraArgs: cfg.ManagerArgs,
	}); err != nil {
		return nil, err
	}
	if len(s.Manager.Unsupported) > 0 {
		cfg.Logf("manager does not accept %v: running it with its defaults for those", s.Manager.Unsupported)
	}
	if err := s.Manager.Start(ctx); err != nil {
		return nil, err
	}
	if s.Keys, err = NewTrustDir(e.CP, filepath.Join(s.Dir, "trust"), cfg.Namespace); err != nil {
		return nil, err
	}

	dq := cfg.QuotaObject
	if dq == nil {
		dq = NewQuota(QuotaConfig{Namespace: cfg.Namespace, Name: cfg.Quota, Limit: cfg.Limit, FactorPercent: cfg.FactorPercent,
			Target: cfg.Workload, AcquireTimeout: cfg.AcquireTimeout, RequestTimeout: cfg.RequestTimeout})
	}
	dq = dq.DeepCopy()
	dq.Namespace, dq.ResourceVersion = cfg.Namespace, ""
	dq.Spec.Upstream = s.DS.URL
	if cfg.UpstreamTLS {
		cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: dq.Name + "-ca", Namespace: cfg.Namespace},
			Data: map[string]string{apportionv1.DefaultCAKey: string(caPEM)}}
		if err := e.CP.Client.Create(ctx, cm); err != nil {
			return nil, fmt.Errorf("creating the CA ConfigMap: %w", err)
		}
		dq.Spec.UpstreamTLS = &apportionv1.UpstreamTLS{CABundle: &apportionv1.ConfigMapKey{Name: cm.Name}}
	}
	s.Cfg.Quota = dq.Name
	if err := e.CP.Client.Create(ctx, dq); err != nil {
		return nil, fmt.Errorf("creating the DownstreamQuota: %w", err)
	}
	// The manager keeps its public keys in every namespace with a quota: in place before the
	// first agent starts, as a pod's ConfigMap volume needs it.
	if s.Pushing {
		if err := s.Keys.Wait(ctx, 30*time.Second); err != nil {
			return nil, err
		}
		go s.Keys.Run(s.ctx, time.Second)
	}

	var agentArgs []string
	if cfg.Bootstrap {
		path, err := s.writeBootstrap(dq)
		if err != nil {
			return nil, err
		}
		agentArgs = append(agentArgs, "--bootstrap="+path)
	}
	s.Workload = NewWorkload(e.CP, e.Bin, s.Keys, e.IPs, s.Dir, WorkloadConfig{
		AgentArgs: agentArgs,
		Namespace: cfg.Namespace, Name: cfg.Workload, MinReplicas: cfg.MinReplicas, MaxReplicas: cfg.MaxReplicas,
		Deployment: cfg.Deployment, HPA: cfg.HPA, PodStartDelay: cfg.PodStartDelay, Terminating: cfg.Terminating,
		Logf: cfg.Logf, NoAgents: !s.Pushing, Cluster: e.Cluster,
	})
	if err := s.Workload.Create(ctx, cfg.Replicas); err != nil {
		return nil, err
	}
	if !s.Pushing {
		// No agents: the Deployment, the HPA and the Pod objects only.
		return s, nil
	}
	if !cfg.NoMonitor {
		if s.Monitor, err = StartMonitor(s.ctx, MonitorConfig{
			Source: s.Workload, Downstream: s.Cfg.Quota, Limit: cfg.Limit, Hz: cfg.MonitorHz, Key: s.Keys.Key,
			SafeDefault: func() int32 { return s.safeDefault.Load() }, RequestTimeout: cfg.RequestTimeout,
			FailClosed: s.failClosed.Load, DS: s.DS, Ledger: s.ledger, KeepHistory: cfg.KeepHistory, Record: cfg.Record, LeaseTTL: cfg.LeaseTTL,
		}); err != nil {
			return nil, err
		}
	}
	s.Started = time.Now()
	if !cfg.NoLoad {
		s.Load = StartLoad(s.ctx, LoadConfig{Source: s.Workload, Downstream: s.Cfg.Quota, WorkersPerAgent: cfg.WorkersPerAgent,
			Timeout: 5 * time.Second, CallSuspended: cfg.CallSuspended, Protocol: cfg.Protocol})
	}
	return s, nil
}

// writeBootstrap writes a bootstrap Assignment for the quota's downstream at its safe default.
func (s *Scenario) writeBootstrap(dq *apportionv1.DownstreamQuota) (string, error) {
	safe := int32(int64(s.Cfg.Limit) * int64(s.Cfg.FactorPercent) / 100 / int64(s.Cfg.MaxReplicas))
	a := assignment.Assignment{
		LeaseTTL: assignment.Duration(s.Cfg.LeaseTTL),
		Downstreams: []assignment.Downstream{{
			Name: dq.Name, Upstream: dq.Spec.Upstream, Permits: safe, SafeDefaultPermits: safe,
			AcquireTimeout: assignment.Duration(s.Cfg.AcquireTimeout), RequestTimeout: assignment.Duration(s.Cfg.RequestTimeout),
			Fallback: assignment.Fallback{Action: "Reject"},
		}},
	}
	data, err := json.MarshalIndent(a, "", "  ")
	if err != nil {
		return "", err
	}
	path := filepath.Join(s.Dir, "bootstrap.json")
	return path, os.WriteFile(path, data, 0o644)
}

// ledger reads status.ledger (and keeps status.safeDefaultPermits and the failure policy for
// the monitor).
func (s *Scenario) ledger(ctx context.Context) (LedgerReading, error) {
	dq, err := s.Quota(ctx)
	if err != nil {
		return LedgerReading{}, err
	}
	s.safeDefault.Store(dq.Status.SafeDefaultPermits)
	s.failClosed.Store(dq.Spec.Agent.FailurePolicy == apportionv1.FailureClosed)
	var b strings.Builder
	fmt.Fprintf(&b, "pods=%d perPod=%s assigned=%d holdings:", dq.Status.Pods, dq.Status.PerPod, dq.Status.Assigned)
	for _, h := range dq.Status.Holdings {
		fmt.Fprintf(&b, " %s(granted=%d counted=%d inFlight=%d synced=%v)", h.Pod, h.Granted, h.Counted, h.InFlight, h.Synced)
	}
	ready := meta.FindStatusCondition(dq.Status.Conditions, apportionv1.ConditionReady)
	recovering := ready != nil && ready.Status == metav1.ConditionFalse && ready.Reason == apportionv1.ReasonRecovering
	return LedgerReading{Sum: dq.Status.Ledger, Recovering: recovering, Detail: b.String()}, nil
}

// Quota reads the DownstreamQuota.
func (s *Scenario) Quota(ctx context.Context) (*apportionv1.DownstreamQuota, error) {
	return s.Env.CP.GetQuota(ctx, s.Cfg.Namespace, s.Cfg.Quota)
}

// PerPod is floor(limit × factor / pods): every pod's permits at that count, or one more for
// the pods the remainder goes to (WaitPermits).
func (s *Scenario) PerPod(pods int32) int32 {
	if pods <= 0 {
		return 0
	}
	return int32(int64(s.Cfg.Limit) * int64(s.Cfg.FactorPercent) / 100 / int64(pods))
}

// States reads the State of every live pod's agent (pods not deleted), by pod.
func (s *Scenario) States(ctx context.Context) (map[string]*assignment.State, error) {
	key, err := s.Keys.Key()
	if err != nil {
		return nil, err
	}
	c := &assignment.Client{HTTP: probeClient, Key: key}
	out := map[string]*assignment.State{}
	var errs []error
	for _, pod := range s.Workload.Pods() {
		a := s.Workload.Agent(pod)
		if a == nil || !a.Running() || a.Suspended() {
			continue
		}
		rctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		st, err := c.State(rctx, a.Endpoint(), 0)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", pod, err))
			continue
		}
		out[pod] = st
	}
	return out, errors.Join(errs...)
}

// Effective is a State's effective permits for the scenario's downstream (-1 when absent).
func (s *Scenario) Effective(st *assignment.State) int32 {
	for _, d := range st.Downstreams {
		if d.Name == s.Cfg.Quota {
			return d.EffectivePermits
		}
	}
	return -1
}

// WaitPermits waits until every live, running, reachable pod's agent enforces want permits, or
// want+1 for as many of them as the remainder of the split leaves, limit × factor − pods × want
// when that is below the pods (the manager hands it out, one permit per pod: internal/apportion).
func (s *Scenario) WaitPermits(ctx context.Context, want int32, timeout time.Duration) error {
	budget := int32(int64(s.Cfg.Limit) * int64(s.Cfg.FactorPercent) / 100)
	return poll(ctx, timeout, 20*time.Millisecond, func() error {
		sts, err := s.States(ctx)
		ok := err == nil && len(sts) > 0
		last := fmt.Sprint(err)
		extra := budget - int32(len(sts))*want
		if extra < 0 || extra >= int32(len(sts)) {
			extra = 0
		}
		more := int32(0)
		for pod, st := range sts {
			switch e := s.Effective(st); {
			case e == want+1 && extra > 0:
				more++
			case e != want:
				ok = false
				last = fmt.Sprintf("%s enforces %d (epoch %d gen %d, lease expired %v)", pod, e, st.Epoch, st.Generation, st.LeaseExpired)
			}
		}
		if ok && more != extra {
			ok = false
			last = fmt.Sprintf("%d pods enforce %d, want %d of them (the remainder)", more, want+1, extra)
		}
		if ok {
			return nil
		}
		return fmt.Errorf("pods did not converge on %d permits within %s: %s", want, timeout, last)
	})
}

// Close stops the load, the monitor, the agents and the manager, removes the scenario's objects
// and returns the monitor's summary (zero when there was none).
func (s *Scenario) Close() MonitorStats {
	var st MonitorStats
	if s.Load != nil {
		s.Load.Stop()
	}
	if s.Monitor != nil {
		st = s.Monitor.Stop()
	}
	if s.Workload != nil {
		s.Workload.Close()
	}
	if s.Manager != nil {
		_ = s.Manager.Stop(5 * time.Second)
	}
	if s.cancel != nil {
		s.cancel()
	}
	if s.DS != nil && s.Cfg.Upstream == nil {
		_ = s.DS.Close()
	}
	s.cleanupObjects()
	return st
}

// cleanupObjects deletes the scenario's objects, the quota first (so that the manager lets go of
// the pods).
func (s *Scenario) cleanupObjects() {
	deleteAllIn(s.Env.CP.Client, s.Cfg.Namespace, &apportionv1.DownstreamQuota{}, &autoscalingv2.HorizontalPodAutoscaler{},
		&appsv1.Deployment{}, &appsv1.ReplicaSet{})
}

// deleteAllIn deletes, best effort and within 20 s, every object of each kind in namespace ns in
// that order, then the pods, at once (the harness's kubelet finalizer removed: no kubelet will).
func deleteAllIn(c client.Client, ns string, kinds ...client.Object) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, k := range kinds {
		_ = c.DeleteAllOf(ctx, k, client.InNamespace(ns))
	}
	var pods corev1.PodList
	if c.List(ctx, &pods, client.InNamespace(ns)) == nil {
		for i := range pods.Items {
			if p := &pods.Items[i]; len(p.Finalizers) > 0 {
				orig := p.DeepCopy()
				p.Finalizers = nil
				_ = c.Patch(ctx, p, client.MergeFrom(orig))
			}
		}
	}
	_ = c.DeleteAllOf(ctx, &corev1.Pod{}, client.InNamespace(ns), client.GracePeriodSeconds(0))
}
