package controller

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/inject"
)

// upstreamTLSFor converts a quota's spec.upstreamTLS to the wire: the files where the injection
// webhook mounts its ConfigMap and Secret (inject.UpstreamTLSFiles); nil without one.
func upstreamTLSFor(dq *apportionv1.DownstreamQuota) *assignment.UpstreamTLS {
	t := dq.Spec.UpstreamTLS
	if t == nil {
		return nil
	}
	out := &assignment.UpstreamTLS{
		ServerName:         t.ServerName,
		MinVersion:         string(t.MinVersion),
		InsecureSkipVerify: t.InsecureSkipVerifyDangerous,
	}
	if out.MinVersion == "" {
		out.MinVersion = string(apportionv1.TLSVersion12)
	}
	if !out.InsecureSkipVerify {
		out.CAFile, out.CertFile, out.KeyFile = inject.UpstreamTLSFiles(dq.Name, t)
	} else {
		_, out.CertFile, out.KeyFile = inject.UpstreamTLSFiles(dq.Name, t)
	}
	return out
}

// setUpstreamTLSCondition sets UpstreamTLSVerified for a quota with spec.upstreamTLS: False
// (reason VerificationDisabled, a Warning Event with it) while insecureSkipVerifyDangerous is
// set, True otherwise. A quota without the block has no such condition.
func setUpstreamTLSCondition(dq *apportionv1.DownstreamQuota, st *apportionv1.DownstreamQuotaStatus, set func(t string, ok bool, reason, msg string)) {
	t := dq.Spec.UpstreamTLS
	switch {
	case t == nil:
		meta.RemoveStatusCondition(&st.Conditions, apportionv1.ConditionUpstreamTLSVerified)
	case t.InsecureSkipVerifyDangerous:
		set(apportionv1.ConditionUpstreamTLSVerified, false, apportionv1.ReasonVerificationDisabled,
			"insecureSkipVerifyDangerous is set: the agents accept any certificate from "+dq.Spec.Upstream+", and anyone on the path can impersonate it")
	default:
		set(apportionv1.ConditionUpstreamTLSVerified, true, apportionv1.ReasonVerified,
			"the agents verify the upstream's certificate chain and name")
	}
}

// insecureTLSEvent: a Warning each time verification is turned off.
func insecureTLSEvent(c *eventContext) (statusEvent, bool) {
	now := meta.FindStatusCondition(c.After.Conditions, apportionv1.ConditionUpstreamTLSVerified)
	if now == nil || now.Status != metav1.ConditionFalse {
		return statusEvent{}, false
	}
	if old := meta.FindStatusCondition(c.Before.Conditions, apportionv1.ConditionUpstreamTLSVerified); old != nil && old.Status == metav1.ConditionFalse {
		return statusEvent{}, false
	}
	return statusEvent{corev1.EventTypeWarning, apportionv1.ReasonVerificationDisabled, "Apportion", now.Message}, true
}
