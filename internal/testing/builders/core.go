package builders

import (
	"strconv"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// PodWrapper builds a Pod.
type PodWrapper struct{ corev1.Pod }

// MakePod is a pod with one container "app" and no labels, status or IP.
func MakePod(name, ns string) *PodWrapper {
	return &PodWrapper{corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: DefaultImage}}},
	}}
}

// Obj returns a copy of the Pod.
func (w *PodWrapper) Obj() *corev1.Pod { return w.DeepCopy() }

// Labels sets labels (added to those already set).
func (w *PodWrapper) Labels(labels map[string]string) *PodWrapper {
	for k, v := range labels {
		w.Label(k, v)
	}
	return w
}

// Label sets one label.
func (w *PodWrapper) Label(k, v string) *PodWrapper {
	if w.ObjectMeta.Labels == nil {
		w.ObjectMeta.Labels = map[string]string{}
	}
	w.ObjectMeta.Labels[k] = v
	return w
}

// Annotation sets one annotation.
func (w *PodWrapper) Annotation(k, v string) *PodWrapper {
	if w.Annotations == nil {
		w.Annotations = map[string]string{}
	}
	w.Annotations[k] = v
	return w
}

// UID sets metadata.uid (for objects that are never sent to an API server).
func (w *PodWrapper) UID(uid types.UID) *PodWrapper {
	w.ObjectMeta.UID = uid
	return w
}

// Containers replaces the pod's containers.
func (w *PodWrapper) Containers(cs ...corev1.Container) *PodWrapper {
	w.Spec.Containers = cs
	return w
}

// Container adds a container.
func (w *PodWrapper) Container(c corev1.Container) *PodWrapper {
	w.Spec.Containers = append(w.Spec.Containers, c)
	return w
}

// InitContainer adds an init container.
func (w *PodWrapper) InitContainer(c corev1.Container) *PodWrapper {
	w.Spec.InitContainers = append(w.Spec.InitContainers, c)
	return w
}

// Env adds an environment variable to container i.
func (w *PodWrapper) Env(i int, name, value string) *PodWrapper {
	w.Spec.Containers[i].Env = append(w.Spec.Containers[i].Env, corev1.EnvVar{Name: name, Value: value})
	return w
}

// Volume adds a volume.
func (w *PodWrapper) Volume(v corev1.Volume) *PodWrapper {
	w.Spec.Volumes = append(w.Spec.Volumes, v)
	return w
}

// AgentPort says where the pod's agent listens for control calls, as the injected sidecar does:
// the annotation apportionv1.AgentPortAnnotation.
func (w *PodWrapper) AgentPort(port int) *PodWrapper {
	return w.Annotation(apportionv1.AgentPortAnnotation, strconv.Itoa(port))
}

// Running sets the status a kubelet writes for a running pod with the given IP ("" for none).
// The API server keeps status apart: create the pod, then write this with Status().Update.
func (w *PodWrapper) Running(ip string) *PodWrapper {
	w.Status.Phase = corev1.PodRunning
	w.Status.PodIP = ip
	if ip != "" {
		w.Status.PodIPs = []corev1.PodIP{{IP: ip}}
	}
	return w
}

// NamespaceWrapper builds a Namespace.
type NamespaceWrapper struct{ corev1.Namespace }

// MakeNamespace is a namespace without labels.
func MakeNamespace(name string) *NamespaceWrapper {
	return &NamespaceWrapper{corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}}
}

// Obj returns a copy of the Namespace.
func (w *NamespaceWrapper) Obj() *corev1.Namespace { return w.DeepCopy() }

// Label sets one label.
func (w *NamespaceWrapper) Label(k, v string) *NamespaceWrapper {
	if w.Labels == nil {
		w.Labels = map[string]string{}
	}
	w.Labels[k] = v
	return w
}

// InjectionEnabled labels the namespace for agent injection.
func (w *NamespaceWrapper) InjectionEnabled() *NamespaceWrapper {
	return w.Label(apportionv1.InjectionLabel, apportionv1.InjectionEnabled)
}
