package harness

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// AgentImage is the agent image the harness's manager injects (--agent-image). The harness's
// "kubelet" runs the agent binary it built for it, and refuses any other image.
const AgentImage = "e2e.apportion.invalid/agent:built-by-the-harness"

// AgentContainer is the name of the agent's container, injected or hand-written.
const AgentContainer = "apportion-agent"

// createPod creates pod through the API server, retrying while the injection webhook cannot be
// called — the API server then refuses the pod (failurePolicy Fail), and the ReplicaSet
// controller retries the same way until a manager serves the webhook again. On success pod holds
// what the API server admitted.
func createPod(ctx context.Context, c client.Client, pod *corev1.Pod, logf func(string, ...any)) error {
	backoff := 50 * time.Millisecond
	logged := false
	for {
		p := pod.DeepCopy()
		err := c.Create(ctx, p)
		if err == nil {
			*pod = *p
			return nil
		}
		if !strings.Contains(err.Error(), "failed calling webhook") {
			return err
		}
		if !logged {
			logf("pod %s: the API server cannot call the injection webhook; retrying as the ReplicaSet controller would (%v)", pod.Name, err)
			logged = true
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("creating pod %s: %w (last: %w)", pod.Name, ctx.Err(), err)
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, time.Second)
	}
}

// writeRunning writes the status a kubelet gives a started pod: Running at ip, Ready or not yet
// (AgentNotReady).
func writeRunning(ctx context.Context, c client.Client, pod *corev1.Pod, ip string, ready bool) error {
	orig := pod.DeepCopy()
	now := metav1.Now()
	readyCond := corev1.PodCondition{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now}
	if !ready {
		readyCond.Status, readyCond.Reason = corev1.ConditionFalse, "AgentNotReady"
	}
	pod.Status = corev1.PodStatus{
		Phase: corev1.PodRunning, PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}, HostIP: "127.0.0.1", StartTime: &now,
		Conditions: []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now}, readyCond},
	}
	if err := c.Status().Patch(ctx, pod, client.MergeFrom(orig)); err != nil {
		return fmt.Errorf("writing pod %s status: %w", pod.Name, err)
	}
	return nil
}

// podProbe is what one mode's kubelet adds to runAgent.
type podProbe struct {
	// gated: no traffic reaches the agent until the mode lets it (Agent.gated).
	gated bool
	// started runs once the agent's process answers /healthz, before the readiness probe: the
	// mode's bookkeeping and the pod's status. An error stops there: runAgent returns it.
	started func(*Agent) error
	// ready turns the pod Ready once the agent answered /readyz.
	ready func()
}

// runAgent is the kubelet's one pod-readiness path, in both modes (AddPod in the simulated one,
// clusterPods.startAgent in the cluster one): it runs the admitted pod's agent at ip as the
// pod's agent container says (agentSpecFromPod), makes it one of the workload's agents, calls
// p.started, and then plays the readiness probe in the background: once the agent answers
// /readyz — it applied an assignment, so it enforces its permits — p.ready turns the pod Ready
// (the simulated mode patches the pod's status; in the cluster mode kwok does, on an
// annotation). An agent that never gets ready, or exits, leaves its pod not Ready.
func (w *Workload) runAgent(ctx context.Context, pod *corev1.Pod, ip string, p podProbe) (*Agent, error) {
	spec, err := agentSpecFromPod(pod, ip, w.keys.Dir)
	if err != nil {
		return nil, err
	}
	if err := mountProjected(ctx, w.cp.Client, pod); err != nil {
		return nil, err
	}
	a := newAgentFromSpec(w.bin, w.cfg.Namespace, pod.Name, ip, w.keys.Dir, w.dir, spec, w.cfg.AgentArgs...)
	a.gated.Store(p.gated)
	if err := a.Start(ctx); err != nil {
		_ = a.Kill()
		return nil, err
	}
	w.mu.Lock()
	w.agents[pod.Name] = a
	w.mu.Unlock()
	if err := p.started(a); err != nil {
		return a, err
	}
	w.wg.Go(func() {
		if a.WaitReady(ctx, 30*time.Second) == nil {
			p.ready()
		}
	})
	return a, nil
}

// drainAgent plays SIGTERM reaching a pod's containers: the app stops calling, the agent drains
// for up to 5 s (a frozen one cannot: it is killed at once, the grace would only slow the test)
// and exits; it is then no longer one of the workload's agents.
func (w *Workload) drainAgent(name string, a *Agent) error {
	a.SetDraining()
	grace := 5 * time.Second
	if a.Suspended() {
		grace = 0
	}
	// SIGTERM reaches the agent, a native sidecar, only once the app container has stopped:
	// after the app's calls under way ended (a call sent to the closed listener would fail).
	a.waitAppCalls(grace)
	err := a.Stop(grace)
	w.dropAgent(name, a)
	return err
}

// dropAgent forgets pod name's agent a (not one started since for the same name).
func (w *Workload) dropAgent(name string, a *Agent) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if a != nil && w.agents[name] == a {
		delete(w.agents, name)
	}
}

// agentContainer finds the pod's agent: the injected native sidecar (an init container), or a
// hand-written plain container.
func agentContainer(pod *corev1.Pod) (*corev1.Container, bool) {
	for _, list := range [][]corev1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for i := range list {
			if list[i].Name == AgentContainer {
				return &list[i], true
			}
		}
	}
	return nil, false
}

// AgentSpec is how the "kubelet" runs an admitted pod's agent on the pod's own loopback address.
type AgentSpec struct {
	Args []string
	// Env is the container's environment as NAME=value, the downward API resolved for the pod.
	Env                   []string
	DataPort, ControlPort int
}

// agentSpecFromPod reads the agent's command line and ports from the admitted pod, as a kubelet
// would run its container, translated to this machine: the pod's network namespace is its own
// loopback address ip (so 127.0.0.1 and "all interfaces" inside the pod both mean ip), and the
// trust volume mounted at --trust-dir is trustDir, which plays the ConfigMap volume; the
// downward API's fields are the pod's. It fails when the pod has no agent, runs an image the
// harness did not build, or is inconsistent: a flag the pod spec does not satisfy (a --trust-dir
// that is not a mounted trust ConfigMap, a control port the named container port does not match,
// an environment variable from a source the harness cannot resolve) would fail in a cluster too.
func agentSpecFromPod(pod *corev1.Pod, ip, trustDir string) (AgentSpec, error) {
	c, ok := agentContainer(pod)
	if !ok {
		return AgentSpec{}, fmt.Errorf("pod %s was admitted without an %s container: is its namespace labelled %s=enabled, and does its workload belong to a DownstreamQuota?",
			pod.Name, AgentContainer, apportionv1.InjectionLabel)
	}
	if c.Image != AgentImage {
		return AgentSpec{}, fmt.Errorf("pod %s: the agent's image is %q; the harness runs only %q (the binary it built)", pod.Name, c.Image, AgentImage)
	}
	if len(c.Command) > 0 {
		return AgentSpec{}, fmt.Errorf("pod %s: the agent overrides the image's entrypoint with %q", pod.Name, c.Command)
	}
	var s AgentSpec
	listen := func(flag, v string) (string, int, error) {
		host, port, err := net.SplitHostPort(v)
		n, perr := strconv.Atoi(port)
		if err != nil || perr != nil || n <= 0 || n > 65535 {
			return "", 0, fmt.Errorf("pod %s: %s=%q is not host:port", pod.Name, flag, v)
		}
		switch host {
		case "", "127.0.0.1", "localhost", "0.0.0.0", "::":
		default:
			return "", 0, fmt.Errorf("pod %s: %s=%q binds an address a pod does not have", pod.Name, flag, v)
		}
		return net.JoinHostPort(ip, port), n, nil
	}
	ports := map[string]*int{"--listen": &s.DataPort, "--control-listen": &s.ControlPort}
	for _, a := range c.Args {
		name, value, hasValue := strings.Cut(a, "=")
		switch name {
		case "--listen", "--control-listen", "--trust-dir":
			if !hasValue {
				return AgentSpec{}, fmt.Errorf("pod %s: the harness reads %s only in the --flag=value form", pod.Name, name)
			}
		}
		switch port := ports[name]; {
		case port != nil:
			addr, n, err := listen(name, value)
			if err != nil {
				return AgentSpec{}, err
			}
			*port, a = n, name+"="+addr
		case name == "--trust-dir":
			if err := trustVolumeAt(pod, c, value); err != nil {
				return AgentSpec{}, err
			}
			a = name + "=" + trustDir
		}
		s.Args = append(s.Args, a)
	}
	for _, e := range c.Env {
		v := e.Value
		if e.ValueFrom != nil {
			f := e.ValueFrom.FieldRef
			switch {
			case f != nil && f.FieldPath == "metadata.name":
				v = pod.Name
			case f != nil && f.FieldPath == "metadata.namespace":
				v = pod.Namespace
			default:
				return AgentSpec{}, fmt.Errorf("pod %s: the agent's env %s comes from a source the harness does not resolve: %+v", pod.Name, e.Name, e.ValueFrom)
			}
		}
		s.Env = append(s.Env, e.Name+"="+v)
	}
	if s.DataPort == 0 || s.ControlPort == 0 {
		return AgentSpec{}, fmt.Errorf("pod %s: the agent's args %q set no --listen or no --control-listen", pod.Name, c.Args)
	}
	named := 0
	for _, p := range c.Ports {
		if p.Name == apportionv1.AgentPortName {
			named = int(p.ContainerPort)
		}
	}
	if named != s.ControlPort {
		return AgentSpec{}, fmt.Errorf("pod %s: the container port apportion-ctl is %d but the agent's control port is %d: the manager would not reach it", pod.Name, named, s.ControlPort)
	}
	return s, nil
}

// trustVolumeAt checks that path is where c mounts a volume of the manager's trust ConfigMap.
func trustVolumeAt(pod *corev1.Pod, c *corev1.Container, path string) error {
	i := slices.IndexFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return filepath.Clean(m.MountPath) == filepath.Clean(path) })
	if i < 0 {
		return fmt.Errorf("pod %s: --trust-dir=%s is not a volume mount of the agent", pod.Name, path)
	}
	name := c.VolumeMounts[i].Name
	j := slices.IndexFunc(pod.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == name })
	if j < 0 || pod.Spec.Volumes[j].ConfigMap == nil || pod.Spec.Volumes[j].ConfigMap.Name != apportionv1.TrustConfigMap {
		return fmt.Errorf("pod %s: the volume %s at --trust-dir=%s is not the ConfigMap %s", pod.Name, name, path, apportionv1.TrustConfigMap)
	}
	return nil
}

// mountProjected plays the kubelet for the agent's projected volumes (the upstream TLS material
// the webhook mounts, inject.AddUpstreamTLS): each ConfigMap or Secret item is written at the
// container's mount path, on this machine's file system, where the agent — a process here, told
// the paths by the manager — reads it. A missing object fails the pod's start, as optional=false
// does in a cluster. The paths are the same for every pod of a quota; the package's tests run one
// at a time.
func mountProjected(ctx context.Context, c client.Client, pod *corev1.Pod) error {
	ac, ok := agentContainer(pod)
	if !ok {
		return nil
	}
	for _, m := range ac.VolumeMounts {
		i := slices.IndexFunc(pod.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == m.Name })
		if i < 0 || pod.Spec.Volumes[i].Projected == nil {
			continue
		}
		files := map[string][]byte{}
		for _, src := range pod.Spec.Volumes[i].Projected.Sources {
			switch {
			case src.ConfigMap != nil:
				var cm corev1.ConfigMap
				if err := c.Get(ctx, client.ObjectKey{Namespace: pod.Namespace, Name: src.ConfigMap.Name}, &cm); err != nil {
					return fmt.Errorf("pod %s: volume %s: %w", pod.Name, m.Name, err)
				}
				for _, it := range src.ConfigMap.Items {
					v, ok := cm.Data[it.Key]
					if !ok {
						return fmt.Errorf("pod %s: volume %s: the ConfigMap %s has no key %s", pod.Name, m.Name, cm.Name, it.Key)
					}
					files[it.Path] = []byte(v)
				}
			case src.Secret != nil:
				var sec corev1.Secret
				if err := c.Get(ctx, client.ObjectKey{Namespace: pod.Namespace, Name: src.Secret.Name}, &sec); err != nil {
					return fmt.Errorf("pod %s: volume %s: %w", pod.Name, m.Name, err)
				}
				for _, it := range src.Secret.Items {
					v, ok := sec.Data[it.Key]
					if !ok {
						return fmt.Errorf("pod %s: volume %s: the Secret %s has no key %s", pod.Name, m.Name, sec.Name, it.Key)
					}
					files[it.Path] = v
				}
			}
		}
		if err := os.MkdirAll(m.MountPath, 0o755); err != nil {
			return err
		}
		for name, b := range files {
			// Atomically, as the kubelet swaps its files: another pod's agent may be reading.
			tmp, err := os.CreateTemp(m.MountPath, ".tmp-")
			if err != nil {
				return err
			}
			_, werr := tmp.Write(b)
			cerr := tmp.Close()
			if err := errors.Join(werr, cerr, os.Chmod(tmp.Name(), 0o644), os.Rename(tmp.Name(), filepath.Join(m.MountPath, name))); err != nil {
				_ = os.Remove(tmp.Name())
				return err
			}
		}
	}
	return nil
}
