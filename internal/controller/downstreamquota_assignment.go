package controller

import (
	"cmp"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/apportion"
	"github.com/apportion/apportion/internal/push"
)

// This file is the first half of a DownstreamQuota reconcile's decision (downstreamquota_decide.go
// holds the second): how the budget splits among the targets and what every pod should hold, the
// assignment the engine takes. Pure: no client, no clock.

// quotaAssignment is the first half of a decision: how the budget splits and what every pod
// should hold.
type quotaAssignment struct {
	Rotation remainderRotation
	Split    apportion.Result
	// Desired is the engine's assignment; nil without an engine.
	Desired *push.DesiredQuota
	// Shared is the DemandAware round's outcome; nil for an Equal quota or without an engine.
	Shared *shareResult
}

// decideAssignment splits the quota's budget among the observed targets (the remainder at the
// rotation counter of in.Now) and, with an engine, decides what every pod should hold: the split,
// or under DemandAware the shares that follow demand (decideShares, which advances in.Sharing).
// Σ of the desired permits never exceeds the quota's limit (package apportion, decideShares);
// the engine moves the pods to them without ever exceeding it on the way (docs/protocol.md).
func decideAssignment(in *quotaInputs, p quotaPolicy) quotaAssignment {
	dq := in.Quota
	a := quotaAssignment{Rotation: rotationAt(dq, in.Now, p.RemainderRotation)}
	a.Split = splitFor(dq, in.Targets, a.Rotation.Counter)
	if in.Global != nil {
		globalSafeDefaults(dq, in.Targets, in.Global, &a.Split)
		dq = withGlobalFloor(dq, a.Split)
	}
	if !p.Push {
		return a
	}
	d := desiredQuota(dq, in.Targets, a.Split, in.Switches)
	if demandAware(dq) {
		mem := in.Sharing
		if mem == nil {
			mem = newSharingMemory()
		}
		res := decideShares(dq, in.Targets, a.Split, in.LastReport, &d, mem, p.Sharing, in.Now)
		a.Shared = &res
	}
	a.Desired = &d
	return a
}

// targetsFor is the quota's targets as package apportion counts them.
func targetsFor(obs []targetObservation) []apportion.Target {
	ts := make([]apportion.Target, len(obs))
	for i, o := range obs {
		ts[i] = apportion.Target{Weight: weightOf(o.Target), Replicas: o.replicas(), MaxReplicas: o.maxReplicas()}
		for j := range o.Pods {
			if takesRemainder(&o.Pods[j]) {
				ts[i].Pods = append(ts[i].Pods, podIdentity(o.Pods[j].UID, o.Pods[j].Name))
			}
		}
	}
	return ts
}

// takesRemainder says whether a pod may get a permit of the remainder: not a terminating one,
// which the push engine grants nothing anyway; its slot keeps its floor.
func takesRemainder(p *corev1.Pod) bool { return p.DeletionTimestamp == nil }

// podIdentity is what ranks a pod for the remainder: its UID (a pod created again under the
// same name is another pod), its name where it has none (tests).
func podIdentity(uid types.UID, name string) string { return cmp.Or(string(uid), name) }

// splitFor splits the quota's in-flight limit among the observed targets, the remainder handed
// out at rotation counter rotation.
func splitFor(dq *apportionv1.DownstreamQuota, obs []targetObservation, rotation uint64) apportion.Result {
	return apportion.Split(int64(dq.Spec.MaxInFlight), int64(safetyFactorPercent(dq)), targetsFor(obs), rotation)
}

// rateSplitFor splits the quota's rate contract among the observed targets like splitFor splits
// its limit; nil when the quota has no rate contract.
func rateSplitFor(dq *apportionv1.DownstreamQuota, obs []targetObservation) *apportion.RateResult {
	rc := dq.Spec.Rate
	if rc == nil {
		return nil
	}
	r := apportion.SplitRate(int64(rc.RequestsPerSecond), int64(int32Or(rc.Burst, apportionv1.DefaultRateBurst)),
		int64(safetyFactorPercent(dq)), targetsFor(obs))
	return &r
}

// desiredQuota is what every pod should hold, for the Pusher.
func desiredQuota(dq *apportionv1.DownstreamQuota, obs []targetObservation, split apportion.Result, switches []push.TargetedSwitch) push.DesiredQuota {
	d := push.DesiredQuota{
		Key:        types.NamespacedName{Namespace: dq.Namespace, Name: dq.Name},
		UID:        dq.UID,
		Generation: dq.Generation,
		Limit:      dq.Spec.MaxInFlight,
		Downstream: downstreamTemplate(dq),
		Switches:   switches,
	}
	rates := rateSplitFor(dq, obs)
	for i, o := range obs {
		var rate apportion.RateShare
		if rates != nil {
			rate = rates.PerPod[i]
		}
		k := 0 // o.Pods index among the pods that take a remainder: split.Permits[i]'s order
		for _, p := range o.Pods {
			permits := split.PerPod[i]
			if takesRemainder(&p) {
				permits = split.Permits[i][k]
				k++
			}
			d.Pods = append(d.Pods, push.DesiredPod{
				Name:          p.Name,
				UID:           p.UID,
				Target:        o.Target.Name,
				Endpoint:      agentEndpoint(&p),
				Permits:       int32(permits),
				SafeDefault:   int32(split.SafeDefault[i]),
				RatePerSecond: rate.PerSecond,
				RateBurst:     int32(rate.Burst),
				Terminating:   p.DeletionTimestamp != nil,
				Since:         p.CreationTimestamp.Time,
				Bootstrap:     agentBootstraps(&p),
			})
		}
	}
	return d
}
