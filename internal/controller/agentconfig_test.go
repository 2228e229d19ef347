package controller

import (
	"testing"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/builders"
)

// The rate contract's mode reaches the agents through the template's Rate (the engine fills in
// each pod's PerSecond and Burst); no contract, no Rate.
func TestDownstreamTemplateRateMode(t *testing.T) {
	for _, tc := range []struct {
		name string
		dq   *apportionv1.DownstreamQuota
		want *assignment.Rate
	}{
		{"no contract", builders.MakeDownstreamQuota("q", "ns").Limit(10).Obj(), nil},
		{"mode left out", builders.MakeDownstreamQuota("q", "ns").Limit(10).Rate(10, 1).Obj(), &assignment.Rate{Mode: assignment.ModeTokenBucket}},
		{"Pacing", builders.MakeDownstreamQuota("q", "ns").Limit(10).Rate(10, 1).RateMode(apportionv1.RatePacing).Obj(), &assignment.Rate{Mode: assignment.ModePacing}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := downstreamTemplate(tc.dq).Rate
			if (got == nil) != (tc.want == nil) || (got != nil && *got != *tc.want) {
				t.Fatalf("template rate = %+v, want %+v", got, tc.want)
			}
		})
	}
}
