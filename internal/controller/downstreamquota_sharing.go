package controller

import (
	"cmp"
	"fmt"
	"k8s.io/utils/ptr"
	"slices"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/apportion"
	"github.com/apportion/apportion/internal/apportion/demand"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/push"
)

// This file holds demand-aware sharing and priority lanes as the DownstreamQuota reconciler
// sees them: the lanes' wire form, the per-pod shares under DemandAware (decideShares, pure over
// what the reconciler gathered and the memory it keeps per quota), and the lanes' status.
//
// Safety does not rest here. The shares decided are the pods' desired permits, handed to the
// push engine like Equal's; the engine moves them with the lower-before-raise protocol against
// its ledger (docs/protocol.md), so whatever this file decides, Σ of what live pods may use stays
// within maxInFlight. What rests here is that Σ shares ≤ the shareable budget, so that the
// engine can converge.

// Sharing defaults (the Reconciler's zero values).
const (
	// DefaultSharingPeriod is how often a DemandAware quota is re-evaluated (its demand sampled).
	// Agents report their state with every renewal (push.DefaultRenewEvery, 3 s).
	DefaultSharingPeriod = 2 * time.Second
	// DefaultDemandTau is the smoothing time constant of a pod's demand: a step in demand is 63 %
	// reflected after it, 95 % after three.
	DefaultDemandTau = 6 * time.Second
	// lanesStatusPeriod is how often a quota with lanes but Equal sharing refreshes lane status.
	lanesStatusPeriod = 10 * time.Second
	// DefaultRemainderRotation is how often the permits rounding leaves over (the remainder of
	// the split, package apportion) move to other pods. Slow, because each move is a push to
	// every pod that loses or gains one, and a raise may wait for a lowering to be acknowledged;
	// fast enough that no pod holds one more for long: at 16 pods and 40 permits, 8 pods hold 3
	// and 8 hold 2, each pod 3 for half of the periods on average, drawn anew every 5 minutes.
	DefaultRemainderRotation = 5 * time.Minute
)

// remainderRotation is a quota's rotation counter at a reconcile (apportion.Rotation).
type remainderRotation struct {
	Counter uint64
	// Now is when it was read; Next when the counter advances (zero: never).
	Now, Next time.Time
}

// rotationAt is the quota's remainder rotation counter at now, the counter advancing every
// period (negative: never). It follows the wall clock, with a phase of the quota's own (its UID):
// a manager that takes over computes the same counter and so the same split, a reconcile within
// one period changes nothing, and the quotas of a manager do not all rotate — and push — at once.
// A counter per quota generation would leave a quota nobody edits favouring the same pods
// forever; one per reconcile would push on every reconcile.
func rotationAt(dq *apportionv1.DownstreamQuota, now time.Time, period time.Duration) remainderRotation {
	rot := remainderRotation{Now: now}
	rot.Counter, rot.Next = apportion.Rotation(now, period, string(dq.UID))
	return rot
}

// lanesFor is the quota's lanes on the wire (nil without lanes).
func lanesFor(dq *apportionv1.DownstreamQuota) []assignment.Lane {
	var out []assignment.Lane
	for _, l := range dq.Spec.Lanes {
		w := assignment.Lane{
			Name: l.Name, ReservePercent: l.ReservedPercent, LendPercent: ptr.Deref(l.LendPercent, apportionv1.DefaultLaneLendPercent),
			PathPrefixes: slices.Clone(l.Match.PathPrefixes),
		}
		for _, h := range l.Match.Headers {
			w.Headers = append(w.Headers, assignment.HeaderMatch{Name: h.Name, Value: h.Value})
		}
		for _, m := range l.Match.Methods {
			w.Methods = append(w.Methods, string(m))
		}
		out = append(out, w)
	}
	return out
}

// demandAware reports whether the quota shares by demand.
func demandAware(dq *apportionv1.DownstreamQuota) bool {
	return dq.Spec.Sharing != nil && dq.Spec.Sharing.Policy == apportionv1.SharingDemandAware
}

// sharingMemory is what demand-aware sharing remembers of one quota between rounds.
type sharingMemory struct {
	mu       sync.Mutex
	demand   map[string]float64 // pod → smoothed demand, in permits
	level    map[string]int64   // pod → the demand in whole permits (demand.Quantize)
	refused  map[string]int64   // pod → the agent's no-permit counter at the last sample
	shares   map[string]int64   // pod → share decided
	sampled  time.Time          // last sample
	lastMove time.Time          // last damped round
	moved    metav1.Time        // last round that moved anything, for status
}

func newSharingMemory() *sharingMemory {
	return &sharingMemory{demand: map[string]float64{}, level: map[string]int64{}, refused: map[string]int64{}, shares: map[string]int64{}}
}

// memoryFor is the sharing memory of quota key, created on first use.
func (r *DownstreamQuotaReconciler) memoryFor(key types.NamespacedName) *sharingMemory {
	m, _ := r.sharing.LoadOrStore(key, newSharingMemory())
	return m.(*sharingMemory)
}

func (r *DownstreamQuotaReconciler) sharingParams() sharingParams {
	p := sharingParams{Tau: r.DemandTau, Damping: r.Damping}
	if p.Tau == 0 {
		p.Tau = DefaultDemandTau
	}
	if p.Damping == nil {
		p.Damping = demand.DefaultDamping
	}
	return p
}

// requeueFor is when a quota is reconciled again without any change: DemandAware quotas every
// sharing period (their demand is sampled then), quotas with lanes to refresh the lanes' status,
// and a split with a remainder when its rotation counter advances, whichever comes first.
func requeueFor(dq *apportionv1.DownstreamQuota, p quotaPolicy, split apportion.Result, rot remainderRotation) time.Duration {
	d := periodicRequeue(dq, p)
	for _, e := range split.Extra {
		if e > 0 && !rot.Next.IsZero() {
			if untilNext := rot.Next.Sub(rot.Now); d == 0 || untilNext < d {
				d = max(untilNext, time.Millisecond)
			}
			break
		}
	}
	return d
}

// periodicRequeue is the periodic requeue of a quota with an engine (requeueFor): DemandAware
// quotas are re-evaluated every SharingPeriod, quotas with lanes refresh their lanes' status every
// lanesStatusPeriod, and every other one its usage every usageStatusPeriod. Without an engine
// there is neither demand to sample nor anything reported.
func periodicRequeue(dq *apportionv1.DownstreamQuota, p quotaPolicy) time.Duration {
	switch {
	case !p.Push:
		return 0
	case demandAware(dq):
		return p.SharingPeriod
	case len(dq.Spec.Lanes) > 0:
		return lanesStatusPeriod
	}
	return usageStatusPeriod
}

// sharingParams are the reconciler's tunables.
type sharingParams struct {
	Tau     time.Duration
	Damping func(budget int64) demand.Damping
}

// shareResult is what one round decided.
type shareResult struct {
	// Status for the quota.
	Status *apportionv1.SharingStatus
	// Moved is the permits that changed hands this round (Σ raises).
	Moved int64
	// Budget shared this round.
	Budget int64
}

// decideShares sets the Permits of d's live pods by demand (package demand): the budget, less
// the Equal floor of every pod the targets expect but that does not exist yet (a pending
// scale-out), plus, with lendHeadroom and nothing pending, the scale-out headroom; each pod's
// demand sampled from the report (in flight + waiting + refused for lack of a permit since the
// last sample) and smoothed; the damped step towards the target split, whose units left by
// rounding go, within a group of pods that ask alike, to the pods ranked first at the split's
// rotation counter (the Equal split's ranks: equal demand gives the Equal split). Terminating
// pods keep the Equal share in d (the engine grants them 0 anyway) and are forgotten. The Equal
// shares in d may differ by one between pods (the remainder); nothing here assumes they are
// equal, and the budget is the same whatever they are.
func decideShares(dq *apportionv1.DownstreamQuota, obs []targetObservation, split apportion.Result, report *push.Report,
	d *push.DesiredQuota, mem *sharingMemory, p sharingParams, now time.Time) shareResult {
	mem.mu.Lock()
	defer mem.mu.Unlock()
	sh := dq.Spec.Sharing
	floor := int64(ptr.Deref(sh.FloorPermits, apportionv1.DefaultSharingFloorPermits))

	budget := split.Budget
	var pending int64
	for i, o := range obs {
		if n := o.replicas() - int64(len(o.Pods)); n > 0 {
			pending += n
			budget -= n * split.PerPod[i]
		}
	}
	res := shareResult{Status: &apportionv1.SharingStatus{Policy: apportionv1.SharingDemandAware}}
	if sh.LendHeadroom && pending == 0 {
		lent := int64(dq.Spec.MaxInFlight) - split.Budget
		budget += lent
		res.Status.LentHeadroom = int32(max(lent, 0))
	}
	budget = max(budget, 0)
	res.Budget = budget

	holdings := map[string]push.Holding{}
	if report != nil {
		for _, h := range report.Holdings {
			holdings[h.Pod] = h
		}
	}
	dt := now.Sub(mem.sampled)
	if mem.sampled.IsZero() {
		dt = 0
	}
	var live []int
	var unheard []string // pods with no demand remembered and no answer yet
	seen := map[string]bool{}
	for i, pod := range d.Pods {
		if pod.Terminating {
			continue
		}
		live = append(live, i)
		seen[pod.Name] = true
		h, known := holdings[pod.Name]
		delta := h.RefusedNoPermit - mem.refused[pod.Name]
		if _, ok := mem.refused[pod.Name]; !ok || delta < 0 {
			delta = 0 // first sample, or the agent restarted (its counter started again)
		}
		mem.refused[pod.Name] = h.RefusedNoPermit
		sample := demand.Sample(int64(h.InFlight), int64(h.Waiting), delta, mem.shares[pod.Name])
		if prev, ok := mem.demand[pod.Name]; ok && known {
			mem.demand[pod.Name] = demand.Smooth(prev, sample, dt, p.Tau)
		} else if known {
			mem.demand[pod.Name] = sample
		} else if ok {
			mem.demand[pod.Name] = 0
		} else {
			unheard = append(unheard, pod.Name)
		}
	}
	// A pod not heard from yet (new) is presumed to ask what the average pod asks, not nothing:
	// at 0 it would get only the floor and wait for the next damped round (about 10 s) to get a
	// share, refusing calls meanwhile on a healthy downstream (issue 29: a new pod of a healthy
	// downstream gets its permits at once). Its round is forced anyway (below its floor), so it
	// gets its target share at once; its first answer then replaces the guess.
	var sum float64
	var heard int
	for _, i := range live {
		if v, ok := mem.demand[d.Pods[i].Name]; ok { // the unheard are not in mem.demand yet
			sum += v
			heard++
		}
	}
	for _, name := range unheard {
		mem.demand[name] = 0
		if heard > 0 {
			mem.demand[name] = sum / float64(heard)
		}
	}
	for name := range mem.demand {
		if !seen[name] {
			delete(mem.demand, name)
			delete(mem.level, name)
			delete(mem.refused, name)
			delete(mem.shares, name)
		}
	}
	mem.sampled = now

	// The current split: what was decided last round; on the first round after the quota turned
	// DemandAware, the Equal shares the pods hold, so that the switch itself is damped. A pod
	// new since the last round starts from 0 (below its floor: the round is forced).
	fresh := len(mem.shares) == 0
	dem := make([]int64, len(live))
	cur := make([]int64, len(live))
	rank := make([]uint64, len(live))
	for j, i := range live {
		name := d.Pods[i].Name
		prev, ok := mem.level[name]
		if !ok {
			prev = -1
		}
		mem.level[name] = demand.Quantize(prev, mem.demand[name], demand.DemandBand)
		dem[j] = mem.level[name]
		rank[j] = apportion.Rank(podIdentity(d.Pods[i].UID, name), split.Rotation)
		cur[j] = mem.shares[d.Pods[i].Name]
		if fresh {
			cur[j] = int64(d.Pods[i].Permits)
		}
	}
	target := demand.Target(budget, floor, dem, rank)
	next, damped := demand.Step(budget, floor, cur, target, p.Damping(budget), now, mem.lastMove)
	if damped {
		mem.lastMove = now
	}
	for j, i := range live {
		name := d.Pods[i].Name
		if next[j] > cur[j] {
			res.Moved += next[j] - cur[j]
		}
		mem.shares[name] = next[j]
		d.Pods[i].Permits = int32(next[j])
		res.Status.Pods = append(res.Status.Pods, apportionv1.PodShare{Pod: name, Share: int32(next[j]), Demand: int32(min(dem[j], 1<<30))})
	}
	if res.Moved > 0 {
		// Whole seconds, as the API server keeps it: else every later status would differ from
		// the written one by the nanoseconds, and be written again.
		mem.moved = metav1.NewTime(now).Rfc3339Copy()
	}
	if !mem.moved.IsZero() {
		t := mem.moved
		res.Status.LastMoveTime = &t
	}
	slices.SortStableFunc(res.Status.Pods, func(a, b apportionv1.PodShare) int {
		if c := cmp.Compare(b.Share, a.Share); c != 0 {
			return c
		}
		return cmp.Compare(a.Pod, b.Pod)
	})
	if len(res.Status.Pods) > apportionv1.MaxStatusShares {
		res.Status.Pods = res.Status.Pods[:apportionv1.MaxStatusShares]
	}
	return res
}

// sharesMovedMessage is the SharesMoved Event's message when a round moved more than the
// quota's threshold of the budget, else "".
func sharesMovedMessage(dq *apportionv1.DownstreamQuota, r shareResult) string {
	th := int64(int32Or(dq.Spec.Sharing.EventThresholdPercent, apportionv1.DefaultSharingEventThresholdPercent))
	if r.Moved == 0 || r.Moved*100 <= th*r.Budget {
		return ""
	}
	return fmt.Sprintf("%d of %d permits moved to follow demand (more than %d%%)", r.Moved, r.Budget, th)
}

// lanesStatus sums the lanes the agents reported over the quota's pods: the spec's lanes in
// order, then default. Nil without lanes.
func lanesStatus(dq *apportionv1.DownstreamQuota, report *push.Report) []apportionv1.LaneStatus {
	if len(dq.Spec.Lanes) == 0 {
		return nil
	}
	out := make([]apportionv1.LaneStatus, 0, len(dq.Spec.Lanes)+1)
	idx := map[string]int{}
	for _, l := range dq.Spec.Lanes {
		idx[l.Name] = len(out)
		out = append(out, apportionv1.LaneStatus{Name: l.Name})
	}
	idx[assignment.DefaultLane] = len(out)
	out = append(out, apportionv1.LaneStatus{Name: assignment.DefaultLane})
	if report == nil {
		return out
	}
	for _, h := range report.Holdings {
		if h.Gone {
			continue
		}
		for _, l := range h.Lanes {
			i, ok := idx[l.Name]
			if !ok {
				continue // an agent still on the previous lanes
			}
			out[i].ReservedPermits += l.Reserved
			out[i].InFlight += l.InFlight
			out[i].Borrowed += l.Borrowed
			out[i].RefusedNoPermit += l.Rejected["no-permit"]
		}
	}
	return out
}
