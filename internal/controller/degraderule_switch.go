package controller

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"k8s.io/utils/ptr"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/push"
)

// switchFor turns a DegradeRule into the switch the agents enforce, if it may be pushed at now.
//
// A rule is pushed only once the DegradeRule controller has judged its current spec valid: its
// status must describe the current generation (status.observedGeneration == generation) with
// phase Pending or Active. So a rule that was just created or edited is not pushed by a
// DownstreamQuota reconcile that runs before the DegradeRule controller has looked at it, and a
// rule whose expiry was already past or beyond the manager's horizon, whose DownstreamQuota or
// target does not exist, or that the agents would refuse, never reaches an agent. Besides, the
// rule must be switched on and now must be before its expiry.
//
// The price: an edit withdraws the rule's previous form until the DegradeRule controller has
// judged the new one (one reconcile, typically milliseconds), after which the new form is pushed.
func switchFor(rule *apportionv1.DegradeRule, now time.Time) (push.TargetedSwitch, bool) {
	if rule.Spec.Active != nil && !*rule.Spec.Active {
		return push.TargetedSwitch{}, false
	}
	if !now.Before(rule.Spec.ExpiresAt.Time) {
		return push.TargetedSwitch{}, false
	}
	if rule.Status.ObservedGeneration != rule.Generation {
		return push.TargetedSwitch{}, false
	}
	if p := rule.Status.Phase; p != apportionv1.PhasePending && p != apportionv1.PhaseActive {
		return push.TargetedSwitch{}, false
	}
	return switchOf(rule), true
}

// switchOf converts a rule's spec to the switch the agents enforce, whatever its state.
func switchOf(rule *apportionv1.DegradeRule) push.TargetedSwitch {
	sw := assignment.Switch{
		Name:       switchName(rule),
		Downstream: rule.Spec.Downstream,
		ExpiresAt:  rule.Spec.ExpiresAt.UTC(),
		Percent:    apportionv1.DefaultDegradePercent,
		Action:     fallbackFor(&rule.Spec.Action),
		DryRun:     rule.Spec.DryRun,
	}
	if s := rule.Spec.Scope; s != nil {
		sw.Percent = ptr.Deref(s.Percent, apportionv1.DefaultDegradePercent)
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
	return ts
}

// switchName is the name a rule's switch travels under, "<namespace>/<rule>".
func switchName(rule *apportionv1.DegradeRule) string { return rule.Namespace + "/" + rule.Name }

// agentRefusal runs the agents' own validation on a rule's switch and returns what they would
// refuse, with paths of the DegradeRule (e.g. `spec.action.static.headers["a b"]: ...`), or "".
// The CRD admits what the agents accept for nearly every field; this catches the rest (header
// names of a static answer, for one), which would otherwise make the agents refuse the whole
// assignment that carries the switch.
func agentRefusal(rule *apportionv1.DegradeRule) string {
	sw := switchOf(rule).Switch
	a := assignment.Assignment{
		Epoch: 1, Generation: 1, LeaseTTL: assignment.Duration(assignment.MinLeaseTTL),
		Downstreams: []assignment.Downstream{{Name: sw.Downstream}},
		Switches:    []assignment.Switch{sw},
	}
	err := a.Validate()
	if err == nil {
		return ""
	}
	var errs []error
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = j.Unwrap()
	} else {
		errs = []error{err}
	}
	var out []string
	for _, e := range errs {
		var fe *assignment.FieldError
		if !errors.As(e, &fe) {
			continue
		}
		rest, ok := strings.CutPrefix(fe.Path, "switches[0]")
		if !ok {
			continue // the placeholder downstream, not the rule
		}
		rest = strings.TrimPrefix(rest, ".")
		var path string
		switch {
		case strings.HasPrefix(rest, "action"):
			path = "spec." + rest
		case rest == "name":
			path = "metadata.name"
		case rest == "downstream", rest == "expiresAt":
			path = "spec." + rest
		default: // percent, keyHeader, headers[i].name, methods
			path = "spec.scope." + rest
		}
		out = append(out, path+": "+fe.Message)
	}
	if len(out) == 0 {
		return ""
	}
	return strings.Join(out, "; ")
}

// scopeSummary is the SCOPE printer column, e.g. "10% by X-User-Id, GET".
func scopeSummary(s *apportionv1.DegradeScope) string {
	if s == nil {
		return "100%"
	}
	parts := []string{fmt.Sprintf("%d%%", ptr.Deref(s.Percent, apportionv1.DefaultDegradePercent))}
	if s.KeyHeader != "" && ptr.Deref(s.Percent, apportionv1.DefaultDegradePercent) < 100 {
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
