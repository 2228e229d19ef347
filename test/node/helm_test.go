//go:build linux

package node

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"k8s.io/cli-runtime/pkg/genericclioptions"
)

// helmRelease is the release name docs/install.md uses with the chart.
const helmRelease = "apportion"

// helmConfig is Helm's action configuration for the node's API server (an admin's kubeconfig),
// with the release record kept in Secrets of the manager's namespace, as the helm CLI does.
func helmConfig(t *testing.T, n *node) *action.Configuration {
	t.Helper()
	flags := genericclioptions.NewConfigFlags(false)
	flags.KubeConfig = &n.kubeconfig
	ns := system
	flags.Namespace = &ns
	cfg := new(action.Configuration)
	if err := cfg.Init(flags, system, "secret", func(format string, v ...any) {
		t.Logf("helm: "+format, v...)
	}); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// imageValues splits an image reference into the chart's repository and tag values.
func imageValues(t *testing.T, ref string) map[string]any {
	i := strings.LastIndex(ref, ":")
	if i < 0 {
		t.Fatalf("image %q has no tag", ref)
	}
	return map[string]any{"repository": ref[:i], "tag": ref[i+1:]}
}

// helmWalk is the same user's path with the chart (dist/chart) instead of dist/install.yaml,
// through Helm's install and uninstall actions (Helm's Go SDK, as the helm CLI runs them):
// `helm install apportion dist/chart -n apportion-system --create-namespace --wait` with the
// images given as the chart's values, both manager replicas Ready; the namespace labelled again,
// the sample applied and rolled, so its pods are injected; one scale step under traffic; and
// "Uninstalling" with `helm uninstall` -- after which, since Helm keeps a chart's crds/, the CRDs
// and the namespace Helm created are deleted by hand, as docs/install.md says -- leaving nothing.
// It runs after the kubectl walk's uninstall, on the same node: the sample's workload is there,
// without agents.
func helmWalk(ctx context.Context, t *testing.T, n *node, j *judge, replicas int) {
	chart, err := loader.Load(filepath.Join(repoRoot(), "dist", "chart"))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	install := action.NewInstall(helmConfig(t, n))
	install.ReleaseName = helmRelease
	install.Namespace = system
	install.CreateNamespace = true
	install.Wait = true
	install.Timeout = 4 * time.Minute
	vals := map[string]any{
		"image":      imageValues(t, managerImage),
		"agentImage": imageValues(t, agentImage),
	}
	rel, err := install.RunWithContext(ctx, chart, vals)
	if err != nil {
		t.Fatalf("helm install: %v", err)
	}
	t.Logf("helm install %s (chart %s %s): %s, %d CRDs, manifest of %d objects", rel.Name, rel.Chart.Metadata.Name,
		rel.Chart.Metadata.Version, rel.Info.Status, len(chart.CRDObjects()), strings.Count(rel.Manifest, "\nkind: "))
	waitManagers(ctx, t, n)
	t.Logf("figure: helm install -> 2 manager replicas Ready in %s", time.Since(start).Round(time.Millisecond))

	// The sample's Deployment is back at the lane's replica count; its pods, created while the
	// namespace was not labelled, get their agents when rolled.
	applyAt := applySample(ctx, t, n, j.url(), sampleReplicas, sampleConcurrency)
	n.kubectlAll(ctx, t, []string{"-n", "shop", "rollout", "restart", "deployment/gateway"})
	pods := waitInjected(ctx, t, n, start, applyAt, sampleReplicas)
	waitFor(ctx, t, time.Minute, "every agent holding its full share", func() (bool, error) {
		return fullShares(quotaSample(ctx, t, n).Holdings, sampleReplicas, nil), nil
	})
	t.Logf("helm: %d injected pods Ready, full shares acknowledged", len(pods))
	scaleStep(ctx, t, n, j, replicas)

	uninstallWith(ctx, t, n, j, replicas, "helm uninstall", func() {
		un := action.NewUninstall(helmConfig(t, n))
		un.Wait = true
		un.Timeout = 3 * time.Minute
		res, err := un.Run(helmRelease)
		if err != nil {
			t.Fatalf("helm uninstall: %v", err)
		}
		t.Logf("helm uninstall %s: %s", helmRelease, strings.TrimSpace(res.Info))
		crds := []string{"delete", "crd"}
		for _, c := range chart.CRDObjects() {
			crds = append(crds, strings.TrimSuffix(filepath.Base(c.Filename), ".yaml"))
		}
		if len(crds) == 2 {
			t.Fatal("the chart has no CRDs in crds/")
		}
		n.kubectlAll(ctx, t, crds, []string{"delete", "namespace", system, "--timeout=3m"})
	})
	if rels, err := action.NewList(helmConfig(t, n)).Run(); err == nil && len(rels) > 0 {
		t.Errorf("helm releases left: %v", rels)
	} else if err != nil {
		t.Logf("helm list after the uninstall: %v", err)
	}
	t.Logf("figure: helm walk (install, inject, scale step, uninstall) in %s", time.Since(start).Round(time.Second))
}
