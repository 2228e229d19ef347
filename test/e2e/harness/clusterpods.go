package harness

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	autoscalingv1 "k8s.io/api/autoscaling/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// clusterPods is the harness's kubelet in the cluster mode: it does not create or delete pods
// (the ReplicaSet controller does; the scheduler binds them to kwok nodes; kwok gives them an
// address and a phase) but runs what a kubelet runs and kwok cannot, the pods' agents:
//
//   - a pod kwok set Running with a podIP gets its real agent process at that address, as the
//     admitted pod's injected container says (agentSpecFromPod); once the agent answers
//     /readyz (an assignment is applied: it enforces its permits) the pod is annotated
//     AgentReadyAnnotation and kwok sets it Ready — readiness follows /readyz;
//   - traffic reaches an agent (Agent.Serving) only while its pod is Ready and not terminating:
//     what the endpoint-slice controller publishes as a ready endpoint. The load generator
//     plays a Service's clients, but reads the pods rather than EndpointSlices: the API server
//     refuses loopback addresses in an EndpointSlice ("may not be in the loopback range"), so
//     the endpoint-slice controller cannot publish these pods;
//   - a terminating pod's agent keeps running for the Terminating time (a preStop hook), then
//     gets SIGTERM and drains; once it exited the pod is annotated AgentStoppedAnnotation and
//     kwok deletes it;
//   - a pod gone without terminating (force-deleted, e.g. by the pod garbage collector after its
//     node was deleted) has its agent killed if it still runs.
type clusterPods struct {
	w      *Workload
	cs     kubernetes.Interface
	cancel context.CancelFunc
	ctx    context.Context
	wg     sync.WaitGroup

	// Guarded by w.mu.
	pods        map[string]*podRun // by pod name, pods that exist
	history     []*podRun          // every pod seen, in order of appearance
	terminating time.Duration
	errs        []error
}

// podRun is one pod as the kubelet sees it.
type podRun struct {
	name     string
	uid      types.UID
	node, ip string
	created  time.Time
	agent    *Agent
	// starting: its agent is being (or was) started; started is closed once the process runs
	// or failed to. stopping: it is terminating and its agent being stopped. gone: the pod
	// object no longer exists. lost: its node was lost (its agent killed).
	starting, stopping, gone, lost bool
	started                        chan struct{}
	// enforced: the agent first answered /readyz; ready: the pod was first seen Ready;
	// serving: traffic was first let through to it.
	enforced, ready, serving time.Time
}

// PodTimes is what happened to one pod of a cluster-mode workload.
type PodTimes struct {
	Name, Node string
	// Seen is when the harness first saw the pod.
	Seen time.Time
	// Enforced is when its agent first answered /readyz; Ready when the pod was first seen
	// Ready; Serving when traffic was first let through to it; FirstCall when the app first
	// called through it, FirstStatus that call's status (0: no answer).
	Enforced, Ready, Serving, FirstCall time.Time
	FirstStatus                         int
	Lost                                bool
}

func newClusterPods(w *Workload) (*clusterPods, error) {
	cs, err := kubernetes.NewForConfig(w.cp.Config)
	if err != nil {
		return nil, err
	}
	cl := &clusterPods{w: w, cs: cs, pods: map[string]*podRun{}, terminating: w.cfg.Terminating}
	cl.ctx, cl.cancel = context.WithCancel(context.Background())
	return cl, nil
}

// run starts the informers on the workload's namespace and waits for their first listing.
func (cl *clusterPods) run(ctx context.Context) error {
	f := informers.NewSharedInformerFactoryWithOptions(cl.cs, 0, informers.WithNamespace(cl.w.cfg.Namespace))
	pods := f.Core().V1().Pods().Informer()
	if _, err := pods.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { cl.onPod(obj.(*corev1.Pod)) },
		UpdateFunc: func(_, obj any) { cl.onPod(obj.(*corev1.Pod)) },
		DeleteFunc: func(obj any) {
			if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = tomb.Obj
			}
			if pod, ok := obj.(*corev1.Pod); ok {
				cl.onPodGone(pod)
			}
		},
	}); err != nil {
		return err
	}
	f.Start(cl.ctx.Done())
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("cluster kubelet: %v informer did not sync", typ)
		}
	}
	cl.wg.Go(func() {
		<-cl.ctx.Done()
		f.Shutdown()
	})
	return nil
}

func (cl *clusterPods) stop() {
	cl.cancel()
	cl.wg.Wait()
}

func (cl *clusterPods) fail(err error) {
	cl.w.cfg.Logf("cluster kubelet: %v", err)
	cl.w.mu.Lock()
	cl.errs = append(cl.errs, err)
	cl.w.mu.Unlock()
}

func (cl *clusterPods) ours(pod *corev1.Pod) bool {
	for k, v := range cl.w.Labels() {
		if pod.Labels[k] != v {
			return false
		}
	}
	return true
}

func (cl *clusterPods) onPod(pod *corev1.Pod) {
	if !cl.ours(pod) {
		return
	}
	w := cl.w
	w.mu.Lock()
	defer w.mu.Unlock()
	r := cl.pods[pod.Name]
	if r == nil || r.uid != pod.UID {
		if pod.DeletionTimestamp != nil && r == nil && pod.Status.PodIP == "" {
			// Deleted before it ever ran: nothing to stop.
			cl.wg.Go(func() { cl.annotate(pod.Name, AgentStoppedAnnotation) })
			return
		}
		r = &podRun{name: pod.Name, uid: pod.UID, created: time.Now()}
		cl.pods[pod.Name] = r
		cl.history = append(cl.history, r)
		w.live = append(w.live, pod.Name)
	}
	r.node = pod.Spec.NodeName
	if pod.DeletionTimestamp != nil {
		if r.agent != nil {
			r.agent.gated.Store(true) // no longer an endpoint
		}
		if !r.stopping {
			r.stopping = true
			w.live = slices.DeleteFunc(w.live, func(s string) bool { return s == pod.Name })
			w.cfg.Logf("pod %s terminating", pod.Name)
			cl.wg.Go(func() { cl.stopAgent(r) })
		}
		return
	}
	if !r.starting && !r.lost && pod.Status.Phase == corev1.PodRunning && pod.Status.PodIP != "" {
		r.starting, r.ip, r.started = true, pod.Status.PodIP, make(chan struct{})
		p := pod.DeepCopy()
		cl.wg.Go(func() { cl.startAgent(p, r) })
	}
	if r.ready.IsZero() && podReady(pod) {
		r.ready = time.Now()
	}
	// Traffic follows the pod's readiness, as the endpoint-slice controller publishes it
	// (Ready and not terminating; see clusterPods on why not the EndpointSlices themselves).
	if r.agent != nil && podReady(pod) {
		r.agent.gated.Store(false)
		if r.serving.IsZero() {
			r.serving = time.Now()
		}
	}
}

func podReady(pod *corev1.Pod) bool {
	for _, c := range pod.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// startAgent runs the pod's agent at its address (runAgent) and, once it is ready, has kwok
// mark the pod Ready.
func (cl *clusterPods) startAgent(pod *corev1.Pod, r *podRun) {
	w := cl.w
	defer close(r.started)
	if w.cfg.NoAgents {
		cl.annotate(pod.Name, AgentReadyAnnotation)
		return
	}
	errGone := errors.New("the pod is gone")
	_, err := w.runAgent(cl.ctx, pod, r.ip, podProbe{
		gated: true, // no traffic before its pod is Ready
		started: func(a *Agent) error {
			w.mu.Lock()
			r.agent = a
			gone := r.gone || r.lost
			w.mu.Unlock()
			w.cfg.Logf("pod %s on %s at %s (agent pid %d)", pod.Name, r.node, r.ip, a.Pid())
			if gone {
				cl.killAgent(r)
				return errGone
			}
			return nil
		},
		// A live pod whose agent never gets ready fails WaitSettled.
		ready: func() {
			w.mu.Lock()
			r.enforced = time.Now()
			w.mu.Unlock()
			cl.annotate(pod.Name, AgentReadyAnnotation)
		},
	})
	if err != nil && !errors.Is(err, errGone) && cl.ctx.Err() == nil {
		cl.fail(fmt.Errorf("pod %s on %s: %w", pod.Name, r.node, err))
	}
}

// stopAgent plays a terminating pod: preStop (Terminating), SIGTERM, drain, exit; then kwok may
// delete the pod.
func (cl *clusterPods) stopAgent(r *podRun) {
	w := cl.w
	w.mu.Lock()
	starting, term := r.starting, cl.terminating
	w.mu.Unlock()
	if starting {
		select {
		case <-r.started:
		case <-cl.ctx.Done():
			return
		}
	}
	w.mu.Lock()
	a := r.agent
	w.mu.Unlock()
	if a != nil && a.Running() {
		if sleepOrDone(cl.ctx, term) != nil {
			return
		}
		if err := w.drainAgent(r.name, a); err != nil {
			cl.fail(fmt.Errorf("stopping the agent of %s: %w", r.name, err))
		}
	}
	w.dropAgent(r.name, a)
	cl.annotate(r.name, AgentStoppedAnnotation)
}

// onPodGone: the pod object is gone. An agent still running belonged to a pod deleted without
// a grace period: its containers are killed.
func (cl *clusterPods) onPodGone(pod *corev1.Pod) {
	w := cl.w
	w.mu.Lock()
	r := cl.pods[pod.Name]
	if r == nil || r.uid != pod.UID {
		w.mu.Unlock()
		return
	}
	r.gone = true
	delete(cl.pods, pod.Name)
	w.live = slices.DeleteFunc(w.live, func(s string) bool { return s == pod.Name })
	stopping := r.stopping
	w.mu.Unlock()
	w.cfg.Logf("pod %s gone", pod.Name)
	if !stopping {
		cl.killAgent(r)
	}
}

func (cl *clusterPods) killAgent(r *podRun) {
	w := cl.w
	w.mu.Lock()
	a := r.agent
	w.mu.Unlock()
	if a == nil {
		return
	}
	if a.Running() {
		w.cfg.Logf("agent %s: kill -9", r.name)
		_ = a.Kill()
	}
	w.dropAgent(r.name, a)
}

// annotate sets annotation key=true on pod name (a merge patch: no conflicts). A pod already
// gone is fine.
func (cl *clusterPods) annotate(name, key string) {
	patch := []byte(`{"metadata":{"annotations":{"` + key + `":"true"}}}`)
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: cl.w.cfg.Namespace}}
	for attempt := 0; ; attempt++ {
		err := cl.w.cp.Client.Patch(cl.ctx, pod, client.RawPatch(types.MergePatchType, patch))
		if err == nil || apierrors.IsNotFound(err) || cl.ctx.Err() != nil {
			return
		}
		if attempt == 20 {
			cl.fail(fmt.Errorf("annotating pod %s %s: %w", name, key, err))
			return
		}
		select {
		case <-cl.ctx.Done():
			return
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Scale writes the Deployment's spec.replicas through its scale subresource, as the HPA
// controller does.
func (w *Workload) Scale(ctx context.Context, n int32) error {
	d := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: w.deployment().Name, Namespace: w.cfg.Namespace}}
	sc := &autoscalingv1.Scale{ObjectMeta: metav1.ObjectMeta{Name: d.Name, Namespace: d.Namespace}, Spec: autoscalingv1.ScaleSpec{Replicas: n}}
	if err := w.cp.Client.SubResource("scale").Update(ctx, d, client.WithSubResourceBody(sc)); err != nil {
		return fmt.Errorf("scaling the Deployment to %d: %w", n, err)
	}
	w.cfg.Logf("deployment %s: /scale spec.replicas=%d", d.Name, n)
	return nil
}

// UpdateTemplate changes the Deployment's pod template (a rollout) or strategy.
func (w *Workload) UpdateTemplate(ctx context.Context, mutate func(*appsv1.Deployment)) error {
	var d appsv1.Deployment
	if err := w.cp.Client.Get(ctx, types.NamespacedName{Namespace: w.cfg.Namespace, Name: w.deployment().Name}, &d); err != nil {
		return err
	}
	orig := d.DeepCopy()
	mutate(&d)
	return w.cp.Client.Patch(ctx, &d, client.MergeFrom(orig))
}

// WaitSettled waits (cluster mode) until the Deployment has n replicas, all updated, ready and
// available, no other pod exists (none terminating), and every pod's agent enforces and takes
// traffic. An agent the kubelet could not run fails it at once.
func (w *Workload) WaitSettled(ctx context.Context, n int32, timeout time.Duration) error {
	if w.cl == nil {
		return errors.New("WaitSettled: not in the cluster mode")
	}
	return poll(ctx, timeout, 50*time.Millisecond, func() error {
		w.mu.Lock()
		errs := errors.Join(w.cl.errs...)
		var waiting []string
		for name, r := range w.cl.pods {
			switch {
			case r.lost:
				waiting = append(waiting, name+" (lost)")
			case r.stopping:
				waiting = append(waiting, name+" (terminating)")
			case !w.cfg.NoAgents && (r.enforced.IsZero() || r.serving.IsZero()):
				waiting = append(waiting, name+" (not enforcing or not serving)")
			}
		}
		pods := len(w.cl.pods)
		w.mu.Unlock()
		if errs != nil {
			return fatal(errs)
		}
		var d appsv1.Deployment
		err := w.cp.Client.Get(ctx, types.NamespacedName{Namespace: w.cfg.Namespace, Name: w.deployment().Name}, &d)
		st := d.Status
		if err == nil && st.ObservedGeneration >= d.Generation && st.Replicas == n && st.UpdatedReplicas == n &&
			st.ReadyReplicas == n && st.AvailableReplicas == n && int32(pods) == n && len(waiting) == 0 {
			return nil
		}
		sort.Strings(waiting)
		return fmt.Errorf("the Deployment did not settle at %d pods within %s: deployment replicas=%d updated=%d ready=%d available=%d (generation %d observed %d, err %s); %d pods, waiting for %s",
			n, timeout, st.Replicas, st.UpdatedReplicas, st.ReadyReplicas, st.AvailableReplicas, d.Generation, st.ObservedGeneration, fmt.Sprint(err), pods, strings.Join(waiting, ", "))
	})
}

// LoseNode plays the loss of a node: every agent on it is killed (kill -9: the machine is
// gone), then its Node object is deleted. The pods stay until the pod garbage collector
// deletes them (orphaned pods); the ReplicaSet controller then replaces them.
func (w *Workload) LoseNode(ctx context.Context, node string) ([]string, error) {
	if w.cl == nil {
		return nil, errors.New("LoseNode: not in the cluster mode")
	}
	w.mu.Lock()
	var lost []*podRun
	for _, r := range w.cl.pods {
		if r.node == node {
			r.lost = true
			lost = append(lost, r)
		}
	}
	w.mu.Unlock()
	names := make([]string, 0, len(lost))
	for _, r := range lost {
		w.cl.killAgent(r)
		names = append(names, r.name)
	}
	sort.Strings(names)
	w.cfg.Logf("node %s lost: agents of %v killed", node, names)
	return names, w.cfg.Cluster.DeleteNode(ctx, node)
}

// PodNodes maps each existing pod to its node (cluster mode).
func (w *Workload) PodNodes() map[string]string {
	out := map[string]string{}
	if w.cl == nil {
		return out
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	for name, r := range w.cl.pods {
		out[name] = r.node
	}
	return out
}

// PodTimes lists every pod the cluster-mode workload has seen, in order of appearance.
func (w *Workload) PodTimes() []PodTimes {
	if w.cl == nil {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]PodTimes, 0, len(w.cl.history))
	for _, r := range w.cl.history {
		pt := PodTimes{Name: r.name, Node: r.node, Seen: r.created, Enforced: r.enforced, Ready: r.ready, Serving: r.serving, Lost: r.lost}
		if r.agent != nil {
			pt.FirstCall, pt.FirstStatus = r.agent.FirstCall(), r.agent.FirstStatus()
		}
		out = append(out, pt)
	}
	return out
}
