package e2e

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/apportion/apportion/test/e2e/harness"
)

// The cluster mode: the scenarios whose top-level test's name starts with "TestCluster" run on
// a control plane of their own with Kubernetes' own control loops (the real
// kube-controller-manager and kube-scheduler, kwok's nodes; harness/cluster.go) instead of the
// harness's simulation of them.
const clusterPrefix = "TestCluster"

var (
	clusterOnce sync.Once
	theCluster  *harness.Env
	clusterErr  error
)

// inCluster reports whether t runs in the cluster mode.
func inCluster(t tb) bool { return strings.HasPrefix(t.Name(), clusterPrefix) }

// envFor returns the environment t runs in.
func envFor(t tb) *harness.Env {
	if inCluster(t) {
		return clusterEnv(t)
	}
	return env(t)
}

// clusterEnv starts (once per package) a second control plane with the cluster mode's
// controllers, scheduler and kwok nodes; it shares the binaries with env.
func clusterEnv(t tb) *harness.Env {
	t.Helper()
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		t.Skip(harness.ErrNoAssets.Error())
	}
	if os.Getenv(harness.ClusterAssetsEnv) == "" {
		t.Skip(harness.ErrNoClusterAssets.Error())
	}
	clusterOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		bin, err := harness.Build(ctx)
		if err != nil {
			clusterErr = err
			return
		}
		dir, err := os.MkdirTemp("", "apportion-e2e-cluster-")
		if err != nil {
			clusterErr = err
			return
		}
		theCluster = &harness.Env{Bin: bin, IPs: harness.NewIPPool(), Dir: dir}
		if !bin.HasAgent() || !bin.Pushes() {
			return
		}
		if theCluster.CP, err = harness.StartControlPlane(dir); err != nil {
			clusterErr = err
			return
		}
		theCluster.Cluster, clusterErr = harness.StartCluster(ctx, theCluster.CP, theCluster.IPs, dir, harness.ClusterConfig{Nodes: 3})
	})
	if clusterErr != nil {
		t.Fatalf("e2e cluster environment: %v", clusterErr)
	}
	switch b := theCluster.Bin; {
	case !b.HasAgent():
		t.Fatalf("no agent binary: %v", harness.FirstLine(b.AgentErr))
	case !b.Pushes():
		t.Fatalf("the manager takes no --lease-ttl: its push engine is not wired, nothing reaches the agents")
	}
	return theCluster
}

// stopClusterEnv stops what clusterEnv started; its logs stay when keep.
func stopClusterEnv(keep bool) {
	if theCluster == nil {
		return
	}
	if theCluster.Cluster != nil {
		theCluster.Cluster.Stop()
	}
	if theCluster.CP != nil {
		_ = theCluster.CP.Stop()
	}
	if keep {
		fmt.Fprintf(os.Stderr, "e2e cluster logs: %s\n", theCluster.Dir)
	} else {
		_ = os.RemoveAll(theCluster.Dir)
	}
}

// playedInClusterWhenShort skips the simulated form of a scenario that TestClusterScenarios
// plays on the real control loops, unless E2E_FULL=1: the short run keeps its time budget by
// playing each of them once, in the cluster mode.
func playedInClusterWhenShort(t *testing.T) {
	t.Helper()
	if !full && !inCluster(t) {
		t.Skip("the short run plays this scenario in the cluster mode (TestClusterScenarios/" + strings.TrimPrefix(t.Name(), "Test") + "); E2E_FULL=1 runs the simulated form too")
	}
}

// TestClusterScenarios runs scenarios written for the simulated cluster on the real control
// loops: the HPA's scale events go through the scale subresource, the ReplicaSet controller
// creates the pods (through the injection webhook) and picks the victims of a scale-in.
func TestClusterScenarios(t *testing.T) {
	for _, tc := range []struct {
		name string
		run  func(*testing.T)
	}{
		{"ScaleSteps", TestScaleSteps},
		{"ManagerKilledDuringScaleOut", TestManagerKilledDuringScaleOut},
		{"AgentKilledAndRestarted", TestAgentKilledAndRestarted},
		{"HPAFlapping", TestHPAFlapping},
	} {
		t.Run(tc.name, tc.run)
	}
}

// rollingDeployment is the workload's Deployment with a RollingUpdate strategy.
func rollingDeployment(name, surge string) *appsv1.Deployment {
	labels := map[string]string{"app": name}
	return &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(int32(1)),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Strategy: appsv1.DeploymentStrategy{
				Type: appsv1.RollingUpdateDeploymentStrategyType,
				RollingUpdate: &appsv1.RollingUpdateDeployment{
					MaxSurge:       ptr.To(intstr.FromString(surge)),
					MaxUnavailable: ptr.To(intstr.FromInt32(0)),
				},
			},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec: corev1.PodSpec{Containers: []corev1.Container{
					{Name: "app", Image: "example.invalid/app:v1"},
				}},
			},
		},
	}
}

// checkEnforcedFirst asserts that every pod that appeared after since (the new ones) had its
// agent enforcing (an assignment applied: /readyz) before it became a ready endpoint and
// before the app first called through it, and that the first call found its downstream
// configured; it returns how long after since the last new pod began enforcing.
func checkEnforcedFirst(t *testing.T, s *harness.Scenario, since time.Time) (newPods int, allEnforced time.Duration) {
	t.Helper()
	for _, p := range s.Workload.PodTimes() {
		if p.Seen.Before(since) || p.Lost {
			continue
		}
		if p.Enforced.IsZero() {
			if !p.Serving.IsZero() || !p.FirstCall.IsZero() {
				t.Errorf("pod %s took traffic (serving %v, first call %v) and never enforced", p.Name, p.Serving, p.FirstCall)
			}
			continue // deleted before it was ready (a scale-in or a newer rollout)
		}
		newPods++
		allEnforced = max(allEnforced, p.Enforced.Sub(since))
		if !p.Serving.IsZero() && p.Serving.Before(p.Enforced) {
			t.Errorf("pod %s was a ready endpoint at %s, before its agent enforced at %s", p.Name, p.Serving.Format(time.StampMicro), p.Enforced.Format(time.StampMicro))
		}
		if !p.FirstCall.IsZero() && p.FirstCall.Before(p.Enforced) {
			t.Errorf("pod %s took its first call at %s, before its agent enforced at %s", p.Name, p.FirstCall.Format(time.StampMicro), p.Enforced.Format(time.StampMicro))
		}
		if p.FirstStatus == 404 {
			t.Errorf("pod %s: the first call through its agent found no downstream (404): it took traffic before its assignment", p.Name)
		}
	}
	return newPods, allEnforced
}

// TestClusterRollingUpdate: a new image tag under load, maxUnavailable 0 and maxSurge 25 % (2
// extra pods of 8) or 100 % (8 extra): the deployment controller surges the new ReplicaSet
// before it scales the old one down, so up to 8 + surge pods share the quota. Σ permits and
// Σ in-flight stay within the limit, the downstream answers no 429, and every new pod's agent
// enforces before its pod takes traffic.
func TestClusterRollingUpdate(t *testing.T) {
	for _, surge := range []string{"25%", "100%"} {
		t.Run("maxSurge="+surge, func(t *testing.T) {
			const replicas = 8
			s := scenario(t, harness.ScenarioConfig{Replicas: replicas, MaxReplicas: 16, Deployment: rollingDeployment("gateway", surge)})
			ctx := t.Context()
			start := time.Now()
			mustConverge(t, ctx, s)
			old := s.Workload.Pods()
			t0 := time.Now()
			if err := s.Workload.UpdateTemplate(ctx, func(d *appsv1.Deployment) {
				d.Spec.Template.Spec.Containers[0].Image = "example.invalid/app:v2"
			}); err != nil {
				t.Fatal(err)
			}
			if err := s.Workload.WaitSettled(ctx, replicas, 3*time.Minute); err != nil {
				t.Fatal(err)
			}
			rolled := time.Since(t0)
			for _, p := range s.Workload.Pods() {
				if slices.Contains(old, p) {
					t.Errorf("pod %s of the old ReplicaSet survived the rollout", p)
				}
			}
			newPods, enforced := checkEnforcedFirst(t, s, t0)
			mustConverge(t, ctx, s)
			_ = sleep(ctx, time.Second)
			st := finish(t, s, start)
			t.Logf("rolling update maxSurge=%s, %d pods: %d new pods, all enforcing %s after the template change, rollout done after %s; maxima: Σ permits %d, Σ in-flight %d, downstream peak %d (limit %d)",
				surge, replicas, newPods, enforced.Round(time.Millisecond), rolled.Round(time.Millisecond), st.MaxSumPermits, st.MaxSumInFlight, st.Downstream.Peak, s.Cfg.Limit)
			if newPods < replicas {
				t.Errorf("only %d new pods enforced, want ≥ %d", newPods, replicas)
			}
		})
	}
}

// TestClusterScaleOutAndBack: 8 → 32 pods in one step through the scale subresource and back to
// 8, the ReplicaSet controller choosing which 24 pods go.
func TestClusterScaleOutAndBack(t *testing.T) {
	s := scenario(t, harness.ScenarioConfig{Replicas: 8, MaxReplicas: 32, Limit: 64, WorkersPerAgent: 3})
	ctx := t.Context()
	start := time.Now()
	mustConverge(t, ctx, s)
	before := s.Workload.Pods()
	t0 := time.Now()
	if err := s.Workload.ScaleTo(ctx, 32, harness.ScaleOptions{}); err != nil {
		t.Fatal(err)
	}
	newPods, enforced := checkEnforcedFirst(t, s, t0)
	mustConverge(t, ctx, s)
	t.Logf("8 → 32: %d new pods, all enforcing %s after /scale; every pod at %d permits %s after /scale",
		newPods, enforced.Round(time.Millisecond), s.PerPod(32), time.Since(t0).Round(time.Millisecond))
	_ = sleep(ctx, time.Second)
	t1 := time.Now()
	if err := s.Workload.ScaleTo(ctx, 8, harness.ScaleOptions{}); err != nil {
		t.Fatal(err)
	}
	mustConverge(t, ctx, s)
	after := s.Workload.Pods()
	kept := 0
	for _, p := range after {
		if slices.Contains(before, p) {
			kept++
		}
	}
	t.Logf("32 → 8: every pod at %d permits %s after /scale; the ReplicaSet controller kept %d of the 8 original pods: %v",
		s.PerPod(8), time.Since(t1).Round(time.Millisecond), kept, after)
	_ = sleep(ctx, time.Second)
	finish(t, s, start)
}

// TestClusterNodeLost: under load, a node is lost (its agents killed, its Node deleted); its
// pods stay counted until the pod garbage collector deletes them as orphans (its quarantine is
// a fixed 40 s), then the ReplicaSet controller replaces them on the remaining nodes.
func TestClusterNodeLost(t *testing.T) {
	if !full {
		t.Skip("full run only (E2E_FULL=1, make test-e2e): the pod garbage collector deletes a lost node's pods after its fixed 40 s quarantine, about a minute in all")
	}
	const replicas = 9
	s := scenario(t, harness.ScenarioConfig{Replicas: replicas, MaxReplicas: 16})
	ctx := t.Context()
	start := time.Now()
	mustConverge(t, ctx, s)
	byNode := map[string][]string{}
	for pod, node := range s.Workload.PodNodes() {
		byNode[node] = append(byNode[node], pod)
	}
	nodes := make([]string, 0, len(byNode))
	for n := range byNode {
		nodes = append(nodes, n)
	}
	sort.Slice(nodes, func(i, j int) bool { return len(byNode[nodes[i]]) > len(byNode[nodes[j]]) })
	victim := nodes[0]
	t0 := time.Now()
	lost, err := s.Workload.LoseNode(ctx, victim)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// The next scenario gets its node back (a new one: a lost node's podCIDR is not reused).
		if _, err := s.Env.Cluster.AddNode(context.Background()); err != nil {
			t.Errorf("adding a node back: %v", err)
		}
	})
	if err := s.Workload.WaitSettled(ctx, replicas, 3*time.Minute); err != nil {
		t.Fatal(err)
	}
	for _, p := range s.Workload.Pods() {
		if slices.Contains(lost, p) {
			t.Errorf("pod %s of the lost node still exists", p)
		}
	}
	newPods, _ := checkEnforcedFirst(t, s, t0)
	mustConverge(t, ctx, s)
	t.Logf("node %s lost with %d pods %v: replaced by %d new pods, settled %s after the loss", victim, len(lost), lost, newPods, time.Since(t0).Round(time.Millisecond))
	_ = sleep(ctx, time.Second)
	finish(t, s, start)
}
