package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"
)

func TestWebhookFlags(t *testing.T) {
	o, _, err := parseFlags([]string{"--agent-image=registry.example/agent:v1", "--agent-cpu-limit=500m", "--agent-memory-request=0"})
	if err != nil {
		t.Fatal(err)
	}
	want := corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("50m")},
		Limits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("500m"), corev1.ResourceMemory: resource.MustParse("128Mi")},
	}
	if o.inject.Image != "registry.example/agent:v1" || !cmp.Equal(want, o.inject.Resources) {
		t.Errorf("inject config = %+v; want the image and resources %v", o.inject, want)
	}
	if o.webhook.port != 9443 || o.webhook.certDir != "/tmp/k8s-webhook-server/serving-certs" || !o.webhook.certRotation {
		t.Errorf("webhook defaults = %+v", o.webhook)
	}

	if _, _, err := parseFlags([]string{"--webhook-port=0"}); err != nil {
		t.Errorf("no webhook needs no agent image: %v", err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "--agent-image"},
		{[]string{"--agent-image=a", "--agent-memory-limit=lots"}, "--agent-memory-limit"},
		{[]string{"--agent-image=a", "--agent-cpu-request=2", "--agent-cpu-limit=1"}, "above its limit"},
		{[]string{"--agent-image=a", "--agent-image-pull-policy=Sometimes"}, "--agent-image-pull-policy"},
		{[]string{"--agent-image=a", "--webhook-port=70000"}, "--webhook-port"},
		{[]string{"--agent-image=a", "--webhook-cert-secret="}, "--webhook-cert-rotation"},
	} {
		if _, _, err := parseFlags(tc.args); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseFlags(%q) = %v; want an error naming %s", tc.args, err, tc.want)
		}
	}
}

// The flags' defaults are the names the installer gives the objects: config/webhook's generated
// configuration and Service under config/default's namePrefix.
func TestWebhookDefaultsMatchTheInstaller(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "webhook", "manifests.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var c admissionregistrationv1.MutatingWebhookConfiguration
	if err := yaml.UnmarshalStrict(raw, &c); err != nil {
		t.Fatal(err)
	}
	kust, err := os.ReadFile(filepath.Join("..", "..", "config", "default", "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		NamePrefix string `json:"namePrefix"`
	}
	if err := yaml.Unmarshal(kust, &k); err != nil {
		t.Fatal(err)
	}
	if got := k.NamePrefix + c.Name; got != defaultWebhookConfiguration {
		t.Errorf("installed configuration %q, --webhook-configuration default %q", got, defaultWebhookConfiguration)
	}
	if len(c.Webhooks) != 1 || c.Webhooks[0].ClientConfig.Service == nil {
		t.Fatalf("want one webhook behind a Service: %+v", c.Webhooks)
	}
	if got := k.NamePrefix + c.Webhooks[0].ClientConfig.Service.Name; got != defaultWebhookService {
		t.Errorf("installed Service %q, --webhook-service default %q", got, defaultWebhookService)
	}
}
