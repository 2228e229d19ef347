package inject

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
)

func testConfig() Config {
	return Config{
		Image: "registry.example/apportion/agent:v1",
		Resources: corev1.ResourceRequirements{
			Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("50m"), corev1.ResourceMemory: resource.MustParse("32Mi")},
			Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("128Mi")},
		},
	}
}

// makePod is the pod the tests mutate: gateway's, in namespace shop.
func makePod(name string) *builders.PodWrapper {
	return builders.MakePod(name, "shop").Label("app", "gateway")
}

func mustMutate(t *testing.T, p *corev1.Pod, quotas ...string) {
	t.Helper()
	changed, err := Mutate(p, quotas, testConfig())
	if err != nil || !changed {
		t.Fatalf("Mutate = %v, %v; want changed, no error", changed, err)
	}
}

func TestMutateInjectsANativeSidecar(t *testing.T) {
	p := makePod("gateway-1").InitContainer(corev1.Container{Name: "migrate", Image: "migrate:1"}).Obj()
	mustMutate(t, p, "logistics")

	if len(p.Spec.InitContainers) != 2 || p.Spec.InitContainers[1].Name != "migrate" {
		t.Fatalf("init containers = %v; want the agent first, then the app's", names(p.Spec.InitContainers))
	}
	a := p.Spec.InitContainers[0]
	if a.Name != AgentContainerName || a.Image != "registry.example/apportion/agent:v1" {
		t.Errorf("agent = %s %s", a.Name, a.Image)
	}
	if a.RestartPolicy == nil || *a.RestartPolicy != corev1.ContainerRestartPolicyAlways {
		t.Errorf("restartPolicy = %v; want Always (a native sidecar)", a.RestartPolicy)
	}
	wantArgs := []string{"--listen=127.0.0.1:15001", "--control-listen=:15000", "--trust-dir=/etc/apportion/trust"}
	if diff := cmp.Diff(wantArgs, a.Args); diff != "" {
		t.Errorf("args (-want +got):\n%s", diff)
	}
	wantPorts := []corev1.ContainerPort{
		{Name: "apportion-ctl", ContainerPort: 15000, Protocol: corev1.ProtocolTCP},
		{Name: "apportion-data", ContainerPort: 15001, Protocol: corev1.ProtocolTCP},
	}
	if diff := cmp.Diff(wantPorts, a.Ports); diff != "" {
		t.Errorf("ports (-want +got):\n%s", diff)
	}
	if a.StartupProbe == nil || a.StartupProbe.HTTPGet.Path != "/healthz" || a.StartupProbe.HTTPGet.Port.StrVal != "apportion-ctl" {
		t.Errorf("startup probe = %+v", a.StartupProbe)
	}
	if a.ReadinessProbe == nil || a.ReadinessProbe.HTTPGet.Path != "/readyz" {
		t.Errorf("readiness probe = %+v", a.ReadinessProbe)
	}
	sc := a.SecurityContext
	if sc == nil || !*sc.RunAsNonRoot || !*sc.ReadOnlyRootFilesystem || *sc.AllowPrivilegeEscalation ||
		sc.Capabilities == nil || len(sc.Capabilities.Drop) != 1 || sc.Capabilities.Drop[0] != "ALL" ||
		sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("securityContext not hardened: %+v", sc)
	}
	if diff := cmp.Diff(testConfig().Resources, a.Resources); diff != "" {
		t.Errorf("resources (-want +got):\n%s", diff)
	}
	vol, mount, _, identity := TrustMaterial()
	if diff := cmp.Diff(append(identity, corev1.EnvVar{Name: "GOMAXPROCS", Value: "1"}), a.Env); diff != "" {
		t.Errorf("agent env (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]corev1.Volume{vol}, p.Spec.Volumes); diff != "" {
		t.Errorf("volumes (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff([]corev1.VolumeMount{mount}, a.VolumeMounts); diff != "" {
		t.Errorf("mounts (-want +got):\n%s", diff)
	}
	if vol.ConfigMap == nil || vol.ConfigMap.Name != "apportion-trust" || len(vol.ConfigMap.Items) != 0 || vol.Secret != nil {
		t.Errorf("trust volume = %+v; want the whole apportion-trust ConfigMap (public keys only)", vol)
	}
	if mount.SubPath != "" || !mount.ReadOnly {
		t.Errorf("trust mount = %+v; want read-only without subPath (the kubelet refreshes it)", mount)
	}
	for _, e := range identity {
		if e.ValueFrom == nil || e.ValueFrom.FieldRef == nil {
			t.Errorf("agent identity %s is not from the downward API: %+v", e.Name, e)
		}
	}
	if got := p.Annotations[apportionv1.AgentPortAnnotation]; got != "15000" {
		t.Errorf("annotation %s = %q; want 15000", apportionv1.AgentPortAnnotation, got)
	}
	wantEnv := []corev1.EnvVar{{Name: "APPORTION_LOGISTICS_URL", Value: "http://127.0.0.1:15001/logistics"}}
	if diff := cmp.Diff(wantEnv, p.Spec.Containers[0].Env); diff != "" {
		t.Errorf("app env (-want +got):\n%s", diff)
	}
	if len(p.Spec.InitContainers[1].Env) != 0 {
		t.Errorf("the app's init container got env %v; only app containers get the URLs", p.Spec.InitContainers[1].Env)
	}
}

func names(cs []corev1.Container) []string {
	out := make([]string, len(cs))
	for i, c := range cs {
		out[i] = c.Name
	}
	return out
}

func TestMutateTwoQuotasOneAgent(t *testing.T) {
	p := makePod("gateway-1").Container(corev1.Container{Name: "worker", Image: "w:1"}).Obj()
	mustMutate(t, p, "recommend", "logistics-eu.v2", "recommend")
	if n := len(p.Spec.InitContainers); n != 1 {
		t.Fatalf("%d init containers; want one agent for both quotas", n)
	}
	want := []corev1.EnvVar{
		{Name: "APPORTION_LOGISTICS_EU_V2_URL", Value: "http://127.0.0.1:15001/logistics-eu.v2"},
		{Name: "APPORTION_RECOMMEND_URL", Value: "http://127.0.0.1:15001/recommend"},
	}
	for _, c := range p.Spec.Containers {
		if diff := cmp.Diff(want, c.Env); diff != "" {
			t.Errorf("container %s env (-want +got):\n%s", c.Name, diff)
		}
	}
}

func TestMutateKeepsWhatThePodSets(t *testing.T) {
	p := makePod("gateway-1").
		Env(0, "APPORTION_LOGISTICS_URL", "http://mine/logistics").Obj()
	mustMutate(t, p, "logistics", "recommend")
	want := []corev1.EnvVar{
		{Name: "APPORTION_LOGISTICS_URL", Value: "http://mine/logistics"},
		{Name: "APPORTION_RECOMMEND_URL", Value: "http://127.0.0.1:15001/recommend"},
	}
	if diff := cmp.Diff(want, p.Spec.Containers[0].Env); diff != "" {
		t.Errorf("env (-want +got):\n%s", diff)
	}
}

// A pod's own agent-port annotation does not survive injection: the manager talks to the
// injected container's port (the controller's agentOf), and the annotation says that port, not
// one the pod chose (its app's, say).
func TestMutateReplacesThePodsAgentPort(t *testing.T) {
	for _, own := range []string{"8080", "15000", "ctl"} {
		p := makePod("gateway-1").Annotation(apportionv1.AgentPortAnnotation, own).Obj()
		mustMutate(t, p, "logistics")
		if got := p.Annotations[apportionv1.AgentPortAnnotation]; got != "15000" {
			t.Errorf("the pod's own %s=%q became %q; want the injected port 15000", apportionv1.AgentPortAnnotation, own, got)
		}
		a := p.Spec.InitContainers[0]
		if a.Name != apportionv1.AgentContainerName || len(a.Ports) == 0 || a.Ports[0].Name != apportionv1.AgentPortName || a.Ports[0].ContainerPort != 15000 {
			t.Errorf("the injected agent is not the %s container with port %s 15000: %+v", apportionv1.AgentContainerName, apportionv1.AgentPortName, a)
		}
	}
}

func TestMutateLeavesAlone(t *testing.T) {
	injected := makePod("again").Obj()
	mustMutate(t, injected, "logistics")
	for name, p := range map[string]*corev1.Pod{
		"no quota":           makePod("p").Obj(),
		"opted out":          makePod("p").Annotation(apportionv1.InjectAnnotation, "false").Obj(),
		"hand-written agent": makePod("p").Container(corev1.Container{Name: AgentContainerName, Image: "agent"}).Obj(),
		"already injected":   injected,
	} {
		t.Run(name, func(t *testing.T) {
			quotas := []string{"logistics"}
			if name == "no quota" {
				quotas = nil
			}
			before := p.DeepCopy()
			changed, err := Mutate(p, quotas, testConfig())
			if err != nil || changed {
				t.Fatalf("Mutate = %v, %v; want unchanged, no error", changed, err)
			}
			if diff := cmp.Diff(before, p); diff != "" {
				t.Errorf("pod changed (-before +after):\n%s", diff)
			}
		})
	}
}

func TestMutateResourceAnnotations(t *testing.T) {
	p := makePod("p").
		Annotation(CPURequestAnnotation, "200m").
		Annotation(CPULimitAnnotation, "1").
		Annotation(MemoryLimitAnnotation, "0").Obj()
	mustMutate(t, p, "logistics")
	want := corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("200m"), corev1.ResourceMemory: resource.MustParse("32Mi")},
		Limits:   corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1")},
	}
	if diff := cmp.Diff(want, p.Spec.InitContainers[0].Resources); diff != "" {
		t.Errorf("resources (-want +got):\n%s", diff)
	}
}

func TestMutateRefuses(t *testing.T) {
	for name, tc := range map[string]struct {
		pod  *corev1.Pod
		want string
	}{
		"bad quantity":        {makePod("p").Annotation(MemoryRequestAnnotation, "lots").Obj(), MemoryRequestAnnotation},
		"negative quantity":   {makePod("p").Annotation(CPURequestAnnotation, "-1").Obj(), CPURequestAnnotation},
		"request above limit": {makePod("p").Annotation(MemoryRequestAnnotation, "1Gi").Obj(), "above its limit"},
		"inject typo":         {makePod("p").Annotation(apportionv1.InjectAnnotation, "no").Obj(), apportionv1.InjectAnnotation},
		"volume name taken": {makePod("p").Volume(corev1.Volume{Name: TrustVolumeName,
			VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}).Obj(), TrustVolumeName},
	} {
		t.Run(name, func(t *testing.T) {
			before := tc.pod.DeepCopy()
			changed, err := Mutate(tc.pod, []string{"logistics"}, testConfig())
			if err == nil || !strings.Contains(err.Error(), tc.want) || changed {
				t.Fatalf("Mutate = %v, %v; want an error naming %q", changed, err, tc.want)
			}
			if diff := cmp.Diff(before, tc.pod); diff != "" {
				t.Errorf("a refused pod was changed (-before +after):\n%s", diff)
			}
		})
	}
}

func TestEnvName(t *testing.T) {
	for in, want := range map[string]string{
		"logistics":      "APPORTION_LOGISTICS_URL",
		"logistics-eu":   "APPORTION_LOGISTICS_EU_URL",
		"api.partner.v2": "APPORTION_API_PARTNER_V2_URL",
		"a1-b2.c3":       "APPORTION_A1_B2_C3_URL",
	} {
		if got := EnvName(in); got != want {
			t.Errorf("EnvName(%q) = %q; want %q", in, got, want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	if err := testConfig().Validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	bad := testConfig()
	bad.Image = " "
	bad.Resources.Requests[corev1.ResourceMemory] = resource.MustParse("1Gi")
	err := bad.Validate()
	if err == nil || !strings.Contains(err.Error(), "--agent-image") || !strings.Contains(err.Error(), "above its limit") {
		t.Fatalf("Validate = %v; want both problems named", err)
	}
}
