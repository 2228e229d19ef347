package controller

import (
	"context"
	"fmt"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	autoscalingv2 "k8s.io/api/autoscaling/v2"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/push"
	"github.com/apportion/apportion/internal/testing/builders"
)

// newNamespace creates a namespace of its own for one test.
func newNamespace(ctx context.Context) string {
	ns := builders.MakeNamespace("t-" + rand.String(8)).Obj()
	Expect(k8sClient.Create(ctx, ns)).To(Succeed())
	return ns.Name
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
		out = append(out, createPod(ctx, builders.MakePod(fmt.Sprintf("%s-%d", prefix, i), ns).Labels(labels).Running("")))
	}
	return out
}

// createPod plays the kubelet for one pod: it creates the pod, then writes the wrapper's status.
func createPod(ctx context.Context, w *builders.PodWrapper) *corev1.Pod {
	p, status := w.Obj(), w.Obj().Status
	Expect(k8sClient.Create(ctx, p)).To(Succeed())
	p.Status = status
	Expect(k8sClient.Status().Update(ctx, p)).To(Succeed())
	return p
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

// startTestEngine starts a real push engine over client with windows short enough that its
// recovery after start (PushTimeout + AcceptGrace + LeaseTTL + the quota's requestTimeout) is
// over in about 2 s; it is stopped when the spec ends.
func startTestEngine(ctx context.Context, client push.AgentClient) *push.Engine {
	engine, err := push.New(push.Options{
		Client:      client,
		Epoch:       push.EpochFunc(func(context.Context) (int64, error) { return 1, nil }),
		LeaseTTL:    time.Second,
		RenewEvery:  500 * time.Millisecond,
		PushTimeout: 250 * time.Millisecond,
		AcceptGrace: 100 * time.Millisecond,
	})
	Expect(err).NotTo(HaveOccurred())
	ectx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- engine.Start(ectx) }()
	DeferCleanup(func() {
		stop()
		Eventually(done).Should(Receive(BeNil()))
	})
	return engine
}
