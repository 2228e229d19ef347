package controller

import (
	"fmt"
	"strings"
	"time"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/push"
)

// switchFor turns a DegradeRule into the switch the agents enforce, if it is in force at now:
// active, not expired, not marked invalid.
func switchFor(rule *apportionv1.DegradeRule, now time.Time) (push.TargetedSwitch, bool) {
	if rule.Spec.Active != nil && !*rule.Spec.Active {
		return push.TargetedSwitch{}, false
	}
	if !now.Before(rule.Spec.ExpiresAt.Time) || rule.Status.Phase == apportionv1.PhaseInvalid {
		return push.TargetedSwitch{}, false
	}
	sw := assignment.Switch{
		Name:       rule.Namespace + "/" + rule.Name,
		Downstream: rule.Spec.Downstream,
		ExpiresAt:  rule.Spec.ExpiresAt.Time.UTC(),
		Percent:    100,
		Action:     fallbackFor(&rule.Spec.Action),
	}
	if s := rule.Spec.Scope; s != nil {
		sw.Percent = int32Or(s.Percent, 100)
		sw.KeyHeader = s.KeyHeader
		for _, h := range s.Headers {
			sw.Headers = append(sw.Headers, assignment.HeaderMatch{Name: h.Name, Value: h.Value})
		}
		for _, m := range s.Methods {
			sw.Methods = append(sw.Methods, string(m))
		}
	}
	ts := push.TargetedSwitch{Switch: sw}
	if rule.Spec.Target != nil {
		ts.Target = rule.Spec.Target.Name
	}
	return ts, true
}

// scopeSummary is the SCOPE printer column, e.g. "10% by X-User-Id, GET".
func scopeSummary(s *apportionv1.DegradeScope) string {
	if s == nil {
		return "100%"
	}
	parts := []string{fmt.Sprintf("%d%%", int32Or(s.Percent, 100))}
	if s.KeyHeader != "" && int32Or(s.Percent, 100) < 100 {
		parts[0] += " by " + s.KeyHeader
	}
	for _, h := range s.Headers {
		parts = append(parts, h.Name+"="+h.Value)
	}
	if len(s.Methods) > 0 {
		ms := make([]string, len(s.Methods))
		for i, m := range s.Methods {
			ms[i] = string(m)
		}
		parts = append(parts, strings.Join(ms, "|"))
	}
	return strings.Join(parts, ", ")
}
