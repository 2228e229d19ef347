package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/apportion/apportion"

// forbidden is what the agent must never reach, directly or through any package it imports:
// the Kubernetes client machinery and API types (the agent is a small sidecar in every pod and
// talks to the manager over its own control API, docs/agent.md), and the manager's own packages
// (the agent enforces the numbers it is sent; it neither computes shares nor reconciles). A
// rule names a package and everything under it, unless exact.
var forbidden = []struct {
	path  string
	exact bool
	why   string
}{
	{path: "k8s.io/client-go", why: "Kubernetes client"},
	{path: "k8s.io/apimachinery", why: "Kubernetes API machinery"},
	{path: "k8s.io/api", why: "Kubernetes API types"},
	{path: "sigs.k8s.io/controller-runtime", why: "controller-runtime"},
	// The CRD types import apimachinery; their dependency-free defaults (api/v1alpha1/defaults)
	// are the agent's too.
	{path: module + "/api/v1alpha1", exact: true, why: "the CRD types"},
	{path: module + "/cmd/manager", why: "the manager"},
	{path: module + "/internal/controller", why: "the manager's reconcilers"},
	{path: module + "/internal/push", why: "the manager's push engine"},
	{path: module + "/internal/inject", why: "the manager's injection webhook"},
	{path: module + "/internal/keys", why: "the manager's signing keys"},
	{path: module + "/internal/targets", why: "the manager's target resolution"},
	{path: module + "/internal/apportion", why: "the manager's share arithmetic"},
}

// TestAgentReachesNoKubernetesOrManagerPackage is the agent's dependency rule, checked on the
// whole transitive graph `go list -deps -test` gives for cmd/agent and internal/agent/...
// (their tests included), not only on direct imports: it fails, naming the import chain, when
// anything there reaches a forbidden package. The control run checks that the same rule finds
// the violations of a manager package, so the check cannot pass by seeing nothing.
func TestAgentReachesNoKubernetesOrManagerPackage(t *testing.T) {
	g := goListDeps(t, module+"/cmd/agent/...", module+"/internal/agent/...")
	for _, want := range []string{module + "/cmd/agent", module + "/internal/agent/proxy", module + "/internal/assignment"} {
		if _, ok := g.imports[want]; !ok {
			t.Fatalf("go list did not list %s: the patterns no longer match the agent", want)
		}
	}
	if v := g.violations(); len(v) > 0 {
		t.Errorf("the agent reaches %d forbidden package(s) (docs/architecture.md):\n%s", len(v), strings.Join(v, "\n"))
	}
	t.Logf("%d packages checked (with tests)", len(g.imports))

	// Control: a package outside the agent that imports the CRD types and k8s.io/api must show
	// violations, read from go list the same way.
	control := goListDeps(t, module+"/internal/testing/builders")
	if v := control.violations(); len(v) == 0 {
		t.Error("control: internal/testing/builders shows no violation; the check sees nothing")
	} else {
		t.Logf("control, internal/testing/builders:\n%s", strings.Join(v, "\n"))
	}
}

// TestDependencyCheckFollowsChains: a forbidden package reached only through others is found,
// with its shortest chain; one reached by two roots is reported once; a package merely named like a
// forbidden one (k8s.io/apiextensions-apiserver is not k8s.io/api) and api/v1alpha1's defaults
// are not.
func TestDependencyCheckFollowsChains(t *testing.T) {
	g := depGraph{
		roots: []string{module + "/cmd/agent", module + "/internal/agent/x [x.test]"},
		imports: map[string][]string{
			module + "/cmd/agent":                  {module + "/internal/agent/x", module + "/api/v1alpha1/defaults"},
			module + "/internal/agent/x":           {"example.com/lib"},
			module + "/internal/agent/x [x.test]":  {"example.com/lib [x.test]"},
			"example.com/lib":                      {"k8s.io/apimachinery/pkg/util/wait", "k8s.io/apiextensions-apiserver/pkg/x"},
			"example.com/lib [x.test]":             {"k8s.io/apimachinery/pkg/util/wait"},
			module + "/api/v1alpha1/defaults":      nil,
			"k8s.io/apimachinery/pkg/util/wait":    nil,
			"k8s.io/apiextensions-apiserver/pkg/x": nil,
		},
	}
	got := g.violations()
	// The shortest chain: through the test variant (two steps), not from cmd/agent (three).
	want := []string{
		"  internal/agent/x [x.test] -> example.com/lib [x.test] -> k8s.io/apimachinery/pkg/util/wait (Kubernetes API machinery)",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("violations:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// depGraph is go list's import graph: package -> its imports, as go list names them (a test's
// variant of a package carries a " [p.test]" suffix, in both places).
type depGraph struct {
	roots   []string
	imports map[string][]string
}

func goListDeps(t *testing.T, patterns ...string) depGraph {
	t.Helper()
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the dependency check needs the go command (go test puts it on PATH): %v", err)
	}
	var stderr bytes.Buffer
	cmd := exec.Command(gobin, append([]string{"list", "-deps", "-test", "-json=ImportPath,Imports,DepOnly"}, patterns...)...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, stderr.Bytes())
	}
	g := depGraph{imports: map[string][]string{}}
	for dec := json.NewDecoder(bytes.NewReader(out)); ; {
		var p struct {
			ImportPath string
			Imports    []string
			DepOnly    bool
		}
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("decoding go list's output: %v", err)
		}
		g.imports[p.ImportPath] = p.Imports
		if !p.DepOnly {
			g.roots = append(g.roots, p.ImportPath)
		}
	}
	return g
}

// violations lists every forbidden package reachable from the roots, each with one shortest
// import chain from a root, sorted.
func (g depGraph) violations() []string {
	from := map[string]string{} // breadth-first tree: package -> the package that imports it
	queue := slices.Clone(g.roots)
	for _, r := range g.roots {
		from[r] = ""
	}
	var out []string
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		if why, bad := isForbidden(p); bad {
			var chain []string
			for q := p; q != ""; q = from[q] {
				chain = append(chain, strings.TrimPrefix(q, module+"/"))
			}
			slices.Reverse(chain)
			out = append(out, fmt.Sprintf("  %s (%s)", strings.Join(chain, " -> "), why))
			continue // one chain per forbidden package is enough; do not walk into it
		}
		for _, i := range g.imports[p] {
			if _, seen := from[i]; !seen {
				from[i] = p
				queue = append(queue, i)
			}
		}
	}
	slices.Sort(out)
	return out
}

func isForbidden(pkg string) (string, bool) {
	pkg, _, _ = strings.Cut(pkg, " ") // a test variant: "p [q.test]"
	for _, f := range forbidden {
		if pkg == f.path || (!f.exact && strings.HasPrefix(pkg, f.path+"/")) {
			return f.why, true
		}
	}
	return "", false
}

// TestAgentBinaryLinksNoGRPC: the agent speaks gRPC's status codes itself (internal/agent/grpcstatus)
// and links no gRPC implementation; grpc-go is for its tests (the real client and server the
// HTTP/2 path is held to). The binary's own graph, tests excluded, must not reach it; the control
// is a test graph that does.
func TestAgentBinaryLinksNoGRPC(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the dependency check needs the go command: %v", err)
	}
	list := func(args ...string) []string {
		out, err := exec.Command(gobin, append([]string{"list", "-deps"}, args...)...).Output()
		if err != nil {
			t.Fatalf("go list %v: %v", args, err)
		}
		return strings.Fields(string(out))
	}
	grpc := func(pkgs []string) []string {
		return slices.DeleteFunc(pkgs, func(p string) bool { return !strings.HasPrefix(p, "google.golang.org/grpc") })
	}
	if g := grpc(list(module + "/cmd/agent")); len(g) > 0 {
		t.Errorf("the agent binary links %d gRPC packages, e.g. %s: write the spec's constants instead (internal/agent/grpcstatus)", len(g), g[0])
	}
	if g := grpc(list("-test", module+"/internal/agent/proxy")); len(g) == 0 {
		t.Error("control: internal/agent/proxy's tests reach no gRPC package; the check sees nothing")
	}
}
