package controller

import (
	"context"
	"fmt"
	"time"

	. "github.com/onsi/gomega"
	appsv1 "k8s.io/api/apps/v1"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// newNamespace creates a namespace of its own for one test.
func newNamespace(ctx context.Context) string {
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "t-" + rand.String(8)}}
	Expect(k8sClient.Create(ctx, ns)).To(Succeed())
	return ns.Name
}

func deployment(ns, name string, replicas int32) *appsv1.Deployment {
	labels := map[string]string{"app": name}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(replicas),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "app"}}},
			},
		},
	}
}

func hpa(ns, name, deploymentName string, minR, maxR int32) *autoscalingv2.HorizontalPodAutoscaler {
	return &autoscalingv2.HorizontalPodAutoscaler{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: autoscalingv2.HorizontalPodAutoscalerSpec{
			ScaleTargetRef: autoscalingv2.CrossVersionObjectReference{APIVersion: "apps/v1", Kind: "Deployment", Name: deploymentName},
			MinReplicas:    ptr.To(minR),
			MaxReplicas:    maxR,
		},
	}
}

// setHPAStatus plays the HPA controller.
func setHPAStatus(ctx context.Context, h *autoscalingv2.HorizontalPodAutoscaler, desired, current int32) {
	Eventually(func() error {
		if err := k8sClient.Get(ctx, client.ObjectKeyFromObject(h), h); err != nil {
			return err
		}
		h.Status.DesiredReplicas, h.Status.CurrentReplicas = desired, current
		return k8sClient.Status().Update(ctx, h)
	}).Should(Succeed())
}

// createPods plays the kubelet: n running pods of a workload with the given labels.
func createPods(ctx context.Context, ns, prefix string, labels map[string]string, n int) []*corev1.Pod {
	var out []*corev1.Pod
	for i := range n {
		p := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: fmt.Sprintf("%s-%d", prefix, i), Labels: labels},
			Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "app"}}},
		}
		Expect(k8sClient.Create(ctx, p)).To(Succeed())
		p.Status.Phase = corev1.PodRunning
		Expect(k8sClient.Status().Update(ctx, p)).To(Succeed())
		out = append(out, p)
	}
	return out
}

func quota(ns, name string, limit int32, targets ...apportionv1.Target) *apportionv1.DownstreamQuota {
	return &apportionv1.DownstreamQuota{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: apportionv1.DownstreamQuotaSpec{
			MaxInFlight: limit,
			Targets:     targets,
			Upstream:    "https://api.logistics.example.com/v2",
		},
	}
}

// getQuota reads a quota's current state for Eventually.
func getQuota(ctx context.Context, ns, name string) func() (*apportionv1.DownstreamQuota, error) {
	return func() (*apportionv1.DownstreamQuota, error) {
		var dq apportionv1.DownstreamQuota
		err := k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: name}, &dq)
		return &dq, err
	}
}

func timeParse(s string) (time.Duration, error) { return time.ParseDuration(s) }
