package v1alpha1

import metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

// SharingPolicy is how a quota's budget (maxInFlight × safetyFactorPercent) is shared among pods.
// +kubebuilder:validation:Enum=Equal;DemandAware
type SharingPolicy string

const (
	// SharingEqual gives every pod its weighted equal share (the default).
	SharingEqual SharingPolicy = "Equal"
	// SharingDemandAware gives every pod a floor and shares the rest by each pod's recent demand
	// (in flight + waiting + refused for lack of a permit, smoothed), damped against oscillation.
	// Target weights apply to Equal only.
	SharingDemandAware SharingPolicy = "DemandAware"
)

// Sharing says how the budget is shared among the quota's pods.
type Sharing struct {
	// policy is Equal (default) or DemandAware.
	// +kubebuilder:default=Equal
	// +optional
	Policy SharingPolicy `json:"policy,omitempty"`
	// floorPermits is what every pod keeps under DemandAware, whatever its demand, when the
	// budget allows (otherwise every pod gets the Equal share).
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=1000000
	// +kubebuilder:default=1
	// +optional
	FloorPermits *int32 `json:"floorPermits,omitempty"`
	// lendHeadroom, under DemandAware, also shares the scale-out headroom (maxInFlight − budget)
	// among busy pods while no scale-out is pending; a scale-out takes it back first, through
	// the same lower-before-raise protocol. Off by default: with it on, a new pod may wait for
	// busy pods to be lowered (and their calls to drain) before it gets its first permits.
	// +optional
	LendHeadroom bool `json:"lendHeadroom,omitempty"`
	// eventThresholdPercent: a Normal Event SharesMoved is recorded when a round moves more
	// than this share of the budget.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=10
	// +optional
	EventThresholdPercent int32 `json:"eventThresholdPercent,omitempty"`
}

// LaneMatch says which calls belong to a lane. All given parts must match; at least one must be
// given.
// +kubebuilder:validation:XValidation:rule="(has(self.headers) && size(self.headers) > 0) || (has(self.methods) && size(self.methods) > 0) || (has(self.pathPrefixes) && size(self.pathPrefixes) > 0)",message="a lane must match on headers, methods or pathPrefixes"
type LaneMatch struct {
	// headers must all match exactly.
	// +kubebuilder:validation:MaxItems=8
	// +optional
	Headers []HeaderMatch `json:"headers,omitempty"`
	// methods the call must use, one of them; empty means any.
	// +kubebuilder:validation:MaxItems=8
	// +listType=set
	// +optional
	Methods []HTTPMethod `json:"methods,omitempty"`
	// pathPrefixes: the call's path below the downstream (what follows /<downstream>) must start
	// with one of them; empty means any.
	// +kubebuilder:validation:MaxItems=16
	// +kubebuilder:validation:items:MaxLength=1024
	// +kubebuilder:validation:items:Pattern="^/"
	// +listType=set
	// +optional
	PathPrefixes []string `json:"pathPrefixes,omitempty"`
}

// Lane is a priority lane: the calls it matches share a reserve of every pod's permits that no
// other calls may use beyond lendPercent of it, and get it back first when they need it.
type Lane struct {
	// name of the lane, a DNS label; "default" is the lane of calls that match no lane.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=63
	// +kubebuilder:validation:Pattern="^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
	// +kubebuilder:validation:XValidation:rule="self != 'default'",message="default is the lane of unmatched calls; choose another name"
	// +required
	Name string `json:"name"`
	// match says which calls belong to the lane; lanes are tried in order, the first match wins.
	// +required
	Match LaneMatch `json:"match"`
	// reservedPercent of every pod's permits is kept for this lane (rounded up per pod, within
	// the pod's permits). The reserves of all lanes sum to at most 100.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +required
	ReservedPercent int32 `json:"reservedPercent"`
	// lendPercent of the reserve other lanes may borrow while it is idle; when this lane's calls
	// come back, borrowers are not admitted into it and the lane's calls are served first.
	// +kubebuilder:validation:Minimum=0
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=50
	// +optional
	LendPercent *int32 `json:"lendPercent,omitempty"`
}

// MaxStatusShares bounds status.sharing.pods: the pods with the largest shares are listed.
const MaxStatusShares = 64

// PodShare is one pod's share under DemandAware.
type PodShare struct {
	// pod name.
	Pod string `json:"pod"`
	// share is the permits the manager wants the pod to hold.
	Share int32 `json:"share"`
	// demand is the pod's smoothed demand, in permits (rounded up).
	Demand int32 `json:"demand"`
}

// SharingStatus is what demand-aware sharing decided.
type SharingStatus struct {
	// policy in force.
	Policy SharingPolicy `json:"policy"`
	// lentHeadroom is the part of the scale-out headroom lent to pods now.
	// +optional
	LentHeadroom int32 `json:"lentHeadroom,omitempty"`
	// lastMoveTime is when shares last moved.
	// +optional
	LastMoveTime *metav1.Time `json:"lastMoveTime,omitempty"`
	// pods, largest share first, at most 64.
	// +kubebuilder:validation:MaxItems=64
	// +optional
	Pods []PodShare `json:"pods,omitempty"`
}

// LaneStatus is one lane summed over the quota's pods, as their agents last reported.
type LaneStatus struct {
	// name of the lane ("default" for unmatched calls).
	Name string `json:"name"`
	// reservedPermits is Σ over pods of the lane's reserve.
	ReservedPermits int32 `json:"reservedPermits"`
	// inFlight is Σ calls of the lane in flight.
	InFlight int32 `json:"inFlight"`
	// borrowed is Σ permits of other lanes' reserves the lane's calls hold.
	Borrowed int32 `json:"borrowed"`
	// refusedNoPermit counts the lane's calls refused for lack of a permit since the agents
	// started.
	RefusedNoPermit int64 `json:"refusedNoPermit"`
}
