package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"

	"github.com/open-policy-agent/cert-controller/pkg/rotator"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/webhook"
	"sigs.k8s.io/controller-runtime/pkg/webhook/admission"

	"github.com/apportion/apportion/internal/inject"
)

// webhookOptions are the injection webhook's flags.
type webhookOptions struct {
	port          int
	host          string
	certDir       string
	certRotation  bool
	certSecret    string
	serviceName   string
	configuration string

	agentImage      string
	agentPullPolicy string
	cpuRequest      string
	cpuLimit        string
	memoryRequest   string
	memoryLimit     string
}

// Names the installer uses (config/webhook, config/manager); the flags default to them.
const (
	defaultWebhookCertDir       = "/tmp/k8s-webhook-server/serving-certs"
	defaultWebhookCertSecret    = "apportion-webhook-server-cert"
	defaultWebhookService       = "apportion-webhook-service"
	defaultWebhookConfiguration = "apportion-mutating-webhook-configuration"
)

func (w *webhookOptions) bind(fs *flag.FlagSet) {
	fs.IntVar(&w.port, "webhook-port", 9443, "port the injection webhook serves on (TLS); 0 disables the webhook")
	fs.StringVar(&w.host, "webhook-host", "", "address the injection webhook binds to (default: all)")
	fs.StringVar(&w.certDir, "webhook-cert-dir", defaultWebhookCertDir, "directory of the webhook's serving certificate (tls.crt, tls.key)")
	fs.BoolVar(&w.certRotation, "webhook-cert-rotation", true,
		"create and rotate the webhook's serving certificate in --webhook-cert-secret and inject its CA into --webhook-configuration; false when cert-manager (or anything else) provides the certificate in --webhook-cert-dir")
	fs.StringVar(&w.certSecret, "webhook-cert-secret", defaultWebhookCertSecret, "Secret in --manager-namespace holding the webhook's serving certificate (must exist; the manager fills it)")
	fs.StringVar(&w.serviceName, "webhook-service", defaultWebhookService, "Service in --manager-namespace in front of the webhook; its DNS name is in the certificate")
	fs.StringVar(&w.configuration, "webhook-configuration", defaultWebhookConfiguration, "MutatingWebhookConfiguration whose CA bundle the manager keeps current")
	fs.StringVar(&w.agentImage, "agent-image", "", "image of the injected agent sidecar; required unless --webhook-port=0")
	fs.StringVar(&w.agentPullPolicy, "agent-image-pull-policy", "", "pull policy of the injected agent: Always, IfNotPresent, Never (default: the cluster's)")
	fs.StringVar(&w.cpuRequest, "agent-cpu-request", "50m", "injected agent's CPU request; 0 none (per pod: annotation "+inject.CPURequestAnnotation+")")
	fs.StringVar(&w.cpuLimit, "agent-cpu-limit", "0", "injected agent's CPU limit; 0 none (per pod: annotation "+inject.CPULimitAnnotation+")")
	fs.StringVar(&w.memoryRequest, "agent-memory-request", "32Mi", "injected agent's memory request; 0 none (per pod: annotation "+inject.MemoryRequestAnnotation+")")
	fs.StringVar(&w.memoryLimit, "agent-memory-limit", "128Mi", "injected agent's memory limit; 0 none (per pod: annotation "+inject.MemoryLimitAnnotation+")")
}

// injectConfig checks the flags and turns them into the injector's configuration.
func (w *webhookOptions) injectConfig() (inject.Config, error) {
	var errs []error
	if w.port < 0 || w.port > 65535 {
		errs = append(errs, fmt.Errorf("--webhook-port must be 0..65535, got %d", w.port))
	}
	if w.port == 0 {
		return inject.Config{}, errors.Join(errs...)
	}
	cfg := inject.Config{Image: w.agentImage, PullPolicy: corev1.PullPolicy(w.agentPullPolicy)}
	switch cfg.PullPolicy {
	case "", corev1.PullAlways, corev1.PullIfNotPresent, corev1.PullNever:
	default:
		errs = append(errs, fmt.Errorf("--agent-image-pull-policy must be Always, IfNotPresent or Never, got %q", w.agentPullPolicy))
	}
	for _, q := range []struct {
		flag, value string
		list        *corev1.ResourceList
		name        corev1.ResourceName
	}{
		{"agent-cpu-request", w.cpuRequest, &cfg.Resources.Requests, corev1.ResourceCPU},
		{"agent-cpu-limit", w.cpuLimit, &cfg.Resources.Limits, corev1.ResourceCPU},
		{"agent-memory-request", w.memoryRequest, &cfg.Resources.Requests, corev1.ResourceMemory},
		{"agent-memory-limit", w.memoryLimit, &cfg.Resources.Limits, corev1.ResourceMemory},
	} {
		v, err := resource.ParseQuantity(q.value)
		if err != nil || v.Sign() < 0 {
			errs = append(errs, fmt.Errorf("--%s: %q is not a non-negative quantity (e.g. 100m, 64Mi)", q.flag, q.value))
			continue
		}
		if v.IsZero() {
			continue
		}
		if *q.list == nil {
			*q.list = corev1.ResourceList{}
		}
		(*q.list)[q.name] = v
	}
	if err := cfg.Validate(); err != nil {
		errs = append(errs, err)
	}
	if w.certRotation && (w.certSecret == "" || w.serviceName == "" || w.configuration == "") {
		errs = append(errs, errors.New("--webhook-cert-rotation needs --webhook-cert-secret, --webhook-service and --webhook-configuration"))
	}
	return cfg, errors.Join(errs...)
}

// webhookServer is the manager's webhook server for the options (port, host, cert dir).
func (w *webhookOptions) webhookServer() webhook.Server {
	return webhook.NewServer(webhook.Options{Port: w.port, Host: w.host, CertDir: w.certDir})
}

// +kubebuilder:rbac:groups="",namespace=system,resources=secrets,verbs=get;list;watch;create;update;patch
// The rotator watches webhook configurations; it may change only the one it injects the CA into,
// which config/rbac/webhook_cert_role.yaml grants by name (a marker cannot name an object).
// +kubebuilder:rbac:groups=admissionregistration.k8s.io,resources=mutatingwebhookconfigurations,verbs=get;list;watch

// setupWebhook arranges for the injection webhook to serve once its certificate is ready, as
// kueue does: with --webhook-cert-rotation the cert-controller rotator creates the CA and the
// serving certificate in the Secret (which the Deployment mounts at --webhook-cert-dir), keeps
// them rotated and writes the CA into the MutatingWebhookConfiguration; the webhook server is
// registered — and so started — only after the certificate is on disk and the CA injected.
// Every replica runs the rotator and serves the webhook: admission must not wait for a leader.
// It returns a readiness check that fails until the webhook serves.
func setupWebhook(ctx context.Context, mgr ctrl.Manager, o options, cfg inject.Config) (func(*http.Request) error, error) {
	w := o.webhook
	certsReady := make(chan struct{})
	if w.certRotation {
		// The rotator fills the Secret but does not create it; the installer does, and so does
		// this, for a manager run any other way.
		key := types.NamespacedName{Namespace: o.managerNamespace, Name: w.certSecret}
		if err := ensureSecret(ctx, mgr.GetAPIReader(), mgr.GetClient(), key); err != nil {
			return nil, fmt.Errorf("webhook certificate Secret: %w", err)
		}
		err := rotator.AddRotator(mgr, &rotator.CertRotator{
			SecretKey:      key,
			CertDir:        w.certDir,
			CAName:         "apportion-ca",
			CAOrganization: "apportion",
			DNSName:        fmt.Sprintf("%s.%s.svc", w.serviceName, o.managerNamespace),
			ExtraDNSNames: []string{
				fmt.Sprintf("%s.%s.svc.cluster.local", w.serviceName, o.managerNamespace),
				fmt.Sprintf("%s.%s", w.serviceName, o.managerNamespace),
			},
			IsReady:               certsReady,
			Webhooks:              []rotator.WebhookInfo{{Type: rotator.Mutating, Name: w.configuration}},
			RequireLeaderElection: false,
			EnableReadinessCheck:  true,
		})
		if err != nil {
			return nil, fmt.Errorf("webhook certificate rotator: %w", err)
		}
	} else {
		close(certsReady)
	}
	log := ctrl.Log.WithName("webhook")
	registered := make(chan struct{})
	go func() {
		<-certsReady
		log.Info("certificate ready; serving the injection webhook", "port", w.port, "path", inject.Path)
		// GetWebhookServer adds the server to the (running) manager, which starts it.
		mgr.GetWebhookServer().Register(inject.Path, &webhook.Admission{Handler: &inject.Webhook{
			Reader:    mgr.GetClient(),
			Live:      mgr.GetAPIReader(),
			Namespace: o.watchNamespace,
			Config:    cfg,
			Decoder:   admission.NewDecoder(mgr.GetScheme()),
		}})
		close(registered)
	}()
	return func(req *http.Request) error {
		select {
		case <-registered:
			return mgr.GetWebhookServer().StartedChecker()(req)
		default:
			return errors.New("the injection webhook is not serving yet: waiting for its certificate")
		}
	}, nil
}

// ensureSecret creates an empty Secret key unless one exists.
func ensureSecret(ctx context.Context, r client.Reader, c client.Writer, key types.NamespacedName) error {
	var s corev1.Secret
	err := r.Get(ctx, key, &s)
	if !apierrors.IsNotFound(err) {
		return err
	}
	s = corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name,
		Labels: map[string]string{"app.kubernetes.io/name": "apportion", "app.kubernetes.io/component": "webhook"}}}
	if err := c.Create(ctx, &s); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}
