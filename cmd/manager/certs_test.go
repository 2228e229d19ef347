package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	metricsserver "sigs.k8s.io/controller-runtime/pkg/metrics/server"
	"sigs.k8s.io/yaml"

	"github.com/apportion/apportion/internal/testing/testenv"
)

// TestWebhookCertificateRotation runs the manager's webhook setup with its own certificate
// management against a real API server: the webhook must not serve (readiness fails) until the
// rotator has filled the Secret, the certificate is "mounted" (the test plays the kubelet, copying
// the Secret into the cert dir) and the CA is in the MutatingWebhookConfiguration; then it serves
// TLS with a certificate for the webhook Service's DNS name, signed by that CA.
func TestWebhookCertificateRotation(t *testing.T) {
	testenv.SkipWithoutAssets(t)
	env, err := testenv.Start(testenv.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = env.Stop() }()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cfg, sch, c := env.Config, env.Scheme, env.Client

	const ns = "apportion-system"
	if err := c.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}); err != nil {
		t.Fatal(err)
	}
	// The installer's configuration, under its installed name and Service.
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "webhook", "manifests.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var whc admissionregistrationv1.MutatingWebhookConfiguration
	if err := yaml.UnmarshalStrict(raw, &whc); err != nil {
		t.Fatal(err)
	}
	whc.Name = defaultWebhookConfiguration
	whc.Webhooks[0].ClientConfig.Service.Name, whc.Webhooks[0].ClientConfig.Service.Namespace = defaultWebhookService, ns
	if err := c.Create(ctx, &whc); err != nil {
		t.Fatal(err)
	}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	certDir := t.TempDir()
	o, _, err := parseFlags([]string{"--manager-namespace=" + ns, "--agent-image=registry.example/agent:v1",
		"--webhook-host=127.0.0.1", "--webhook-port=" + strconv.Itoa(port), "--webhook-cert-dir=" + certDir})
	if err != nil {
		t.Fatal(err)
	}
	mgr, err := ctrl.NewManager(cfg, ctrl.Options{Scheme: sch, Metrics: metricsserver.Options{BindAddress: "0"}, WebhookServer: o.webhook.webhookServer()})
	if err != nil {
		t.Fatal(err)
	}
	ready, err := setupWebhook(ctx, mgr, o, o.inject)
	if err != nil {
		t.Fatal(err)
	}
	probe := func() error { return ready(httptest.NewRequest("GET", "/readyz", nil)) }
	if err := probe(); err == nil {
		t.Fatal("ready before the manager started: no certificate can exist yet")
	}
	mgrDone := make(chan error, 1)
	go func() { mgrDone <- mgr.Start(ctx) }()
	defer func() {
		cancel()
		<-mgrDone
	}()

	// The kubelet: mount the Secret's certificate into the cert dir once the rotator filled it.
	secretKey := client.ObjectKey{Namespace: ns, Name: defaultWebhookCertSecret}
	var secret corev1.Secret
	wait(t, ctx, "the rotator fills the Secret", func() error {
		if err := c.Get(ctx, secretKey, &secret); err != nil {
			return err
		}
		if len(secret.Data["tls.crt"]) == 0 || len(secret.Data["tls.key"]) == 0 || len(secret.Data["ca.crt"]) == 0 {
			return fmt.Errorf("Secret keys: %d", len(secret.Data))
		}
		return nil
	})
	for _, f := range []string{"tls.crt", "tls.key"} {
		if err := os.WriteFile(filepath.Join(certDir, f), secret.Data[f], 0o600); err != nil {
			t.Fatal(err)
		}
	}
	wait(t, ctx, "the CA is injected into the webhook configuration", func() error {
		var got admissionregistrationv1.MutatingWebhookConfiguration
		if err := c.Get(ctx, client.ObjectKey{Name: defaultWebhookConfiguration}, &got); err != nil {
			return err
		}
		if string(got.Webhooks[0].ClientConfig.CABundle) != string(secret.Data["ca.crt"]) {
			return fmt.Errorf("caBundle is %d bytes, not the Secret's CA", len(got.Webhooks[0].ClientConfig.CABundle))
		}
		return nil
	})
	wait(t, ctx, "readiness passes once the webhook serves", probe)

	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(secret.Data["ca.crt"]) {
		t.Fatal("the Secret's ca.crt is not PEM")
	}
	conn, err := tls.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), &tls.Config{
		RootCAs: pool, ServerName: defaultWebhookService + "." + ns + ".svc", MinVersion: tls.VersionTLS12,
	})
	if err != nil {
		t.Fatalf("TLS to the webhook as the API server would verify it: %v", err)
	}
	_ = conn.Close()
}

// wait polls f until it succeeds (a backstop deadline of its context) and names what it waited for.
func wait(t *testing.T, ctx context.Context, what string, f func() error) {
	t.Helper()
	var err error
	for {
		if err = f(); err == nil {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: %v (last: %v)", what, ctx.Err(), err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}
