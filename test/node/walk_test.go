//go:build linux

package node

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// TestNode walks docs/install.md on a real node: a kubelet and containerd with a bridge pod
// network, in a network namespace of their own (see TestMain).
func TestNode(t *testing.T) {
	skipUnlessEnabled(t)
	timeout := 28 * time.Minute
	if os.Getenv(laneEnv) == "hold" {
		timeout = 24 * time.Hour
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	laneStart := time.Now()
	defer func() {
		t.Logf("figure: node test (inner) %s in %s", os.Getenv(laneEnv), time.Since(laneStart).Round(time.Second))
	}()
	n := startNode(ctx, t)
	t.Logf("figure: node up in %s", time.Since(laneStart).Round(time.Millisecond))
	if os.Getenv(laneEnv) == "hold" {
		holdNode(ctx, t, n)
		return
	}
	j := startJudge(t, sampleLimit)
	var installStart time.Time
	var pods []corev1.Pod

	short := os.Getenv(laneEnv) == "short"
	type step struct {
		name string
		run  func(t *testing.T)
		// inShort: the step is part of the short lane (`make test`).
		inShort bool
	}
	steps := []step{
		{"plain pod", func(t *testing.T) { plainPod(ctx, t, n) }, false},
		{"ctr images import dist/images", func(t *testing.T) { importUserImages(ctx, t, n) }, true},
		{"kubectl apply -f dist/install.yaml", func(t *testing.T) { installStart = installManager(ctx, t, n) }, true},
		{"injected sample pods", func(t *testing.T) {
			pods = injectedApps(ctx, t, n, installStart, j.url(), sampleReplicas, sampleConcurrency)
		}, true},
		{"traffic through the agents", func(t *testing.T) { traffic(ctx, t, n, j, pods) }, false},
		{"the agent's readiness gates the pod's", func(t *testing.T) { agentGatesReady(ctx, t, n, sampleReplicas) }, false},
		{"scale step 2 -> 3 under traffic", func(t *testing.T) { scaleStep(ctx, t, n, j, sampleReplicas+1) }, true},
		{"leader failover under traffic", func(t *testing.T) { failover(ctx, t, n, j, sampleReplicas+1) }, true},
		{"rolling update under traffic", func(t *testing.T) { rollingUpdate(ctx, t, n, j, sampleReplicas+1) }, false},
		{"signing-key rotation under traffic", func(t *testing.T) { keyRotation(ctx, t, n, j, sampleReplicas+1) }, false},
		{"uninstall", func(t *testing.T) { uninstall(ctx, t, n, j, sampleReplicas+1) }, true},
		{"helm install, inject, scale step, helm uninstall", func(t *testing.T) { helmWalk(ctx, t, n, j, sampleReplicas+1) }, false},
	}
	if short {
		t.Logf("the short lane (%s=short): install, inject, scale step, failover, uninstall", laneEnv)
	}
	for _, s := range steps {
		if short && !s.inShort {
			continue
		}
		// Each step needs the one before it: stop at the first that fails.
		if !t.Run(s.name, s.run) {
			return
		}
	}
}

// plainPod runs the lane's own image as a pod without the webhook: the sandbox, the CNI and
// the kubelet's probes on a real runtime, before anything of Apportion runs.
func plainPod(ctx context.Context, t *testing.T, n *node) {
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "plain", Namespace: "default"},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{{
				Name: "app", Image: testImage, ImagePullPolicy: corev1.PullNever,
				SecurityContext: &corev1.SecurityContext{
					RunAsUser: ptr.To[int64](65532), RunAsNonRoot: ptr.To(true), ReadOnlyRootFilesystem: ptr.To(true),
					AllowPrivilegeEscalation: ptr.To(false), Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}},
				},
			}},
			TerminationGracePeriodSeconds: ptr.To[int64](5),
		},
	}
	// The default ServiceAccount (serviceaccount-controller) must exist before the admission
	// plugin admits a pod.
	waitFor(ctx, t, time.Minute, "the default ServiceAccount", func() (bool, error) {
		var sa corev1.ServiceAccount
		err := n.c.Get(ctx, types.NamespacedName{Namespace: "default", Name: "default"}, &sa)
		return err == nil, nil
	})
	start := time.Now()
	if err := n.c.Create(ctx, pod); err != nil {
		t.Fatal(err)
	}
	var got corev1.Pod
	waitFor(ctx, t, 2*time.Minute, "pod default/plain Ready", func() (bool, error) {
		if err := n.c.Get(ctx, types.NamespacedName{Namespace: "default", Name: "plain"}, &got); err != nil {
			return false, err
		}
		return podReady(&got), nil
	})
	t.Logf("figure: plain pod Ready in %s", time.Since(start).Round(time.Millisecond))
	if got.Spec.NodeName != nodeName {
		t.Errorf("pod scheduled to %q, want %q", got.Spec.NodeName, nodeName)
	}
	_, cidr, _ := net.ParseCIDR(podCIDR)
	if ip := net.ParseIP(got.Status.PodIP); ip == nil || !cidr.Contains(ip) {
		t.Errorf("pod IP %q is not in the node's pod network %s", got.Status.PodIP, podCIDR)
	}
	// The bridge exists now, in this namespace only.
	if _, err := net.InterfaceByName("cni0"); err != nil {
		t.Errorf("bridge cni0: %v", err)
	}
	// The projected ServiceAccount token is mounted where every in-cluster client looks.
	if !hasSATokenVolume(&got) {
		t.Errorf("pod has no projected ServiceAccount token volume: %+v", got.Spec.Volumes)
	}
	if err := n.c.Delete(ctx, &got, client.GracePeriodSeconds(0)); err != nil {
		t.Fatal(err)
	}
	waitFor(ctx, t, time.Minute, "pod default/plain gone", func() (bool, error) {
		err := n.c.Get(ctx, types.NamespacedName{Namespace: "default", Name: "plain"}, &corev1.Pod{})
		return err != nil, nil
	})
}

func hasSATokenVolume(p *corev1.Pod) bool {
	for _, v := range p.Spec.Volumes {
		if v.Projected != nil {
			for _, s := range v.Projected.Sources {
				if s.ServiceAccountToken != nil {
					return true
				}
			}
		}
	}
	return false
}

func podReady(p *corev1.Pod) bool {
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// waitFor polls cond every 250ms until it holds, failing t after timeout (or at once when cond
// returns an error that is not worth retrying: none here, errors are retried and reported).
func waitFor(ctx context.Context, t *testing.T, timeout time.Duration, what string, cond func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var lastErr error
	for {
		ok, err := cond()
		if ok {
			return
		}
		if err != nil {
			lastErr = err
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			t.Fatalf("waiting for %s: not within %s (last error: %v)", what, timeout, lastErr)
		}
		time.Sleep(250 * time.Millisecond)
	}
}
