package v1alpha1

import (
	"time"

	"github.com/apportion/apportion/api/v1alpha1/defaults"
)

// Defaults of optional fields. The API server applies them from the CRD's +kubebuilder:default
// markers; the manager applies the same values where a field can still be empty (an object
// built in memory, a whole optional struct left out). Markers cannot name Go constants, so
// TestDefaultsMatchCRD checks every constant here against the generated CRDs (and
// TestAgentDefaultsMatchCRD the agent's copies, which come from package defaults).
const (
	DefaultSafetyFactorPercent int32 = 80
	DefaultWeight              int32 = 1
	DefaultRateBurst           int32 = 1
	DefaultRateMode                  = RateTokenBucket
	DefaultFailurePolicy             = FailureSafeDefault
	DefaultFallbackAction            = FallbackReject
	DefaultStaticStatus        int32 = 200
	DefaultDegradePercent      int32 = 100
	DefaultEnforcement               = EnforcementEnforce
	DefaultWarnAtPercent       int32 = 80

	DefaultAcquireTimeout = 200 * time.Millisecond
	DefaultRequestTimeout = 30 * time.Second
	DefaultMaxStaleness   = 5 * time.Minute

	// The breaker's and the recovery's are the agent's too: one statement of them, in the
	// dependency-free package the agent imports as well.
	DefaultBreakerWindow                    = defaults.BreakerWindow
	DefaultBreakerFailureRatePercent  int32 = defaults.BreakerFailureRatePercent
	DefaultBreakerSlowCallThreshold         = defaults.BreakerSlowCallThreshold
	DefaultBreakerSlowCallRatePercent int32 = defaults.BreakerSlowCallRatePercent
	DefaultBreakerMinimumCalls        int32 = defaults.BreakerMinimumCalls
	DefaultBreakerOpenDuration              = defaults.BreakerOpenDuration
	DefaultBreakerHalfOpenProbes      int32 = defaults.BreakerHalfOpenProbes

	DefaultRecoveryWindow                 = defaults.RecoveryWindow
	DefaultRampShape                      = RampLinear
	DefaultRampInitialPercent       int32 = defaults.RampInitialPercent
	DefaultRampStepPercent          int32 = defaults.RampStepPercent
	DefaultRampHealthyWindows       int32 = defaults.RampHealthyWindows
	DefaultAdaptiveTolerancePercent int32 = defaults.AdaptiveTolerancePercent
	DefaultAdaptiveBaselineWindows  int32 = defaults.AdaptiveBaselineWindows
	DefaultAdaptiveMinLimit         int32 = defaults.AdaptiveMinLimit

	DefaultSharingPolicy                      = SharingEqual
	DefaultSharingFloorPermits          int32 = 1
	DefaultSharingEventThresholdPercent int32 = 10
	DefaultLaneLendPercent              int32 = 50
)
