package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// RateMode is how a rate contract treats bursts.
// +kubebuilder:validation:Enum=TokenBucket;Pacing
type RateMode string

const (
	// RateTokenBucket allows bursts up to burst requests above the steady rate.
	RateTokenBucket RateMode = "TokenBucket"
	// RatePacing spaces requests evenly, for contracts that ban bursts.
	RatePacing RateMode = "Pacing"
)

// RateContract is a global requests-per-second contract, apportioned across pods like permits.
type RateContract struct {
	// requestsPerSecond is the global steady rate the downstream accepts.
	// +kubebuilder:validation:Minimum=1
	// +required
	RequestsPerSecond int32 `json:"requestsPerSecond"`
	// burst is the global number of requests allowed above the steady rate (TokenBucket only).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:default=1
	// +optional
	Burst int32 `json:"burst,omitempty"`
	// mode is TokenBucket (default) or Pacing.
	// +kubebuilder:default=TokenBucket
	// +optional
	Mode RateMode `json:"mode,omitempty"`
}

// Enforcement is whether agents enforce a quota or only observe what enforcing would do.
// +kubebuilder:validation:Enum=Enforce;Observe
type Enforcement string

const (
	// EnforcementEnforce: agents admit calls within their permits, rate and switches (the default).
	EnforcementEnforce Enforcement = "Enforce"
	// EnforcementObserve: agents forward every call at once and count, by reason, what they would
	// have refused (apportion_agent_would_refuse_total); the manager still apportions and pushes
	// permits, and the calls in flight count against them (docs/protocol.md §11b).
	EnforcementObserve Enforcement = "Observe"
)

// WorkloadKind is the kind of a workload that shares a quota.
// +kubebuilder:validation:Enum=Deployment;StatefulSet
type WorkloadKind string

const (
	KindDeployment  WorkloadKind = "Deployment"
	KindStatefulSet WorkloadKind = "StatefulSet"
)

// Target is a workload, in the quota's namespace, whose pods share the quota.
type Target struct {
	// kind is Deployment or StatefulSet.
	// +required
	Kind WorkloadKind `json:"kind"`
	// name is the workload's name.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +required
	Name string `json:"name"`
	// weight is this target's share relative to the other targets, per pod.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000
	// +kubebuilder:default=1
	// +optional
	Weight int32 `json:"weight,omitempty"`
	// hpaName names the HorizontalPodAutoscaler that scales this workload. When empty, the
	// HPA whose scaleTargetRef names the workload is used, if there is one.
	// +kubebuilder:validation:MaxLength=253
	// +optional
	HPAName string `json:"hpaName,omitempty"`
}

// CircuitBreaker opens when the downstream is failing or slow, and probes it before closing.
type CircuitBreaker struct {
	// window is the sliding time window over which failure and slow-call rates are measured.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s') && duration(self) <= duration('10m')",message="window must be between 1s and 10m"
	// +kubebuilder:default="10s"
	// +optional
	Window *metav1.Duration `json:"window,omitempty"`
	// failureRatePercent opens the breaker when this share of calls in the window failed
	// (5xx, 429, timeouts, connection errors).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=50
	// +optional
	FailureRatePercent int32 `json:"failureRatePercent,omitempty"`
	// slowCallThreshold is the duration at or above which a call counts as slow.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1ms') && duration(self) <= duration('10m')",message="slowCallThreshold must be between 1ms and 10m"
	// +kubebuilder:default="1s"
	// +optional
	SlowCallThreshold *metav1.Duration `json:"slowCallThreshold,omitempty"`
	// slowCallRatePercent opens the breaker when this share of calls in the window was slow.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=100
	// +optional
	SlowCallRatePercent int32 `json:"slowCallRatePercent,omitempty"`
	// minimumCalls is the number of calls in the window below which the breaker never opens.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:default=20
	// +optional
	MinimumCalls int32 `json:"minimumCalls,omitempty"`
	// openDuration is how long the breaker stays open before it admits probes.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('100ms') && duration(self) <= duration('1h')",message="openDuration must be between 100ms and 1h"
	// +kubebuilder:default="30s"
	// +optional
	OpenDuration *metav1.Duration `json:"openDuration,omitempty"`
	// halfOpenProbes is how many probe calls may be in flight at once while half-open, and how
	// many must succeed to close the breaker.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=3
	// +optional
	HalfOpenProbes int32 `json:"halfOpenProbes,omitempty"`
}

// FailurePolicy is what an agent does when it holds no valid assignment.
// +kubebuilder:validation:Enum=SafeDefault;Closed
type FailurePolicy string

const (
	// FailureSafeDefault keeps serving with the safe-default permits (global × factor / HPA
	// maxReplicas), never more than the pod held last.
	FailureSafeDefault FailurePolicy = "SafeDefault"
	// FailureClosed answers every call with the fallback until an assignment arrives.
	FailureClosed FailurePolicy = "Closed"
)

// AgentPolicy says how agents enforce the quota in each pod.
type AgentPolicy struct {
	// acquireTimeout is how long a call may wait for a permit before it fails fast into the fallback.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1ms') && duration(self) <= duration('5s')",message="acquireTimeout must be between 1ms and 5s"
	// +kubebuilder:default="200ms"
	// +optional
	AcquireTimeout *metav1.Duration `json:"acquireTimeout,omitempty"`
	// requestTimeout bounds one call to the downstream. It is also the longest time a call may
	// still be running after its pod lost its permits, which the manager waits out.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('10ms') && duration(self) <= duration('10m')",message="requestTimeout must be between 10ms and 10m"
	// +kubebuilder:default="30s"
	// +optional
	RequestTimeout *metav1.Duration `json:"requestTimeout,omitempty"`
	// circuitBreaker configures the breaker; when absent, no breaker is used.
	// +optional
	CircuitBreaker *CircuitBreaker `json:"circuitBreaker,omitempty"`
	// fallback is the answer when no permit, no rate token or an open breaker stops a call.
	// +optional
	Fallback *Fallback `json:"fallback,omitempty"`
	// failurePolicy is SafeDefault (default) or Closed.
	// +kubebuilder:default=SafeDefault
	// +optional
	FailurePolicy FailurePolicy `json:"failurePolicy,omitempty"`
	// recovery says how a pod's effective limit ramps back after an incident, and turns on
	// adaptive concurrency; both stay inside the pod's permits. Default: the Linear ramp.
	// +kubebuilder:default={}
	// +optional
	Recovery *Recovery `json:"recovery,omitempty"`
	// maxWaiting bounds the calls of one pod waiting for a permit; a call beyond it is refused
	// at once (reason queue-full). Default: 10 × the pod's permits, at least 10.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000000
	// +optional
	MaxWaiting *int32 `json:"maxWaiting,omitempty"`
	// deadlineHeader, when set, names the header in which the agent tells the downstream what
	// is left of the call's time: grpc-timeout's form when it is grpc-timeout, a Go duration
	// ("250ms") otherwise.
	// +kubebuilder:validation:MaxLength=256
	// +kubebuilder:validation:Pattern=`^[-!#$%&'*+.^_|~0-9A-Za-z]+$`
	// +kubebuilder:validation:XValidation:rule="!(self.lowerAscii() in ['host', 'content-length', 'transfer-encoding', 'connection', 'keep-alive', 'te', 'trailer', 'upgrade', 'expect', 'x-forwarded-for', 'forwarded', 'x-apportion-timeout']) && !self.lowerAscii().startsWith('proxy-')",message="deadlineHeader names a field the agent or HTTP itself sets"
	// +optional
	DeadlineHeader string `json:"deadlineHeader,omitempty"`
	// abandonedCallHold is how long a call that timed out keeps its permit (and its place in
	// the in-flight count the manager's ledger sees) after its upstream connection was closed:
	// the downstream may still be working on it. Default: the requestTimeout; 0s: no hold.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('0s') && duration(self) <= duration('10m')",message="abandonedCallHold must be between 0s and 10m"
	// +optional
	AbandonedCallHold *metav1.Duration `json:"abandonedCallHold,omitempty"`
}

// DownstreamQuotaSpec is one downstream's global contract and the workloads that share it.
// +kubebuilder:validation:XValidation:rule="has(self.global) == has(oldSelf.global) && (!has(self.global) || self.global == oldSelf.global)",message="global is set at creation and never changed"
// +kubebuilder:validation:XValidation:rule="!has(self.upstreamTLS) || (isURL(self.upstream) && url(self.upstream).getScheme() == 'https')",message="upstreamTLS applies to an https upstream only",fieldPath=".upstreamTLS"
type DownstreamQuotaSpec struct {
	// maxInFlight is the global number of concurrent calls the downstream accepts.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000
	// +required
	MaxInFlight int32 `json:"maxInFlight"`
	// safetyFactorPercent is the share of maxInFlight apportioned to pods, in percent
	// (80 means a factor of 0.8). The rest is headroom for scale-out.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=80
	// +optional
	SafetyFactorPercent int32 `json:"safetyFactorPercent,omitempty"`
	// rate is an optional global requests-per-second contract.
	// +optional
	Rate *RateContract `json:"rate,omitempty"`
	// enforcement is Enforce (default) or Observe. Under Observe every call is forwarded without
	// waiting; the agents run the whole admission beside it and count what they would have
	// refused, by reason. Switching to Enforce behaves like lowering the permits: the calls
	// admitted under Observe count against them until they end (docs/protocol.md §11b).
	// +kubebuilder:default=Enforce
	// +optional
	Enforcement Enforcement `json:"enforcement,omitempty"`
	// warnAtPercent is the share of the pods' budget (maxInFlight × safetyFactorPercent) at
	// which the quota warns: when the calls in flight across its pods reach it, the condition
	// NearLimit turns true and a Warning Event is recorded, before anything is refused.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=80
	// +optional
	WarnAtPercent int32 `json:"warnAtPercent,omitempty"`
	// targets are the workloads whose pods share this quota.
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=16
	// +listType=map
	// +listMapKey=kind
	// +listMapKey=name
	// +required
	Targets []Target `json:"targets"`
	// upstream is the URL the agent forwards calls to, http or https.
	// +kubebuilder:validation:MaxLength=2048
	// +kubebuilder:validation:XValidation:rule="isURL(self) && url(self).getScheme() in ['http', 'https'] && url(self).getHost() != ''",message="upstream must be an absolute http or https URL"
	// +required
	Upstream string `json:"upstream"`
	// upstreamTLS says how agents verify an https upstream and authenticate to it
	// (upstreamtls_types.go); the system roots and the URL's host when absent.
	// +optional
	UpstreamTLS *UpstreamTLS `json:"upstreamTLS,omitempty"`
	// agent says how agents enforce the quota.
	// +kubebuilder:default={}
	// +optional
	Agent AgentPolicy `json:"agent,omitempty"`
	// sharing says how the budget is shared among pods (sharing_types.go); Equal when absent.
	// +optional
	Sharing *Sharing `json:"sharing,omitempty"`
	// lanes are priority lanes with reserves (sharing_types.go); calls matching none use the
	// default lane.
	// +kubebuilder:validation:MaxItems=8
	// +kubebuilder:validation:XValidation:rule="self.map(l, l.reservedPercent).sum() <= 100",message="the lanes' reservedPercent sum to at most 100"
	// +listType=map
	// +listMapKey=name
	// +optional
	Lanes []Lane `json:"lanes,omitempty"`
	// global makes this quota a member's part of a GlobalQuota on a hub cluster (global_types.go):
	// its local limit is the slice the hub grants it, at most maxInFlight (0 until the member
	// reads its grant or its record; docs/protocol.md §16). Set at creation only.
	// +optional
	Global *GlobalRef `json:"global,omitempty"`
}

// HPAStatus is what the HPA that scales a target reports.
type HPAStatus struct {
	// name of the HPA.
	Name string `json:"name"`
	// desiredReplicas is the HPA's last decision.
	DesiredReplicas int32 `json:"desiredReplicas"`
	// currentReplicas is the HPA's view of the running replicas.
	CurrentReplicas int32 `json:"currentReplicas"`
	// maxReplicas is the HPA's upper bound.
	MaxReplicas int32 `json:"maxReplicas"`
}

// TargetStatus is what the manager counts and assigns for one target.
type TargetStatus struct {
	// kind of the workload.
	Kind WorkloadKind `json:"kind"`
	// name of the workload.
	Name string `json:"name"`
	// found is false when the workload does not exist; nothing is assigned to it then.
	Found bool `json:"found"`
	// replicas is the count the permits were computed for: the highest of the HPA's desired and
	// current replicas, the workload's spec.replicas and its existing pods, terminating included.
	Replicas int32 `json:"replicas"`
	// pods is the number of existing pods, terminating included.
	Pods int32 `json:"pods"`
	// hpa is the HPA's view, when an HPA scales the workload.
	// +optional
	HPA *HPAStatus `json:"hpa,omitempty"`
	// permitsPerPod is each pod's share rounded down: every pod gets at least this, and
	// extraPermits of them one more.
	PermitsPerPod int32 `json:"permitsPerPod"`
	// extraPermits is how many of the target's replicas get permitsPerPod + 1: the permits that
	// rounding down leaves over, so that the targets together are assigned the whole budget.
	// Which pods get them rotates every few minutes; pods that exist get them first (a replica
	// whose pod does not exist yet holds one only when every pod of the target already has one).
	// +optional
	ExtraPermits int32 `json:"extraPermits,omitempty"`
	// safeDefaultPermits is what one pod of this target may use with no valid assignment:
	// its weighted share of maxInFlight × factor over every target's safeDefaultReplicas.
	SafeDefaultPermits int32 `json:"safeDefaultPermits"`
	// safeDefaultReplicas is the replica count the safe default is split over: the HPA's
	// maxReplicas while an HPA scales the target; without one, the highest count seen for the
	// target since the quota was created (its replicas, or the maxReplicas of an HPA since
	// deleted), so that a deleted HPA or a scale-in never raises the safe default. Never below
	// replicas.
	// +optional
	SafeDefaultReplicas int32 `json:"safeDefaultReplicas,omitempty"`
	// ratePerPod is each pod's share of the rate contract; absent when the quota has none.
	// +optional
	RatePerPod *RateShare `json:"ratePerPod,omitempty"`
	// podsSynced is the number of pods whose agent acknowledged its current permits.
	// +optional
	PodsSynced int32 `json:"podsSynced"`
}

// RateShare is one pod's share of the rate contract, apportioned like permits: with the same
// factor, weights and replica counts, so that Σ replicas × requestsPerSecond ≤ the contract's
// requestsPerSecond and Σ replicas × burst ≤ its burst at every replica count.
type RateShare struct {
	// requestsPerSecond is each pod's steady rate, requestsPerSecond × factor × weight /
	// Σ (weight × replicas), as a decimal rounded down to thousandths (the agent gets the exact
	// share, rounded down).
	RequestsPerSecond string `json:"requestsPerSecond"`
	// burst is each pod's share of the contract's burst, ⌊burst × factor × weight /
	// Σ (weight × replicas)⌋. It is 0 when the pods outnumber the burst: such a pod is paced —
	// one call, then one per 1/requestsPerSecond, never two at once (docs/agent.md).
	Burst int32 `json:"burst"`
}

// PodHolding is what one pod may be using, as the manager's ledger counts it.
type PodHolding struct {
	// pod name.
	Pod string `json:"pod"`
	// target workload name.
	Target string `json:"target"`
	// granted is the pod's current permits as last pushed.
	Granted int32 `json:"granted"`
	// counted is what the ledger counts for the pod: the highest of what it was granted and not
	// yet acknowledged as lowered, and what its agent reports in flight.
	Counted int32 `json:"counted"`
	// inFlight is what the agent last reported in flight.
	InFlight int32 `json:"inFlight"`
	// synced is true when the agent acknowledged the current grant.
	Synced bool `json:"synced"`
}

// Condition types of a DownstreamQuota.
const (
	// ConditionReady is true when every existing target has been apportioned and pushed.
	ConditionReady = "Ready"
	// ConditionOversubscribed is true when maxInFlight × factor is smaller than the pods sharing it.
	ConditionOversubscribed = "Oversubscribed"
	// ConditionTargetsFound is false when a target workload does not exist.
	ConditionTargetsFound = "TargetsFound"
	// ConditionPodsReachable is false when some pods' agents could not be reached, or some pods
	// have no agent to reach.
	ConditionPodsReachable = "PodsReachable"
	// ConditionNearLimit is true while the calls in flight across the quota's pods are at or
	// above spec.warnAtPercent of the pods' budget (maxInFlight × safetyFactorPercent): a warning
	// before anything is refused. Under Observe the calls in flight may exceed the budget.
	ConditionNearLimit = "NearLimit"
	// ConditionPodsWithoutAgent is true when pods of a target have an IP but no agent the manager
	// can find (no apportion.io/agent-port annotation, no container port apportion-ctl): they are
	// counted at their share, but nothing enforces it.
	ConditionPodsWithoutAgent = "PodsWithoutAgent"
)

// The reasons of these conditions, and of the Events the manager records about a quota, are in
// conditions.go.

// DownstreamQuotaStatus is what the manager computed and what every pod holds.
type DownstreamQuotaStatus struct {
	// observedGeneration is the spec generation this status was computed from.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// conditions: Ready, Oversubscribed, TargetsFound, PodsReachable, PodsWithoutAgent, NearLimit.
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
	// targets, in spec order.
	// +optional
	Targets []TargetStatus `json:"targets,omitempty"`
	// pods is the replica count summed over targets.
	// +optional
	Pods int32 `json:"pods"`
	// perPod is each target's permits per pod, comma-separated in spec order: "5", or "2-3" when
	// some of the target's pods get one more (targets[].extraPermits).
	// +optional
	PerPod string `json:"perPod,omitempty"`
	// assigned is the permits assigned across all pods, Σ replicas × permitsPerPod + extraPermits:
	// the whole of maxInFlight × safetyFactorPercent whenever some replica is counted.
	// +optional
	Assigned int32 `json:"assigned"`
	// safeDefaultPermits is what one weight-1 pod may use with no valid assignment:
	// floor(maxInFlight × factor / Σ weight × HPA maxReplicas), never more than it last held.
	// +optional
	SafeDefaultPermits int32 `json:"safeDefaultPermits"`
	// ledger is Σ permits that live or recently deleted pods may be using, as the manager counts it.
	// +optional
	Ledger int32 `json:"ledger"`
	// holdings lists what every pod holds, at most 100 pods: those not synced, gone or counted
	// above their grant first, then by name. ledger and targets[].podsSynced cover every pod.
	// +optional
	// +kubebuilder:validation:MaxItems=100
	Holdings []PodHolding `json:"holdings,omitempty"`
	// holdingsOmitted is how many pods the ledger counts that holdings leaves out (beyond 100).
	// +optional
	HoldingsOmitted int32 `json:"holdingsOmitted,omitempty"`
	// lastRebalanceTime is when the permits last changed.
	// +optional
	LastRebalanceTime *metav1.Time `json:"lastRebalanceTime,omitempty"`
	// lastRebalanceDuration is how long the last rebalance took to be acknowledged by every pod.
	// +optional
	LastRebalanceDuration string `json:"lastRebalanceDuration,omitempty"`
	// sharing is what demand-aware sharing decided (sharing_types.go); absent under Equal.
	// +optional
	Sharing *SharingStatus `json:"sharing,omitempty"`
	// lanes, in spec order then default, summed over pods (sharing_types.go).
	// +optional
	Lanes []LaneStatus `json:"lanes,omitempty"`
	// global is the slice held of the GlobalQuota spec.global names (global_types.go).
	// +optional
	Global *GlobalSliceStatus `json:"global,omitempty"`
	// inFlight is Σ of the calls in flight the pods' agents last reported.
	// +optional
	InFlight int32 `json:"inFlight"`
	// utilizationPercent is inFlight ÷ the permits granted across the pods, in percent (rounded
	// down; 0 when none are granted). Above 100 only under Observe, or while lowered pods drain.
	// +optional
	UtilizationPercent int32 `json:"utilizationPercent"`
	// peakSecond is the busiest whole second of the last 60 across the quota's pods: the calls
	// the agents counted in it, summed per second, as reported on their renewals.
	// +optional
	PeakSecond *PeakSecond `json:"peakSecond,omitempty"`
}

// PeakSecond is the busiest whole second of the last minute across a quota's pods.
type PeakSecond struct {
	// calls is the number of calls addressed to the downstream in that second, across its pods.
	Calls int64 `json:"calls"`
	// at is the start of that second.
	At metav1.Time `json:"at"`
}

// DownstreamQuota is one downstream's global contract (max in-flight, optional rate), the
// workloads that share it, and how their agents enforce it.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=dq,categories=apportion
// +kubebuilder:printcolumn:name="GLOBAL",type=integer,JSONPath=`.spec.maxInFlight`,description="Global in-flight limit of the downstream"
// +kubebuilder:printcolumn:name="PODS",type=integer,JSONPath=`.status.pods`,description="Pods counted across targets (errs high)"
// +kubebuilder:printcolumn:name="PER-POD",type=string,JSONPath=`.status.perPod`,description="Permits per pod, per target (low-high when the remainder gives some pods one more)"
// +kubebuilder:printcolumn:name="ASSIGNED",type=integer,JSONPath=`.status.assigned`,description="Permits assigned across all pods"
// +kubebuilder:printcolumn:name="MODE",type=string,JSONPath=`.spec.enforcement`,description="Enforce, or Observe: every call forwarded, refusals only counted"
// +kubebuilder:printcolumn:name="IN-FLIGHT",type=integer,JSONPath=`.status.inFlight`,description="Calls in flight across the pods, as their agents last reported"
// +kubebuilder:printcolumn:name="UTIL%",type=integer,JSONPath=`.status.utilizationPercent`,description="Calls in flight ÷ permits granted, percent"
// +kubebuilder:printcolumn:name="READY",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`,description="Apportioned and pushed"
// +kubebuilder:printcolumn:name="SLICE",type=integer,JSONPath=`.status.global.slice`,description="The slice of a GlobalQuota this member holds (spec.global)",priority=1
// +kubebuilder:printcolumn:name="LEASED",type=string,JSONPath=`.status.conditions[?(@.type=="SliceLeased")].status`,description="Whether this member holds a lease on its slice (False: on its reserved slice)",priority=1
// +kubebuilder:printcolumn:name="LEASE-UNTIL",type=string,JSONPath=`.status.global.leaseUntil`,description="Until when the slice is leased (rewritten before half a lease is left while it holds; when it ended once it lapsed)",priority=1
// +kubebuilder:printcolumn:name="AGE",type=date,JSONPath=`.metadata.creationTimestamp`,description="Time since creation"
type DownstreamQuota struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   DownstreamQuotaSpec   `json:"spec"`
	Status DownstreamQuotaStatus `json:"status,omitempty"`
}

// DownstreamQuotaList contains a list of DownstreamQuota.
//
// +kubebuilder:object:root=true
type DownstreamQuotaList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []DownstreamQuota `json:"items"`
}
