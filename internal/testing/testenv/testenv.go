// Package testenv starts what the envtest suites of the controllers and of the injection webhook
// share: a real kube-apiserver and etcd (sigs.k8s.io/controller-runtime/pkg/envtest) with
// Apportion's CRDs installed from config/crd/bases — the generated files the installer ships —
// and a client whose scheme knows the built-in kinds and Apportion's.
//
// Each suite keeps what is its own (the controllers it runs, the webhook it serves); this package
// holds only the common start, stop and skip.
package testenv

import (
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	k8sruntime "k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// SkipWithoutAssets skips t when KUBEBUILDER_ASSETS does not name the kube-apiserver and etcd
// binaries (make test sets it).
func SkipWithoutAssets(t testing.TB) {
	t.Helper()
	if os.Getenv("KUBEBUILDER_ASSETS") == "" {
		t.Skip("KUBEBUILDER_ASSETS is not set: run `make test`, which builds kube-apiserver and etcd (hack/envtest-assets.sh)")
	}
}

// Options are what a suite adds to the common environment.
type Options struct {
	// Webhooks installs config/webhook/manifests.yaml, rewritten by envtest to serve from a
	// local port with a CA of its own (Env.Environment.WebhookInstallOptions says where).
	Webhooks bool
}

// Env is a running API server and a client for it.
type Env struct {
	// Environment is the envtest environment, for what a suite needs of it (webhook options).
	Environment *envtest.Environment
	Config      *rest.Config
	Scheme      *k8sruntime.Scheme
	// Client talks to the API server directly (no cache).
	Client client.Client
}

// Start starts the API server and etcd with the CRDs installed.
func Start(o Options) (*Env, error) {
	scheme := k8sruntime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if err := apportionv1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	root := repoRoot()
	e := &Env{Scheme: scheme, Environment: &envtest.Environment{
		CRDDirectoryPaths:     []string{filepath.Join(root, "config", "crd", "bases")},
		ErrorIfCRDPathMissing: true,
		// envtest's default (20 s) is too short when `make test` runs its suites beside each
		// other on a loaded 2-core machine: kube-apiserver once took longer five times in a row.
		ControlPlaneStartTimeout: 2 * time.Minute,
		ControlPlaneStopTimeout:  time.Minute,
	}}
	if o.Webhooks {
		e.Environment.WebhookInstallOptions = envtest.WebhookInstallOptions{
			Paths: []string{filepath.Join(root, "config", "webhook", "manifests.yaml")},
		}
	}
	cfg, err := e.Environment.Start()
	if err != nil {
		return nil, err
	}
	e.Config = cfg
	if e.Client, err = client.New(cfg, client.Options{Scheme: scheme}); err != nil {
		_ = e.Environment.Stop()
		return nil, err
	}
	return e, nil
}

// Stop stops the API server and etcd; a nil Env is already stopped.
func (e *Env) Stop() error {
	if e == nil {
		return nil
	}
	return e.Environment.Stop()
}

// repoRoot is the module's root directory, found from this file's place in it.
func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}
