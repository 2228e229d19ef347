package controller

import (
	"context"
	"encoding/json"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/controller-runtime/pkg/client"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/testing/builders"
)

// The API of one quota across clusters (docs/protocol.md §16): what the API server itself
// refuses, defaults and prints for GlobalQuota and ClusterSlice on a hub and for a member's
// DownstreamQuota.spec.global.

func globalQuota(ns, name string, limit int32, members ...apportionv1.GlobalMember) *apportionv1.GlobalQuota {
	return &apportionv1.GlobalQuota{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec:       apportionv1.GlobalQuotaSpec{MaxInFlight: limit, Members: members},
	}
}

func clusterSlice(ns, quota, cluster string, seq int64, slice, reserved int32) *apportionv1.ClusterSlice {
	return &apportionv1.ClusterSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: quota + "-" + cluster},
		Spec: apportionv1.ClusterSliceSpec{
			GlobalQuota: quota, Cluster: cluster, Seq: seq, Slice: slice, ReservedSlice: reserved,
			LeaseDuration: metav1.Duration{Duration: 30 * time.Second},
		},
	}
}

// table reads a list as kubectl does (the API server's Table, its printer columns) and returns
// every row's cells by column name; wide asks for the columns of priority 1 too.
func table(ctx context.Context, ns, resource string, wide bool) []map[string]any {
	GinkgoHelper()
	cs, err := kubernetes.NewForConfig(cfg)
	Expect(err).NotTo(HaveOccurred())
	body, err := cs.CoreV1().RESTClient().Get().AbsPath("/apis/apportion.io/v1alpha1/namespaces", ns, resource).
		SetHeader("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io").DoRaw(ctx)
	Expect(err).NotTo(HaveOccurred(), string(body))
	var t metav1.Table
	Expect(json.Unmarshal(body, &t)).To(Succeed())
	var rows []map[string]any
	for _, r := range t.Rows {
		row := map[string]any{}
		for i, c := range t.ColumnDefinitions {
			if c.Priority == 0 || wide {
				row[c.Name] = r.Cells[i]
			}
		}
		rows = append(rows, row)
	}
	return rows
}

var _ = Describe("The API of one quota across clusters", func() {
	var ns string
	BeforeEach(func(ctx SpecContext) { ns = newNamespace(ctx) })

	Context("GlobalQuota", func() {
		It("defaults the lease and the reserved slices, and prints the limit and what is granted", func(ctx SpecContext) {
			gq := globalQuota(ns, "partner", 100, apportionv1.GlobalMember{Name: "eu-1", ReservedSlice: 10}, apportionv1.GlobalMember{Name: "us-1"})
			Expect(k8sClient.Create(ctx, gq)).To(Succeed())
			Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(gq), gq)).To(Succeed())
			Expect(gq.Spec.Lease.Duration.Duration).To(Equal(30 * time.Second))
			Expect(gq.Spec.Lease.ClockMargin.Duration).To(Equal(5 * time.Second))
			Expect(gq.Spec.Members[1].ReservedSlice).To(BeZero())

			gq.Status.Granted = 90
			gq.Status.Allocation = []apportionv1.SliceAllocation{{Cluster: "eu-1", Seq: 3, Slice: 60, ReservedSlice: 10, Former: 70}, {Cluster: "us-1", Seq: 2, Slice: 30}}
			Expect(k8sClient.Status().Update(ctx, gq)).To(Succeed())
			rows := table(ctx, ns, "globalquotas", false)
			Expect(rows).To(HaveLen(1))
			Expect(rows[0]).To(HaveKeyWithValue("GLOBAL", BeNumerically("==", 100)))
			Expect(rows[0]).To(HaveKeyWithValue("GRANTED", BeNumerically("==", 90)))
		})

		DescribeTable("refuses", func(ctx SpecContext, mutate func(*apportionv1.GlobalQuota), message string) {
			gq := globalQuota(ns, "partner", 10, apportionv1.GlobalMember{Name: "a", ReservedSlice: 4}, apportionv1.GlobalMember{Name: "b", ReservedSlice: 6})
			mutate(gq)
			err := k8sClient.Create(ctx, gq)
			Expect(err).To(HaveOccurred())
			Expect(err.Error()).To(ContainSubstring(message))
		},
			Entry("reserved slices above the limit", func(gq *apportionv1.GlobalQuota) { gq.Spec.Members[1].ReservedSlice = 7 }, "the members' reservedSlice sum to at most maxInFlight"),
			Entry("a member named twice", func(gq *apportionv1.GlobalQuota) { gq.Spec.Members[1].Name = "a" }, "Duplicate value"),
			Entry("a member name that is not a DNS label", func(gq *apportionv1.GlobalQuota) { gq.Spec.Members[0].Name = "EU_1" }, "spec.members[0].name"),
			Entry("no member", func(gq *apportionv1.GlobalQuota) { gq.Spec.Members = nil }, "spec.members"),
			Entry("a lease under 1s", func(gq *apportionv1.GlobalQuota) {
				gq.Spec.Lease.Duration = &metav1.Duration{Duration: 500 * time.Millisecond}
			}, "duration must be between 1s and 10m"),
			Entry("a negative clock margin", func(gq *apportionv1.GlobalQuota) {
				gq.Spec.Lease.ClockMargin = &metav1.Duration{Duration: -time.Second}
			}, "clockMargin must be between 0s and 10m"),
		)

		It("lets the lease grow and never shorten", func(ctx SpecContext) {
			gq := globalQuota(ns, "partner", 10, apportionv1.GlobalMember{Name: "a"})
			Expect(k8sClient.Create(ctx, gq)).To(Succeed())
			gq.Spec.Lease.Duration = &metav1.Duration{Duration: time.Minute}
			Expect(k8sClient.Update(ctx, gq)).To(Succeed())
			gq.Spec.Lease.Duration = &metav1.Duration{Duration: 59 * time.Second}
			err := k8sClient.Update(ctx, gq)
			Expect(err).To(HaveOccurred())
			Expect(err.Error()).To(ContainSubstring("lease.duration never shortens"))
		})

		It("accepts reserved slices that sum to exactly the limit, and refuses raising one above it", func(ctx SpecContext) {
			gq := globalQuota(ns, "partner", 10, apportionv1.GlobalMember{Name: "a", ReservedSlice: 4}, apportionv1.GlobalMember{Name: "b", ReservedSlice: 6})
			Expect(k8sClient.Create(ctx, gq)).To(Succeed())
			gq.Spec.Members[0].ReservedSlice = 5
			err := k8sClient.Update(ctx, gq)
			Expect(err).To(HaveOccurred())
			Expect(err.Error()).To(ContainSubstring("the members' reservedSlice sum to at most maxInFlight"))
		})
	})

	Context("ClusterSlice", func() {
		It("prints each cluster's slice, demand and lease, and takes grants that only go forward", func(ctx SpecContext) {
			cs := clusterSlice(ns, "partner", "eu-1", 1, 40, 10)
			Expect(k8sClient.Create(ctx, cs)).To(Succeed())
			cs.Status.Demand = 55
			cs.Status.AcknowledgedSeq = 1
			cs.Status.Drain = &metav1.Duration{Duration: 45 * time.Second}
			Expect(k8sClient.Status().Update(ctx, cs)).To(Succeed())
			rows := table(ctx, ns, "clusterslices", false)
			Expect(rows).To(HaveLen(1))
			Expect(rows[0]).To(And(
				HaveKeyWithValue("QUOTA", "partner"), HaveKeyWithValue("CLUSTER", "eu-1"),
				HaveKeyWithValue("SLICE", BeNumerically("==", 40)), HaveKeyWithValue("RESERVED", BeNumerically("==", 10)),
				HaveKeyWithValue("DEMAND", BeNumerically("==", 55)), HaveKeyWithValue("LEASE", "30s"),
				HaveKeyWithValue("ACKED", BeNumerically("==", 1)), Not(HaveKey("SEQ")),
			))
			Expect(table(ctx, ns, "clusterslices", true)[0]).To(HaveKeyWithValue("SEQ", BeNumerically("==", 1)))

			cs.Spec.Seq, cs.Spec.Slice = 2, 50
			Expect(k8sClient.Update(ctx, cs)).To(Succeed())
		})

		DescribeTable("refuses", func(ctx SpecContext, update func(*apportionv1.ClusterSlice) error, message string) {
			cs := clusterSlice(ns, "partner", "eu-1", 3, 40, 10)
			Expect(k8sClient.Create(ctx, cs)).To(Succeed())
			cs.Status.AcknowledgedSeq = 2
			Expect(k8sClient.Status().Update(ctx, cs)).To(Succeed())
			err := update(cs)
			Expect(err).To(HaveOccurred())
			Expect(err.Error()).To(ContainSubstring(message))
		},
			Entry("a lower seq", func(cs *apportionv1.ClusterSlice) error {
				cs.Spec.Seq = 2
				return k8sClient.Update(context.Background(), cs)
			}, "seq never goes back"),
			Entry("another grant under the same seq", func(cs *apportionv1.ClusterSlice) error {
				cs.Spec.Slice = 41
				return k8sClient.Update(context.Background(), cs)
			}, "one seq is one grant"),
			Entry("a reserved slice above the slice", func(cs *apportionv1.ClusterSlice) error {
				cs.Spec.Seq, cs.Spec.ReservedSlice = 4, 41
				return k8sClient.Update(context.Background(), cs)
			}, "reservedSlice is at most slice"),
			Entry("another cluster", func(cs *apportionv1.ClusterSlice) error {
				cs.Spec.Cluster = "us-1"
				return k8sClient.Update(context.Background(), cs)
			}, "globalQuota and cluster are immutable"),
			Entry("an acknowledgement of a grant not given", func(cs *apportionv1.ClusterSlice) error {
				cs.Status.AcknowledgedSeq = 4
				return k8sClient.Status().Update(context.Background(), cs)
			}, "a member acknowledges only a grant it was given"),
			Entry("an acknowledgement going back", func(cs *apportionv1.ClusterSlice) error {
				cs.Status.AcknowledgedSeq = 1
				return k8sClient.Status().Update(context.Background(), cs)
			}, "acknowledgedSeq never goes back"),
			Entry("a drain of 0s", func(cs *apportionv1.ClusterSlice) error {
				cs.Status.Drain = &metav1.Duration{}
				return k8sClient.Status().Update(context.Background(), cs)
			}, "drain must be above 0s and at most 1h"),
		)
	})

	Context("a member's DownstreamQuota", func() {
		ref := apportionv1.GlobalRef{Hub: "hub-kubeconfig", Namespace: "partners", Name: "partner", Cluster: "eu-1"}
		member := func(ns string) *apportionv1.DownstreamQuota {
			dq := builders.MakeDownstreamQuota("partner", ns).Limit(100).Target(apportionv1.KindDeployment, "app").Obj()
			dq.Spec.Global = ref.DeepCopy()
			return dq
		}

		It("names the global quota at creation and prints the slice it holds with -o wide", func(ctx SpecContext) {
			dq := member(ns)
			Expect(k8sClient.Create(ctx, dq)).To(Succeed())
			until := metav1.NewTime(time.Now().Add(30 * time.Second).Truncate(time.Second))
			Eventually(func(g Gomega) {
				g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(dq), dq)).To(Succeed())
				dq.Status.Global = &apportionv1.GlobalSliceStatus{Seq: 4, Slice: 37, ReservedSlice: 5, LeaseUntil: &until}
				apportionv1.SetCondition(&dq.Status.Conditions, apportionv1.ConditionSliceLeased, true, apportionv1.ReasonLeaseHeld, "slice 37", dq.Generation, metav1.Now())
				g.Expect(k8sClient.Status().Update(ctx, dq)).To(Succeed())
			}).Should(Succeed())
			Expect(table(ctx, ns, "downstreamquotas", false)[0]).NotTo(HaveKey("SLICE"))
			Expect(table(ctx, ns, "downstreamquotas", true)[0]).To(And(
				HaveKeyWithValue("SLICE", BeNumerically("==", 37)), HaveKeyWithValue("LEASE-UNTIL", until.UTC().Format(time.RFC3339)),
				HaveKeyWithValue("LEASED", "True"),
			))
			// The manager's status writes keep the member's condition as the member wrote it.
			Consistently(func(g Gomega) {
				g.Expect(k8sClient.Get(ctx, client.ObjectKeyFromObject(dq), dq)).To(Succeed())
				c := meta.FindStatusCondition(dq.Status.Conditions, apportionv1.ConditionSliceLeased)
				g.Expect(c).NotTo(BeNil())
				g.Expect(c.Message).To(Equal("slice 37"))
			}, 2*time.Second).Should(Succeed())
		})

		DescribeTable("refuses", func(ctx SpecContext, create bool, change func(*apportionv1.DownstreamQuota)) {
			dq := member(ns)
			if !create {
				dq.Spec.Global = nil
			}
			Expect(k8sClient.Create(ctx, dq)).To(Succeed())
			err := retryOnConflict(ctx, dq, change)
			Expect(err).To(HaveOccurred())
			Expect(err.Error()).To(ContainSubstring("global is set at creation and never changed"))
		},
			Entry("adding global later", false, func(dq *apportionv1.DownstreamQuota) { dq.Spec.Global = ref.DeepCopy() }),
			Entry("removing it", true, func(dq *apportionv1.DownstreamQuota) { dq.Spec.Global = nil }),
			Entry("pointing it at another quota", true, func(dq *apportionv1.DownstreamQuota) { dq.Spec.Global.Name = "other" }),
		)

		It("refuses a cluster name that is not a DNS label", func(ctx SpecContext) {
			dq := member(ns)
			dq.Spec.Global.Cluster = "EU 1"
			err := k8sClient.Create(ctx, dq)
			Expect(err).To(HaveOccurred())
			Expect(err.Error()).To(ContainSubstring("spec.global.cluster"))
		})
	})
})

// retryOnConflict applies change to the latest dq and updates it, again on a conflict (the
// suite's controller writes the quota's status meanwhile); it returns the first other outcome.
func retryOnConflict(ctx context.Context, dq *apportionv1.DownstreamQuota, change func(*apportionv1.DownstreamQuota)) error {
	for {
		if err := k8sClient.Get(ctx, client.ObjectKeyFromObject(dq), dq); err != nil {
			return err
		}
		change(dq)
		err := k8sClient.Update(ctx, dq)
		if err == nil || !apierrors.IsConflict(err) {
			return err
		}
	}
}
