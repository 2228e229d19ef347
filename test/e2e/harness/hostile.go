package harness

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	gomaps "maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/builders"
)

// HostileConfig is a tenant's namespace whose pods' "agents" are hostile: what anyone with the
// built-in edit role in one namespace can run (a DownstreamQuota, a Deployment, pods, and the
// namespace's ConfigMaps), against the one manager every namespace shares (issue 26).
type HostileConfig struct {
	Namespace string
	// Quota and Workload name the tenant's DownstreamQuota and Deployment (defaults "tenant" and
	// "tenant-app").
	Quota, Workload string
	// Limit is the tenant quota's limit (default 50). Nothing calls its downstream.
	Limit int32
	// Pods is how many pods of each kind to run. Each opts out of injection (apportion.io/inject:
	// "false") and names its own agent port, 15000 — every other one by the
	// apportion.io/agent-port annotation, the rest by a container port named apportion-ctl —
	// where the harness serves the kind's answers on the pod's address.
	Pods map[HostileKind]int
	// Injected is how many pods are admitted with the injected agent (the namespace is labelled
	// for injection) while carrying their own apportion.io/agent-port annotation, InjectedPort,
	// where the harness serves InjectedKind's answers. The harness runs each one's genuine agent
	// as the injected container says (control port 15000), beside the hostile server.
	Injected     int
	InjectedKind HostileKind
	// Logf logs the tenant's actions; nil discards.
	Logf func(format string, args ...any)
}

// claimsEpoch says whether kind's answers claim a newer epoch.
func claimsEpoch(kind HostileKind) bool {
	return kind == HostileEpochState || kind == HostileEpochStale || kind == HostileEpochWrongInstance
}

// InjectedPort is the port an injected hostile pod's own annotation points the manager at.
const InjectedPort = 16000

// HostileTenant is a running hostile tenant: its objects, its hostile servers and the genuine
// agents of its injected pods.
type HostileTenant struct {
	Cfg  HostileConfig
	Dir  string
	Keys *TrustDir
	env  *Env

	counts map[HostileKind]*hostileCounters
	cancel context.CancelFunc

	mu      sync.Mutex
	servers []*hostileAgent
	agents  []*Agent
}

// InjectedPodKind is the kind Counts reports the injected pods' servers under.
const InjectedPodKind HostileKind = "injected"

// StartHostileTenant creates the tenant's namespace (labelled for injection when the control
// plane has the webhook), quota and Deployment, waits until the manager published its keys there
// (so that its webhook knows the quota), then creates the pods through the API server and starts
// their servers and agents. When only the pods' creation failed it returns the tenant with the
// error (Close it).
func StartHostileTenant(ctx context.Context, e *Env, cfg HostileConfig) (out *HostileTenant, err error) {
	if cfg.Quota == "" {
		cfg.Quota = "tenant"
	}
	if cfg.Workload == "" {
		cfg.Workload = "tenant-app"
	}
	if cfg.Limit == 0 {
		cfg.Limit = 50
	}
	if cfg.InjectedKind == "" {
		cfg.InjectedKind = HostileEpochState
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	if cfg.Injected > 0 && e.CP.Webhook == nil {
		return nil, errors.New("injected hostile pods need the injection webhook, and the control plane has none")
	}
	h := &HostileTenant{Cfg: cfg, Dir: filepath.Join(e.Dir, cfg.Namespace), env: e,
		counts: map[HostileKind]*hostileCounters{}}
	for _, k := range append(slices.Clone(HostileKinds), InjectedPodKind) {
		h.counts[k] = &hostileCounters{}
	}
	var tctx context.Context
	tctx, h.cancel = context.WithCancel(context.Background())
	defer func() {
		if err != nil && out == nil {
			h.Close()
		}
	}()
	if err := os.MkdirAll(h.Dir, 0o755); err != nil {
		return nil, err
	}
	c := e.CP.Client
	if err := e.CP.CreatePodNamespace(ctx, cfg.Namespace); err != nil {
		return nil, err
	}
	total := int32(cfg.Injected)
	for _, n := range cfg.Pods {
		total += int32(n)
	}
	dq := NewQuota(QuotaConfig{Namespace: cfg.Namespace, Name: cfg.Quota, Limit: cfg.Limit,
		Upstream: "http://127.0.0.1:9", Target: cfg.Workload})
	if err := c.Create(ctx, dq); err != nil {
		return nil, fmt.Errorf("creating the tenant's DownstreamQuota: %w", err)
	}
	d := builders.MakeDeployment(cfg.Workload, cfg.Namespace).Image("example.invalid/tenant:1").Replicas(total).Obj()
	if err := c.Create(ctx, d); err != nil {
		return nil, fmt.Errorf("creating the tenant's Deployment: %w", err)
	}
	if h.Keys, err = NewTrustDir(e.CP, filepath.Join(h.Dir, "trust"), cfg.Namespace); err != nil {
		return nil, err
	}
	if err := h.Keys.Wait(ctx, 30*time.Second); err != nil {
		return nil, err
	}
	go h.Keys.Run(tctx, time.Second)

	type job struct {
		kind HostileKind
		i    int
	}
	// The pods that claim a newer epoch come last: today's manager stops at the first one it
	// reaches, and with it its webhook, which every pod of this namespace is admitted through.
	var jobs []job
	for _, k := range HostileKinds {
		if !claimsEpoch(k) {
			for i := range cfg.Pods[k] {
				jobs = append(jobs, job{k, i})
			}
		}
	}
	for i := range cfg.Injected {
		jobs = append(jobs, job{InjectedPodKind, i})
	}
	for _, k := range HostileKinds {
		if claimsEpoch(k) {
			for i := range cfg.Pods[k] {
				jobs = append(jobs, job{k, i})
			}
		}
	}
	errs := make([]error, len(jobs))
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	for n, j := range jobs {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if j.kind == InjectedPodKind {
				errs[n] = h.addInjected(ctx, j.i)
			} else {
				errs[n] = h.addHostile(ctx, j.kind, j.i)
			}
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		// The tenant is half up: the caller closes it, and reports why (a manager that stopped
		// serving its webhook, most likely).
		return h, fmt.Errorf("creating the tenant's pods: %w", err)
	}
	cfg.Logf("tenant %s: %d pods up (%v, %d injected with their own agent-port %d → %s)", cfg.Namespace, len(jobs), cfg.Pods, cfg.Injected, InjectedPort, cfg.InjectedKind)
	return h, nil
}

// addHostile creates one opted-out pod of kind and serves kind's answers at its agent port.
func (h *HostileTenant) addHostile(ctx context.Context, kind HostileKind, i int) error {
	pod, ip, err := h.createPod(ctx, fmt.Sprintf("%s-%s-%03d", h.Cfg.Workload, kind, i), func(pod *corev1.Pod) {
		pod.Annotations[apportionv1.InjectAnnotation] = "false"
		if i%2 == 0 {
			pod.Annotations[apportionv1.AgentPortAnnotation] = strconv.Itoa(AgentControlPort)
		} else {
			pod.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: apportionv1.AgentPortName, ContainerPort: AgentControlPort}}
		}
	})
	if err != nil {
		return err
	}
	if err := h.serve(pod.Name, ip, AgentControlPort, kind, kind); err != nil {
		return err
	}
	return writeRunning(ctx, h.env.CP.Client, pod, ip, true)
}

// addInjected creates a pod the webhook gives the genuine agent while the pod's own annotation
// points at a hostile server beside it; the harness runs both.
func (h *HostileTenant) addInjected(ctx context.Context, i int) error {
	pod, ip, err := h.createPod(ctx, fmt.Sprintf("%s-injected-%03d", h.Cfg.Workload, i), func(pod *corev1.Pod) {
		pod.Annotations[apportionv1.AgentPortAnnotation] = strconv.Itoa(InjectedPort)
	})
	if err != nil {
		return err
	}
	spec, err := agentSpecFromPod(pod, ip, h.Keys.Dir)
	if err != nil {
		return err
	}
	if got := pod.Annotations[apportionv1.AgentPortAnnotation]; got != strconv.Itoa(InjectedPort) {
		h.Cfg.Logf("pod %s: admitted with agent-port annotation %q (it asked for %d)", pod.Name, got, InjectedPort)
	}
	a := newAgentFromSpec(h.env.Bin, h.Cfg.Namespace, pod.Name, ip, h.Keys.Dir, h.Dir, spec)
	h.mu.Lock()
	h.agents = append(h.agents, a)
	h.mu.Unlock()
	if err := a.Start(ctx); err != nil {
		return err
	}
	if err := h.serve(pod.Name, ip, InjectedPort, h.Cfg.InjectedKind, InjectedPodKind); err != nil {
		return err
	}
	return writeRunning(ctx, h.env.CP.Client, pod, ip, false)
}

// createPod creates the tenant's pod name, edited, through the API server, for a fresh loopback
// address.
func (h *HostileTenant) createPod(ctx context.Context, name string, edit func(*corev1.Pod)) (*corev1.Pod, string, error) {
	ip, err := h.env.IPs.Next()
	if err != nil {
		return nil, "", err
	}
	pod := h.podObject(name)
	edit(pod)
	if err := createPod(ctx, h.env.CP.Client, pod, h.Cfg.Logf); err != nil {
		return nil, "", fmt.Errorf("creating pod %s: %w", name, err)
	}
	return pod, ip, nil
}

// serve starts the server answering kind's way at ip:port for pod name, counted under podKind.
func (h *HostileTenant) serve(name, ip string, port int, kind, podKind HostileKind) error {
	srv, err := startHostileAgent(net.JoinHostPort(ip, strconv.Itoa(port)), h.Cfg.Namespace+"/"+name, h.Cfg.Quota, kind, h.counts[podKind])
	if err != nil {
		return err
	}
	h.mu.Lock()
	h.servers = append(h.servers, srv)
	h.mu.Unlock()
	return nil
}

func (h *HostileTenant) podObject(name string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: h.Cfg.Namespace,
			Labels: map[string]string{"app": h.Cfg.Workload}, Annotations: map[string]string{}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "example.invalid/tenant:1"}}},
	}
}

// Counts is what each kind's servers saw so far; under InjectedPodKind, the servers at the port
// the injected pods' own annotation names.
func (h *HostileTenant) Counts() map[HostileKind]HostileCounts {
	out := make(map[HostileKind]HostileCounts, len(h.counts))
	for k, c := range h.counts {
		out[k] = c.snapshot()
	}
	return out
}

// InjectedAgents are the genuine agents of the injected pods.
func (h *HostileTenant) InjectedAgents() []*Agent {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.agents)
}

// Close stops the servers and agents and deletes the tenant's objects (the quota first, so that
// the manager lets go of the pods).
func (h *HostileTenant) Close() {
	if h.cancel != nil {
		h.cancel()
	}
	h.mu.Lock()
	servers, agents := h.servers, h.agents
	h.servers, h.agents = nil, nil
	h.mu.Unlock()
	var wg sync.WaitGroup
	for _, s := range servers {
		wg.Go(s.Close)
	}
	for _, a := range agents {
		wg.Go(func() { _ = a.Kill() })
	}
	wg.Wait()
	deleteAllIn(h.env.CP.Client, h.Cfg.Namespace, &apportionv1.DownstreamQuota{}, &appsv1.Deployment{})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_ = h.env.CP.Client.Delete(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: h.Cfg.Namespace, Name: TrustConfigMap}})
}

// Trust edits a namespace editor can make to the apportion-trust ConfigMap of its namespace.
const (
	EditAddKey    = "add evil.pem"
	EditUnlabel   = "remove the label"
	EditRecreate  = "delete and re-create unlabelled"
	EditImmutable = "make immutable"
	// EditFinal is the last edit TamperTrust makes: all of the above at once.
	EditFinal = "re-create unlabelled and immutable with evil.pem"
)

// EvilKey is the name of the key the tenant plants.
const EvilKey = "evil" + assignment.TrustFileSuffix

// TrustLabel is the label the manager marks its trust ConfigMaps with (controller.TrustLabel).
const TrustLabel = "apportion.io/trust"

// TamperStats counts TamperTrust's edits.
type TamperStats struct {
	// Applied counts the edits the API server took, by edit.
	Applied map[string]int
	// Failed counts those it refused (a conflict with the manager's own write, mostly), Absent the
	// rounds the ConfigMap did not exist.
	Failed, Absent int
	// LastErr is the last refusal.
	LastErr string
	// Final is when the final edit was made (zero if it failed).
	Final time.Time
}

// TamperTrust edits the tenant namespace's trust ConfigMap every period, cycling through the
// edits above, until ctx ends; then it makes EditFinal once. Every edit keeps the keys the
// ConfigMap holds and adds EvilKey (a fresh Ed25519 public key): the tenant plants a key, and the
// genuine agents of its namespace keep the manager's keys, as a tenant who wants its pushes
// accepted beside the manager's would.
func (h *HostileTenant) TamperTrust(ctx context.Context, period time.Duration) TamperStats {
	st := TamperStats{Applied: map[string]int{}}
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		st.LastErr = err.Error()
		return st
	}
	evil, err := assignment.MarshalPublicKey(pub)
	if err != nil {
		st.LastErr = err.Error()
		return st
	}
	edits := []string{EditAddKey, EditUnlabel, EditRecreate, EditImmutable}
	do := func(ctx context.Context, edit string) {
		switch err := h.editTrust(ctx, edit, string(evil)); {
		case err == nil:
			st.Applied[edit]++
			h.Cfg.Logf("tenant %s: trust ConfigMap: %s", h.Cfg.Namespace, edit)
		case apierrors.IsNotFound(err):
			st.Absent++
		default:
			st.Failed++
			st.LastErr = err.Error()
		}
	}
	t := time.NewTicker(period)
	defer t.Stop()
	for i := 0; ; i++ {
		select {
		case <-ctx.Done():
			fctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			for range 5 {
				before := st.Applied[EditFinal]
				do(fctx, EditFinal)
				if st.Applied[EditFinal] > before {
					st.Final = time.Now()
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			return st
		case <-t.C:
		}
		do(ctx, edits[i%len(edits)])
	}
}

// editTrust makes one edit; an immutable ConfigMap, whose data cannot change, is deleted and
// re-created with the edit, as its owner would.
func (h *HostileTenant) editTrust(ctx context.Context, edit, evil string) error {
	c := h.env.CP.Client
	var cm corev1.ConfigMap
	key := types.NamespacedName{Namespace: h.Cfg.Namespace, Name: TrustConfigMap}
	if err := c.Get(ctx, key, &cm); err != nil {
		return err
	}
	data := gomaps.Clone(cm.Data)
	if data == nil {
		data = map[string]string{}
	}
	data[EvilKey] = evil
	labels := gomaps.Clone(cm.Labels)
	recreate := func(labels map[string]string, immutable bool) error {
		if err := c.Delete(ctx, &cm, client.Preconditions{UID: &cm.UID}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		fresh := &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Namespace: cm.Namespace, Name: cm.Name, Labels: labels},
			Data:       data,
		}
		if immutable {
			fresh.Immutable = ptr.To(true)
		}
		return c.Create(ctx, fresh)
	}
	immutable := cm.Immutable != nil && *cm.Immutable
	switch edit {
	case EditAddKey:
		if immutable {
			return recreate(labels, true)
		}
		cm.Data = data
	case EditUnlabel:
		delete(labels, TrustLabel)
		if immutable {
			return recreate(labels, true)
		}
		cm.Labels, cm.Data = labels, data
	case EditRecreate:
		return recreate(nil, false)
	case EditImmutable:
		if immutable {
			return recreate(labels, true)
		}
		cm.Data, cm.Immutable = data, ptr.To(true)
	case EditFinal:
		return recreate(nil, true)
	default:
		return fmt.Errorf("unknown trust edit %q", edit)
	}
	return c.Update(ctx, &cm)
}

// TrustConfigMapOf reads the trust ConfigMap of namespace (nil when there is none).
func (cp *ControlPlane) TrustConfigMapOf(ctx context.Context, namespace string) (*corev1.ConfigMap, error) {
	var cm corev1.ConfigMap
	if err := cp.Client.Get(ctx, types.NamespacedName{Namespace: namespace, Name: TrustConfigMap}, &cm); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, nil
		}
		return nil, err
	}
	return &cm, nil
}
