// Package defaults holds the defaults of the v1alpha1 fields that the agent applies too: the
// circuit breaker's, the recovery ramp's and adaptive concurrency's. The manager always sends
// these fields filled in (the API server or the manager applied the defaults), but the agent's
// packages take a zero field as its default too (a Config built in code, a test, a bootstrap
// file), and the two must not disagree.
//
// It imports only the standard library, so that the agent — which must not depend on Kubernetes
// libraries (cmd/agent/deps_test.go), as api/v1alpha1 does — can share these values with the API
// instead of stating them a second time: api/v1alpha1's Default* constants are these, and so are
// internal/agent/breaker's and internal/agent/recovery's. The CRDs' +kubebuilder:default markers
// cannot name Go constants; api/v1alpha1's TestDefaultsMatchCRD checks the API's constants against
// the generated CRDs, and TestAgentDefaultsMatchCRD the agent packages' own.
package defaults

import "time"

// The circuit breaker (spec.agent.circuitBreaker).
const (
	BreakerWindow              = 10 * time.Second
	BreakerFailureRatePercent  = 50
	BreakerSlowCallThreshold   = time.Second
	BreakerSlowCallRatePercent = 100
	BreakerMinimumCalls        = 20
	BreakerOpenDuration        = 30 * time.Second
	BreakerHalfOpenProbes      = 3
)

// The recovery ramp and adaptive concurrency (spec.agent.recovery).
const (
	RecoveryWindow           = time.Second
	RampInitialPercent       = 10 // Envoy's min_weight_percent default
	RampStepPercent          = 10
	RampHealthyWindows       = 2
	AdaptiveTolerancePercent = 150 // Gradient2's rttTolerance 1.5
	AdaptiveBaselineWindows  = 60
	AdaptiveMinLimit         = 1
)
