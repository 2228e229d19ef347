// Package inject gives the pods of a DownstreamQuota's targets their agent: a mutating admission
// webhook for Pods (Webhook) around a pure mutation (Mutate).
//
// Which pods: those in a namespace labelled apportion.io/injection=enabled (the webhook
// configuration's namespaceSelector; the API server does not call the webhook for others) that
// belong to a target of a DownstreamQuota in their namespace by the rule of internal/targets
// (the workload's selector matches the pod's labels) — the pods the controller counts. A pod
// annotated apportion.io/inject: "false" is left alone, and so is a pod that already has a
// container or init container named apportion-agent (a hand-written sidecar, or a second
// admission of an injected pod): injection is idempotent.
//
// What Mutate adds, for every quota the pod belongs to (a pod of two quotas gets ONE agent
// serving both; the agent learns its downstreams from the manager's pushes):
//   - the agent as a native sidecar: the first init container, named apportion-agent, with
//     restartPolicy Always, so it starts before the app's containers (and init containers) and
//     stops after them; control port 15000 (named apportion-ctl, also written to the pod
//     annotation apportion.io/agent-port, replacing the pod's own value: the manager talks to the
//     injected container's port and ignores the annotation of a pod that has it, so the
//     annotation only says what is used) and data port 15001 on
//     127.0.0.1; a startup probe on /healthz and a readiness probe on /readyz (ready once the
//     manager granted it permits); resources from the manager's flags, overridable per pod by
//     the annotations in ResourceAnnotations; GOMAXPROCS in its environment (agentGOMAXPROCS:
//     the apportion.io/agent-gomaxprocs annotation, else its CPU limit, else 1); a hardened
//     securityContext;
//   - the trust material the agent verifies the manager's pushes with (TrustMaterial: one
//     function, so a change of trust model touches one place);
//   - for a quota whose spec.upstreamTLS names a CA bundle or a client certificate, the
//     ConfigMap and Secret as a read-only projected volume of the agent (AddUpstreamTLS, tls.go;
//     the webhook calls it after Mutate);
//   - into every app container, per quota, APPORTION_<QUOTA_NAME_UPPER_SNAKE>_URL =
//     http://127.0.0.1:15001/<quota>, unless the container already sets that variable.
//
// Mutate has no side effects and reads nothing but its arguments, so the webhook is safe under
// dry-run (sideEffects=None).
package inject

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// Labels, annotations and names the injector reads or writes.
const (
	// The namespace label, the opt-out annotation, the agent-port annotation and the control
	// port's name are part of the API: apportionv1.InjectionLabel, apportionv1.InjectAnnotation,
	// apportionv1.AgentPortAnnotation and apportionv1.AgentPortName.

	// AgentContainerName is the agent's container name, injected or hand-written
	// (apportionv1.AgentContainerName: the manager finds the agent by it).
	AgentContainerName = apportionv1.AgentContainerName
	// DataPortName names the data port.
	DataPortName = "apportion-data"
	// ControlPort and DataPort are the agent's ports: control on the pod IP (manager, kubelet
	// probes, metrics), data on 127.0.0.1 only (the app).
	ControlPort = 15000
	DataPort    = 15001
)

// Per-pod resource annotations; each overrides the matching Config default. Values are
// Kubernetes quantities ("100m", "64Mi"); "0" removes that request or limit.
const (
	CPURequestAnnotation    = "apportion.io/agent-cpu-request"
	CPULimitAnnotation      = "apportion.io/agent-cpu-limit"
	MemoryRequestAnnotation = "apportion.io/agent-memory-request"
	MemoryLimitAnnotation   = "apportion.io/agent-memory-limit"
)

// GOMAXPROCSAnnotation sets the injected agent's GOMAXPROCS (a whole number, 1..256), overriding
// the one derived from its CPU limit (see agentGOMAXPROCS).
const GOMAXPROCSAnnotation = "apportion.io/agent-gomaxprocs"

// DefaultGOMAXPROCS is the injected agent's GOMAXPROCS without a CPU limit or the annotation:
// one processor. For the agent's many short calls it costs about a fifth less CPU per call than
// two (docs/benchmarks.md), and one carries about 25,000 calls/s; Istio's proxy defaults to a
// concurrency of 2 for the throughput of a mesh's every call, which the agent does not carry.
const DefaultGOMAXPROCS = 1

// maxGOMAXPROCS bounds the annotation: a typo must not make hundreds of threads.
const maxGOMAXPROCS = 256

// ResourceAnnotations lists the per-pod resource annotations.
var ResourceAnnotations = []string{CPURequestAnnotation, CPULimitAnnotation, MemoryRequestAnnotation, MemoryLimitAnnotation}

// AgentUID is the user the agent runs as when the image does not say otherwise (the images'
// nonroot user); runAsNonRoot needs a numeric user to check.
const AgentUID = 65532

// Config is what the manager's flags decide about every injected agent.
type Config struct {
	// Image is the agent image (registry/name:tag or @digest). Required.
	Image string
	// PullPolicy is the image pull policy; empty leaves the API server's default.
	PullPolicy corev1.PullPolicy
	// Resources are the default requests and limits.
	Resources corev1.ResourceRequirements
}

// Validate says what is wrong with c, naming the manager flag.
func (c Config) Validate() error {
	var errs []error
	if strings.TrimSpace(c.Image) == "" {
		errs = append(errs, errors.New("--agent-image must name the agent image"))
	}
	if err := checkResources(c.Resources); err != nil {
		errs = append(errs, fmt.Errorf("agent resources: %w", err))
	}
	return errors.Join(errs...)
}

// OptedOut reports whether the pod's annotations opt it out, or an error for a value that is
// neither "true" nor "false" (a typo must not silently decide).
func OptedOut(annotations map[string]string) (bool, error) {
	v, ok := annotations[apportionv1.InjectAnnotation]
	if !ok {
		return false, nil
	}
	switch v {
	case "false":
		return true, nil
	case "true":
		return false, nil
	}
	return false, fmt.Errorf("annotation %s must be \"true\" or \"false\", got %q", apportionv1.InjectAnnotation, v)
}

// HasAgent reports whether the pod already runs an agent: a container or init container named
// apportion-agent.
func HasAgent(spec *corev1.PodSpec) bool {
	isAgent := func(c corev1.Container) bool { return c.Name == AgentContainerName }
	return slices.ContainsFunc(spec.Containers, isAgent) || slices.ContainsFunc(spec.InitContainers, isAgent)
}

// EnvName is the variable that hands an app the base URL of downstream quota:
// APPORTION_<QUOTA_NAME_UPPER_SNAKE>_URL ("logistics-eu.v2" → APPORTION_LOGISTICS_EU_V2_URL).
func EnvName(quota string) string {
	return "APPORTION_" + strings.ToUpper(strings.NewReplacer("-", "_", ".", "_").Replace(quota)) + "_URL"
}

// DownstreamURL is the app's base URL for downstream quota through the agent.
func DownstreamURL(quota string) string {
	return "http://127.0.0.1:" + strconv.Itoa(DataPort) + "/" + quota
}

// Mutate injects the agent into pod for the quotas named (the quotas the pod belongs to; none
// means nothing to do). It returns whether it changed the pod, and an error — pod untouched —
// for a pod it cannot inject: a bad resource annotation, or a volume of the agent's name the pod
// already uses. It changes nothing when the pod opted out or already has an agent.
func Mutate(pod *corev1.Pod, quotas []string, cfg Config) (bool, error) {
	if len(quotas) == 0 || HasAgent(&pod.Spec) {
		return false, nil
	}
	if out, err := OptedOut(pod.Annotations); err != nil || out {
		return false, err
	}
	res, err := resourcesFor(pod.Annotations, cfg.Resources)
	if err != nil {
		return false, err
	}
	procs, err := agentGOMAXPROCS(pod.Annotations, res)
	if err != nil {
		return false, err
	}
	vol, mount, flags, identity := TrustMaterial()
	env := append(slices.Clone(identity), corev1.EnvVar{Name: "GOMAXPROCS", Value: strconv.Itoa(procs)})
	if slices.ContainsFunc(pod.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == vol.Name }) {
		return false, fmt.Errorf("the pod already has a volume named %s, which the agent's trust material needs", vol.Name)
	}

	names := slices.Clone(quotas)
	slices.Sort(names)
	names = slices.Compact(names)
	for i := range pod.Spec.Containers {
		addEnv(&pod.Spec.Containers[i], names)
	}
	pod.Spec.Volumes = append(pod.Spec.Volumes, vol)
	pod.Spec.InitContainers = append([]corev1.Container{agentContainer(cfg, res, mount, flags, env)}, pod.Spec.InitContainers...)
	if pod.Annotations == nil {
		pod.Annotations = map[string]string{}
	}
	// The manager talks to the injected container's port whatever the annotation says (a pod may
	// edit its annotations while it runs); a value of the pod's own would only mislead a reader.
	pod.Annotations[apportionv1.AgentPortAnnotation] = strconv.Itoa(ControlPort)
	return true, nil
}

// addEnv appends the downstream URLs the container does not set itself. Two quota names that
// map to one variable ("a-b", "a.b") give it the first name's URL, in sorted order.
func addEnv(c *corev1.Container, quotas []string) {
	for _, q := range quotas {
		name := EnvName(q)
		if slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == name }) {
			continue
		}
		c.Env = append(c.Env, corev1.EnvVar{Name: name, Value: DownstreamURL(q)})
	}
}

func agentContainer(cfg Config, res corev1.ResourceRequirements, mount corev1.VolumeMount, flags []string, env []corev1.EnvVar) corev1.Container {
	probe := func(path string, period, failures int32) *corev1.Probe {
		return &corev1.Probe{
			ProbeHandler:     corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: path, Port: intstr.FromString(apportionv1.AgentPortName)}},
			PeriodSeconds:    period,
			FailureThreshold: failures,
			TimeoutSeconds:   1,
		}
	}
	return corev1.Container{
		Name:            AgentContainerName,
		Image:           cfg.Image,
		ImagePullPolicy: cfg.PullPolicy,
		Args: append([]string{
			"--listen=127.0.0.1:" + strconv.Itoa(DataPort),
			"--control-listen=:" + strconv.Itoa(ControlPort),
		}, flags...),
		Env: env,
		Ports: []corev1.ContainerPort{
			{Name: apportionv1.AgentPortName, ContainerPort: ControlPort, Protocol: corev1.ProtocolTCP},
			{Name: DataPortName, ContainerPort: DataPort, Protocol: corev1.ProtocolTCP},
		},
		// Native sidecar: started before the app, stopped after it, restarted when it exits.
		RestartPolicy: ptr.To(corev1.ContainerRestartPolicyAlways),
		// The app's containers start once /healthz answers (up to 30 s); the pod is Ready — gets
		// traffic — only once the agent holds permits the manager granted (/readyz).
		StartupProbe:   probe("/healthz", 1, 30),
		ReadinessProbe: probe("/readyz", 2, 1),
		Resources:      res,
		VolumeMounts:   []corev1.VolumeMount{mount},
		SecurityContext: &corev1.SecurityContext{
			RunAsNonRoot:             ptr.To(true),
			RunAsUser:                ptr.To(int64(AgentUID)),
			RunAsGroup:               ptr.To(int64(AgentUID)),
			ReadOnlyRootFilesystem:   ptr.To(true),
			AllowPrivilegeEscalation: ptr.To(false),
			Privileged:               ptr.To(false),
			Capabilities:             &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
			SeccompProfile:           &corev1.SeccompProfile{Type: corev1.SeccompProfileTypeRuntimeDefault},
		},
		TerminationMessagePolicy: corev1.TerminationMessageFallbackToLogsOnError,
	}
}

// resourcesFor applies the pod's resource annotations to the defaults.
func resourcesFor(annotations map[string]string, def corev1.ResourceRequirements) (corev1.ResourceRequirements, error) {
	out := *def.DeepCopy()
	var errs []error
	for _, o := range []struct {
		annotation string
		list       *corev1.ResourceList
		name       corev1.ResourceName
	}{
		{CPURequestAnnotation, &out.Requests, corev1.ResourceCPU},
		{CPULimitAnnotation, &out.Limits, corev1.ResourceCPU},
		{MemoryRequestAnnotation, &out.Requests, corev1.ResourceMemory},
		{MemoryLimitAnnotation, &out.Limits, corev1.ResourceMemory},
	} {
		v, ok := annotations[o.annotation]
		if !ok {
			continue
		}
		q, err := resource.ParseQuantity(v)
		if err != nil || q.Sign() < 0 {
			errs = append(errs, fmt.Errorf("annotation %s: %q is not a non-negative quantity (e.g. 100m, 64Mi)", o.annotation, v))
			continue
		}
		if *o.list == nil {
			*o.list = corev1.ResourceList{}
		}
		if q.IsZero() {
			delete(*o.list, o.name)
		} else {
			(*o.list)[o.name] = q
		}
	}
	if err := errors.Join(errs...); err != nil {
		return out, err
	}
	for _, l := range []*corev1.ResourceList{&out.Requests, &out.Limits} {
		if len(*l) == 0 {
			*l = nil
		}
	}
	return out, checkResources(out)
}

// agentGOMAXPROCS is the injected agent's GOMAXPROCS, set deliberately rather than left to the
// binary (whose own default, without the variable, is 1 too) or to Go (the node's cores without
// a CPU limit): the GOMAXPROCSAnnotation when the pod has it; else the agent's CPU limit rounded
// up to whole processors (a limit of 1500m runs 2); else DefaultGOMAXPROCS.
func agentGOMAXPROCS(annotations map[string]string, res corev1.ResourceRequirements) (int, error) {
	if v, ok := annotations[GOMAXPROCSAnnotation]; ok {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxGOMAXPROCS {
			return 0, fmt.Errorf("annotation %s: %q is not a whole number from 1 to %d", GOMAXPROCSAnnotation, v, maxGOMAXPROCS)
		}
		return n, nil
	}
	if lim, ok := res.Limits[corev1.ResourceCPU]; ok && !lim.IsZero() {
		return int(min((lim.MilliValue()+999)/1000, maxGOMAXPROCS)), nil
	}
	return DefaultGOMAXPROCS, nil
}

// checkResources refuses a request above its limit, which the API server would refuse later
// with a message that does not name our annotation.
func checkResources(r corev1.ResourceRequirements) error {
	var errs []error
	for name, req := range r.Requests {
		if lim, ok := r.Limits[name]; ok && req.Cmp(lim) > 0 {
			errs = append(errs, fmt.Errorf("the agent's %s request %s is above its limit %s", name, req.String(), lim.String()))
		}
	}
	return errors.Join(errs...)
}
