package controller

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"sync"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/inject"
	"github.com/apportion/apportion/internal/testing/builders"
)

const testTrustName = apportionv1.TrustConfigMap

// trustData stands in for the manager's key keeper.
var trustData = struct {
	sync.Mutex
	data    map[string]string
	changes chan event.GenericEvent
}{data: map[string]string{"k1.pem": "public key 1"}, changes: make(chan event.GenericEvent, 1)}

func setTrustData(d map[string]string) {
	trustData.Lock()
	trustData.data = d
	trustData.Unlock()
	trustData.changes <- event.GenericEvent{Object: &corev1.Namespace{}}
}

func currentTrustData() map[string]string {
	trustData.Lock()
	defer trustData.Unlock()
	return maps.Clone(trustData.data)
}

func init() {
	extraControllers = append(extraControllers, func(mgr ctrl.Manager) error {
		return (&TrustReconciler{
			Client:   mgr.GetClient(),
			Recorder: mgr.GetEventRecorder("apportion-manager"),
			Data: func() map[string]string {
				trustData.Lock()
				defer trustData.Unlock()
				return trustData.data
			},
			Changes: trustData.changes,
		}).SetupWithManager(mgr)
	})
}

func getTrust(ctx context.Context, ns string) func() (map[string]string, error) {
	return func() (map[string]string, error) {
		var cm corev1.ConfigMap
		err := k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: testTrustName}, &cm)
		return cm.Data, err
	}
}

// asPublished says whether the namespace's trust ConfigMap is exactly what the manager publishes
// now: its keys and nothing else, its label, mutable, not being deleted. It returns what differs.
func asPublished(ctx context.Context, ns string) func() error {
	return func() error {
		var cm corev1.ConfigMap
		if err := k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: testTrustName}, &cm); err != nil {
			return err
		}
		want := currentTrustData()
		switch {
		case !maps.Equal(cm.Data, want):
			return fmt.Errorf("data %v, want %v", cm.Data, want)
		case len(cm.BinaryData) > 0:
			return fmt.Errorf("binaryData %v", cm.BinaryData)
		case cm.Labels[TrustLabel] != "true":
			return fmt.Errorf("labels %v", cm.Labels)
		case ptr.Deref(cm.Immutable, false):
			return fmt.Errorf("immutable")
		case !cm.DeletionTimestamp.IsZero():
			return fmt.Errorf("being deleted")
		}
		return nil
	}
}

// restoreWarnings lists the Warning Events recorded on the namespace's trust ConfigMap.
func restoreWarnings(ctx context.Context, ns string) func() ([]string, error) {
	return func() ([]string, error) {
		var list eventsv1.EventList
		if err := k8sClient.List(ctx, &list, client.InNamespace(ns)); err != nil {
			return nil, err
		}
		var out []string
		for _, e := range list.Items {
			if e.Type == corev1.EventTypeWarning && e.Reason == TrustRestoredReason && e.Regarding.Name == testTrustName {
				out = append(out, e.Note)
			}
		}
		return out, nil
	}
}

// updateTrust changes the namespace's trust ConfigMap with f, as an admin (whom the admission
// policy lets through: this is the manager's repair on its own), retrying on conflict.
func updateTrust(ctx context.Context, ns string, f func(*corev1.ConfigMap)) {
	Eventually(func() error {
		var cm corev1.ConfigMap
		if err := k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: testTrustName}, &cm); err != nil {
			return err
		}
		f(&cm)
		return k8sClient.Update(ctx, &cm)
	}).Should(Succeed())
}

// injectionNamespace creates a namespace labelled for injection and waits for its trust ConfigMap.
func injectionNamespace(ctx context.Context) string {
	ns := builders.MakeNamespace("t-" + rand.String(8)).InjectionEnabled().Obj()
	Expect(k8sClient.Create(ctx, ns)).To(Succeed())
	Eventually(asPublished(ctx, ns.Name)).Should(Succeed())
	return ns.Name
}

const evilKey = "-----BEGIN PUBLIC KEY-----\nMCowBQYDK2VwAyEA2VmSx3p3+ocMFHwWDgyaO8qW8xVcaO8lZ2dPWdsIlX4=\n-----END PUBLIC KEY-----\n"

var _ = Describe("Trust ConfigMap", Ordered, func() {
	ctx := context.Background()

	It("is kept in a namespace labelled for injection before any quota exists, and follows key changes", func() {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "t-" + rand.String(8), Labels: map[string]string{apportionv1.InjectionLabel: apportionv1.InjectionEnabled}}}
		Expect(k8sClient.Create(ctx, ns)).To(Succeed())
		Eventually(getTrust(ctx, ns.Name)).Should(Equal(map[string]string{"k1.pem": "public key 1"}))
		var cm corev1.ConfigMap
		Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns.Name, Name: testTrustName}, &cm)).To(Succeed())
		Expect(cm.Labels).To(HaveKeyWithValue(TrustLabel, "true"))

		// A new key published, then the old one withdrawn: every namespace follows.
		setTrustData(map[string]string{"k1.pem": "public key 1", "k2.pem": "public key 2"})
		Eventually(getTrust(ctx, ns.Name)).Should(HaveLen(2))
		setTrustData(map[string]string{"k2.pem": "public key 2"})
		Eventually(getTrust(ctx, ns.Name)).Should(Equal(map[string]string{"k2.pem": "public key 2"}))
		// The manager's own changes are no tampering.
		Consistently(restoreWarnings(ctx, ns.Name), "500ms").Should(BeEmpty())

		// A hand edit is put back; a deleted ConfigMap is recreated.
		Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns.Name, Name: testTrustName}, &cm)).To(Succeed())
		cm.Data["evil.pem"] = "attacker key"
		Expect(k8sClient.Update(ctx, &cm)).To(Succeed())
		Eventually(getTrust(ctx, ns.Name)).Should(Equal(map[string]string{"k2.pem": "public key 2"}))
		Expect(k8sClient.Delete(ctx, &cm)).To(Succeed())
		Eventually(getTrust(ctx, ns.Name)).Should(Equal(map[string]string{"k2.pem": "public key 2"}))
	})

	It("is created in a namespace when its first DownstreamQuota appears, and nowhere else", func() {
		quiet := newNamespace(ctx)
		ns := newNamespace(ctx)
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Targets(apportionv1.Target{Kind: "Deployment", Name: "gateway", Weight: 1}).Obj())).To(Succeed())
		Eventually(getTrust(ctx, ns)).Should(HaveKey("k2.pem"))
		Consistently(func() error { _, err := getTrust(ctx, quiet)(); return err }, "1s").ShouldNot(Succeed())
	})

	It("is the ConfigMap an injected pod mounts", func() {
		ns := injectionNamespace(ctx)
		pod := builders.MakePod("gateway-0", ns).Obj()
		changed, err := inject.Mutate(pod, []string{"logistics"}, inject.Config{Image: "agent:test"})
		Expect(err).NotTo(HaveOccurred())
		Expect(changed).To(BeTrue())
		var mounted []string
		for _, v := range pod.Spec.Volumes {
			if v.ConfigMap != nil {
				mounted = append(mounted, v.ConfigMap.Name)
			}
		}
		Expect(mounted).To(HaveLen(1), "the injected pod mounts one ConfigMap, its trust material")
		var cm corev1.ConfigMap
		Expect(k8sClient.Get(ctx, client.ObjectKey{Namespace: ns, Name: mounted[0]}, &cm)).To(Succeed(),
			"the injected pod's volume names a ConfigMap the manager does not keep")
		Expect(cm.Data).To(Equal(currentTrustData()))
	})

	It("leaves a ConfigMap of that name alone in a namespace with no agents", func() {
		ns := newNamespace(ctx)
		foreign := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: testTrustName}, Data: map[string]string{"mine": "x"}}
		Expect(k8sClient.Create(ctx, foreign)).To(Succeed())
		Consistently(getTrust(ctx, ns), "1s").Should(Equal(map[string]string{"mine": "x"}))
		Expect(restoreWarnings(ctx, ns)()).To(BeEmpty())
	})

	// Whatever is done to the ConfigMap in a namespace with agents — by someone the admission
	// policy lets through, or where it is not installed — the manager puts back exactly what it
	// publishes, and says so. Each measures how long that took.
	DescribeTable("puts back exactly the published keys, and says so, after someone",
		func(what string, tamper func(ns string)) {
			ns := injectionNamespace(ctx)
			start := time.Now()
			tamper(ns)
			Eventually(asPublished(ctx, ns)).WithTimeout(10 * time.Second).WithPolling(5 * time.Millisecond).Should(Succeed())
			took := time.Since(start)
			_, _ = fmt.Fprintf(GinkgoWriter, "restored after %q in %v\n", what, took.Round(time.Millisecond))
			AddReportEntry("restore latency: "+what, took.Round(time.Millisecond).String())
			Eventually(restoreWarnings(ctx, ns)).ShouldNot(BeEmpty(), "no Warning Event names the ConfigMap")
			// Put back for good: it stays as published.
			Consistently(asPublished(ctx, ns), "300ms").Should(Succeed())
		},
		Entry("removes its label", "remove the label", func(ns string) {
			updateTrust(ctx, ns, func(cm *corev1.ConfigMap) { delete(cm.Labels, TrustLabel) })
		}),
		Entry("removes its label and adds a key", "remove the label, add evil.pem", func(ns string) {
			updateTrust(ctx, ns, func(cm *corev1.ConfigMap) {
				delete(cm.Labels, TrustLabel)
				cm.Data["evil.pem"] = evilKey
			})
		}),
		Entry("deletes it and creates it again unlabelled with a key of their own", "delete, re-create unlabelled with evil.pem", func(ns string) {
			// The manager may re-create it between the two: then again, as a tenant would.
			Eventually(func() error {
				if err := k8sClient.Delete(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: testTrustName}}); client.IgnoreNotFound(err) != nil {
					return err
				}
				return k8sClient.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: testTrustName},
					Data: map[string]string{"evil.pem": evilKey}})
			}).Should(Succeed())
		}),
		Entry("adds a key", "add evil.pem", func(ns string) {
			updateTrust(ctx, ns, func(cm *corev1.ConfigMap) { cm.Data["evil.pem"] = evilKey })
		}),
		Entry("changes a key", "change a published key", func(ns string) {
			updateTrust(ctx, ns, func(cm *corev1.ConfigMap) {
				for k := range cm.Data {
					cm.Data[k] = evilKey
				}
			})
		}),
		Entry("adds a binaryData key", "add binaryData evil.pem", func(ns string) {
			updateTrust(ctx, ns, func(cm *corev1.ConfigMap) { cm.BinaryData = map[string][]byte{"evil.pem": []byte(evilKey)} })
		}),
		Entry("adds a key and makes it immutable", "add evil.pem, immutable", func(ns string) {
			updateTrust(ctx, ns, func(cm *corev1.ConfigMap) {
				cm.Data["evil.pem"] = evilKey
				cm.Immutable = ptr.To(true)
			})
		}),
		Entry("makes it immutable with a finalizer, then deletes it", "add evil.pem, immutable, finalizer, delete", func(ns string) {
			updateTrust(ctx, ns, func(cm *corev1.ConfigMap) {
				cm.Data["evil.pem"] = evilKey
				cm.Immutable = ptr.To(true)
				cm.Finalizers = append(cm.Finalizers, "example.com/keep")
			})
			err := k8sClient.Delete(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: testTrustName}})
			Expect(client.IgnoreNotFound(err)).To(Succeed())
		}),
	)
})

// The admission policy of config/rbac/trust_guard.yaml keeps a namespace's editors from writing
// the trust ConfigMap at all, while the manager (its RBAC) can.
var _ = Describe("Trust ConfigMap admission policy (config/rbac/trust_guard.yaml)", Ordered, func() {
	ctx := context.Background()
	var ns string
	var tenant, asManager client.Client

	get := func(c client.Client) *corev1.ConfigMap {
		GinkgoHelper()
		var cm corev1.ConfigMap
		Expect(c.Get(ctx, client.ObjectKey{Namespace: ns, Name: testTrustName}, &cm)).To(Succeed())
		return &cm
	}
	refused := func(err error) {
		GinkgoHelper()
		Expect(err).To(HaveOccurred())
		Expect(apierrors.IsForbidden(err)).To(BeTrue(), "%v", err)
		Expect(err.Error()).To(ContainSubstring("only the apportion manager writes it"))
	}

	BeforeAll(func() {
		applyConfigRBAC(ctx)
		ns = injectionNamespace(ctx)
		user := "tenant-" + ns
		bindEditor(ctx, ns, user)
		tenant = impersonate(user, "system:authenticated")
		asManager = impersonate(managerSA, "system:serviceaccounts", "system:serviceaccounts:"+rbacNamespace, "system:authenticated")

		// The policy takes effect once the API server has loaded it (a moment after it exists).
		Eventually(func() error {
			var cm corev1.ConfigMap
			if err := tenant.Get(ctx, client.ObjectKey{Namespace: ns, Name: testTrustName}, &cm); err != nil {
				return err
			}
			cm.Data["evil.pem"] = evilKey
			if err := tenant.Update(ctx, &cm); err == nil || !strings.Contains(err.Error(), "only the apportion manager writes it") {
				return fmt.Errorf("the policy is not in force yet: %w", err)
			}
			return nil
		}).WithTimeout(30 * time.Second).WithPolling(200 * time.Millisecond).Should(Succeed())
	})

	It("refuses every change a namespace editor tries", func() {
		Expect(tenant.Get(ctx, client.ObjectKey{Namespace: ns, Name: testTrustName}, &corev1.ConfigMap{})).To(Succeed(), "the editor can read it: public keys")

		cm := get(tenant)
		delete(cm.Labels, TrustLabel)
		refused(tenant.Update(ctx, cm))

		cm = get(tenant)
		cm.Data["evil.pem"] = evilKey
		refused(tenant.Update(ctx, cm))

		cm = get(tenant)
		for k := range cm.Data {
			cm.Data[k] = evilKey
		}
		refused(tenant.Update(ctx, cm))

		cm = get(tenant)
		cm.Immutable = ptr.To(true)
		refused(tenant.Update(ctx, cm))

		cm = get(tenant)
		refused(tenant.Patch(ctx, cm, client.RawPatch("application/merge-patch+json", []byte(`{"data":{"evil.pem":"x"}}`))))
		refused(tenant.Delete(ctx, cm))
		refused(tenant.DeleteAllOf(ctx, &corev1.ConfigMap{}, client.InNamespace(ns)))

		// Nothing changed.
		Expect(asPublished(ctx, ns)()).To(Succeed())
		// Its other ConfigMaps are its own.
		own := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "app-config"}, Data: map[string]string{"a": "b"}}
		Expect(tenant.Create(ctx, own)).To(Succeed())
		own.Data["a"] = "c"
		Expect(tenant.Update(ctx, own)).To(Succeed())
		Expect(tenant.Delete(ctx, own)).To(Succeed())
	})

	It("refuses an editor's ConfigMap of that name in a namespace where the manager has none yet", func() {
		other := newNamespace(ctx)
		bindEditor(ctx, other, "tenant-"+ns)
		refused(tenant.Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: other, Name: testTrustName},
			Data: map[string]string{"evil.pem": evilKey}}))
	})

	It("lets the manager's ServiceAccount write it", func() {
		cm := get(asManager)
		cm.Annotations["apportion.io/rbac-test"] = "manager"
		Expect(asManager.Update(ctx, cm)).To(Succeed())
		// What the manager does with an immutable one: delete, create.
		other := injectionNamespace(ctx)
		var theirs corev1.ConfigMap
		Expect(asManager.Get(ctx, client.ObjectKey{Namespace: other, Name: testTrustName}, &theirs)).To(Succeed())
		Expect(asManager.Delete(ctx, &theirs)).To(Succeed())
		Eventually(asPublished(ctx, other)).Should(Succeed())
	})

	It("lets a namespace being deleted be emptied", func() {
		doomed := injectionNamespace(ctx)
		bindEditor(ctx, doomed, "tenant-"+ns)
		trust := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: doomed, Name: testTrustName}}
		refused(tenant.Delete(ctx, trust))
		// envtest runs no namespace controller: the namespace stays Terminating, and the deletion
		// of its contents is what that controller would do (as whoever it runs as).
		Expect(k8sClient.Delete(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: doomed}})).To(Succeed())
		Eventually(func() error { return tenant.Delete(ctx, trust) }).Should(Succeed())
	})
})

// bindEditor gives user the rules of the built-in edit role in ns: system:aggregate-to-edit and
// system:aggregate-to-view, which kube-controller-manager aggregates into edit (envtest runs no
// such controller).
func bindEditor(ctx context.Context, ns, user string) {
	for _, role := range []string{"system:aggregate-to-edit", "system:aggregate-to-view"} {
		Expect(k8sClient.Create(ctx, &rbacv1.RoleBinding{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "tenant-" + strings.TrimPrefix(role, "system:")},
			RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: role},
			Subjects:   []rbacv1.Subject{{APIGroup: rbacv1.GroupName, Kind: "User", Name: user}},
		})).To(Succeed())
	}
}

// impersonate is a client of the suite's API server acting as user in groups.
func impersonate(user string, groups ...string) client.Client {
	imp := rest.CopyConfig(cfg)
	imp.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: groups}
	c, err := client.New(imp, client.Options{Scheme: scheme})
	Expect(err).NotTo(HaveOccurred())
	return c
}
