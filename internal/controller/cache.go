package controller

import (
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	toolscache "k8s.io/client-go/tools/cache"
	"sigs.k8s.io/controller-runtime/pkg/cache"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// CacheOptions is the manager's informer cache. It watches every Pod, Deployment, StatefulSet,
// HPA and Namespace of the cluster (a quota may name any of them, and a pod without an agent
// must be counted too, so no label or namespace selector would be safe) but keeps of each only
// the fields the manager reads: at thousands of pods the cached objects are a large part of the
// manager's live heap, and what it does not keep it neither holds nor copies on every List.
// The trust ConfigMaps are the only ConfigMaps cached, selected by name (TrustCacheOptions: the
// manager's RBAC lists and watches no other ConfigMap). Every other kind
// (DownstreamQuotas, DegradeRules, the trust ConfigMaps) is kept whole but for its managed fields
// (nothing reads them): the manager writes those objects back, a quota's status by a merge
// patch computed from the cached copy and a ConfigMap by an update.
//
// The readers of each stripped kind, which must read nothing else (cache_test.go checks each
// reader against the unstripped object):
//   - Pod (StripPod): observe's label selector and mayCall, agentOf and what uses it
//     (agentEndpoint, agentBootstraps, withoutAgent), desiredQuota, computeStatus, podChanged,
//     quotasForPod. The injection webhook gets its pods from the admission request.
//   - Deployment, StatefulSet (StripWorkload): internal/targets.Get (for the controller and the
//     injection webhook), workloadChanged, quotasForWorkload.
//   - HorizontalPodAutoscaler (StripHPA): hpaFor and observe, the indexHPATarget index,
//     quotasForHPA.
//   - Namespace (StripNamespace): the trust reconciler.
func CacheOptions() cache.Options {
	byObject := TrustCacheOptions()
	byObject[&corev1.Pod{}] = cache.ByObject{Transform: StripPod}
	byObject[&appsv1.Deployment{}] = cache.ByObject{Transform: StripWorkload}
	byObject[&appsv1.StatefulSet{}] = cache.ByObject{Transform: StripWorkload}
	byObject[&autoscalingv2.HorizontalPodAutoscaler{}] = cache.ByObject{Transform: StripHPA}
	byObject[&corev1.Namespace{}] = cache.ByObject{Transform: StripNamespace}
	return cache.Options{ByObject: byObject, DefaultTransform: cache.TransformStripManagedFields()}
}

var (
	_ toolscache.TransformFunc = StripPod
	_ toolscache.TransformFunc = StripWorkload
	_ toolscache.TransformFunc = StripHPA
	_ toolscache.TransformFunc = StripNamespace
)

// strippedMeta is the object metadata every stripped kind keeps: identity, versions, creation and
// deletion. Labels, annotations, owner references and managed fields are dropped (each kind adds
// back what it reads); finalizers are kept so that a stripped object is still a valid one (a
// deletion timestamp comes with finalizers), at the cost of a few strings.
func strippedMeta(m *metav1.ObjectMeta) metav1.ObjectMeta {
	return metav1.ObjectMeta{
		Name:              m.Name,
		Namespace:         m.Namespace,
		UID:               m.UID,
		ResourceVersion:   m.ResourceVersion,
		Generation:        m.Generation,
		CreationTimestamp: m.CreationTimestamp,
		DeletionTimestamp: m.DeletionTimestamp,
		Finalizers:        m.Finalizers,
	}
}

// StripPod keeps of a Pod what the manager reads (see CacheOptions): its metadata with every
// label and only the agent-port annotation; of its containers and native sidecars (agentOf looks
// at nothing else, and never at other init containers) only those that carry a --bootstrap flag
// or an agent control port agentOf may use — the apportion-agent container's always, another's
// only while the annotation names no valid port (which then wins over it) — each with only its
// name, restart policy, those ports and those flags; its phase and pod IP. Anything else passes
// unchanged (a tombstone is never handed to a transform). Stripping a stripped pod changes
// nothing.
func StripPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil
	}
	out := &corev1.Pod{TypeMeta: p.TypeMeta, ObjectMeta: strippedMeta(&p.ObjectMeta)}
	out.Labels = p.Labels
	if v, ok := p.Annotations[apportionv1.AgentPortAnnotation]; ok {
		out.Annotations = map[string]string{apportionv1.AgentPortAnnotation: v}
	}
	annotated := annotatedPort(p) != 0
	out.Spec.Containers = agentContainers(p.Spec.Containers, annotated, func(*corev1.Container) bool { return true })
	out.Spec.InitContainers = agentContainers(p.Spec.InitContainers, annotated, isNativeSidecar)
	out.Status.Phase, out.Status.PodIP = p.Status.Phase, p.Status.PodIP
	return out, nil
}

// agentContainers is the containers of cs that agentOf may look at (looked) and that carry an
// agent port it may use or a --bootstrap flag, reduced to those; nil when none does. Only the
// apportion-agent container's ports are kept when the pod's annotation names a port (annotated).
func agentContainers(cs []corev1.Container, annotated bool, looked func(*corev1.Container) bool) []corev1.Container {
	var out []corev1.Container
	for i := range cs {
		c := &cs[i]
		if !looked(c) {
			continue
		}
		k := corev1.Container{Name: c.Name, RestartPolicy: c.RestartPolicy}
		ports := !annotated || c.Name == apportionv1.AgentContainerName
		for _, cp := range c.Ports {
			if ports && isAgentPort(cp) {
				k.Ports = append(k.Ports, corev1.ContainerPort{Name: cp.Name, ContainerPort: cp.ContainerPort})
			}
		}
		k.Command = bootstrapArgs(c.Command)
		k.Args = bootstrapArgs(c.Args)
		if len(k.Ports) > 0 || len(k.Command) > 0 || len(k.Args) > 0 {
			out = append(out, k)
		}
	}
	return out
}

// bootstrapArgs is the words of list that are a --bootstrap flag (nil when none is).
func bootstrapArgs(list []string) []string {
	var out []string
	for _, arg := range list {
		if isBootstrapArg(arg) {
			out = append(out, arg)
		}
	}
	return out
}

// StripWorkload keeps of a Deployment or StatefulSet what the manager reads (see CacheOptions):
// its metadata, spec.replicas and spec.selector. Its pod template, often most of it, goes.
// Anything else passes unchanged.
func StripWorkload(obj any) (any, error) {
	switch w := obj.(type) {
	case *appsv1.Deployment:
		return &appsv1.Deployment{TypeMeta: w.TypeMeta, ObjectMeta: strippedMeta(&w.ObjectMeta),
			Spec: appsv1.DeploymentSpec{Replicas: w.Spec.Replicas, Selector: w.Spec.Selector}}, nil
	case *appsv1.StatefulSet:
		return &appsv1.StatefulSet{TypeMeta: w.TypeMeta, ObjectMeta: strippedMeta(&w.ObjectMeta),
			Spec: appsv1.StatefulSetSpec{Replicas: w.Spec.Replicas, Selector: w.Spec.Selector}}, nil
	}
	return obj, nil
}

// StripHPA keeps of a HorizontalPodAutoscaler what the manager reads (see CacheOptions): its
// metadata, scale target, maxReplicas and its desired and current replicas; its metrics,
// behavior and conditions go. Anything else passes unchanged.
func StripHPA(obj any) (any, error) {
	h, ok := obj.(*autoscalingv2.HorizontalPodAutoscaler)
	if !ok {
		return obj, nil
	}
	return &autoscalingv2.HorizontalPodAutoscaler{TypeMeta: h.TypeMeta, ObjectMeta: strippedMeta(&h.ObjectMeta),
		Spec: autoscalingv2.HorizontalPodAutoscalerSpec{ScaleTargetRef: h.Spec.ScaleTargetRef, MaxReplicas: h.Spec.MaxReplicas},
		Status: autoscalingv2.HorizontalPodAutoscalerStatus{
			DesiredReplicas: h.Status.DesiredReplicas, CurrentReplicas: h.Status.CurrentReplicas,
		},
	}, nil
}

// StripNamespace keeps of a Namespace what the trust reconciler reads: its metadata and the
// injection label. Anything else passes unchanged.
func StripNamespace(obj any) (any, error) {
	ns, ok := obj.(*corev1.Namespace)
	if !ok {
		return obj, nil
	}
	out := &corev1.Namespace{TypeMeta: ns.TypeMeta, ObjectMeta: strippedMeta(&ns.ObjectMeta)}
	if v, ok := ns.Labels[apportionv1.InjectionLabel]; ok {
		out.Labels = map[string]string{apportionv1.InjectionLabel: v}
	}
	return out, nil
}
