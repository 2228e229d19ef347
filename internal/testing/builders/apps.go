package builders

import (
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// DefaultImage is the image of the one container Make* objects start with.
const DefaultImage = "app:1"

// podTemplate is the template every workload starts with: labels app=name, one container "app".
func podTemplate(name string) corev1.PodTemplateSpec {
	return corev1.PodTemplateSpec{
		ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": name}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: DefaultImage}}},
	}
}

// DeploymentWrapper builds a Deployment.
type DeploymentWrapper struct{ appsv1.Deployment }

// MakeDeployment is a Deployment of 1 replica whose selector and pod template carry app=name.
func MakeDeployment(name, ns string) *DeploymentWrapper {
	return &DeploymentWrapper{appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To[int32](1),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": name}},
			Template: podTemplate(name),
		},
	}}
}

// Obj returns a copy of the Deployment.
func (w *DeploymentWrapper) Obj() *appsv1.Deployment { return w.DeepCopy() }

// Replicas sets spec.replicas.
func (w *DeploymentWrapper) Replicas(n int32) *DeploymentWrapper {
	w.Spec.Replicas = ptr.To(n)
	return w
}

// Image sets the image of the template's first container.
func (w *DeploymentWrapper) Image(image string) *DeploymentWrapper {
	w.Spec.Template.Spec.Containers[0].Image = image
	return w
}

// TemplateAnnotation sets an annotation of the pod template.
func (w *DeploymentWrapper) TemplateAnnotation(k, v string) *DeploymentWrapper {
	if w.Spec.Template.Annotations == nil {
		w.Spec.Template.Annotations = map[string]string{}
	}
	w.Spec.Template.Annotations[k] = v
	return w
}

// StatefulSetWrapper builds a StatefulSet.
type StatefulSetWrapper struct{ appsv1.StatefulSet }

// MakeStatefulSet is a StatefulSet of 1 replica whose selector and pod template carry app=name.
func MakeStatefulSet(name, ns string) *StatefulSetWrapper {
	return &StatefulSetWrapper{appsv1.StatefulSet{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: appsv1.StatefulSetSpec{
			Replicas: ptr.To[int32](1),
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": name}},
			Template: podTemplate(name),
		},
	}}
}

// Obj returns a copy of the StatefulSet.
func (w *StatefulSetWrapper) Obj() *appsv1.StatefulSet { return w.DeepCopy() }

// Replicas sets spec.replicas.
func (w *StatefulSetWrapper) Replicas(n int32) *StatefulSetWrapper {
	w.Spec.Replicas = ptr.To(n)
	return w
}

// HPAWrapper builds a HorizontalPodAutoscaler.
type HPAWrapper struct {
	autoscalingv2.HorizontalPodAutoscaler
}

// MakeHPA is an HPA (minReplicas 1, maxReplicas 1) that scales the Deployment of the same name.
func MakeHPA(name, ns string) *HPAWrapper {
	return &HPAWrapper{autoscalingv2.HorizontalPodAutoscaler{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: autoscalingv2.HorizontalPodAutoscalerSpec{
			ScaleTargetRef: autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1", Kind: "Deployment", Name: name},
			MinReplicas:    ptr.To[int32](1),
			MaxReplicas:    1,
		},
	}}
}

// Obj returns a copy of the HPA.
func (w *HPAWrapper) Obj() *autoscalingv2.HorizontalPodAutoscaler { return w.DeepCopy() }

// ScaleTarget sets the workload the HPA scales (kind Deployment or StatefulSet).
func (w *HPAWrapper) ScaleTarget(kind, name string) *HPAWrapper {
	w.Spec.ScaleTargetRef = autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1", Kind: kind, Name: name}
	return w
}

// Replicas sets minReplicas and maxReplicas.
func (w *HPAWrapper) Replicas(minReplicas, maxReplicas int32) *HPAWrapper {
	w.Spec.MinReplicas, w.Spec.MaxReplicas = ptr.To(minReplicas), maxReplicas
	return w
}

// CPUUtilization adds a CPU utilization target, in percent.
func (w *HPAWrapper) CPUUtilization(percent int32) *HPAWrapper {
	w.Spec.Metrics = append(w.Spec.Metrics, autoscalingv2.MetricSpec{
		Type: autoscalingv2.ResourceMetricSourceType,
		Resource: &autoscalingv2.ResourceMetricSource{
			Name:   corev1.ResourceCPU,
			Target: autoscalingv2.MetricTarget{Type: autoscalingv2.UtilizationMetricType, AverageUtilization: ptr.To(percent)},
		},
	})
	return w
}

// Status sets the status the HPA controller would write: its desired and current replicas.
func (w *HPAWrapper) Status(desired, current int32) *HPAWrapper {
	w.HorizontalPodAutoscaler.Status.DesiredReplicas, w.HorizontalPodAutoscaler.Status.CurrentReplicas = desired, current
	return w
}
