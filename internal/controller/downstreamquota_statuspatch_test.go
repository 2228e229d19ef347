package controller

import (
	"context"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
)

var _ = Describe("DownstreamQuota status writes", func() {
	ctx := context.Background()
	makeQuota := func(ns string) *apportionv1.DownstreamQuota {
		dq := builders.MakeDownstreamQuota("q", ns).Limit(10).Target(apportionv1.KindDeployment, "absent").Obj()
		Expect(k8sClient.Create(ctx, dq)).To(Succeed())
		return dq
	}
	marked := func(mark string) apportionv1.DownstreamQuotaStatus {
		return apportionv1.DownstreamQuotaStatus{PerPod: mark}
	}
	inCache := func(key client.ObjectKey) func() (*apportionv1.DownstreamQuota, error) {
		return func() (*apportionv1.DownstreamQuota, error) {
			var dq apportionv1.DownstreamQuota
			err := managerClient.Get(ctx, key, &dq)
			return &dq, err
		}
	}

	It("drops the status of a deleted quota", func() {
		ns := newNamespace(ctx)
		dq := makeQuota(ns)
		key := client.ObjectKeyFromObject(dq)
		Expect(k8sClient.Delete(ctx, dq)).To(Succeed())
		Eventually(func() bool { _, err := inCache(key)(); return apierrors.IsNotFound(err) }).Should(BeTrue())

		s := &quotaStatusWriter{Reader: managerClient, Client: managerClient}
		Expect(s.write(ctx, key, quotaStatusUpdate{UID: dq.UID, Status: marked("gone")})).To(Equal(StatusDropped))
	})

	It("never writes a status onto a quota created again under the same name", func() {
		ns := newNamespace(ctx)
		old := makeQuota(ns)
		key := client.ObjectKeyFromObject(old)
		Eventually(inCache(key)).Should(HaveField("UID", old.UID))
		cachedOld, err := inCache(key)()
		Expect(err).NotTo(HaveOccurred())
		Expect(k8sClient.Delete(ctx, old)).To(Succeed())
		renewed := makeQuota(ns)
		Expect(renewed.UID).NotTo(Equal(old.UID))
		Eventually(inCache(key)).Should(HaveField("UID", renewed.UID))

		// The cache shows the new quota.
		s := &quotaStatusWriter{Reader: managerClient, Client: managerClient}
		Expect(s.write(ctx, key, quotaStatusUpdate{UID: old.UID, Status: marked("stale")})).To(Equal(StatusDropped))
		// The cache still shows the old one: the API server refuses the patch (its UID test).
		s = &quotaStatusWriter{Reader: staleQuota{Client: managerClient, key: key, dq: cachedOld}, Client: managerClient}
		Expect(s.write(ctx, key, quotaStatusUpdate{UID: old.UID, Status: marked("stale")})).To(Equal(StatusDropped))

		var now apportionv1.DownstreamQuota
		Expect(k8sClient.Get(ctx, key, &now)).To(Succeed())
		Expect(now.UID).To(Equal(renewed.UID))
		Expect(now.Status.PerPod).NotTo(Equal("stale"))
	})

	It("writes a status back to what a lagging cache still shows", func() {
		ns := newNamespace(ctx)
		dq := makeQuota(ns)
		key := client.ObjectKeyFromObject(dq)
		// The suite's reconciler writes the quota's status once; then nothing else writes it.
		Eventually(inCache(key)).Should(HaveField("Status.Conditions", Not(BeEmpty())))
		cached, err := inCache(key)()
		Expect(err).NotTo(HaveOccurred())
		before := cached.Status
		flipped := *before.DeepCopy()
		flipped.PerPod = "flipped"

		s := &quotaStatusWriter{Reader: staleQuota{Client: managerClient, key: key, dq: cached}, Client: managerClient}
		Expect(s.write(ctx, key, quotaStatusUpdate{UID: dq.UID, Status: flipped})).To(Equal(StatusWritten))
		Expect(getQuota(ctx, ns, "q")()).To(HaveField("Status.PerPod", "flipped"))
		// The cache still shows the status from before: the quota has "flipped" all the same.
		Expect(s.write(ctx, key, quotaStatusUpdate{UID: dq.UID, Status: before})).To(Equal(StatusWritten))
		Expect(getQuota(ctx, ns, "q")()).To(HaveField("Status.PerPod", before.PerPod))
		Expect(s.write(ctx, key, quotaStatusUpdate{UID: dq.UID, Status: before})).To(Equal(StatusUnchanged))
	})

	It("never writes an older status.global over the member's record of its grant", func() {
		ns := newNamespace(ctx)
		dq := builders.MakeDownstreamQuota("q", ns).Limit(10).Target(apportionv1.KindDeployment, "absent").Obj()
		dq.Spec.Global = &apportionv1.GlobalRef{Hub: "hub", Namespace: "partners", Name: "q", Cluster: "eu-1"}
		Expect(k8sClient.Create(ctx, dq)).To(Succeed())
		key := client.ObjectKeyFromObject(dq)
		Eventually(inCache(key)).Should(HaveField("Status.Conditions", Not(BeEmpty())))
		cached, err := inCache(key)()
		Expect(err).NotTo(HaveOccurred())

		// The member records grant 7 (as hubsync.Member does: a merge patch, optimistic lock).
		var live apportionv1.DownstreamQuota
		Expect(k8sClient.Get(ctx, key, &live)).To(Succeed())
		base := live.DeepCopy()
		live.Status.Global = &apportionv1.GlobalSliceStatus{Seq: 7, Slice: 6, ReservedSlice: 2}
		Expect(k8sClient.Status().Patch(ctx, &live, client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{}))).To(Succeed())

		// A writer whose cache still shows the quota from before the record: its write conflicts.
		flipped := *cached.Status.DeepCopy()
		flipped.PerPod = "flipped"
		s := &quotaStatusWriter{Reader: staleQuota{Client: managerClient, key: key, dq: cached}, Client: managerClient}
		_, err = s.write(ctx, key, quotaStatusUpdate{UID: dq.UID, Status: flipped})
		Expect(apierrors.IsConflict(err)).To(BeTrue(), "%v", err)
		Expect(getQuota(ctx, ns, "q")()).To(HaveField("Status.Global.Seq", int64(7)))

		// Once the cache shows the record, the write goes through and keeps it.
		Eventually(inCache(key)).Should(HaveField("Status.Global", Not(BeNil())))
		s = &quotaStatusWriter{Reader: managerClient, Client: managerClient}
		Eventually(func() error { _, err := s.write(ctx, key, quotaStatusUpdate{UID: dq.UID, Status: flipped}); return err }).Should(Succeed())
		Expect(getQuota(ctx, ns, "q")()).To(And(HaveField("Status.PerPod", "flipped"), HaveField("Status.Global.Seq", int64(7))))
	})
})
