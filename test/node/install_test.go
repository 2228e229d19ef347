//go:build linux

package node

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"
)

const (
	managerImage = "ghcr.io/apportion/manager:v0.1.0"
	agentImage   = "ghcr.io/apportion/agent:v0.1.0"
	system       = "apportion-system"
	managerName  = "apportion-controller-manager"
)

func (n *node) kubectl(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	return sh(ctx, assetPath("KUBEBUILDER_ASSETS", "kubectl"), append([]string{"--kubeconfig", n.kubeconfig}, args...)...)
}

// importUserImages is docs/install.md's step for a local node: the archives `make images`
// wrote (dist/images/{manager,agent}.tar, copied into the run directory when they were
// built), imported into containerd's CRI namespace.
func importUserImages(ctx context.Context, t *testing.T, n *node) {
	if err := n.importImages(ctx, filepath.Join(n.dir, "manager.tar"), filepath.Join(n.dir, "agent.tar")); err != nil {
		t.Fatal(err)
	}
	out, err := sh(ctx, ctrBin, "--address", n.sock, "-n", "k8s.io", "images", "ls", "-q")
	if err != nil {
		t.Fatal(err)
	}
	for _, img := range []string{managerImage, agentImage} {
		if !strings.Contains(out, img) {
			t.Fatalf("%s is not among the node's images after the import:\n%s", img, out)
		}
	}
}

// installManager applies dist/install.yaml as it is and waits for both manager replicas to be
// Ready: on the kubelet, with their ServiceAccount's token, after cert-controller wrote the
// webhook's certificate into the Secret the kubelet mounts.
func installManager(ctx context.Context, t *testing.T, n *node) time.Time {
	start := time.Now()
	if out, err := n.kubectl(ctx, "apply", "-f", filepath.Join(repoRoot(), "dist/install.yaml")); err != nil {
		t.Fatal(err)
	} else {
		t.Logf("kubectl apply -f dist/install.yaml:\n%s", strings.TrimSpace(out))
	}
	waitManagers(ctx, t, n)
	t.Logf("figure: kubectl apply -> 2 manager replicas Ready in %s", time.Since(start).Round(time.Millisecond))
	return start
}

// waitManagers waits for both manager replicas to be Ready on the node, each with its
// ServiceAccount's token and the manager image, and one of them holding the leader lease.
func waitManagers(ctx context.Context, t *testing.T, n *node) {
	t.Helper()
	var d appsv1.Deployment
	waitFor(ctx, t, 4*time.Minute, "two manager replicas Ready", func() (bool, error) {
		if err := n.c.Get(ctx, types.NamespacedName{Namespace: system, Name: managerName}, &d); err != nil {
			return false, err
		}
		failIfCrashing(ctx, t, n, system)
		return d.Status.ReadyReplicas == 2 && d.Status.UpdatedReplicas == 2, nil
	})
	var pods corev1.PodList
	if err := n.c.List(ctx, &pods, client.InNamespace(system), client.MatchingLabels{"app.kubernetes.io/component": "manager"}); err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for i := range pods.Items {
		p := &pods.Items[i]
		if !podReady(p) {
			continue
		}
		names[p.Name] = true
		if p.Spec.NodeName != nodeName {
			t.Errorf("manager pod %s on node %q", p.Name, p.Spec.NodeName)
		}
		if p.Spec.ServiceAccountName != managerName || !hasSATokenVolume(p) {
			t.Errorf("manager pod %s: ServiceAccount %q, token volume %v", p.Name, p.Spec.ServiceAccountName, hasSATokenVolume(p))
		}
		if len(p.Spec.Containers) != 1 || p.Spec.Containers[0].Image != managerImage {
			t.Errorf("manager pod %s runs %+v", p.Name, p.Spec.Containers)
		}
	}
	if len(names) != 2 {
		t.Fatalf("%d Ready manager pods, want 2", len(names))
	}
	// Leader election through the API server, from inside a pod: one of the two holds the lease.
	waitFor(ctx, t, time.Minute, "a manager pod holding the leader lease", func() (bool, error) {
		var leases coordinationv1.LeaseList
		if err := n.c.List(ctx, &leases, client.InNamespace(system)); err != nil {
			return false, err
		}
		for _, l := range leases.Items {
			if l.Spec.HolderIdentity != nil {
				for name := range names {
					if strings.HasPrefix(*l.Spec.HolderIdentity, name) {
						t.Logf("leader lease %s held by %s", l.Name, *l.Spec.HolderIdentity)
						return true, nil
					}
				}
			}
		}
		return false, nil
	})
}

// sampleManifest is config/samples' quota, Deployment and HPA with what a machine without a
// registry or the logistics partner's API needs changed: the app's image (the lane's own,
// as "app" calling its downstream), the quota's upstream (the judge in the node's network),
// the replicas (2, so a loaded 2-core machine runs it; the HPA's minimum to match), and Equal
// sharing (the lane's checks count Equal's split).
func sampleManifest(t *testing.T, upstream string, replicas int64, concurrency int) []byte {
	b, err := os.ReadFile(filepath.Join(repoRoot(), "config/samples/apportion_v1alpha1_downstreamquota.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	kinds := map[string]bool{}
	for _, doc := range strings.Split(string(b), "\n---\n") {
		var u unstructured.Unstructured
		if err := yaml.Unmarshal([]byte(doc), &u.Object); err != nil {
			t.Fatal(err)
		}
		if u.Object == nil {
			continue
		}
		kinds[u.GetKind()] = true
		set := func(v any, path ...string) {
			if err := unstructured.SetNestedField(u.Object, v, path...); err != nil {
				t.Fatal(err)
			}
		}
		switch u.GetKind() {
		case "DownstreamQuota":
			// Numbers decode as float64 (YAML through JSON).
			if m, _, _ := unstructured.NestedFieldNoCopy(u.Object, "spec", "maxInFlight"); fmt.Sprint(m) != fmt.Sprint(sampleLimit) {
				t.Fatalf("the sample quota's maxInFlight is %v; the lane's judge assumes %d", m, sampleLimit)
			}
			set(upstream, "spec", "upstream")
			// The lane checks Equal's split to the permit (fullShares: Σ = the budget, each
			// pod at ⌊budget/pods⌋ or one more); the sample's demand-aware sharing, which
			// follows the app's traffic and lends the headroom, is test/e2e's
			// (TestDemandAwareSkew, TestLendHeadroomNewPod).
			unstructured.RemoveNestedField(u.Object, "spec", "sharing")
		case "Deployment":
			set(replicas, "spec", "replicas")
			cs, _, _ := unstructured.NestedSlice(u.Object, "spec", "template", "spec", "containers")
			if len(cs) != 1 {
				t.Fatalf("sample Deployment has %d containers, want 1", len(cs))
			}
			c := cs[0].(map[string]any)
			c["image"] = testImage
			c["args"] = []any{"app"}
			c["env"] = []any{
				map[string]any{"name": "LOAD_URL_FROM", "value": "APPORTION_LOGISTICS_URL"},
				map[string]any{"name": "LOAD_CONCURRENCY", "value": fmt.Sprint(concurrency)},
			}
			set(cs, "spec", "template", "spec", "containers")
			set(int64(5), "spec", "template", "spec", "terminationGracePeriodSeconds")
		case "HorizontalPodAutoscaler":
			set(replicas, "spec", "minReplicas")
			set(2*replicas, "spec", "maxReplicas")
		}
		y, err := yaml.Marshal(u.Object)
		if err != nil {
			t.Fatal(err)
		}
		out.WriteString("---\n")
		out.Write(y)
	}
	for _, k := range []string{"DownstreamQuota", "Deployment", "HorizontalPodAutoscaler"} {
		if !kinds[k] {
			t.Fatalf("config/samples/apportion_v1alpha1_downstreamquota.yaml has no %s", k)
		}
	}
	return out.Bytes()
}

// injectedApps labels a namespace, applies the sample and waits for its pods to be Ready, each
// with the agent injected as a native sidecar that the kubelet started and probed before the
// app. It returns the Ready pods.
func injectedApps(ctx context.Context, t *testing.T, n *node, installStart time.Time, upstream string, replicas int64, concurrency int) []corev1.Pod {
	if _, err := n.kubectl(ctx, "create", "namespace", "shop"); err != nil {
		t.Fatal(err)
	}
	applyAt := applySample(ctx, t, n, upstream, replicas, concurrency)
	return waitInjected(ctx, t, n, installStart, applyAt, replicas)
}

// applySample labels namespace shop for injection and applies the adapted sample to it; it
// returns when it applied it.
func applySample(ctx context.Context, t *testing.T, n *node, upstream string, replicas int64, concurrency int) time.Time {
	t.Helper()
	if _, err := n.kubectl(ctx, "label", "namespace", "shop", "apportion.io/injection=enabled"); err != nil {
		t.Fatal(err)
	}
	manifest := filepath.Join(n.dir, "sample.yaml")
	if err := os.WriteFile(manifest, sampleManifest(t, upstream, replicas, concurrency), 0o644); err != nil {
		t.Fatal(err)
	}
	applyAt := time.Now()
	if out, err := n.kubectl(ctx, "apply", "-f", manifest); err != nil {
		t.Fatal(err)
	} else {
		t.Logf("kubectl apply (config/samples, adapted):\n%s", strings.TrimSpace(out))
	}
	return applyAt
}

// waitInjected waits for replicas app pods of the sample, each Ready with the agent injected
// as a native sidecar that the kubelet started and probed before the app (checkInjected), and
// returns them; installStart and applyAt date its figures.
func waitInjected(ctx context.Context, t *testing.T, n *node, installStart, applyAt time.Time, replicas int64) []corev1.Pod {
	t.Helper()
	agentReadyAt := map[string]time.Time{}
	var firstReady time.Time
	var pods corev1.PodList
	waitFor(ctx, t, 4*time.Minute, fmt.Sprintf("%d injected app pods Ready", replicas), func() (bool, error) {
		if err := n.c.List(ctx, &pods, client.InNamespace("shop"), client.MatchingLabels{"app": "gateway"}); err != nil {
			return false, err
		}
		failIfCrashing(ctx, t, n, "shop")
		failIfCrashing(ctx, t, n, system)
		ready := 0
		for i := range pods.Items {
			p := &pods.Items[i]
			agentReady := false
			for _, s := range p.Status.InitContainerStatuses {
				if s.Name == agentContainer && s.Ready {
					agentReady = true
					if _, ok := agentReadyAt[p.Name]; !ok {
						agentReadyAt[p.Name] = time.Now()
					}
				}
			}
			injected := len(p.Spec.InitContainers) > 0 && p.Spec.InitContainers[0].Name == agentContainer
			// The agent's readiness (permits granted) gates the pod's.
			if injected && podReady(p) && !agentReady {
				t.Errorf("pod %s is Ready while its agent is not", p.Name)
			}
			if podReady(p) && p.DeletionTimestamp == nil && injected {
				ready++
				if firstReady.IsZero() {
					firstReady = time.Now()
				}
			}
		}
		return ready == int(replicas) && len(pods.Items) == int(replicas), nil
	})
	t.Logf("figure: install -> first injected pod Ready: %s (sample applied -> first Ready: %s)",
		firstReady.Sub(installStart).Round(time.Millisecond), firstReady.Sub(applyAt).Round(time.Millisecond))
	for i := range pods.Items {
		p := &pods.Items[i]
		checkInjected(t, p)
		for _, s := range p.Status.InitContainerStatuses {
			if s.Name == agentContainer && s.State.Running != nil {
				// The kubelet's startedAt has a resolution of one second.
				t.Logf("figure: pod %s: agent started -> Ready (first seen) %s; agent started %s, app started %s",
					p.Name, agentReadyAt[p.Name].Sub(s.State.Running.StartedAt.Time).Round(100*time.Millisecond),
					s.State.Running.StartedAt.Format(time.RFC3339), appStarted(p).Format(time.RFC3339))
			}
		}
	}
	return pods.Items
}

const agentContainer = "apportion-agent"

func appStarted(p *corev1.Pod) time.Time {
	for _, s := range p.Status.ContainerStatuses {
		if s.State.Running != nil {
			return s.State.Running.StartedAt.Time
		}
	}
	return time.Time{}
}

// checkInjected asserts what the webhook promised and the kubelet did with it.
func checkInjected(t *testing.T, p *corev1.Pod) {
	t.Helper()
	if p.Spec.NodeName != nodeName {
		t.Errorf("pod %s on node %q", p.Name, p.Spec.NodeName)
	}
	if len(p.Spec.InitContainers) == 0 || p.Spec.InitContainers[0].Name != agentContainer {
		t.Fatalf("pod %s: the agent is not the first init container: %+v", p.Name, p.Spec.InitContainers)
	}
	a := p.Spec.InitContainers[0]
	if a.RestartPolicy == nil || *a.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("pod %s: agent restartPolicy %v, want Always (a native sidecar)", p.Name, a.RestartPolicy)
	}
	if a.Image != agentImage {
		t.Errorf("pod %s: agent image %q, want %q", p.Name, a.Image, agentImage)
	}
	sc := a.SecurityContext
	if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser != 65532 ||
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" {
		t.Errorf("pod %s: agent securityContext %+v is not the hardened one", p.Name, sc)
	}
	if a.StartupProbe == nil || a.ReadinessProbe == nil {
		t.Errorf("pod %s: agent probes startup=%v readiness=%v", p.Name, a.StartupProbe, a.ReadinessProbe)
	}
	var agentStarted time.Time
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name == agentContainer {
			if s.Started == nil || !*s.Started || !s.Ready || s.State.Running == nil {
				t.Errorf("pod %s: agent status %+v: want started, ready, running", p.Name, s)
			} else {
				agentStarted = s.State.Running.StartedAt.Time
			}
		}
	}
	app := appStarted(p)
	if app.IsZero() || agentStarted.IsZero() || app.Before(agentStarted) {
		t.Errorf("pod %s: app started %v, agent started %v: want the agent first", p.Name, app, agentStarted)
	}
	envOK := false
	for _, e := range p.Spec.Containers[0].Env {
		envOK = envOK || (e.Name == "APPORTION_LOGISTICS_URL" && e.Value == "http://127.0.0.1:15001/logistics")
	}
	if !envOK {
		t.Errorf("pod %s: app env %+v lacks APPORTION_LOGISTICS_URL", p.Name, p.Spec.Containers[0].Env)
	}
}

// failIfCrashing fails t at once when a container in ns restarted twice: waiting out the
// timeout would only hide its log (printed by the node's cleanup).
func failIfCrashing(ctx context.Context, t *testing.T, n *node, ns string) {
	t.Helper()
	var pods corev1.PodList
	if err := n.c.List(ctx, &pods, client.InNamespace(ns)); err != nil {
		return
	}
	for _, p := range pods.Items {
		for _, s := range append(p.Status.InitContainerStatuses, p.Status.ContainerStatuses...) {
			if s.RestartCount >= 2 {
				t.Fatalf("pod %s/%s: container %s restarted %d times (last state %+v)", ns, p.Name, s.Name, s.RestartCount, s.LastTerminationState)
			}
		}
	}
}

// uninstall follows docs/install.md's "Uninstalling" to the letter and asserts that nothing of
// Apportion is left and nothing depends on it: no CRD, webhook configuration, namespace or trust
// ConfigMap; the rolled workload's pods run without an agent and are Ready.
func uninstall(ctx context.Context, t *testing.T, n *node, j *judge, replicas int) {
	uninstallWith(ctx, t, n, j, replicas, "kubectl delete -f dist/install.yaml", func() {
		n.kubectlAll(ctx, t, []string{"delete", "-f", filepath.Join(repoRoot(), "dist/install.yaml"), "--timeout=3m"})
	})
}

// uninstallWith is "Uninstalling" with remove as the step that removes the installation.
func uninstallWith(ctx context.Context, t *testing.T, n *node, j *judge, replicas int, how string, remove func()) {
	start := time.Now()
	n.kubectlAll(ctx, t,
		[]string{"delete", "downstreamquotas,degraderules", "--all", "-A"},
		[]string{"label", "namespace", "shop", "apportion.io/injection-"})
	remove()
	n.kubectlAll(ctx, t,
		[]string{"-n", "shop", "rollout", "restart", "deployment/gateway"},
		[]string{"delete", "configmap", "-A", "-l", "apportion.io/trust=true"})
	waitFor(ctx, t, 3*time.Minute, "namespace apportion-system gone", func() (bool, error) {
		err := n.c.Get(ctx, types.NamespacedName{Name: system}, &corev1.Namespace{})
		return err != nil && client.IgnoreNotFound(err) == nil, nil
	})
	var pods corev1.PodList
	waitFor(ctx, t, 3*time.Minute, fmt.Sprintf("%d rolled gateway pods Ready, none with an agent", replicas), func() (bool, error) {
		failIfCrashing(ctx, t, n, "shop")
		if err := n.c.List(ctx, &pods, client.InNamespace("shop"), client.MatchingLabels{"app": "gateway"}); err != nil {
			return false, err
		}
		if len(pods.Items) != replicas {
			return false, nil
		}
		for i := range pods.Items {
			p := &pods.Items[i]
			if len(p.Spec.InitContainers) > 0 || !podReady(p) || p.DeletionTimestamp != nil {
				return false, nil
			}
		}
		return true, nil
	})
	t.Logf("figure: uninstall (docs/install.md, %s) -> workload rolled without agents in %s", how, time.Since(start).Round(time.Millisecond))
	left, err := n.kubectl(ctx, "get", "crd,mutatingwebhookconfigurations,validatingwebhookconfigurations,validatingadmissionpolicies,validatingadmissionpolicybindings,clusterroles,clusterrolebindings", "-o", "name")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Fields(left) {
		if strings.Contains(l, "apportion") {
			t.Errorf("left after uninstall: %s", l)
		}
	}
	var cms corev1.ConfigMapList
	if err := n.c.List(ctx, &cms, client.MatchingLabels{"apportion.io/trust": "true"}); err != nil {
		t.Fatal(err)
	}
	if len(cms.Items) != 0 {
		t.Errorf("%d trust ConfigMaps left", len(cms.Items))
	}
	peak, ok, over := j.snapshot()
	t.Logf("figure: whole lane: judge peak %d, %d served, %d × 429", peak, ok, over)
	if peak > j.limit || over != 0 {
		t.Errorf("judge peak %d (limit %d), %d × 429", peak, j.limit, over)
	}
}

// kubectlAll runs each kubectl command in turn, logging its output, failing t at the first error.
func (n *node) kubectlAll(ctx context.Context, t *testing.T, cmds ...[]string) {
	t.Helper()
	for _, args := range cmds {
		out, err := n.kubectl(ctx, args...)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("kubectl %s:\n%s", strings.Join(args, " "), strings.TrimSpace(out))
	}
}
