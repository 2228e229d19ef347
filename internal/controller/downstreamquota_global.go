package controller

import (
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/apportion"
	"github.com/apportion/apportion/internal/hub"
)

// This file is a member cluster's side of one quota across clusters (docs/protocol.md §16,
// "Inside a member"): a DownstreamQuota with spec.global is apportioned on its local limit, the
// slice its cluster holds of the GlobalQuota, rather than on its maxInFlight.

// GlobalSlices is what the member's hold on its slices (hubsync.Members) tells the reconciler,
// and what the reconciler tells it back.
type GlobalSlices interface {
	// Slice is, for the quota key, the newest grant the member read (or restarted from) and the
	// local limit it allows now: the grant's slice while its lease holds, its fallback
	// min(reservedSlice, slice) after. ok is false while the member holds nothing for the quota
	// (its Member not started, or not yet past reading its record): the local limit is then 0.
	Slice(key types.NamespacedName) (g hub.Grant, limit int64, ok bool)
	// Assigned says that the engine was just handed an assignment planned on grant seq (its
	// limit at most that grant's slice, its pods' safe defaults split from its reserved slice):
	// the member may acknowledge seq once the engine's ledger is under its slice and every pod
	// acknowledged it.
	Assigned(key types.NamespacedName, seq int64)
}

// globalInput is the slice a quota with spec.global is apportioned on.
type globalInput struct {
	// Grant is the grant in force (zero while the member holds nothing).
	Grant hub.Grant
	// Limit is the local limit: min(maxInFlight, the slice while the lease holds, its fallback
	// after; 0 while the member holds nothing).
	Limit int64
	// Reserved is what the pods' safe defaults are split from: min(the grant's reserved slice,
	// Limit). Every pod's lapsed limit then fits in any local limit at or above the reserved
	// slice, and the hub never grants less (docs/protocol.md §16, Lemma H1).
	Reserved int64
}

// globalFor is the slice quota dq is apportioned on, from slices (nil: no member integration in
// this manager, so the quota holds nothing — never its maxInFlight, which may be the whole
// global limit).
func globalFor(dq *apportionv1.DownstreamQuota, slices GlobalSlices) *globalInput {
	if slices == nil {
		return &globalInput{}
	}
	g, limit, ok := slices.Slice(types.NamespacedName{Namespace: dq.Namespace, Name: dq.Name})
	if !ok {
		return &globalInput{}
	}
	limit = min(max(limit, 0), int64(dq.Spec.MaxInFlight))
	return &globalInput{Grant: g, Limit: limit, Reserved: min(max(g.Reserved, 0), limit)}
}

// onSlice is dq as the decision apportions it: maxInFlight replaced by the local limit. The 0.8
// factor (safetyFactorPercent) is applied to the local limit, once: the hub splits all of the
// global limit and applies none.
func onSlice(dq *apportionv1.DownstreamQuota, g *globalInput) *apportionv1.DownstreamQuota {
	eff := dq.DeepCopy()
	eff.Spec.MaxInFlight = int32(g.Limit)
	return eff
}

// globalSafeDefaults replaces the split's safe defaults by the split of the reserved slice: a
// pod that loses its manager falls to a share of the reserved slice, which fits under every local
// limit the hub may leave the member (never below the reserved slice).
func globalSafeDefaults(dq *apportionv1.DownstreamQuota, obs []targetObservation, g *globalInput, split *apportion.Result) {
	split.SafeDefault = apportion.Split(g.Reserved, int64(safetyFactorPercent(dq)), targetsFor(obs), split.Rotation).SafeDefault
}

// withGlobalFloor raises a DemandAware quota's per-pod floor to at least every target's safe
// default: a pod lowered by demand below its safe default would, cut off, fall back up to it
// (docs/protocol.md §16, Lemma H1).
func withGlobalFloor(dq *apportionv1.DownstreamQuota, split apportion.Result) *apportionv1.DownstreamQuota {
	if !demandAware(dq) {
		return dq
	}
	var sd int64
	for _, s := range split.SafeDefault {
		sd = max(sd, s)
	}
	floor := int64(ptr.Deref(dq.Spec.Sharing.FloorPermits, apportionv1.DefaultSharingFloorPermits))
	if sd <= floor {
		return dq
	}
	eff := dq.DeepCopy()
	eff.Spec.Sharing.FloorPermits = ptr.To(int32(sd))
	return eff
}
