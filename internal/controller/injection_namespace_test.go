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
)

// trustEnsured records the namespaces the InjectionNamespaceReconciler provided trust material to.
var trustEnsured sync.Map

func init() {
	extraControllers = append(extraControllers, func(mgr ctrl.Manager) error {
		return (&InjectionNamespaceReconciler{
			Client: mgr.GetClient(),
			EnsureTrust: func(_ context.Context, ns string) error {
				trustEnsured.Store(ns, true)
				return nil
			},
		}).SetupWithManager(mgr)
	})
}

func ensured(ns string) func() bool {
	return func() bool { _, ok := trustEnsured.Load(ns); return ok }
}

var _ = Describe("Namespaces labelled for injection", func() {
	ctx := context.Background()

	It("get the trust material when created with the label, before any quota exists", func() {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "inj-" + rand.String(8),
			Labels: map[string]string{InjectionNamespaceLabel: InjectionNamespaceLabelValue}}}
		Expect(k8sClient.Create(ctx, ns)).To(Succeed())
		Eventually(ensured(ns.Name)).Should(BeTrue())
	})

	It("get it when the label is added later, and not before", func() {
		ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "inj-" + rand.String(8)}}
		Expect(k8sClient.Create(ctx, ns)).To(Succeed())
		other := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "inj-" + rand.String(8),
			Labels: map[string]string{InjectionNamespaceLabel: "disabled"}}}
		Expect(k8sClient.Create(ctx, other)).To(Succeed())
		// A labelled namespace created after both is a marker that the controller saw them.
		marker := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "inj-" + rand.String(8),
			Labels: map[string]string{InjectionNamespaceLabel: InjectionNamespaceLabelValue}}}
		Expect(k8sClient.Create(ctx, marker)).To(Succeed())
		Eventually(ensured(marker.Name)).Should(BeTrue())
		Expect(ensured(ns.Name)()).To(BeFalse(), "an unlabelled namespace")
		Expect(ensured(other.Name)()).To(BeFalse(), "a namespace labelled with another value")

		Eventually(func() error {
			if err := k8sClient.Get(ctx, client.ObjectKeyFromObject(ns), ns); err != nil {
				return err
			}
			ns.Labels = map[string]string{InjectionNamespaceLabel: InjectionNamespaceLabelValue}
			return k8sClient.Update(ctx, ns)
		}).Should(Succeed())
		Eventually(ensured(ns.Name)).Should(BeTrue())
	})
})
