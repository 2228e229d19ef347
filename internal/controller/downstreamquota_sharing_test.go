package controller

import (
	"context"
	"fmt"
	"github.com/apportion/apportion/internal/testing/builders"
	"maps"
	"testing"
	"time"

	. "github.com/onsi/ginkgo/v2"
	. "github.com/onsi/gomega"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/apportion/demand"
	"github.com/apportion/apportion/internal/push"
)

func coreLaneSpec(name string, reserve int32) apportionv1.Lane {
	return apportionv1.Lane{Name: name, ReservedPercent: reserve,
		Match: apportionv1.LaneMatch{Methods: []apportionv1.HTTPMethod{"POST"}, PathPrefixes: []string{"/orders"}}}
}

var _ = Describe("DownstreamQuota lanes and sharing admission", func() {
	ctx := context.Background()
	var ns string
	BeforeEach(func() { ns = newNamespace(ctx) })
	valid := func() *apportionv1.DownstreamQuota {
		return builders.MakeDownstreamQuota("q", ns).Limit(50).Targets(apportionv1.Target{Kind: "Deployment", Name: "gateway"}).Obj()
	}

	It("accepts lanes and sharing and fills their defaults", func() {
		dq := valid()
		dq.Spec.Lanes = []apportionv1.Lane{coreLaneSpec("core", 40), coreLaneSpec("payments", 60)}
		dq.Spec.Sharing = &apportionv1.Sharing{Policy: apportionv1.SharingDemandAware}
		Expect(k8sClient.Create(ctx, dq)).To(Succeed())
		Expect(dq.Spec.Lanes[0].LendPercent).To(Equal(ptr.To[int32](50)))
		Expect(dq.Spec.Sharing.FloorPermits).To(Equal(ptr.To[int32](1)))
		Expect(dq.Spec.Sharing.EventThresholdPercent).To(BeEquivalentTo(10))
		Expect(lanesFor(dq)).To(HaveLen(2))
	})

	DescribeTable("rejects with the field path",
		func(mutate func(*apportionv1.DownstreamQuota), path, msg string) {
			dq := valid()
			mutate(dq)
			err := k8sClient.Create(ctx, dq)
			Expect(err).To(HaveOccurred())
			Expect(err.Error()).To(And(ContainSubstring(path), ContainSubstring(msg)))
		},
		Entry("reserves above 100", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Lanes = []apportionv1.Lane{coreLaneSpec("a", 60), coreLaneSpec("b", 41)}
		}, "spec.lanes", "sum to at most 100"),
		Entry("duplicate lane names", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Lanes = []apportionv1.Lane{coreLaneSpec("a", 10), coreLaneSpec("a", 10)}
		}, "spec.lanes[1]", "Duplicate value"),
		Entry("a lane called default", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Lanes = []apportionv1.Lane{coreLaneSpec("default", 10)}
		}, "spec.lanes[0].name", "lane of unmatched calls"),
		Entry("a lane that matches nothing", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Lanes = []apportionv1.Lane{{Name: "a", ReservedPercent: 10}}
		}, "spec.lanes[0].match", "must match on headers, methods or pathPrefixes"),
		Entry("a relative path prefix", func(d *apportionv1.DownstreamQuota) {
			l := coreLaneSpec("a", 10)
			l.Match.PathPrefixes = []string{"orders"}
			d.Spec.Lanes = []apportionv1.Lane{l}
		}, "spec.lanes[0].match.pathPrefixes[0]", ""),
		Entry("lend above 100", func(d *apportionv1.DownstreamQuota) {
			l := coreLaneSpec("a", 10)
			l.LendPercent = ptr.To[int32](101)
			d.Spec.Lanes = []apportionv1.Lane{l}
		}, "spec.lanes[0].lendPercent", ""),
		Entry("9 lanes", func(d *apportionv1.DownstreamQuota) {
			for i := range 9 {
				d.Spec.Lanes = append(d.Spec.Lanes, coreLaneSpec(fmt.Sprintf("l%d", i), 1))
			}
		}, "spec.lanes", "must have at most 8 items"),
		Entry("unknown policy", func(d *apportionv1.DownstreamQuota) {
			d.Spec.Sharing = &apportionv1.Sharing{Policy: "Proportional"}
		}, "spec.sharing.policy", ""),
	)
})

// shareRig builds the inputs of decideShares: one target with n running pods (names p00..),
// a report with each pod's in-flight and refused counts.
type shareRig struct {
	dq    *apportionv1.DownstreamQuota
	obs   []targetObservation
	mem   *sharingMemory
	now   time.Time
	inFl  map[string]int32
	refus map[string]int64
	// silent: pods the report does not hold yet (new: no push answered).
	silent map[string]bool
}

func newShareRig(limit, factor int32, pods int, lend bool) *shareRig {
	dq := builders.MakeDownstreamQuota("q", "ns").Limit(limit).Targets(apportionv1.Target{Kind: "Deployment", Name: "app", Weight: 1}).Obj()
	dq.Spec.SafetyFactorPercent = factor
	dq.Spec.Sharing = &apportionv1.Sharing{Policy: apportionv1.SharingDemandAware, LendHeadroom: lend}
	o := targetObservation{Target: dq.Spec.Targets[0], Found: true, SpecReplicas: int32(pods)}
	for i := range pods {
		o.Pods = append(o.Pods, corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("p%02d", i)}})
	}
	return &shareRig{dq: dq, obs: []targetObservation{o}, mem: newSharingMemory(),
		now: time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC), inFl: map[string]int32{}, refus: map[string]int64{}}
}

// round runs one decision, sampling every 2 s, and returns the shares by pod.
func (r *shareRig) round() (map[string]int32, shareResult) {
	split := splitFor(r.dq, r.obs, 0)
	d := desiredQuota(r.dq, r.obs, split, nil)
	rep := &push.Report{}
	for _, p := range d.Pods {
		if r.silent[p.Name] {
			continue
		}
		rep.Holdings = append(rep.Holdings, push.Holding{Pod: p.Name, InFlight: r.inFl[p.Name], RefusedNoPermit: r.refus[p.Name]})
	}
	res := decideShares(r.dq, r.obs, split, rep, &d, r.mem, sharingParams{Tau: 6 * time.Second, Damping: demand.DefaultDamping}, r.now)
	r.now = r.now.Add(2 * time.Second)
	out := map[string]int32{}
	var sum int32
	for _, p := range d.Pods {
		out[p.Name] = p.Permits
		sum += p.Permits
	}
	if int64(sum) > res.Budget || res.Budget > int64(r.dq.Spec.MaxInFlight) {
		panic(fmt.Sprintf("Σ shares %d > budget %d (limit %d)", sum, res.Budget, r.dq.Spec.MaxInFlight))
	}
	return out, res
}

// 32 pods and a budget of 40: Equal leaves 8 permits unused; demand-aware sharing gives them to
// the 8 pods that keep refusing calls, and the rest keep their floor of 1.
func TestDecideSharesOddBudget(t *testing.T) {
	r := newShareRig(50, 80, 32, false)
	for i := range 8 {
		r.inFl[fmt.Sprintf("p%02d", i)] = 1
	}
	var shares map[string]int32
	for range 30 {
		for i := range 8 {
			r.refus[fmt.Sprintf("p%02d", i)] += 3 // refused calls every round
		}
		shares, _ = r.round()
	}
	for i := range 32 {
		want := int32(1)
		if i < 8 {
			want = 2
		}
		if got := shares[fmt.Sprintf("p%02d", i)]; got != want {
			t.Fatalf("pod %d: share %d, want %d (%v)", i, got, want, shares)
		}
	}
}

// 16 pods and a budget of 40: the Equal split gives 8 pods 3 and 8 pods 2. Turning DemandAware on
// with every pod asking alike keeps exactly that split (the same ranks break the tie), so the
// switch moves nothing; a pending scale-out keeps the floor of the missing pods free, whatever
// the uneven shares the pods held.
func TestDecideSharesUnevenEqualShares(t *testing.T) {
	r := newShareRig(50, 80, 16, false)
	d := desiredQuota(r.dq, r.obs, splitFor(r.dq, r.obs, 0), nil)
	equal := map[string]int32{}
	var sum int32
	for _, p := range d.Pods {
		equal[p.Name] = p.Permits
		sum += p.Permits
	}
	if sum != 40 {
		t.Fatalf("Equal: Σ %d, want 40: %v", sum, equal)
	}
	for range 10 {
		shares, res := r.round()
		if res.Moved != 0 || !maps.Equal(shares, equal) {
			t.Fatalf("equal demand moved %d: %v, Equal %v", res.Moved, shares, equal)
		}
	}
	r.obs[0].SpecReplicas = 18 // 2 pods decided, not there yet: 2 × ⌊40/18⌋ = 4 kept free
	shares, res := r.round()
	sum = 0
	for _, v := range shares {
		sum += v
	}
	if res.Budget != 36 || sum > 36 {
		t.Fatalf("pending scale-out: budget %d, Σ %d (%v)", res.Budget, sum, shares)
	}
}

// Skew: 2 of 8 pods busy. Shares follow, settle, and do not flap while demand is steady; when
// the skew ends they return towards Equal.
func TestDecideSharesSkewSettlesAndReturns(t *testing.T) {
	r := newShareRig(50, 80, 8, false) // budget 40, Equal 5 each
	busy := func(on bool) {
		for i := range 8 {
			n := fmt.Sprintf("p%02d", i)
			r.inFl[n] = 1
			if on && i < 2 {
				r.inFl[n] = 12
				r.refus[n] += 10
			}
		}
	}
	busy(true)
	var shares map[string]int32
	var moves int
	for range 60 {
		var res shareResult
		shares, res = r.round()
		if res.Moved > 0 {
			moves++
		}
	}
	if shares["p00"] < 12 || shares["p07"] < 1 || shares["p00"] != shares["p01"] {
		t.Fatalf("skewed shares %v", shares)
	}
	// Steady: another minute moves nothing.
	for range 30 {
		if _, res := r.round(); res.Moved > 0 {
			t.Fatalf("shares moved under steady demand: %v", res.Status.Pods)
		}
	}
	busy(false)
	for range 90 {
		shares, _ = r.round()
	}
	for i := range 8 {
		if got := shares[fmt.Sprintf("p%02d", i)]; got < 4 || got > 6 {
			t.Fatalf("after the skew ended: %v", shares)
		}
	}
}

// With lendHeadroom the headroom goes to busy pods while nothing is pending, and a pending
// scale-out takes it back at once (a forced round).
func TestDecideSharesLendHeadroom(t *testing.T) {
	r := newShareRig(50, 80, 4, true)
	r.inFl["p00"] = 40
	var res shareResult
	for range 40 {
		r.refus["p00"] += 10
		_, res = r.round()
	}
	if res.Budget != 50 || res.Status.LentHeadroom != 10 {
		t.Fatalf("budget %d lent %d, want 50 and 10", res.Budget, res.Status.LentHeadroom)
	}
	r.obs[0].SpecReplicas = 5 // scale-out decided, the pod does not exist yet
	shares, res := r.round()
	var sum int32
	for _, s := range shares {
		sum += s
	}
	if res.Status.LentHeadroom != 0 || res.Budget != 32 || sum > 32 {
		t.Fatalf("after scale-out: budget %d lent %d Σ %d (%v)", res.Budget, res.Status.LentHeadroom, sum, shares)
	}
}

// Turning DemandAware on starts from the Equal shares the pods hold: the first round is damped
// (at most MaxMove permits move), not a jump to the target.
func TestDecideSharesSwitchIsDamped(t *testing.T) {
	r := newShareRig(50, 80, 8, false) // Equal 5 each; MaxMove max(2, 40/4) = 10
	r.inFl["p00"], r.inFl["p01"] = 20, 20
	shares, res := r.round()
	var moved int32
	for _, v := range shares {
		if v > 5 {
			moved += v - 5
		}
	}
	if res.Moved != int64(moved) || moved == 0 || moved > 10 {
		t.Fatalf("first round moved %d (reported %d), want 1..10 from Equal: %v", moved, res.Moved, shares)
	}
}

// A scale-out of a healthy downstream: 8 pods each busy alike, then 4 new pods. The new pods,
// not heard from yet, are presumed to ask what the average pod asks, so the round that adds them
// (forced: they are below their floor) gives them an Equal-like share at once instead of the
// floor (issue 29: no waiting ~10 s for the next damped round). The bound holds throughout
// (round panics above the budget).
func TestDecideSharesNewPodGetsAShareAtOnce(t *testing.T) {
	r := newShareRig(50, 80, 8, false) // budget 40, Equal 5 each
	for i := range 8 {
		r.inFl[fmt.Sprintf("p%02d", i)] = 4
	}
	for range 10 {
		r.round()
	}
	r.obs[0].SpecReplicas = 12
	r.silent = map[string]bool{}
	for i := 8; i < 12; i++ {
		n := fmt.Sprintf("p%02d", i)
		r.obs[0].Pods = append(r.obs[0].Pods, corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: n}})
		r.silent[n] = true
	}
	shares, _ := r.round()
	for i := 8; i < 12; i++ {
		if got := shares[fmt.Sprintf("p%02d", i)]; got < 3 {
			t.Fatalf("new pod p%02d got %d permits in the round that added it, want ≥ 3 of 40/12: %v", i, got, shares)
		}
	}
	// Heard from, as busy as the others: the split stays near Equal (3 or 4 each).
	r.silent = nil
	for i := 8; i < 12; i++ {
		r.inFl[fmt.Sprintf("p%02d", i)] = 3
	}
	for range 30 {
		shares, _ = r.round()
	}
	for n, v := range shares {
		if v < 2 || v > 5 {
			t.Fatalf("pod %s: %d permits after the new pods answered (%v)", n, v, shares)
		}
	}
}

func TestSharesMovedMessage(t *testing.T) {
	dq := builders.MakeDownstreamQuota("q", "ns").Limit(50).Targets(apportionv1.Target{Kind: "Deployment", Name: "app"}).Obj()
	dq.Spec.Sharing = &apportionv1.Sharing{Policy: apportionv1.SharingDemandAware}
	if msg := sharesMovedMessage(dq, shareResult{Moved: 4, Budget: 40}); msg != "" {
		t.Errorf("4 of 40 (10 %%, not more) gave %q", msg)
	}
	if msg := sharesMovedMessage(dq, shareResult{Moved: 5, Budget: 40}); msg != "5 of 40 permits moved to follow demand (more than 10%)" {
		t.Errorf("5 of 40 gave %q", msg)
	}
}
