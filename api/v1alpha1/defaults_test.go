package v1alpha1

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"

	"github.com/apportion/apportion/internal/agent/breaker"
	"github.com/apportion/apportion/internal/agent/recovery"
)

// TestDefaultsMatchCRD checks the Default* constants, which the manager applies, against the
// defaults the API server applies: those the +kubebuilder:default markers put in the generated
// CRDs (config/crd/bases). A marker changed without its constant, or the reverse, fails here.
func TestDefaultsMatchCRD(t *testing.T) {
	for _, tc := range []struct {
		crd, path string
		want      any // a time.Duration is compared with the parsed default; anything else as JSON
	}{
		{"downstreamquotas", "spec.safetyFactorPercent", DefaultSafetyFactorPercent},
		{"downstreamquotas", "spec.targets[].weight", DefaultWeight},
		{"downstreamquotas", "spec.enforcement", DefaultEnforcement},
		{"downstreamquotas", "spec.warnAtPercent", DefaultWarnAtPercent},
		{"downstreamquotas", "spec.rate.burst", DefaultRateBurst},
		{"downstreamquotas", "spec.rate.mode", DefaultRateMode},
		{"downstreamquotas", "spec.agent.failurePolicy", DefaultFailurePolicy},
		{"downstreamquotas", "spec.agent.acquireTimeout", DefaultAcquireTimeout},
		{"downstreamquotas", "spec.agent.requestTimeout", DefaultRequestTimeout},
		{"downstreamquotas", "spec.agent.fallback.action", DefaultFallbackAction},
		{"downstreamquotas", "spec.agent.fallback.maxStaleness", DefaultMaxStaleness},
		{"downstreamquotas", "spec.agent.fallback.static.status", DefaultStaticStatus},
		{"downstreamquotas", "spec.agent.circuitBreaker.window", DefaultBreakerWindow},
		{"downstreamquotas", "spec.agent.circuitBreaker.failureRatePercent", DefaultBreakerFailureRatePercent},
		{"downstreamquotas", "spec.agent.circuitBreaker.slowCallThreshold", DefaultBreakerSlowCallThreshold},
		{"downstreamquotas", "spec.agent.circuitBreaker.slowCallRatePercent", DefaultBreakerSlowCallRatePercent},
		{"downstreamquotas", "spec.agent.circuitBreaker.minimumCalls", DefaultBreakerMinimumCalls},
		{"downstreamquotas", "spec.agent.circuitBreaker.openDuration", DefaultBreakerOpenDuration},
		{"downstreamquotas", "spec.agent.circuitBreaker.halfOpenProbes", DefaultBreakerHalfOpenProbes},
		{"downstreamquotas", "spec.agent.recovery.window", DefaultRecoveryWindow},
		{"downstreamquotas", "spec.agent.recovery.ramp.shape", DefaultRampShape},
		{"downstreamquotas", "spec.agent.recovery.ramp.initialPercent", DefaultRampInitialPercent},
		{"downstreamquotas", "spec.agent.recovery.ramp.stepPercent", DefaultRampStepPercent},
		{"downstreamquotas", "spec.agent.recovery.ramp.healthyWindows", DefaultRampHealthyWindows},
		{"downstreamquotas", "spec.agent.recovery.adaptive.tolerancePercent", DefaultAdaptiveTolerancePercent},
		{"downstreamquotas", "spec.agent.recovery.adaptive.baselineWindows", DefaultAdaptiveBaselineWindows},
		{"downstreamquotas", "spec.agent.recovery.adaptive.minLimit", DefaultAdaptiveMinLimit},
		{"downstreamquotas", "spec.sharing.policy", DefaultSharingPolicy},
		{"downstreamquotas", "spec.sharing.floorPermits", DefaultSharingFloorPermits},
		{"downstreamquotas", "spec.sharing.eventThresholdPercent", DefaultSharingEventThresholdPercent},
		{"downstreamquotas", "spec.lanes[].lendPercent", DefaultLaneLendPercent},
		{"degraderules", "spec.scope.percent", DefaultDegradePercent},
		{"degraderules", "spec.action.action", DefaultFallbackAction},
		{"degraderules", "spec.action.maxStaleness", DefaultMaxStaleness},
		{"degraderules", "spec.action.static.status", DefaultStaticStatus},
	} {
		t.Run(tc.crd+"/"+tc.path, func(t *testing.T) { checkDefault(t, tc.crd, tc.path, tc.want) })
	}
}

// TestAgentDefaultsMatchCRD checks the defaults the agent's packages give a zero field against
// the CRD's: a breaker or recovery Config built in code (a test, a bootstrap file's omitted
// field) behaves as the quota's default would. Both come from package defaults; this fails when
// an agent package states a value of its own again.
func TestAgentDefaultsMatchCRD(t *testing.T) {
	for _, tc := range []struct {
		path string
		want any
	}{
		{"spec.agent.circuitBreaker.window", breaker.DefaultWindow},
		{"spec.agent.circuitBreaker.minimumCalls", breaker.DefaultMinCalls},
		{"spec.agent.circuitBreaker.openDuration", breaker.DefaultOpenDuration},
		{"spec.agent.circuitBreaker.halfOpenProbes", breaker.DefaultHalfOpenProbes},
		{"spec.agent.circuitBreaker.failureRatePercent", recovery.DefaultFailureRatePercent},
		{"spec.agent.recovery.window", recovery.DefaultWindow},
		{"spec.agent.recovery.ramp.initialPercent", recovery.DefaultInitialPercent},
		{"spec.agent.recovery.ramp.stepPercent", recovery.DefaultStepPercent},
		{"spec.agent.recovery.ramp.healthyWindows", recovery.DefaultHealthyWindows},
		{"spec.agent.recovery.adaptive.tolerancePercent", recovery.DefaultAdaptiveTolerancePercent},
		{"spec.agent.recovery.adaptive.baselineWindows", recovery.DefaultBaselineWindows},
		{"spec.agent.recovery.adaptive.minLimit", recovery.DefaultMinLimit},
	} {
		t.Run(tc.path, func(t *testing.T) { checkDefault(t, "downstreamquotas", tc.path, tc.want) })
	}
}

// checkDefault fails t unless the CRD's default at path is want: a time.Duration is compared
// with the parsed duration string, anything else as JSON.
func checkDefault(t *testing.T, crd, path string, want any) {
	t.Helper()
	s := schemaAt(t, crd, path)
	if s.Default == nil {
		t.Fatalf("no default in the CRD; the constant says %v", want)
	}
	if d, ok := want.(time.Duration); ok {
		var got string
		if err := json.Unmarshal(s.Default.Raw, &got); err != nil {
			t.Fatalf("CRD default %s is not a duration string: %v", s.Default.Raw, err)
		}
		if g, err := time.ParseDuration(got); err != nil || g != d {
			t.Fatalf("CRD default %q, constant %v", got, d)
		}
		return
	}
	w, err := json.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(s.Default.Raw); got != string(w) {
		t.Fatalf("CRD default %s, constant %s", got, w)
	}
}

// schemaAt walks a CRD's v1alpha1 schema along a dotted path ("a.b[].c": [] steps into items).
func schemaAt(t *testing.T, crd, path string) apiextensionsv1.JSONSchemaProps {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("..", "..", "config", "crd", "bases", "apportion.io_"+crd+".yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var c apiextensionsv1.CustomResourceDefinition
	if err := yaml.Unmarshal(raw, &c); err != nil {
		t.Fatal(err)
	}
	var s *apiextensionsv1.JSONSchemaProps
	for _, v := range c.Spec.Versions {
		if v.Name == GroupVersion.Version {
			s = v.Schema.OpenAPIV3Schema
		}
	}
	if s == nil {
		t.Fatalf("%s has no %s schema", crd, GroupVersion.Version)
	}
	for _, part := range strings.Split(path, ".") {
		name, items := strings.CutSuffix(part, "[]")
		p, ok := s.Properties[name]
		if !ok {
			t.Fatalf("%s: no property %q", crd, name)
		}
		s = &p
		if items {
			s = s.Items.Schema
		}
	}
	return *s
}
