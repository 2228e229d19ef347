package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// One downstream's limit shared by several clusters (docs/protocol.md §16): on a hub cluster, a
// GlobalQuota holds the global limit and names its member clusters, and one ClusterSlice per
// member carries the slice the hub granted it (spec) and the member's acknowledgement and demand
// (status). In each member cluster the DownstreamQuota of the downstream names the GlobalQuota
// (spec.global) and apportions only its slice among its pods.
//
// Members reach the hub, not the reverse: each member's manager holds a kubeconfig for the hub
// (a Secret in its own namespace, spec.global.hub) whose identity may read its own ClusterSlice
// and write that object's status, nothing else; the hub holds no credential of any member.

// GlobalMember is one member cluster of a GlobalQuota.
type GlobalMember struct {
	// name of the member cluster: what its DownstreamQuota's spec.global.cluster says, and the
	// suffix of its ClusterSlice's name (<quota>-<name>).
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	// +required
	Name string `json:"name"`
	// reservedSlice is the member's safe slice: it is never granted less, it falls to it when it
	// cannot reach the hub for a lease, and its pods' safe defaults are split from it. The
	// reserved slices of a quota sum to at most its maxInFlight. Default 0: a member cut off
	// from the hub stops calling once its lease ends.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000000
	// +kubebuilder:default=0
	// +optional
	ReservedSlice int32 `json:"reservedSlice"`
}

// SliceLease is how long a member may use a slice without hearing from the hub.
// +kubebuilder:validation:XValidation:rule="!has(oldSelf.duration) || (has(self.duration) && duration(self.duration) >= duration(oldSelf.duration))",message="lease.duration never shortens: a member may hold a grant it read under the longer lease, which the hub's bounds must cover"
type SliceLease struct {
	// duration: a member uses a slice for this long after the start of the read that returned
	// it, then falls to its reserved slice. Members read every third of it.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s') && duration(self) <= duration('10m')",message="duration must be between 1s and 10m"
	// +kubebuilder:default="30s"
	// +optional
	Duration *metav1.Duration `json:"duration,omitempty"`
	// clockMargin is added to every bound the hub waits out for a member it cannot hear: it
	// covers clocks whose rates differ (not their offsets, which do not matter) and a member that
	// notices late that its lease ended (docs/protocol.md §16, "Clocks").
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('0s') && duration(self) <= duration('10m')",message="clockMargin must be between 0s and 10m"
	// +kubebuilder:default="5s"
	// +optional
	ClockMargin *metav1.Duration `json:"clockMargin,omitempty"`
}

// GlobalSharing says how the global limit above the reserved slices is split between members.
type GlobalSharing struct {
	// policy is Equal (default) or DemandAware: by each member's demand, with the dampers the
	// pods of one cluster share by.
	// +kubebuilder:default=Equal
	// +optional
	Policy SharingPolicy `json:"policy,omitempty"`
}

// GlobalQuotaSpec is a downstream's global limit and the clusters that share it.
// +kubebuilder:validation:XValidation:rule="self.members.map(m, has(m.reservedSlice) ? m.reservedSlice : 0).sum() <= self.maxInFlight",message="the members' reservedSlice sum to at most maxInFlight"
type GlobalQuotaSpec struct {
	// maxInFlight is the global number of concurrent calls the downstream accepts, across every
	// member cluster. The hub splits all of it; each member applies its safetyFactorPercent to
	// its own slice.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000
	// +required
	MaxInFlight int32 `json:"maxInFlight"`
	// members are the clusters that share the limit.
	// +kubebuilder:validation:MinItems=1
	// +kubebuilder:validation:MaxItems=64
	// +listType=map
	// +listMapKey=name
	// +required
	Members []GlobalMember `json:"members"`
	// lease of a member's slice.
	// +kubebuilder:default={}
	// +optional
	Lease SliceLease `json:"lease,omitempty"`
	// sharing between members; Equal when absent.
	// +optional
	Sharing *GlobalSharing `json:"sharing,omitempty"`
}

// SliceAllocation is one member's line of the hub's ledger (docs/protocol.md §16): what the hub
// granted it and what it may still hold.
type SliceAllocation struct {
	// cluster is the member's name.
	Cluster string `json:"cluster"`
	// seq numbers the member's grants; it only grows.
	Seq int64 `json:"seq"`
	// slice is the member's current grant.
	Slice int32 `json:"slice"`
	// reservedSlice is the reserved slice of the current grant.
	ReservedSlice int32 `json:"reservedSlice"`
	// former is the highest slice of an earlier grant the member may still hold (not
	// acknowledged past); counted until the member acknowledges or its lease bound passes.
	// +optional
	Former int32 `json:"former,omitempty"`
	// formerReservedSlice is the highest reserved slice of such a grant.
	// +optional
	FormerReservedSlice int32 `json:"formerReservedSlice,omitempty"`
	// drain is the longest the member said its own ledger takes to get under a lowered limit.
	// +optional
	Drain *metav1.Duration `json:"drain,omitempty"`
}

// GlobalQuotaStatus is the hub's allocation of the global limit.
type GlobalQuotaStatus struct {
	// observedGeneration is the spec generation the allocation was planned from.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// conditions: Ready.
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
	// allocation is the hub's ledger, one line per member (and per former member still holding
	// something). The hub writes it with a resourceVersion precondition before it publishes any
	// grant in a ClusterSlice: it is what a restarted hub manager starts from.
	// +kubebuilder:validation:MaxItems=128
	// +listType=map
	// +listMapKey=cluster
	// +optional
	Allocation []SliceAllocation `json:"allocation,omitempty"`
	// granted is Σ of the members' current slices.
	// +optional
	Granted int32 `json:"granted"`
}

// GlobalQuota is, on a hub cluster, one downstream's limit across several member clusters.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=gq,categories=apportion
// +kubebuilder:printcolumn:name="GLOBAL",type=integer,JSONPath=`.spec.maxInFlight`,description="Global in-flight limit across clusters"
// +kubebuilder:printcolumn:name="GRANTED",type=integer,JSONPath=`.status.granted`,description="Σ of the slices granted"
// +kubebuilder:printcolumn:name="POLICY",type=string,JSONPath=`.spec.sharing.policy`,description="How the slices are split (Equal when empty)"
// +kubebuilder:printcolumn:name="READY",type=string,JSONPath=`.status.conditions[?(@.type=="Ready")].status`,description="Every member holds its slice"
// +kubebuilder:printcolumn:name="AGE",type=date,JSONPath=`.metadata.creationTimestamp`,description="Time since creation"
type GlobalQuota struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   GlobalQuotaSpec   `json:"spec"`
	Status GlobalQuotaStatus `json:"status,omitempty"`
}

// GlobalQuotaList contains a list of GlobalQuota.
//
// +kubebuilder:object:root=true
type GlobalQuotaList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []GlobalQuota `json:"items"`
}

// ClusterSliceSpec is the grant a member reads; only the hub writes it.
// +kubebuilder:validation:XValidation:rule="self.reservedSlice <= self.slice",message="reservedSlice is at most slice"
// +kubebuilder:validation:XValidation:rule="self.globalQuota == oldSelf.globalQuota && self.cluster == oldSelf.cluster",message="globalQuota and cluster are immutable"
// +kubebuilder:validation:XValidation:rule="self.seq >= oldSelf.seq",message="seq never goes back"
// +kubebuilder:validation:XValidation:rule="self.seq != oldSelf.seq || (self.slice == oldSelf.slice && self.reservedSlice == oldSelf.reservedSlice)",message="one seq is one grant"
type ClusterSliceSpec struct {
	// globalQuota is the GlobalQuota's name, in this namespace.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +required
	GlobalQuota string `json:"globalQuota"`
	// cluster is the member's name.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +required
	Cluster string `json:"cluster"`
	// seq numbers the member's grants (0: none yet).
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=9007199254740991
	// +optional
	Seq int64 `json:"seq"`
	// slice is the member's local limit under this grant.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000000
	// +optional
	Slice int32 `json:"slice"`
	// reservedSlice is what the member falls to when its lease ends, and what its pods' safe
	// defaults are split from.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000000
	// +optional
	ReservedSlice int32 `json:"reservedSlice"`
	// leaseDuration is how long after the start of a read that returned this grant the member
	// may use it.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s') && duration(self) <= duration('10m')",message="leaseDuration must be between 1s and 10m"
	// +required
	LeaseDuration metav1.Duration `json:"leaseDuration"`
}

// ClusterSliceStatus is what the member tells the hub; only that member writes it.
// +kubebuilder:validation:XValidation:rule="self.acknowledgedSeq >= oldSelf.acknowledgedSeq",message="acknowledgedSeq never goes back"
type ClusterSliceStatus struct {
	// acknowledgedSeq is the newest grant the member's own ledger is under (every pod pushed
	// its content and counted at most its slice), recorded in the member's cluster first.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=9007199254740991
	// +optional
	AcknowledgedSeq int64 `json:"acknowledgedSeq"`
	// demand is the local limit the member would like: its pods' smoothed demand over its
	// safety factor, capped at its maxInFlight. Written only when it leaves a dead band.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000000
	// +optional
	Demand int32 `json:"demand"`
	// drain is the longest the member's ledger takes to get under a lowered limit: its pods'
	// lease window plus its longest requestTimeout. The hub grants nothing before it is known.
	// +kubebuilder:validation:XValidation:rule="duration(self) > duration('0s') && duration(self) <= duration('1h')",message="drain must be above 0s and at most 1h"
	// +optional
	Drain *metav1.Duration `json:"drain,omitempty"`
}

// ClusterSlice is, on a hub cluster, one member's slice of a GlobalQuota: the hub's grant
// (spec) and the member's answer (status).
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=cs,categories=apportion
// +kubebuilder:validation:XValidation:rule="!has(self.status) || !has(self.status.acknowledgedSeq) || self.status.acknowledgedSeq <= self.spec.seq",message="a member acknowledges only a grant it was given"
// +kubebuilder:printcolumn:name="QUOTA",type=string,JSONPath=`.spec.globalQuota`,description="The GlobalQuota"
// +kubebuilder:printcolumn:name="CLUSTER",type=string,JSONPath=`.spec.cluster`,description="The member cluster"
// +kubebuilder:printcolumn:name="SLICE",type=integer,JSONPath=`.spec.slice`,description="The member's granted slice (its local limit)"
// +kubebuilder:printcolumn:name="RESERVED",type=integer,JSONPath=`.spec.reservedSlice`,description="What it falls to when its lease ends"
// +kubebuilder:printcolumn:name="DEMAND",type=integer,JSONPath=`.status.demand`,description="The slice the member would like"
// +kubebuilder:printcolumn:name="LEASE",type=string,JSONPath=`.spec.leaseDuration`,description="How long a read of the grant holds"
// +kubebuilder:printcolumn:name="SEQ",type=integer,JSONPath=`.spec.seq`,description="The grant's number",priority=1
// +kubebuilder:printcolumn:name="ACKED",type=integer,JSONPath=`.status.acknowledgedSeq`,description="The newest grant the member is under"
// +kubebuilder:printcolumn:name="AGE",type=date,JSONPath=`.metadata.creationTimestamp`,description="Time since creation"
type ClusterSlice struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   ClusterSliceSpec   `json:"spec"`
	Status ClusterSliceStatus `json:"status,omitempty"`
}

// ClusterSliceList contains a list of ClusterSlice.
//
// +kubebuilder:object:root=true
type ClusterSliceList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ClusterSlice `json:"items"`
}

// GlobalRef is, in a member cluster, the GlobalQuota on the hub whose slice a DownstreamQuota
// apportions.
type GlobalRef struct {
	// hub names a Secret in the manager's namespace, labelled apportion.io/hub=true, whose key
	// "kubeconfig" reaches the hub's API server as this member (it may read its ClusterSlice and
	// write its status, nothing else).
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$`
	// +required
	Hub string `json:"hub"`
	// namespace of the GlobalQuota on the hub.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	// +required
	Namespace string `json:"namespace"`
	// name of the GlobalQuota on the hub.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +required
	Name string `json:"name"`
	// cluster is this cluster's name among the GlobalQuota's members.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern=`^[a-z0-9]([-a-z0-9]*[a-z0-9])?$`
	// +required
	Cluster string `json:"cluster"`
}

// GlobalSliceStatus is, in a member cluster, the slice its DownstreamQuota holds. It is also
// the member's record of its newest grant, written before the member acknowledges it: a member
// manager that restarts without the hub starts from min(reservedSlice, slice) of it.
type GlobalSliceStatus struct {
	// seq of the newest grant read.
	// +optional
	Seq int64 `json:"seq,omitempty"`
	// slice of that grant: the local limit while the lease holds.
	// +optional
	Slice int32 `json:"slice"`
	// reservedSlice of that grant: the local limit once the lease ended.
	// +optional
	ReservedSlice int32 `json:"reservedSlice"`
	// leaseUntil is when the lease ends unless renewed (this cluster's clock, to the second,
	// rounded down). While the lease holds, the member writes it again once less than half a
	// lease is left of what it wrote (about every two thirds of a lease): a date in the future
	// while SliceLeased is True; the lease's end once it lapsed.
	// +optional
	LeaseUntil *metav1.Time `json:"leaseUntil,omitempty"`
	// acknowledgedSeq is the newest grant acknowledged to the hub.
	// +optional
	AcknowledgedSeq int64 `json:"acknowledgedSeq,omitempty"`
	// sliceUID is the UID of the ClusterSlice the grant was read from: a GlobalQuota deleted and
	// created again numbers its grants from 1 in a new ClusterSlice.
	// +optional
	SliceUID types.UID `json:"sliceUID,omitempty"`
}

// Condition of a member's DownstreamQuota, written by the member with its record (status.global):
// SliceLeased is True (reason LeaseHeld) while it holds a lease on its slice; False while it runs
// on its reserved slice — reason HubUnreachable when the last read of the hub failed, LeaseLapsed
// otherwise (a manager restarted from its record, before its first read) — or, reason NoGrant,
// before its first grant (local limit 0). The message names the slice, the grant and until when.
const (
	ConditionSliceLeased = "SliceLeased"
	ReasonLeaseHeld      = "LeaseHeld"
	ReasonLeaseLapsed    = "LeaseLapsed"
	ReasonHubUnreachable = "HubUnreachable"
	ReasonNoGrant        = "NoGrant"
)
