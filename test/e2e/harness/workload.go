package harness

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/apportion/apportion/internal/testing/builders"
)

// KubeletFinalizer keeps a deleted Pod terminating until the harness (the "kubelet") has stopped
// its agent, as a real kubelet does.
const KubeletFinalizer = "e2e.apportion.io/kubelet"

// WorkloadConfig describes a Deployment scaled by an HPA whose pods run agents.
type WorkloadConfig struct {
	Namespace, Name string
	// MinReplicas and MaxReplicas of the HPA.
	MinReplicas, MaxReplicas int32
	// Deployment and HPA, when set, are created as given (their namespace is set); otherwise
	// the harness builds them. The pods copy the Deployment's template.
	Deployment *appsv1.Deployment
	HPA        *autoscalingv2.HorizontalPodAutoscaler
	// PodStartDelay is how long the "kubelet" takes from a Pod's creation to its agent's start.
	PodStartDelay time.Duration
	// Terminating is how long a deleted Pod stays terminating (its agent still running) before
	// the agent is stopped and the Pod goes away.
	Terminating time.Duration
	// AgentArgs are extra agent flags.
	AgentArgs []string
	// NoAgents creates the Pod objects (Running, with an address) but starts no agent: for a
	// manager that only computes permits, or when there is no agent binary.
	NoAgents bool
	// Logf logs the workload's actions; nil discards.
	Logf func(format string, args ...any)
	// Cluster, when set, runs the workload on Kubernetes' own control loops (clusterpods.go):
	// the real deployment and ReplicaSet controllers create and delete the pods, the real
	// scheduler places them on kwok's nodes; the harness only plays the HPA and runs each
	// pod's agent.
	Cluster *Cluster
}

// Workload plays the HPA, the deployment controller and the kubelet for one Deployment.
type Workload struct {
	cfg  WorkloadConfig
	cp   *ControlPlane
	bin  *Binaries
	dir  string
	keys *TrustDir
	ips  *IPPool

	mu     sync.Mutex
	agents map[string]*Agent // every pod's agent whose process may be alive, deleted pods' included
	live   []string          // pods not deleted, in creation order
	seq    int
	wg     sync.WaitGroup
	// cl runs the pods' agents in the cluster mode (nil otherwise).
	cl *clusterPods
}

// NewWorkload prepares a workload; Create makes its objects.
func NewWorkload(cp *ControlPlane, bin *Binaries, keys *TrustDir, ips *IPPool, dir string, cfg WorkloadConfig) *Workload {
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	return &Workload{cfg: cfg, cp: cp, bin: bin, dir: dir, keys: keys, ips: ips, agents: map[string]*Agent{}}
}

// Config returns the configuration.
func (w *Workload) Config() WorkloadConfig { return w.cfg }

// Labels are the pods' labels.
func (w *Workload) Labels() map[string]string {
	return w.deployment().Spec.Template.Labels
}

func (w *Workload) deployment() *appsv1.Deployment {
	if w.cfg.Deployment != nil {
		return w.cfg.Deployment
	}
	// No agent: the injection webhook adds it, as in a cluster.
	w.cfg.Deployment = builders.MakeDeployment(w.cfg.Name, w.cfg.Namespace).Image("example.invalid/app:e2e").Obj()
	return w.cfg.Deployment
}

func (w *Workload) hpa() *autoscalingv2.HorizontalPodAutoscaler {
	if w.cfg.HPA != nil {
		return w.cfg.HPA
	}
	w.cfg.HPA = builders.MakeHPA(w.cfg.Name, w.cfg.Namespace).
		Replicas(w.cfg.MinReplicas, w.cfg.MaxReplicas).
		CPUUtilization(70).
		Obj()
	return w.cfg.HPA
}

// Create creates the Deployment and the HPA with replicas, then (simulated mode) the pods and
// their agents, or (cluster mode) waits until the Deployment's pods are ready with their agents
// enforcing.
func (w *Workload) Create(ctx context.Context, replicas int32) error {
	if w.cfg.Cluster != nil {
		cl, err := newClusterPods(w)
		if err != nil {
			return err
		}
		w.cl = cl
		if err := cl.run(ctx); err != nil {
			return err
		}
	}
	d := w.deployment().DeepCopy()
	d.Namespace, d.Spec.Replicas = w.cfg.Namespace, ptr.To(replicas)
	if err := w.cp.Client.Create(ctx, d); err != nil {
		return fmt.Errorf("creating the Deployment: %w", err)
	}
	h := w.hpa().DeepCopy()
	h.Namespace = w.cfg.Namespace
	if err := w.cp.Client.Create(ctx, h); err != nil {
		return fmt.Errorf("creating the HPA: %w", err)
	}
	if err := w.SetHPA(ctx, replicas, replicas); err != nil {
		return err
	}
	if w.cl != nil {
		return w.WaitSettled(ctx, replicas, 2*time.Minute)
	}
	_, err := w.AddPods(ctx, int(replicas))
	return err
}

// SetHPA writes the HPA's status: its decision (desired) and what it sees running (current).
func (w *Workload) SetHPA(ctx context.Context, desired, current int32) error {
	var h autoscalingv2.HorizontalPodAutoscaler
	if err := w.cp.Client.Get(ctx, types.NamespacedName{Namespace: w.cfg.Namespace, Name: w.hpa().Name}, &h); err != nil {
		return err
	}
	orig := h.DeepCopy()
	h.Status.DesiredReplicas, h.Status.CurrentReplicas = desired, current
	now := metav1.Now()
	h.Status.LastScaleTime = &now
	if err := w.cp.Client.Status().Patch(ctx, &h, client.MergeFrom(orig)); err != nil {
		return fmt.Errorf("writing the HPA status: %w", err)
	}
	w.cfg.Logf("hpa %s: desired=%d current=%d", h.Name, desired, current)
	return nil
}

// AddPods adds n pods in parallel.
func (w *Workload) AddPods(ctx context.Context, n int) ([]*Agent, error) {
	out := make([]*Agent, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { out[i], errs[i] = w.AddPod(ctx) })
	}
	wg.Wait()
	return out, errors.Join(errs...)
}

// AddPod creates a Pod object through the API server (and so the injection webhook) and, after
// PodStartDelay, runs its agent on a fresh loopback address (runAgent) and writes the Pod's
// status: podIP, Running; Ready once the agent is ready.
func (w *Workload) AddPod(ctx context.Context) (*Agent, error) {
	ip, err := w.ips.Next()
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	w.seq++
	name := fmt.Sprintf("%s-%03d", w.deployment().Name, w.seq)
	w.mu.Unlock()

	tpl := w.deployment().Spec.Template
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: name, Namespace: w.cfg.Namespace,
			Labels:      maps(tpl.Labels),
			Annotations: maps(tpl.Annotations),
			Finalizers:  []string{KubeletFinalizer},
		},
		Spec: *tpl.Spec.DeepCopy(),
	}
	if err := createPod(ctx, w.cp.Client, pod, w.cfg.Logf); err != nil {
		return nil, fmt.Errorf("creating pod %s: %w", name, err)
	}
	if err := sleepOrDone(ctx, w.cfg.PodStartDelay); err != nil {
		return nil, err
	}
	running := func() error {
		w.mu.Lock()
		w.live = append(w.live, name)
		w.mu.Unlock()
		return writeRunning(ctx, w.cp.Client, pod, ip, false)
	}
	if w.cfg.NoAgents {
		if err := running(); err != nil {
			return nil, err
		}
		w.cfg.Logf("pod %s up at %s (no agent)", name, ip)
		return nil, nil
	}
	return w.runAgent(ctx, pod, ip, podProbe{
		started: func(a *Agent) error {
			if err := running(); err != nil {
				return err
			}
			w.cfg.Logf("pod %s up at %s (agent pid %d)", name, ip, a.Pid())
			return nil
		},
		ready: func() { w.markReady(ctx, name) },
	})
}

// markReady sets the Ready condition of a pod not deleted (the simulated mode's readiness).
func (w *Workload) markReady(ctx context.Context, name string) {
	var pod corev1.Pod
	if err := w.cp.Client.Get(ctx, types.NamespacedName{Namespace: w.cfg.Namespace, Name: name}, &pod); err != nil || pod.DeletionTimestamp != nil {
		return
	}
	orig := pod.DeepCopy()
	for i := range pod.Status.Conditions {
		if pod.Status.Conditions[i].Type == corev1.PodReady {
			pod.Status.Conditions[i].Status = corev1.ConditionTrue
			pod.Status.Conditions[i].Reason = ""
			pod.Status.Conditions[i].LastTransitionTime = metav1.Now()
		}
	}
	_ = w.cp.Client.Status().Patch(ctx, &pod, client.MergeFrom(orig))
}

// Pods lists the pods not deleted, oldest first.
func (w *Workload) Pods() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.live)
}

// Agent returns the agent of pod.
func (w *Workload) Agent(pod string) *Agent {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.agents[pod]
}

// Agents lists every agent whose process is alive (suspended ones included), whether or not its
// pod still exists: what may be calling the downstream.
func (w *Workload) Agents() []*Agent {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]*Agent, 0, len(w.agents))
	for _, name := range sortedKeys(w.agents) {
		if a := w.agents[name]; a.Running() {
			out = append(out, a)
		}
	}
	return out
}

// DeletePod deletes a pod as the API and the kubelet would: the Pod turns terminating
// (deletionTimestamp; the kubelet finalizer holds it), its agent keeps running for terminating,
// then gets SIGTERM, and once it exited the finalizer is removed and the Pod is gone.
func (w *Workload) DeletePod(ctx context.Context, name string, terminating time.Duration) error {
	w.mu.Lock()
	w.live = slices.DeleteFunc(w.live, func(s string) bool { return s == name })
	a := w.agents[name]
	w.mu.Unlock()
	key := types.NamespacedName{Namespace: w.cfg.Namespace, Name: name}
	if err := w.cp.Client.Delete(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: w.cfg.Namespace}}); err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	w.cfg.Logf("pod %s terminating", name)
	if err := sleepOrDone(ctx, terminating); err != nil {
		return err
	}
	if a != nil {
		if err := w.drainAgent(name, a); err != nil {
			return err
		}
	}
	if err := w.removeFinalizer(ctx, key); err != nil {
		return err
	}
	w.cfg.Logf("pod %s gone", name)
	return nil
}

func (w *Workload) removeFinalizer(ctx context.Context, key types.NamespacedName) error {
	for range 10 {
		var pod corev1.Pod
		if err := w.cp.Client.Get(ctx, key, &pod); err != nil {
			return client.IgnoreNotFound(err)
		}
		if !slices.Contains(pod.Finalizers, KubeletFinalizer) {
			return nil
		}
		pod.Finalizers = slices.DeleteFunc(pod.Finalizers, func(s string) bool { return s == KubeletFinalizer })
		err := w.cp.Client.Update(ctx, &pod)
		if err == nil || apierrors.IsNotFound(err) {
			return nil
		}
		if !apierrors.IsConflict(err) {
			return err
		}
	}
	return fmt.Errorf("removing the finalizer of %s: too many conflicts", key)
}

// KillAgent kills a pod's agent (kill -9): the container crashed; the Pod stays.
func (w *Workload) KillAgent(name string) error {
	return w.onAgent(name, "kill -9", (*Agent).Kill)
}

// RestartAgent starts a killed agent again on the same address (the kubelet restarted the
// container; the Pod keeps its IP).
func (w *Workload) RestartAgent(ctx context.Context, name string) error {
	return w.onAgent(name, "restart", func(a *Agent) error {
		if err := a.Kill(); err != nil { // a no-op unless it runs
			return err
		}
		return a.Start(ctx)
	})
}

// SuspendAgent SIGSTOPs a pod's agent: alive, holding what it holds, but unreachable.
func (w *Workload) SuspendAgent(name string) error {
	return w.onAgent(name, "SIGSTOP", (*Agent).Suspend)
}

// ResumeAgent SIGCONTs a pod's agent.
func (w *Workload) ResumeAgent(name string) error {
	return w.onAgent(name, "SIGCONT", (*Agent).Resume)
}

func (w *Workload) onAgent(name, what string, do func(*Agent) error) error {
	a := w.Agent(name)
	if a == nil {
		return fmt.Errorf("no agent %s", name)
	}
	w.cfg.Logf("agent %s: %s", name, what)
	return do(a)
}

// ScaleOptions pace a scale event.
type ScaleOptions struct {
	// Step is the pause between the HPA's decision, the Deployment's spec.replicas, the pods'
	// creation or deletion and the HPA's current replicas.
	Step time.Duration
	// Terminating overrides WorkloadConfig.Terminating when > 0.
	Terminating time.Duration
	// BetweenPhases, when set, is called between the phases with their name ("decided",
	// "spec", "pods", "current") — a scenario kills the manager there.
	BetweenPhases func(phase string)
}

// ScaleTo plays one HPA scale event to n pods: the HPA decides (status.desiredReplicas), writes
// spec.replicas (in the cluster mode through the Deployment's scale subresource), the pods are
// created or deleted — in the simulated mode by the harness, newest first; in the cluster mode by
// the ReplicaSet controller, which chooses the victims itself, until the Deployment settled —
// and the HPA sees them (status.currentReplicas).
func (w *Workload) ScaleTo(ctx context.Context, n int32, o ScaleOptions) error {
	term := w.cfg.Terminating
	if o.Terminating > 0 {
		term = o.Terminating
	}
	if w.cl != nil {
		w.mu.Lock()
		w.cl.terminating = term
		w.mu.Unlock()
	}
	pause := func(phase string) error {
		if o.BetweenPhases != nil {
			o.BetweenPhases(phase)
		}
		return sleepOrDone(ctx, o.Step)
	}
	cur := int32(len(w.Pods()))
	if err := w.SetHPA(ctx, n, cur); err != nil {
		return err
	}
	if err := pause("decided"); err != nil {
		return err
	}
	if err := w.Scale(ctx, n); err != nil {
		return err
	}
	if err := pause("spec"); err != nil {
		return err
	}
	if err := w.scalePods(ctx, cur, n, term); err != nil {
		return err
	}
	if err := pause("pods"); err != nil {
		return err
	}
	if err := w.SetHPA(ctx, n, int32(len(w.Pods()))); err != nil {
		return err
	}
	return pause("current")
}

// scalePods plays the ReplicaSet controller and the kubelets from cur pods to n.
func (w *Workload) scalePods(ctx context.Context, cur, n int32, term time.Duration) error {
	switch {
	case w.cl != nil:
		return w.WaitSettled(ctx, n, 2*time.Minute)
	case n > cur:
		_, err := w.AddPods(ctx, int(n-cur))
		return err
	case n < cur:
		pods := w.Pods()
		victims := pods[len(pods)-int(cur-n):]
		errs := make([]error, len(victims))
		var wg sync.WaitGroup
		for i, p := range victims {
			wg.Go(func() { errs[i] = w.DeletePod(ctx, p, term) })
		}
		wg.Wait()
		return errors.Join(errs...)
	}
	return nil
}

// Close kills every agent and waits for the workload's goroutines.
func (w *Workload) Close() {
	if w.cl != nil {
		w.cl.stop()
	}
	w.mu.Lock()
	list := make([]*Agent, 0, len(w.agents))
	for _, a := range w.agents {
		list = append(list, a)
	}
	w.mu.Unlock()
	var wg sync.WaitGroup
	for _, a := range list {
		wg.Go(func() { _ = a.Kill() })
	}
	wg.Wait()
	w.wg.Wait()
}

func maps(m map[string]string) map[string]string {
	out := make(map[string]string, len(m)+1)
	for k, v := range m {
		out[k] = v
	}
	return out
}
