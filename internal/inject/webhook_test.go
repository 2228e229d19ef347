package inject

import (
	"context"
	"os"
	"path/filepath"

	"github.com/google/go-cmp/cmp"
	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
)

func newNamespace(ctx context.Context, labelled bool) string {
	ns := builders.MakeNamespace("inj-" + rand.String(8))
	if labelled {
		ns.InjectionEnabled()
	}
	Expect(k8sClient.Create(ctx, ns.Obj())).To(Succeed())
	return ns.Name
}

func deployment(ns, name string) *appsv1.Deployment {
	return builders.MakeDeployment(name, ns).Replicas(2).Obj()
}

func quota(ns, name string, targets ...string) *apportionv1.DownstreamQuota {
	dq := builders.MakeDownstreamQuota(name, ns).Limit(50).Upstream("https://api.example.com/v2")
	for _, t := range targets {
		dq.Target(apportionv1.KindDeployment, t)
	}
	return dq.Obj()
}

// create creates objects. It does not wait for the injector's cache: a pod created right after
// its quotas must get its agent for every one of them all the same (the injector lists the
// quotas from the API server, and reads a workload its cache does not have yet from there too).
func create(ctx context.Context, objs ...client.Object) {
	for _, o := range objs {
		Expect(k8sClient.Create(ctx, o)).To(Succeed())
	}
}

// replicaSetPod is a pod as the ReplicaSet controller creates it at CREATE time: a generated
// name, the template's labels plus pod-template-hash, owned by the ReplicaSet (not the
// Deployment).
func replicaSetPod(d *appsv1.Deployment) *corev1.Pod {
	labels := map[string]string{"pod-template-hash": "7d9f8b6c5"}
	for k, v := range d.Spec.Template.Labels {
		labels[k] = v
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Namespace: d.Namespace, GenerateName: d.Name + "-7d9f8b6c5-", Labels: labels,
			Annotations: d.Spec.Template.Annotations,
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet",
				Name: d.Name + "-7d9f8b6c5", UID: "0f2d9a3e-1111-4c5e-9a7b-000000000001", Controller: ptr.To(true)}},
		},
		Spec: *d.Spec.Template.Spec.DeepCopy(),
	}
}

func agentOf(p *corev1.Pod) *corev1.Container {
	for i := range p.Spec.InitContainers {
		if p.Spec.InitContainers[i].Name == AgentContainerName {
			return &p.Spec.InitContainers[i]
		}
	}
	return nil
}

func envOf(c corev1.Container) map[string]string {
	out := map[string]string{}
	for _, e := range c.Env {
		out[e.Name] = e.Value
	}
	return out
}

var _ = Describe("Agent injection", func() {
	var ctx context.Context
	BeforeEach(func() { ctx = context.Background() })

	It("gives a pod of a targeted Deployment in a labelled namespace the native sidecar and the URLs", func() {
		ns := newNamespace(ctx, true)
		d := deployment(ns, "gateway")
		create(ctx, d, quota(ns, "logistics", "gateway"))

		p := replicaSetPod(d)
		Expect(k8sClient.Create(ctx, p)).To(Succeed())
		a := agentOf(p)
		Expect(a).NotTo(BeNil(), "the admitted pod has no agent init container")
		Expect(a.RestartPolicy).To(HaveValue(Equal(corev1.ContainerRestartPolicyAlways)))
		Expect(a.Image).To(Equal(testConfig().Image))
		Expect(a.SecurityContext.ReadOnlyRootFilesystem).To(HaveValue(BeTrue()))
		Expect(p.Spec.InitContainers[0].Name).To(Equal(AgentContainerName))
		Expect(envOf(p.Spec.Containers[0])).To(HaveKeyWithValue("APPORTION_LOGISTICS_URL", "http://127.0.0.1:15001/logistics"))
		Expect(p.Annotations).To(HaveKeyWithValue(apportionv1.AgentPortAnnotation, "15000"))
		vol, _, _, _ := TrustMaterial()
		Expect(p.Spec.Volumes).To(ContainElement(HaveField("Name", vol.Name)))

		By("the API server stored exactly what it answered")
		var stored corev1.Pod
		Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(p), &stored)).To(Succeed())
		Expect(cmp.Diff(p.Spec, stored.Spec)).To(BeEmpty())
	})

	It("replaces a pod's own agent-port annotation with the injected agent's port, and mounts the trust ConfigMap by its one name", func() {
		ns := newNamespace(ctx, true)
		d := deployment(ns, "gateway")
		// The template points the manager at its app's port and names an app port apportion-ctl.
		d.Spec.Template.Annotations = map[string]string{apportionv1.AgentPortAnnotation: "8080"}
		d.Spec.Template.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: apportionv1.AgentPortName, ContainerPort: 8080}}
		create(ctx, d, quota(ns, "logistics", "gateway"))

		p := replicaSetPod(d)
		Expect(k8sClient.Create(ctx, p)).To(Succeed())
		Expect(agentOf(p)).NotTo(BeNil())
		Expect(p.Annotations).To(HaveKeyWithValue(apportionv1.AgentPortAnnotation, "15000"))
		Expect(agentOf(p).Ports).To(ContainElement(corev1.ContainerPort{Name: apportionv1.AgentPortName, ContainerPort: ControlPort, Protocol: corev1.ProtocolTCP}))
		var trust *corev1.Volume
		for i := range p.Spec.Volumes {
			if p.Spec.Volumes[i].Name == TrustVolumeName {
				trust = &p.Spec.Volumes[i]
			}
		}
		Expect(trust).NotTo(BeNil())
		Expect(trust.ConfigMap).NotTo(BeNil())
		Expect(trust.ConfigMap.Name).To(Equal(apportionv1.TrustConfigMap))
	})

	It("leaves an unlabelled namespace, an opted-out pod and a pod of no target untouched", func() {
		plain := newNamespace(ctx, false)
		d := deployment(plain, "gateway")
		create(ctx, d, quota(plain, "logistics", "gateway"))
		p := replicaSetPod(d)
		Expect(k8sClient.Create(ctx, p)).To(Succeed())
		Expect(p.Spec.InitContainers).To(BeEmpty(), "unlabelled namespace")
		Expect(p.Spec.Containers[0].Env).To(BeEmpty())

		ns := newNamespace(ctx, true)
		d = deployment(ns, "gateway")
		other := deployment(ns, "batch")
		create(ctx, d, other, quota(ns, "logistics", "gateway"))

		out := replicaSetPod(d)
		out.Annotations = map[string]string{apportionv1.InjectAnnotation: "false"}
		Expect(k8sClient.Create(ctx, out)).To(Succeed())
		Expect(out.Spec.InitContainers).To(BeEmpty(), "opted out")
		Expect(out.Spec.Containers[0].Env).To(BeEmpty())

		none := replicaSetPod(other)
		Expect(k8sClient.Create(ctx, none)).To(Succeed())
		Expect(none.Spec.InitContainers).To(BeEmpty(), "a pod of no target")
		Expect(none.Annotations).NotTo(HaveKey(apportionv1.AgentPortAnnotation))
	})

	It("is a no-op on a second admission and on a hand-written sidecar", func() {
		ns := newNamespace(ctx, true)
		d := deployment(ns, "gateway")
		create(ctx, d, quota(ns, "logistics", "gateway"))
		first := replicaSetPod(d)
		Expect(k8sClient.Create(ctx, first)).To(Succeed())
		Expect(agentOf(first)).NotTo(BeNil())

		again := replicaSetPod(d)
		again.Annotations = first.Annotations
		again.Spec = *first.Spec.DeepCopy()
		want := again.Spec.DeepCopy()
		Expect(k8sClient.Create(ctx, again)).To(Succeed())
		Expect(cmp.Diff(*want, again.Spec)).To(BeEmpty(), "the second admission changed the pod")

		hand := replicaSetPod(d)
		hand.Spec.Containers = append(hand.Spec.Containers, corev1.Container{Name: AgentContainerName, Image: "agent:hand",
			Ports: []corev1.ContainerPort{{Name: apportionv1.AgentPortName, ContainerPort: ControlPort}}})
		Expect(k8sClient.Create(ctx, hand)).To(Succeed())
		Expect(hand.Spec.InitContainers).To(BeEmpty(), "a hand-written sidecar is kept as it is")
		Expect(hand.Spec.Containers).To(HaveLen(2))
		Expect(hand.Spec.Containers[0].Env).To(BeEmpty())
	})

	It("gives a pod of two quotas one agent serving both", func() {
		ns := newNamespace(ctx, true)
		d := deployment(ns, "gateway")
		create(ctx, d, quota(ns, "logistics", "gateway"), quota(ns, "recommend", "gateway"))
		p := replicaSetPod(d)
		Expect(k8sClient.Create(ctx, p)).To(Succeed())
		agents := 0
		for _, c := range append(p.Spec.InitContainers, p.Spec.Containers...) {
			if c.Name == AgentContainerName {
				agents++
			}
		}
		Expect(agents).To(Equal(1))
		Expect(envOf(p.Spec.Containers[0])).To(SatisfyAll(
			HaveKeyWithValue("APPORTION_LOGISTICS_URL", "http://127.0.0.1:15001/logistics"),
			HaveKeyWithValue("APPORTION_RECOMMEND_URL", "http://127.0.0.1:15001/recommend"),
		))
	})

	It("injects a pod of a StatefulSet target, matched by the StatefulSet's selector", func() {
		ns := newNamespace(ctx, true)
		sts := builders.MakeStatefulSet("ledger", ns).Obj()
		sts.Spec.ServiceName = "ledger"
		dq := quota(ns, "payments")
		dq.Spec.Targets = []apportionv1.Target{{Kind: apportionv1.KindStatefulSet, Name: "ledger"}}
		create(ctx, sts, dq)
		p := builders.MakePod("ledger-0", ns).Label("app", "ledger").Obj()
		Expect(k8sClient.Create(ctx, p)).To(Succeed())
		Expect(agentOf(p)).NotTo(BeNil())
		Expect(envOf(p.Spec.Containers[0])).To(HaveKeyWithValue("APPORTION_PAYMENTS_URL", "http://127.0.0.1:15001/payments"))
	})

	It("answers a dry-run create with the injected pod and stores nothing", func() {
		ns := newNamespace(ctx, true)
		d := deployment(ns, "gateway")
		create(ctx, d, quota(ns, "logistics", "gateway"))
		p := replicaSetPod(d)
		p.GenerateName, p.Name = "", "dry"
		Expect(k8sClient.Create(ctx, p, client.DryRunAll)).To(Succeed())
		Expect(agentOf(p)).NotTo(BeNil())
		err := k8sClient.Get(ctx, client.ObjectKeyFromObject(p), &corev1.Pod{})
		Expect(apierrors.IsNotFound(err)).To(BeTrue(), "a dry-run pod was stored: %v", err)
	})

	It("refuses a pod with a bad annotation, naming it", func() {
		ns := newNamespace(ctx, true)
		d := deployment(ns, "gateway")
		create(ctx, d, quota(ns, "logistics", "gateway"))
		p := replicaSetPod(d)
		p.Annotations = map[string]string{MemoryLimitAnnotation: "lots"}
		err := k8sClient.Create(ctx, p)
		Expect(err).To(MatchError(ContainSubstring(MemoryLimitAnnotation)))
		Expect(apierrors.IsForbidden(err)).To(BeTrue(), "want 403, got %v", err)
	})

	It("is configured as the repository's config/webhook/manifests.yaml says", func() {
		raw, err := os.ReadFile(filepath.Join("..", "..", "config", "webhook", "manifests.yaml"))
		Expect(err).NotTo(HaveOccurred())
		var file admissionregistrationv1.MutatingWebhookConfiguration
		Expect(yaml.UnmarshalStrict(raw, &file)).To(Succeed())
		Expect(file.Webhooks).To(HaveLen(1))
		w := file.Webhooks[0]
		Expect(w.Name).To(Equal("inject.apportion.io"))
		Expect(w.ClientConfig.Service).NotTo(BeNil())
		Expect(w.ClientConfig.Service.Path).To(HaveValue(Equal(Path)))
		Expect(w.FailurePolicy).To(HaveValue(Equal(admissionregistrationv1.Fail)))
		Expect(w.SideEffects).To(HaveValue(Equal(admissionregistrationv1.SideEffectClassNone)))
		Expect(w.NamespaceSelector).To(Equal(&metav1.LabelSelector{MatchLabels: map[string]string{apportionv1.InjectionLabel: apportionv1.InjectionEnabled}}))
		Expect(w.Rules).To(Equal([]admissionregistrationv1.RuleWithOperations{{
			Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
			Rule:       admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"}, Resources: []string{"pods"}},
		}}))

		By("the API server holds that configuration (envtest only points it at the local server)")
		var live admissionregistrationv1.MutatingWebhookConfiguration
		Expect(k8sClient.Get(ctx, client.ObjectKey{Name: file.Name}, &live)).To(Succeed())
		Expect(live.Webhooks).To(HaveLen(1))
		got := live.Webhooks[0]
		Expect(got.ClientConfig.URL).To(HaveValue(HaveSuffix(Path)))
		got.ClientConfig, w.ClientConfig = admissionregistrationv1.WebhookClientConfig{}, admissionregistrationv1.WebhookClientConfig{}
		// The API server's defaults for what the file leaves out.
		if w.ObjectSelector == nil {
			w.ObjectSelector = &metav1.LabelSelector{}
		}
		for i := range w.Rules {
			if w.Rules[i].Scope == nil {
				w.Rules[i].Scope = ptr.To(admissionregistrationv1.AllScopes)
			}
		}
		Expect(cmp.Diff(w, got)).To(BeEmpty())
	})
})

var _ = Describe("Agent injection of upstream TLS material", func() {
	It("mounts the quota's CA ConfigMap and client Secret into the agent only, read-only, and the API server keeps them", func() {
		ctx := context.Background()
		ns := newNamespace(ctx, true)
		d := deployment(ns, "gateway")
		q := quota(ns, "partner", "gateway")
		q.Spec.Upstream = "https://api.partner.example"
		q.Spec.UpstreamTLS = &apportionv1.UpstreamTLS{
			CABundle:          &apportionv1.ConfigMapKey{Name: "partner-ca"},
			ClientCertificate: &apportionv1.SecretName{Name: "partner-client"},
		}
		create(ctx, d, q)

		p := replicaSetPod(d)
		Expect(k8sClient.Create(ctx, p)).To(Succeed())
		a := agentOf(p)
		Expect(a).NotTo(BeNil())
		Expect(a.VolumeMounts).To(ContainElement(And(
			HaveField("MountPath", "/var/run/apportion/upstream-tls/partner"), HaveField("ReadOnly", true))))
		Expect(envOf(*a)).To(HaveKeyWithValue("GOMAXPROCS", "1"))
		for _, c := range p.Spec.Containers {
			Expect(c.VolumeMounts).NotTo(ContainElement(HaveField("MountPath", "/var/run/apportion/upstream-tls/partner")))
		}
		var stored corev1.Pod
		Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(p), &stored)).To(Succeed())
		var projected *corev1.ProjectedVolumeSource
		for _, v := range stored.Spec.Volumes {
			if v.Projected != nil {
				projected = v.Projected
			}
		}
		Expect(projected).NotTo(BeNil(), "no projected volume stored")
		Expect(projected.Sources).To(HaveLen(2))
		Expect(projected.Sources[0].ConfigMap.Name).To(Equal("partner-ca"))
		Expect(projected.Sources[0].ConfigMap.Items).To(Equal([]corev1.KeyToPath{{Key: "ca.crt", Path: "ca.crt"}}))
		Expect(projected.Sources[0].ConfigMap.Optional).To(HaveValue(BeFalse()))
		Expect(projected.Sources[1].Secret.Name).To(Equal("partner-client"))
		Expect(projected.Sources[1].Secret.Optional).To(HaveValue(BeFalse()))
	})
})
