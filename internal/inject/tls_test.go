package inject

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/ptr"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

func TestAddUpstreamTLS(t *testing.T) {
	p := makePod("gateway-1").Obj()
	mustMutate(t, p, "partner", "plain")
	before := p.DeepCopy()
	// Nothing to mount: unchanged.
	for _, tt := range []*apportionv1.UpstreamTLS{nil, {ServerName: "api.partner.example"}, {InsecureSkipVerifyDangerous: true}} {
		if err := AddUpstreamTLS(p, "plain", tt); err != nil {
			t.Fatal(err)
		}
	}
	if diff := cmp.Diff(before, p); diff != "" {
		t.Fatalf("changed without material:\n%s", diff)
	}
	tlsSpec := &apportionv1.UpstreamTLS{
		CABundle:          &apportionv1.ConfigMapKey{Name: "partner-ca", Key: "bundle.pem"},
		ClientCertificate: &apportionv1.SecretName{Name: "partner-client"},
	}
	if err := AddUpstreamTLS(p, "partner", tlsSpec); err != nil {
		t.Fatal(err)
	}
	vol := p.Spec.Volumes[len(p.Spec.Volumes)-1]
	want := corev1.Volume{Name: vol.Name, VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{Sources: []corev1.VolumeProjection{
		{ConfigMap: &corev1.ConfigMapProjection{LocalObjectReference: corev1.LocalObjectReference{Name: "partner-ca"},
			Items: []corev1.KeyToPath{{Key: "bundle.pem", Path: "ca.crt"}}, Optional: ptr.To(false)}},
		{Secret: &corev1.SecretProjection{LocalObjectReference: corev1.LocalObjectReference{Name: "partner-client"},
			Items: []corev1.KeyToPath{{Key: "tls.crt", Path: "tls.crt"}, {Key: "tls.key", Path: "tls.key"}}, Optional: ptr.To(false)}},
	}}}}
	if diff := cmp.Diff(want, vol); diff != "" {
		t.Fatalf("volume (-want +got):\n%s", diff)
	}
	if !strings.HasPrefix(vol.Name, "apportion-upstream-tls-") || len(vol.Name) > 63 {
		t.Fatalf("volume name %q", vol.Name)
	}
	agent := p.Spec.InitContainers[0]
	m := agent.VolumeMounts[len(agent.VolumeMounts)-1]
	if diff := cmp.Diff(corev1.VolumeMount{Name: vol.Name, MountPath: "/var/run/apportion/upstream-tls/partner", ReadOnly: true}, m); diff != "" {
		t.Fatalf("mount (-want +got):\n%s", diff)
	}
	for _, c := range p.Spec.Containers {
		if len(c.VolumeMounts) != len(before.Spec.Containers[0].VolumeMounts) {
			t.Fatal("the app's container got the TLS material")
		}
	}
	ca, cert, key := UpstreamTLSFiles("partner", tlsSpec)
	if ca != "/var/run/apportion/upstream-tls/partner/ca.crt" || cert != "/var/run/apportion/upstream-tls/partner/tls.crt" ||
		key != "/var/run/apportion/upstream-tls/partner/tls.key" {
		t.Fatalf("files %s %s %s", ca, cert, key)
	}
	// Twice: the volume's name is taken.
	if err := AddUpstreamTLS(p, "partner", tlsSpec); err == nil || !strings.Contains(err.Error(), "already has a volume") {
		t.Fatalf("second time: %v", err)
	}
	// A pod without the agent.
	if err := AddUpstreamTLS(makePod("bare").Obj(), "partner", tlsSpec); err == nil {
		t.Fatal("mounted into a pod without an agent")
	}
}

func TestAgentGOMAXPROCS(t *testing.T) {
	env := func(p *corev1.Pod) string {
		for _, e := range p.Spec.InitContainers[0].Env {
			if e.Name == "GOMAXPROCS" {
				return e.Value
			}
		}
		return ""
	}
	for _, tc := range []struct {
		name        string
		annotations map[string]string
		want        string
	}{
		{"no limit: one processor", nil, "1"},
		{"from the CPU limit, rounded up", map[string]string{CPULimitAnnotation: "1500m"}, "2"},
		{"a small limit is one", map[string]string{CPULimitAnnotation: "200m"}, "1"},
		{"the annotation wins", map[string]string{CPULimitAnnotation: "4", GOMAXPROCSAnnotation: "2"}, "2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := makePod("gateway-1").Obj()
			p.Annotations = tc.annotations
			mustMutate(t, p, "partner")
			if got := env(p); got != tc.want {
				t.Fatalf("GOMAXPROCS = %q, want %q", got, tc.want)
			}
		})
	}
	for _, bad := range []string{"0", "two", "-1", "257"} {
		p := makePod("gateway-1").Obj()
		p.Annotations = map[string]string{GOMAXPROCSAnnotation: bad}
		if _, err := Mutate(p, []string{"partner"}, testConfig()); err == nil || !strings.Contains(err.Error(), GOMAXPROCSAnnotation) {
			t.Errorf("%q: %v", bad, err)
		}
	}
}
