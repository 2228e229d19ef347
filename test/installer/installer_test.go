// Package installer checks that the committed installation (dist/install.yaml, rendered by
// `make build-installer` and kept fresh by `make verify`) applies to a real API server with
// kubectl, as a user runs it, and that what it promises is there: the CRDs Established and
// serving, the injection webhook's configuration, Service and certificate Secret, the RBAC
// (the manager's, the metrics endpoint's, the editor and viewer roles aggregated into
// admin/edit/view), the two-replica manager with its disruption budget and network policy.
//
// Last, the real manager binary runs against it as the installed ServiceAccount and fills the
// webhook configuration's caBundle through cert-controller: the installed RBAC is enough.
package installer

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	"github.com/apportion/apportion/internal/testing/wait"
	"github.com/apportion/apportion/test/e2e/harness"
)

const ns = "apportion-system"

func TestInstallYAMLApplies(t *testing.T) {
	assets := os.Getenv("KUBEBUILDER_ASSETS")
	if assets == "" {
		t.Skip("KUBEBUILDER_ASSETS is not set: run `make test`")
	}
	kubectl := filepath.Join(assets, "kubectl")
	installYAML := filepath.Join("..", "..", "dist", "install.yaml")
	if _, err := os.Stat(installYAML); err != nil {
		t.Fatalf("%v: run make build-installer", err)
	}

	// A long start bound: `make test` runs suites beside each other on two cores (envtest's
	// default of 20 s failed there under load).
	env := &envtest.Environment{ControlPlaneStartTimeout: 2 * time.Minute, ControlPlaneStopTimeout: time.Minute}
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

	// What docs/install.md tells users to run. Server-side apply, as a second run (upgrade) is.
	for range 2 {
		apply := exec.Command(kubectl, "--kubeconfig", kcPath, "apply", "--server-side", "-f", installYAML)
		if b, err := apply.CombinedOutput(); err != nil {
			t.Fatalf("kubectl apply -f dist/install.yaml: %v\n%s", err, b)
		}
	}

	scheme := runtime.NewScheme()
	_ = clientgoscheme.AddToScheme(scheme)
	_ = apiextensionsv1.AddToScheme(scheme)
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	for _, name := range []string{"downstreamquotas.apportion.io", "degraderules.apportion.io"} {
		var crd apiextensionsv1.CustomResourceDefinition
		wait.ForContext(ctx, t, "CRD "+name+" Established", func() bool {
			return c.Get(ctx, client.ObjectKey{Name: name}, &crd) == nil && established(&crd)
		})
	}
	// The CRDs serve: kubectl can list the new kinds by their short names.
	for _, short := range []string{"dq", "dr"} {
		get := exec.Command(kubectl, "--kubeconfig", kcPath, "get", short, "-A")
		if b, err := get.CombinedOutput(); err != nil {
			t.Errorf("kubectl get %s: %v\n%s", short, err, b)
		}
	}

	t.Run("webhook", func(t *testing.T) {
		var mwc admissionregistrationv1.MutatingWebhookConfiguration
		wait.ForContext(ctx, t, "the MutatingWebhookConfiguration", func() bool {
			return c.Get(ctx, client.ObjectKey{Name: "apportion-mutating-webhook-configuration"}, &mwc) == nil
		})
		if len(mwc.Webhooks) != 1 {
			t.Fatalf("webhooks: %d, want 1", len(mwc.Webhooks))
		}
		w := mwc.Webhooks[0]
		if w.Name != "inject.apportion.io" {
			t.Errorf("webhook name %q", w.Name)
		}
		svc := w.ClientConfig.Service
		if svc == nil || svc.Name != "apportion-webhook-service" || svc.Namespace != ns || svc.Path == nil || *svc.Path != "/mutate--v1-pod" {
			t.Errorf("clientConfig.service = %+v, want apportion-webhook-service in %s at /mutate--v1-pod", svc, ns)
		}
		if w.FailurePolicy == nil || *w.FailurePolicy != admissionregistrationv1.Fail {
			t.Errorf("failurePolicy %v, want Fail (a pod of a target must never start unmetered)", w.FailurePolicy)
		}
		if w.NamespaceSelector == nil || w.NamespaceSelector.MatchLabels["apportion.io/injection"] != "enabled" {
			t.Errorf("namespaceSelector %+v, want apportion.io/injection=enabled", w.NamespaceSelector)
		}
		if len(w.Rules) != 1 || !slices.Equal(w.Rules[0].Resources, []string{"pods"}) ||
			!slices.Equal(w.Rules[0].Operations, []admissionregistrationv1.OperationType{admissionregistrationv1.Create}) {
			t.Errorf("rules %+v, want pods CREATE", w.Rules)
		}
		var service corev1.Service
		if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "apportion-webhook-service"}, &service); err != nil {
			t.Fatal(err)
		}
		if len(service.Spec.Ports) != 1 || service.Spec.Ports[0].Port != 443 || service.Spec.Ports[0].TargetPort.StrVal != "webhook-server" {
			t.Errorf("webhook Service ports %+v, want 443 -> webhook-server", service.Spec.Ports)
		}
		var secret corev1.Secret
		if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "apportion-webhook-server-cert"}, &secret); err != nil {
			t.Errorf("the serving certificate's Secret, which the manager fills: %v", err)
		}
	})

	t.Run("manager", func(t *testing.T) {
		var d appsv1.Deployment
		if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "apportion-controller-manager"}, &d); err != nil {
			t.Fatal(err)
		}
		if d.Spec.Replicas == nil || *d.Spec.Replicas != 2 {
			t.Errorf("replicas %v, want 2", d.Spec.Replicas)
		}
		pod := d.Spec.Template.Spec
		if pod.Affinity == nil || pod.Affinity.PodAntiAffinity == nil {
			t.Error("no pod anti-affinity: both replicas may land on one node")
		}
		if psc := pod.SecurityContext; psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot ||
			psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
			t.Errorf("pod securityContext %+v, want runAsNonRoot and RuntimeDefault seccomp", psc)
		}
		m := pod.Containers[0]
		if sc := m.SecurityContext; sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
			sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.Capabilities == nil ||
			!slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
			t.Errorf("container securityContext %+v, want read-only root, no escalation, ALL dropped", sc)
		}
		for _, arg := range []string{"--metrics-bind-address=:8443", "--metrics-secure", "--leader-elect"} {
			if !slices.Contains(m.Args, arg) {
				t.Errorf("manager args %q lack %s", m.Args, arg)
			}
		}
		ports := map[string]int32{}
		for _, p := range m.Ports {
			ports[p.Name] = p.ContainerPort
		}
		if ports["webhook-server"] != 9443 || ports["metrics"] != 8443 {
			t.Errorf("container ports %v, want webhook-server 9443 and metrics 8443", ports)
		}
		mounted := false
		for _, vm := range m.VolumeMounts {
			mounted = mounted || vm.MountPath == "/tmp/k8s-webhook-server/serving-certs"
		}
		if !mounted || len(pod.Volumes) != 1 || pod.Volumes[0].Secret == nil || pod.Volumes[0].Secret.SecretName != "apportion-webhook-server-cert" {
			t.Errorf("the serving certificate is not mounted from apportion-webhook-server-cert: mounts %+v volumes %+v", m.VolumeMounts, pod.Volumes)
		}
		var pdb policyv1.PodDisruptionBudget
		if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "apportion-controller-manager"}, &pdb); err != nil {
			t.Error(err)
		} else if pdb.Spec.MinAvailable == nil || pdb.Spec.MinAvailable.IntValue() != 1 {
			t.Errorf("PDB minAvailable %v, want 1", pdb.Spec.MinAvailable)
		}
		var np networkingv1.NetworkPolicy
		if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "apportion-allow-manager-ingress"}, &np); err != nil {
			t.Error(err)
		} else {
			open := map[int32]bool{}
			for _, r := range np.Spec.Ingress {
				for _, p := range r.Ports {
					open[p.Port.IntVal] = true
				}
			}
			if !open[9443] || !open[8443] || !open[8081] {
				t.Errorf("NetworkPolicy opens %v, want 9443 (webhook), 8443 (metrics), 8081 (probes)", open)
			}
		}
		var metrics corev1.Service
		if err := c.Get(ctx, client.ObjectKey{Namespace: ns, Name: "apportion-controller-manager-metrics-service"}, &metrics); err != nil {
			t.Error(err)
		} else if len(metrics.Spec.Ports) != 1 || metrics.Spec.Ports[0].Port != 8443 {
			t.Errorf("metrics Service ports %+v, want 8443", metrics.Spec.Ports)
		}
	})

	t.Run("rbac", func(t *testing.T) {
		for _, tt := range []struct {
			role      string
			aggregate []string
		}{
			{"apportion-downstreamquota-editor-role", []string{"admin", "edit"}},
			{"apportion-degraderule-editor-role", []string{"admin", "edit"}},
			{"apportion-downstreamquota-viewer-role", []string{"view"}},
			{"apportion-degraderule-viewer-role", []string{"view"}},
			{"apportion-manager-role", nil},
			{"apportion-metrics-auth-role", nil},
			{"apportion-metrics-reader", nil},
			{"apportion-webhook-cert-role", nil},
		} {
			var r rbacv1.ClusterRole
			if err := c.Get(ctx, client.ObjectKey{Name: tt.role}, &r); err != nil {
				t.Errorf("ClusterRole %s: %v", tt.role, err)
				continue
			}
			for _, a := range tt.aggregate {
				if r.Labels["rbac.authorization.k8s.io/aggregate-to-"+a] != "true" {
					t.Errorf("ClusterRole %s is not aggregated to %s", tt.role, a)
				}
			}
		}
		// Aggregation into the built-in roles is kube-controller-manager's work, which envtest
		// does not run: the labels above are what it reads. The editor and viewer grant what
		// their names say.
		for _, tt := range []struct {
			role, verb string
			want       bool
		}{
			{"apportion-downstreamquota-editor-role", "create", true},
			{"apportion-degraderule-editor-role", "delete", true},
			{"apportion-downstreamquota-viewer-role", "list", true},
			{"apportion-downstreamquota-viewer-role", "create", false},
			{"apportion-degraderule-viewer-role", "update", false},
		} {
			var r rbacv1.ClusterRole
			if err := c.Get(ctx, client.ObjectKey{Name: tt.role}, &r); err != nil {
				continue // reported above
			}
			resource := "downstreamquotas"
			if strings.Contains(tt.role, "degraderule") {
				resource = "degraderules"
			}
			if got := allows(r.Rules, "apportion.io", resource, tt.verb); got != tt.want {
				t.Errorf("%s allows %s %s: %v, want %v", tt.role, tt.verb, resource, got, tt.want)
			}
		}
		for _, b := range []string{"apportion-manager-rolebinding", "apportion-metrics-auth-rolebinding", "apportion-webhook-cert-rolebinding"} {
			var crb rbacv1.ClusterRoleBinding
			if err := c.Get(ctx, client.ObjectKey{Name: b}, &crb); err != nil {
				t.Errorf("ClusterRoleBinding %s: %v", b, err)
			} else if len(crb.Subjects) != 1 || crb.Subjects[0].Name != "apportion-controller-manager" || crb.Subjects[0].Namespace != ns {
				t.Errorf("ClusterRoleBinding %s binds %+v, want the manager's ServiceAccount", b, crb.Subjects)
			}
		}
		var cert rbacv1.ClusterRole
		if err := c.Get(ctx, client.ObjectKey{Name: "apportion-webhook-cert-role"}, &cert); err == nil {
			patchable := false
			for _, r := range cert.Rules {
				patchable = patchable || (slices.Contains(r.Verbs, "patch") && slices.Equal(r.ResourceNames, []string{"apportion-mutating-webhook-configuration"}))
			}
			if !patchable {
				t.Errorf("the manager may not patch apportion-mutating-webhook-configuration's caBundle: %+v", cert.Rules)
			}
		}
	})

	// The manager itself, run as the installed ServiceAccount (a client certificate whose user is
	// the ServiceAccount's name, which RBAC matches as the ServiceAccount subject): the installed
	// RBAC is enough for it to start, create its signing key and fill the webhook configuration's
	// caBundle through cert-controller, as it does in a cluster.
	t.Run("manager as its ServiceAccount fills the caBundle", func(t *testing.T) {
		bctx, bcancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer bcancel()
		bin, err := harness.Build(bctx)
		if err != nil {
			t.Fatal(err)
		}
		sa, err := env.AddUser(envtest.User{Name: "system:serviceaccount:" + ns + ":apportion-controller-manager",
			Groups: []string{"system:serviceaccounts", "system:serviceaccounts:" + ns, "system:authenticated"}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		saConfig, err := sa.KubeConfig()
		if err != nil {
			t.Fatal(err)
		}
		dir := t.TempDir()
		saPath := filepath.Join(dir, "kubeconfig")
		if err := os.WriteFile(saPath, saConfig, 0o600); err != nil {
			t.Fatal(err)
		}
		webhookPort, probePort := freePort(t), freePort(t)
		certDir := filepath.Join(dir, "certs")
		mctx, mcancel := context.WithCancel(context.Background())
		defer mcancel()
		m := exec.CommandContext(mctx, bin.Manager, "--manager-namespace="+ns, "--metrics-bind-address=0",
			"--health-probe-bind-address=127.0.0.1:"+strconv.Itoa(probePort), "--webhook-host=127.0.0.1",
			"--webhook-port="+strconv.Itoa(webhookPort), "--webhook-cert-dir="+certDir,
			"--agent-image=ghcr.io/apportion/agent:v0.1.0")
		m.Env = append(os.Environ(), "KUBECONFIG="+saPath)
		logPath := filepath.Join(dir, "manager.log")
		logFile, err := os.Create(logPath)
		if err != nil {
			t.Fatal(err)
		}
		defer logFile.Close()
		m.Stdout, m.Stderr = logFile, logFile
		if err := m.Start(); err != nil {
			t.Fatal(err)
		}
		exited := make(chan struct{})
		var exitErr error
		go func() { exitErr = m.Wait(); close(exited) }()
		defer func() { mcancel(); <-exited }()

		// A backstop only: the rotator fills it within seconds.
		const waitCaBundle = 2 * time.Minute
		wctx, wcancel := context.WithTimeout(context.Background(), waitCaBundle)
		defer wcancel()
		var mwc admissionregistrationv1.MutatingWebhookConfiguration
		var secret corev1.Secret
		mounted := false
		for {
			// The kubelet's part: once the rotator has filled the Secret, its files appear in the
			// Deployment's volume at the cert dir (the rotator waits for that before it injects).
			if !mounted && c.Get(wctx, client.ObjectKey{Namespace: ns, Name: "apportion-webhook-server-cert"}, &secret) == nil &&
				len(secret.Data["tls.crt"]) > 0 {
				if err := os.MkdirAll(certDir, 0o700); err != nil {
					t.Fatal(err)
				}
				for f, b := range secret.Data {
					if err := os.WriteFile(filepath.Join(certDir, f), b, 0o600); err != nil {
						t.Fatal(err)
					}
				}
				mounted = true
			}
			if err := c.Get(wctx, client.ObjectKey{Name: "apportion-mutating-webhook-configuration"}, &mwc); err == nil &&
				len(mwc.Webhooks) == 1 && len(mwc.Webhooks[0].ClientConfig.CABundle) > 0 {
				break
			}
			select {
			case <-exited:
				b, _ := os.ReadFile(logPath)
				t.Fatalf("the manager exited (%v) before the caBundle was filled:\n%s", exitErr, b)
			case <-wctx.Done():
				_ = m.Process.Signal(syscall.SIGQUIT) // its goroutines, into the log
				<-exited
				b, _ := os.ReadFile(logPath)
				t.Fatalf("the caBundle is still empty after %v; the manager's log:\n%s", waitCaBundle, b)
			case <-time.After(100 * time.Millisecond):
			}
		}
		if err := c.Get(wctx, client.ObjectKey{Namespace: ns, Name: "apportion-webhook-server-cert"}, &secret); err != nil {
			t.Fatal(err)
		}
		if len(secret.Data["tls.crt"]) == 0 || len(secret.Data["ca.crt"]) == 0 {
			t.Errorf("the serving certificate Secret holds %d keys, want tls.crt and ca.crt", len(secret.Data))
		}
		if string(secret.Data["ca.crt"]) != string(mwc.Webhooks[0].ClientConfig.CABundle) {
			t.Error("the caBundle is not the CA of the serving certificate")
		}
		// The trust ConfigMap of a namespace labelled for injection: the manager lists and watches
		// ConfigMaps by name and writes that one only (its RBAC), past the admission policy that
		// keeps everyone else from writing it.
		var vap admissionregistrationv1.ValidatingAdmissionPolicy
		var vapb admissionregistrationv1.ValidatingAdmissionPolicyBinding
		if err := c.Get(wctx, client.ObjectKey{Name: "apportion-trust-guard"}, &vap); err != nil {
			t.Errorf("the trust ConfigMaps' admission policy: %v", err)
		}
		if err := c.Get(wctx, client.ObjectKey{Name: "apportion-trust-guard"}, &vapb); err != nil || vapb.Spec.PolicyName != vap.Name {
			t.Errorf("the trust ConfigMaps' admission policy binding (%v) binds %q", err, vapb.Spec.PolicyName)
		}
		app := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop", Labels: map[string]string{"apportion.io/injection": "enabled"}}}
		if err := c.Create(wctx, app); err != nil {
			t.Fatal(err)
		}
		var trust corev1.ConfigMap
		wait.ForContext(wctx, t, "the manager's trust ConfigMap in a labelled namespace", func() bool {
			return c.Get(wctx, client.ObjectKey{Namespace: "shop", Name: "apportion-trust"}, &trust) == nil && len(trust.Data) > 0
		})

		// Nothing in the manager's log says it was forbidden anything.
		if b, _ := os.ReadFile(logPath); strings.Contains(string(b), "forbidden") {
			t.Errorf("the manager was refused something its RBAC should grant:\n%s", b)
		}
	})
}

// freePort asks the kernel for a free TCP port on loopback.
func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// allows reports whether rules grant verb on group/resource.
func allows(rules []rbacv1.PolicyRule, group, resource, verb string) bool {
	for _, r := range rules {
		if slices.Contains(r.APIGroups, group) && slices.Contains(r.Resources, resource) &&
			(slices.Contains(r.Verbs, verb) || slices.Contains(r.Verbs, "*")) {
			return true
		}
	}
	return false
}

func established(crd *apiextensionsv1.CustomResourceDefinition) bool {
	for _, c := range crd.Status.Conditions {
		if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
			return true
		}
	}
	return false
}
