package v1alpha1

import "time"

// Defaults of optional fields. The API server applies them from the CRD's +kubebuilder:default
// markers; the manager applies the same values where a field can still be empty (an object
// built in memory, a whole optional struct left out). Markers cannot name Go constants, so
// TestDefaultsMatchCRD checks every constant here against the generated CRDs.
const (
	DefaultSafetyFactorPercent int32 = 80
	DefaultWeight              int32 = 1
	DefaultRateBurst           int32 = 1
	DefaultRateMode                  = RateTokenBucket
	DefaultFailurePolicy             = FailureSafeDefault
	DefaultFallbackAction            = FallbackReject
	DefaultStaticStatus        int32 = 200
	DefaultDegradePercent      int32 = 100

	DefaultAcquireTimeout = 200 * time.Millisecond
	DefaultRequestTimeout = 30 * time.Second
	DefaultMaxStaleness   = 5 * time.Minute

	DefaultBreakerWindow                    = 10 * time.Second
	DefaultBreakerFailureRatePercent  int32 = 50
	DefaultBreakerSlowCallThreshold         = time.Second
	DefaultBreakerSlowCallRatePercent int32 = 100
	DefaultBreakerMinimumCalls        int32 = 20
	DefaultBreakerOpenDuration              = 30 * time.Second
	DefaultBreakerHalfOpenProbes      int32 = 3

	DefaultRecoveryWindow                 = time.Second
	DefaultRampShape                      = RampLinear
	DefaultRampInitialPercent       int32 = 10
	DefaultRampStepPercent          int32 = 10
	DefaultRampHealthyWindows       int32 = 2
	DefaultAdaptiveTolerancePercent int32 = 150
	DefaultAdaptiveBaselineWindows  int32 = 60
	DefaultAdaptiveMinLimit         int32 = 1

	DefaultSharingPolicy                      = SharingEqual
	DefaultSharingFloorPermits          int32 = 1
	DefaultSharingEventThresholdPercent int32 = 10
	DefaultLaneLendPercent              int32 = 50
)
