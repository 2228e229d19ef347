package controller

import (
	"context"
	"sync"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/rand"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
)

const testTrustName = "apportion-trust"

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

func init() {
	extraControllers = append(extraControllers, func(mgr ctrl.Manager) error {
		return (&TrustReconciler{
			Client: mgr.GetClient(),
			Name:   testTrustName,
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

	It("never overwrites a ConfigMap of that name that the manager did not create", func() {
		ns := newNamespace(ctx)
		foreign := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: testTrustName}, Data: map[string]string{"mine": "x"}}
		Expect(k8sClient.Create(ctx, foreign)).To(Succeed())
		Expect(k8sClient.Create(ctx, builders.MakeDownstreamQuota("logistics", ns).Limit(50).Targets(apportionv1.Target{Kind: "Deployment", Name: "gateway", Weight: 1}).Obj())).To(Succeed())
		Consistently(getTrust(ctx, ns), "1s").Should(Equal(map[string]string{"mine": "x"}))
	})
})
