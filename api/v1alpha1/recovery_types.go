package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// RampShape is how the recovery ramp widens a pod's effective limit.
// +kubebuilder:validation:Enum=Linear;Exponential;Off
type RampShape string

const (
	// RampLinear widens by stepPercent of the permits per step.
	RampLinear RampShape = "Linear"
	// RampExponential doubles the effective limit per step.
	RampExponential RampShape = "Exponential"
	// RampOff applies permits in one step: no ramp.
	RampOff RampShape = "Off"
)

// Recovery says how a pod's effective limit comes back after an incident, always inside the
// pod's permits: it only ever narrows what the manager granted.
type Recovery struct {
	// window is the length of the windows calls are judged in.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('100ms') && duration(self) <= duration('1m')",message="window must be between 100ms and 1m"
	// +kubebuilder:default="1s"
	// +optional
	Window *metav1.Duration `json:"window,omitempty"`
	// ramp widens the effective limit step by step after the breaker closes (and, with
	// adaptive on, from the adaptive limit after it dropped), and only after consecutive healthy
	// windows (failure and slow-call rates below the breaker's thresholds, and the mean
	// latency below latencyTarget when set). A pod's first permits, a raise and permits
	// restored after a lapsed lease apply at once. Default: Linear from 10 % of the
	// permits, +10 % after every 2 healthy windows of 1 s.
	// +kubebuilder:default={}
	// +optional
	Ramp *RecoveryRamp `json:"ramp,omitempty"`
	// adaptive turns on adaptive concurrency: the effective limit shrinks toward what the
	// downstream takes (Little's law at its baseline latency) when its latency rises above
	// its recent baseline, and grows back as it recovers. Off when absent.
	// +optional
	Adaptive *AdaptiveConcurrency `json:"adaptive,omitempty"`
}

// RecoveryRamp is the gradual recovery ramp.
type RecoveryRamp struct {
	// shape is Linear (default), Exponential, or Off (permits apply in one step).
	// +kubebuilder:default=Linear
	// +optional
	Shape RampShape `json:"shape,omitempty"`
	// initialPercent of the permits is where a ramp starts (at least one permit).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=10
	// +optional
	InitialPercent int32 `json:"initialPercent,omitempty"`
	// stepPercent of the permits is one Linear step (Exponential doubles and ignores it).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=10
	// +optional
	StepPercent int32 `json:"stepPercent,omitempty"`
	// healthyWindows is how many healthy windows in a row widen the limit by one step.
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=100
	// +kubebuilder:default=2
	// +optional
	HealthyWindows int32 `json:"healthyWindows,omitempty"`
	// latencyTarget, when set, is a mean latency a healthy window stays below.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1ms') && duration(self) <= duration('10m')",message="latencyTarget must be between 1ms and 10m"
	// +optional
	LatencyTarget *metav1.Duration `json:"latencyTarget,omitempty"`
}

// AdaptiveConcurrency is a Gradient2-style limit inside the permits.
type AdaptiveConcurrency struct {
	// tolerancePercent of the baseline latency is where the limit starts shrinking.
	// +kubebuilder:validation:Minimum=101
	// +kubebuilder:validation:Maximum=1000
	// +kubebuilder:default=150
	// +optional
	TolerancePercent int32 `json:"tolerancePercent,omitempty"`
	// baselineWindows is how many windows the baseline latency averages over.
	// +kubebuilder:validation:Minimum=2
	// +kubebuilder:validation:Maximum=10000
	// +kubebuilder:default=60
	// +optional
	BaselineWindows int32 `json:"baselineWindows,omitempty"`
	// minLimit is the least the limit shrinks to (never above the permits).
	// +kubebuilder:validation:Minimum=1
	// +kubebuilder:validation:Maximum=1000000
	// +kubebuilder:default=1
	// +optional
	MinLimit int32 `json:"minLimit,omitempty"`
}
