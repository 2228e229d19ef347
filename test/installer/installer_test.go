// Package installer checks that the rendered installation (make build-installer → dist/install.yaml)
// applies to a real API server with the kubectl built by hack/envtest-assets.sh, and that its
// CRDs become Established.
package installer

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"
)

func TestInstallerAppliesAndCRDsBecomeEstablished(t *testing.T) {
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	if assets == "" {
		t.Skip("KUBEBUILDER_ASSETS is not set: run `make test`")
	}
	kubectl := filepath.Join(assets, "kubectl")

	// Render exactly as `make build-installer` does.
	out := filepath.Join(t.TempDir(), "install.yaml")
	render := exec.Command(kubectl, "kustomize", filepath.Join("..", "..", "config", "default"))
	manifest, err := render.Output()
	if err != nil {
		t.Fatalf("kubectl kustomize config/default: %v\n%s", err, stderrOf(err))
	}
	if err := os.WriteFile(out, manifest, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"kind: CustomResourceDefinition", "name: downstreamquotas.apportion.io",
		"name: degraderules.apportion.io", "namespace: apportion-system", "kind: ClusterRole", "name: apportion-controller-manager"} {
		if !strings.Contains(string(manifest), want) {
			t.Errorf("install.yaml lacks %q", want)
		}
	}

	env := &envtest.Environment{}
	cfg, err := env.Start()
	if err != nil {
		t.Fatalf("starting envtest: %v", err)
	}
	t.Cleanup(func() { _ = env.Stop() })
	user, err := env.AddUser(envtest.User{Name: "installer", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig, err := user.KubeConfig()
	if err != nil {
		t.Fatal(err)
	}
	kcPath := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kcPath, kubeconfig, 0o600); err != nil {
		t.Fatal(err)
	}

	apply := exec.Command(kubectl, "--kubeconfig", kcPath, "apply", "--server-side", "-f", out)
	if b, err := apply.CombinedOutput(); err != nil {
		t.Fatalf("kubectl apply -f install.yaml: %v\n%s", err, b)
	}

	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = apiextensionsv1.AddToScheme(scheme)
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, name := range []string{"downstreamquotas.apportion.io", "degraderules.apportion.io"} {
		for {
			var crd apiextensionsv1.CustomResourceDefinition
			if err := c.Get(ctx, client.ObjectKey{Name: name}, &crd); err == nil && established(&crd) {
				break
			}
			select {
			case <-ctx.Done():
				t.Fatalf("CRD %s did not become Established", name)
			case <-time.After(50 * time.Millisecond):
			}
		}
	}

	// The CRDs serve: kubectl can list the new kinds by their short names.
	for _, short := range []string{"dq", "dr"} {
		get := exec.Command(kubectl, "--kubeconfig", kcPath, "get", short, "-A")
		if b, err := get.CombinedOutput(); err != nil {
			t.Errorf("kubectl get %s: %v\n%s", short, err, b)
		}
	}
}

func established(crd *apiextensionsv1.CustomResourceDefinition) bool {
	for _, c := range crd.Status.Conditions {
		if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
			return true
		}
	}
	return false
}

func stderrOf(err error) string {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return string(ee.Stderr)
	}
	return ""
}
