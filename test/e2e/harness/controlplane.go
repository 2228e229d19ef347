package harness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
)

// ErrNoAssets is returned by StartControlPlane when KUBEBUILDER_ASSETS is not set.
var ErrNoAssets = errors.New("KUBEBUILDER_ASSETS is not set: run `make test-e2e` (or export KUBEBUILDER_ASSETS=\"$(hack/envtest-assets.sh)\"), which builds kube-apiserver, etcd and kubectl")

// ControlPlane is a local kube-apiserver and etcd (envtest) with the CRDs installed.
type ControlPlane struct {
	Env    *envtest.Environment
	Config *rest.Config
	Client client.Client
	Scheme *runtime.Scheme
	// Kubeconfig is the path of a kubeconfig file for an admin user (system:masters).
	Kubeconfig string
	// AssetsDir holds kube-apiserver, etcd and kubectl.
	AssetsDir string
	// Root is the repository root.
	Root string
	// Webhook is where the API server calls the injection webhook: envtest installs
	// config/webhook/manifests.yaml pointed at a local URL (LocalServingHost, LocalServingPort)
	// with a CA and serving certificate of its own in LocalServingCertDir, which the manager is
	// started with. Nil when the repository has no webhook configuration.
	Webhook *envtest.WebhookInstallOptions
}

// StartControlPlane starts envtest with config/crd/bases and writes a kubeconfig into dir. The
// API server's certificates are kept in dir/apiserver (not in a directory envtest removes when
// the API server stops), so that StopAPIServer and StartAPIServer can restart it on the same
// port with the same certificates while etcd keeps running.
func StartControlPlane(dir string) (*ControlPlane, error) {
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	if assets == "" {
		return nil, ErrNoAssets
	}
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if err := apportionv1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	certDir := filepath.Join(dir, "apiserver")
	if err := os.MkdirAll(certDir, 0o700); err != nil {
		return nil, err
	}
	env := &envtest.Environment{
		CRDDirectoryPaths:        []string{filepath.Join(root, "config", "crd", "bases")},
		ErrorIfCRDPathMissing:    true,
		BinaryAssetsDirectory:    assets,
		ControlPlaneStartTimeout: 2 * time.Minute,
		ControlPlaneStopTimeout:  time.Minute,
		WebhookInstallOptions: envtest.WebhookInstallOptions{
			Paths:                    []string{filepath.Join(root, "config", "webhook", "manifests.yaml")},
			IgnoreErrorIfPathMissing: true,
			LocalServingHost:         "127.0.0.1",
		},
	}
	env.ControlPlane.APIServer = &envtest.APIServer{CertDir: certDir}
	cfg, err := env.Start()
	if err != nil {
		return nil, fmt.Errorf("starting envtest: %w", err)
	}
	cp := &ControlPlane{Env: env, Scheme: scheme, AssetsDir: assets, Root: root}
	if len(env.WebhookInstallOptions.MutatingWebhooks) > 0 {
		cp.Webhook = &env.WebhookInstallOptions
	}
	fail := func(err error) (*ControlPlane, error) {
		_ = env.Stop()
		return nil, err
	}
	cfg = rest.CopyConfig(cfg)
	cfg.QPS, cfg.Burst = 500, 1000
	cp.Config = cfg
	if cp.Client, err = client.New(cfg, client.Options{Scheme: scheme}); err != nil {
		return fail(err)
	}
	user, err := env.AddUser(envtest.User{Name: "e2e-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return fail(fmt.Errorf("adding the kubeconfig user: %w", err))
	}
	kc, err := user.KubeConfig()
	if err != nil {
		return fail(err)
	}
	// The manager's default namespace (config/default), for its Secret and epoch ConfigMap.
	if err := cp.CreateNamespace(context.Background(), "apportion-system"); err != nil {
		return fail(err)
	}
	cp.Kubeconfig = filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(cp.Kubeconfig, kc, 0o600); err != nil {
		return fail(err)
	}
	return cp, nil
}

// Stop stops the API server and etcd.
func (cp *ControlPlane) Stop() error {
	if cp == nil || cp.Env == nil {
		return nil
	}
	return cp.Env.Stop()
}

// StopAPIServer stops the control plane's kube-apiserver and leaves etcd running: clients are
// refused until StartAPIServer. Its certificates, its port and the users added to it (the
// kubeconfig's) stay, so that every client works again after the restart. It sends SIGTERM and,
// when the process has not exited after grace, SIGKILL — an API server with clients connected
// (watches, members polling it) was seen to take longer than a minute over its graceful shutdown
// here — and reports whether it had to kill it.
func (cp *ControlPlane) StopAPIServer(grace time.Duration) (killed bool, err error) {
	api := cp.Env.ControlPlane.GetAPIServer()
	pid, err := childWithArg(filepath.Base(api.Path), "--secure-port="+api.Port)
	if err != nil {
		return false, err
	}
	proc, err := os.FindProcess(pid)
	if err != nil {
		return false, err
	}
	if err := proc.Signal(syscall.SIGTERM); err != nil {
		return false, err
	}
	for deadline := time.Now().Add(grace); running(pid) && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	if running(pid) {
		killed = true
		if err := proc.Signal(syscall.SIGKILL); err != nil {
			return killed, err
		}
	}
	// envtest reaps it; its Stop then only forgets it (it signals a process it has not seen
	// exit yet, which may be gone a moment later: try again).
	for range 100 {
		if err = api.Stop(); err == nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	return killed, err
}

// childWithArg is the pid of this process's child running the binary named name with arg among
// its arguments.
func childWithArg(name, arg string) (int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00")
		if len(args) == 0 || filepath.Base(args[0]) != name || !slices.Contains(args[1:], arg) {
			continue
		}
		if ppid, err := parentOf(pid); err == nil && ppid == os.Getpid() {
			return pid, nil
		}
	}
	return 0, fmt.Errorf("no child process %s with %s", name, arg)
}

// parentOf is pid's parent pid (/proc/pid/stat's fourth field, after the parenthesised name).
func parentOf(pid int) (int, error) {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return 0, err
	}
	i := strings.LastIndexByte(string(stat), ')')
	f := strings.Fields(string(stat[i+1:]))
	if i < 0 || len(f) < 2 {
		return 0, fmt.Errorf("unreadable /proc/%d/stat", pid)
	}
	return strconv.Atoi(f[1])
}

// running reports whether pid exists and has not exited (a zombie waiting to be reaped has).
func running(pid int) bool {
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	i := strings.LastIndexByte(string(stat), ')')
	f := strings.Fields(string(stat[i+1:]))
	return i >= 0 && len(f) > 0 && f[0] != "Z" && f[0] != "X"
}

// StartAPIServer starts the kube-apiserver StopAPIServer stopped, on the same port, certificates
// and etcd, and waits until it is healthy (everything stored in etcd — CRDs, objects — is
// there again).
func (cp *ControlPlane) StartAPIServer() error {
	return cp.Env.ControlPlane.GetAPIServer().Start()
}

// Kubectl runs the assets' kubectl with the kubeconfig and returns its combined output.
func (cp *ControlPlane) Kubectl(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(cp.AssetsDir, "kubectl"), append([]string{"--kubeconfig", cp.Kubeconfig}, args...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// EnableInjection labels a namespace apportion.io/injection=enabled: the API server then calls
// the injection webhook for its pods.
func (cp *ControlPlane) EnableInjection(ctx context.Context, name string) error {
	patch := []byte(`{"metadata":{"labels":{"` + apportionv1.InjectionLabel + `":"` + apportionv1.InjectionEnabled + `"}}}`)
	return cp.Client.Patch(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, client.RawPatch(types.MergePatchType, patch))
}

// CreatePodNamespace creates a namespace for a workload's pods: labelled for injection when the
// control plane has the webhook, so that its pods get their agents from the manager's webhook.
func (cp *ControlPlane) CreatePodNamespace(ctx context.Context, name string) error {
	if err := cp.CreateNamespace(ctx, name); err != nil || cp.Webhook == nil {
		return err
	}
	return cp.EnableInjection(ctx, name)
}

// CreateNamespace creates a namespace (an existing one is fine).
func (cp *ControlPlane) CreateNamespace(ctx context.Context, name string) error {
	if err := cp.Client.Create(ctx, builders.MakeNamespace(name).Obj()); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}
