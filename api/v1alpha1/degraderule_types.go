package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// DegradeTarget narrows a rule to one of the downstream's target workloads.
type DegradeTarget struct {
	// kind of the workload.
	// +required
	Kind WorkloadKind `json:"kind"`
	// name of the workload.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +required
	Name string `json:"name"`
}

// HeaderMatch matches a request header by exact value.
type HeaderMatch struct {
	// name of the header (case-insensitive), an RFC 9110 token.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	// +kubebuilder:validation:Pattern="^[-!#$%&'*+.^_`|~0-9A-Za-z]+$"
	// +required
	Name string `json:"name"`
	// value the header must have exactly.
	// +kubebuilder:validation:MaxLength=4096
	// +required
	Value string `json:"value"`
}

// DegradeScope is the part of the traffic a rule applies to. All given parts must match.
type DegradeScope struct {
	// percent of the traffic, 1–100. Below 100 the share is picked per value of keyHeader, so one
	// user sees consistent behaviour; requests without the header are not degraded.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=100
	// +optional
	Percent *int32 `json:"percent,omitempty"`
	// keyHeader names the header whose value picks the share (e.g. X-User-Id); required when
	// percent is below 100.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=256
	// +kubebuilder:validation:Pattern="^[-!#$%&'*+.^_`|~0-9A-Za-z]+$"
	// +optional
	KeyHeader string `json:"keyHeader,omitempty"`
	// headers must all match.
	// +kubebuilder:validation:MaxItems=16
	// +optional
	Headers []HeaderMatch `json:"headers,omitempty"`
	// methods limits the rule to these methods; empty means all.
	// +kubebuilder:validation:MaxItems=8
	// +listType=set
	// +optional
	Methods []HTTPMethod `json:"methods,omitempty"`
}

// DegradeRuleSpec is a person's switch that degrades a downstream for a scope of traffic.
// +kubebuilder:validation:XValidation:rule="!has(self.scope) || !has(self.scope.percent) || self.scope.percent == 100 || has(self.scope.keyHeader)",message="scope.keyHeader is required when scope.percent is below 100",fieldPath=".scope.keyHeader"
type DegradeRuleSpec struct {
	// downstream names a DownstreamQuota in the same namespace.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +required
	Downstream string `json:"downstream"`
	// target narrows the rule to one of the DownstreamQuota's targets; all when absent.
	// +optional
	Target *DegradeTarget `json:"target,omitempty"`
	// action is what the agents answer instead of calling the downstream, with the same
	// semantics as a DownstreamQuota's fallback.
	// +required
	Action Fallback `json:"action"`
	// active switches the rule on; false keeps it on record, switched off.
	// +kubebuilder:default=true
	// +optional
	Active *bool `json:"active,omitempty"`
	// reason is why the switch was flipped, kept on record.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=1024
	// +required
	Reason string `json:"reason"`
	// expiresAt is when the switch turns itself off. When the rule is created or its spec edited,
	// it must lie in the future and no further away than the manager's horizon
	// (--max-degrade-horizon, 24 h by default); otherwise the rule is Invalid and never pushed.
	// Editing it to a valid future time switches an Expired rule on again.
	// +required
	ExpiresAt metav1.Time `json:"expiresAt"`
	// scope is the part of the traffic degraded; all of it when absent.
	// +optional
	Scope *DegradeScope `json:"scope,omitempty"`
	// dryRun, when true, makes the switch observe only: the agents forward the calls it matches
	// as if it were off and count each as one it would have degraded
	// (apportion_agent_would_refuse_total{reason="degraded"}).
	// +optional
	DryRun bool `json:"dryRun,omitempty"`
}

// DegradePhase is where a rule stands.
// +kubebuilder:validation:Enum=Pending;Active;Expired;Inactive;Invalid
type DegradePhase string

const (
	// PhasePending: accepted, not yet confirmed by every affected pod.
	PhasePending DegradePhase = "Pending"
	// PhaseActive: in force on the affected pods.
	PhaseActive DegradePhase = "Active"
	// PhaseExpired: past expiresAt; kept as an audit record until deleted.
	PhaseExpired DegradePhase = "Expired"
	// PhaseInactive: switched off with active: false.
	PhaseInactive DegradePhase = "Inactive"
	// PhaseInvalid: cannot be applied (see the message); never pushed.
	PhaseInvalid DegradePhase = "Invalid"
)

// Condition types of a DegradeRule (besides ConditionReady: true when the rule is Active).
const (
	// ConditionValid is false when the rule cannot be applied: its expiry was already past or
	// beyond the manager's horizon when the spec was written, its DownstreamQuota or target does
	// not exist, or the agents would refuse the switch. An invalid rule is never pushed.
	ConditionValid = "Valid"
)

// DegradeRuleStatus is where the rule stands and how many pods apply it.
type DegradeRuleStatus struct {
	// observedGeneration is the spec generation this status describes.
	// +optional
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// phase is Pending, Active, Expired, Inactive or Invalid.
	// +optional
	Phase DegradePhase `json:"phase,omitempty"`
	// message explains the phase.
	// +optional
	Message string `json:"message,omitempty"`
	// activeSince is when the rule last became active.
	// +optional
	ActiveSince *metav1.Time `json:"activeSince,omitempty"`
	// scope summarises the spec's scope for the printer column.
	// +optional
	Scope string `json:"scope,omitempty"`
	// podsApplied is the number of affected pods whose agent confirmed the rule's current form.
	// +optional
	PodsApplied int32 `json:"podsApplied"`
	// podsTotal is the number of affected pods.
	// +optional
	PodsTotal int32 `json:"podsTotal"`
	// conditions: Ready (applied by every affected pod), Valid.
	// +listType=map
	// +listMapKey=type
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// DegradeRule is a person's switch that degrades a downstream (reject, static response or serve
// stale) for a scope of traffic, with a reason on record and a mandatory expiry.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:shortName=dr,categories=apportion
// +kubebuilder:printcolumn:name="DOWNSTREAM",type=string,JSONPath=`.spec.downstream`,description="The DownstreamQuota degraded"
// +kubebuilder:printcolumn:name="ACTION",type=string,JSONPath=`.spec.action.action`,description="Reject, Static or ServeStale"
// +kubebuilder:printcolumn:name="SCOPE",type=string,JSONPath=`.status.scope`,description="Share of traffic degraded"
// +kubebuilder:printcolumn:name="PHASE",type=string,JSONPath=`.status.phase`,description="Pending, Active, Expired, Inactive or Invalid"
// +kubebuilder:printcolumn:name="EXPIRES",type=string,format=date-time,JSONPath=`.spec.expiresAt`,description="When the switch turns itself off"
// +kubebuilder:printcolumn:name="REASON",type=string,JSONPath=`.spec.reason`,description="Why it was flipped"
type DegradeRule struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   DegradeRuleSpec   `json:"spec"`
	Status DegradeRuleStatus `json:"status,omitempty"`
}

// DegradeRuleList contains a list of DegradeRule.
//
// +kubebuilder:object:root=true
type DegradeRuleList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []DegradeRule `json:"items"`
}
