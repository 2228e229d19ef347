// Package charttest renders the Helm chart (dist/chart) with Helm's Go template engine — no
// helm binary — and checks it object by object against the rendered kustomize installation:
// default values against dist/install.yaml, certs.mode=cert-manager against
// dist/install-certmanager.yaml, hub.enabled against dist/install-hub.yaml, prometheus.enabled
// against config/prometheus. It is a module of its own because Helm's dependencies pin other
// Kubernetes library versions than the main module's; `make test` runs it.
package charttest

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"helm.sh/helm/v3/pkg/chart"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"sigs.k8s.io/yaml"
)

const (
	root      = "../.."
	namespace = "apportion-system"
)

type object = map[string]any

// key names an object the way the API server does.
func key(o object) string {
	md, _ := o["metadata"].(map[string]any)
	return strings.Join([]string{str(o["apiVersion"]), str(o["kind"]), str(md["namespace"]), str(md["name"])}, "/")
}

func str(v any) string {
	s, _ := v.(string)
	return s
}

// parse splits a multi-document YAML stream into objects, skipping empty documents.
func parse(t *testing.T, what, stream string) map[string]object {
	t.Helper()
	out := map[string]object{}
	for _, doc := range strings.Split("\n"+stream, "\n---") {
		if strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(doc), "---")) == "" {
			continue
		}
		var o object
		if err := yaml.Unmarshal([]byte(doc), &o); err != nil {
			t.Fatalf("%s: %v\n%s", what, err, doc)
		}
		if o == nil {
			continue
		}
		k := key(o)
		if _, dup := out[k]; dup {
			t.Errorf("%s: %s twice", what, k)
		}
		out[k] = o
	}
	return out
}

func loadChart(t *testing.T) *chart.Chart {
	t.Helper()
	c, err := loader.Load(filepath.Join(root, "dist", "chart"))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// render renders the chart as `helm install apportion dist/chart -n apportion-system --set ...`.
func render(t *testing.T, c *chart.Chart, set map[string]any) (map[string]object, error) {
	t.Helper()
	vals, err := chartutil.ToRenderValues(c, set, chartutil.ReleaseOptions{
		Name: "apportion", Namespace: namespace, IsInstall: true, Revision: 1,
	}, chartutil.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	files, err := engine.Render(c, vals)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(files))
	for n := range files {
		names = append(names, n)
	}
	sort.Strings(names)
	var all []string
	for _, n := range names {
		if strings.HasSuffix(n, ".tpl") || strings.HasSuffix(n, "NOTES.txt") {
			continue
		}
		all = append(all, files[n])
	}
	objs := parse(t, "chart", strings.Join(all, "\n---\n"))
	for _, crd := range c.CRDObjects() {
		for k, o := range parse(t, crd.Name, string(crd.File.Data)) {
			objs[k] = o
		}
	}
	return objs, nil
}

func readObjects(t *testing.T, rel string) map[string]object {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		t.Fatal(err)
	}
	return parse(t, rel, string(b))
}

// compare reports every object only one side has and every difference of the shared ones.
func compare(t *testing.T, got, want map[string]object) {
	t.Helper()
	for k, w := range want {
		g, ok := got[k]
		if !ok {
			t.Errorf("the chart lacks %s", k)
			continue
		}
		if d := cmp.Diff(w, g); d != "" {
			t.Errorf("%s differs (-kustomize +chart):\n%s", k, d)
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			t.Errorf("the chart renders %s, which the installation does not hold", k)
		}
	}
}

// withoutNamespace drops the Namespace object: Helm installs into an existing namespace
// (namespace.create renders it, checked in TestChartNamespace).
func withoutNamespace(objs map[string]object) map[string]object {
	delete(objs, "v1/Namespace//"+namespace)
	return objs
}

func TestChartDefaultsMatchInstallYAML(t *testing.T) {
	got, err := render(t, loadChart(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	compare(t, got, withoutNamespace(readObjects(t, "dist/install.yaml")))
}

func TestChartCertManagerMatchesInstallCertManagerYAML(t *testing.T) {
	got, err := render(t, loadChart(t), map[string]any{"certs": map[string]any{"mode": "cert-manager"}})
	if err != nil {
		t.Fatal(err)
	}
	compare(t, got, withoutNamespace(readObjects(t, "dist/install-certmanager.yaml")))
}

// hub.enabled is config/hub: the hub role's ClusterRole and binding, and --hub on the manager.
func TestChartHubMatchesInstallHubYAML(t *testing.T) {
	got, err := render(t, loadChart(t), map[string]any{"hub": map[string]any{"enabled": true}})
	if err != nil {
		t.Fatal(err)
	}
	compare(t, got, withoutNamespace(readObjects(t, "dist/install-hub.yaml")))
}

func TestChartNamespace(t *testing.T) {
	got, err := render(t, loadChart(t), map[string]any{"namespace": map[string]any{"create": true}})
	if err != nil {
		t.Fatal(err)
	}
	compare(t, got, readObjects(t, "dist/install.yaml"))
}

func TestChartPrometheusMatchesOverlay(t *testing.T) {
	c := loadChart(t)
	base, err := render(t, c, nil)
	if err != nil {
		t.Fatal(err)
	}
	on, err := render(t, c, map[string]any{"prometheus": map[string]any{"enabled": true}})
	if err != nil {
		t.Fatal(err)
	}
	extra := map[string]object{}
	for k, o := range on {
		if _, ok := base[k]; !ok {
			extra[k] = o
		}
	}
	// The overlay's objects as `kubectl apply -k config/prometheus` creates them.
	want := map[string]object{}
	for _, f := range []string{"monitor.yaml", "podmonitor.yaml", "rules.yaml"} {
		for _, o := range readObjects(t, filepath.Join("config", "prometheus", f)) {
			o["metadata"].(map[string]any)["namespace"] = namespace
			want[key(o)] = o
		}
	}
	dash, err := os.ReadFile(filepath.Join(root, "config", "prometheus", "dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	cm := object{"apiVersion": "v1", "kind": "ConfigMap",
		"metadata": map[string]any{"name": "apportion-grafana-dashboard", "namespace": namespace,
			"labels": map[string]any{"grafana_dashboard": "1"}},
		"data": map[string]any{"apportion.json": strings.TrimSuffix(string(dash), "\n")}}
	want[key(cm)] = cm
	compare(t, extra, want)
}

func TestChartValues(t *testing.T) {
	c := loadChart(t)
	got, err := render(t, c, map[string]any{
		"image":               map[string]any{"repository": "registry.example/m", "tag": "v9", "pullPolicy": "Always"},
		"agentImage":          map[string]any{"repository": "registry.example/a", "tag": "v9"},
		"replicas":            3,
		"injection":           map[string]any{"agentCPURequest": "100m", "agentMemoryLimit": "64Mi"},
		"podDisruptionBudget": map[string]any{"enabled": false},
		"networkPolicy":       map[string]any{"enabled": false},
	})
	if err != nil {
		t.Fatal(err)
	}
	d := got["apps/v1/Deployment/"+namespace+"/apportion-controller-manager"]
	spec := d["spec"].(map[string]any)
	if spec["replicas"] != float64(3) {
		t.Errorf("replicas %v, want 3", spec["replicas"])
	}
	ctr := spec["template"].(map[string]any)["spec"].(map[string]any)["containers"].([]any)[0].(map[string]any)
	if ctr["image"] != "registry.example/m:v9" || ctr["imagePullPolicy"] != "Always" {
		t.Errorf("image %v pull policy %v", ctr["image"], ctr["imagePullPolicy"])
	}
	env := ctr["env"].([]any)[1].(map[string]any)
	if env["name"] != "APPORTION_AGENT_IMAGE" || env["value"] != "registry.example/a:v9" {
		t.Errorf("agent image env %v", env)
	}
	args := ctr["args"].([]any)
	for _, want := range []string{"--agent-cpu-request=100m", "--agent-memory-limit=64Mi"} {
		found := false
		for _, a := range args {
			found = found || a == want
		}
		if !found {
			t.Errorf("args %v lack %s", args, want)
		}
	}
	for k := range got {
		if strings.Contains(k, "PodDisruptionBudget") || strings.Contains(k, "NetworkPolicy") {
			t.Errorf("%s rendered although disabled", k)
		}
	}
	if _, err := render(t, c, map[string]any{"certs": map[string]any{"mode": "vault"}}); err == nil ||
		!strings.Contains(err.Error(), "certs.mode must be controller or cert-manager") {
		t.Errorf("certs.mode=vault rendered (%v), want a clear error", err)
	}
}

// The chart's copy of the dashboard is the overlay's.
func TestChartDashboardIsTheOverlays(t *testing.T) {
	a, err := os.ReadFile(filepath.Join(root, "config", "prometheus", "dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, "dist", "chart", "files", "dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	if string(a) != string(b) {
		t.Error("dist/chart/files/dashboard.json differs from config/prometheus/dashboard.json: copy it")
	}
}
