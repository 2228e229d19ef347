package v1alpha1

import (
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// SetCondition keeps a condition's LastTransitionTime while its status stays, moves it when the
// status changes, and stamps the status's generation.
func TestSetCondition(t *testing.T) {
	t0 := metav1.NewTime(time.Date(2026, 12, 1, 10, 0, 0, 0, time.UTC))
	t1 := metav1.NewTime(t0.Add(time.Minute))
	st := DownstreamQuotaStatus{ObservedGeneration: 3}
	st.SetCondition(ConditionReady, true, ReasonApportioned, "ok", t0)
	st.SetCondition(ConditionReady, true, ReasonApportioned, "still ok", t1)
	c := st.Conditions[0]
	if c.Status != metav1.ConditionTrue || c.Message != "still ok" || !c.LastTransitionTime.Equal(&t0) || c.ObservedGeneration != 3 {
		t.Fatalf("same status: %+v", c)
	}
	st.SetCondition(ConditionReady, false, ReasonPushing, "pushing", t1)
	if c := st.Conditions[0]; c.Status != metav1.ConditionFalse || c.Reason != ReasonPushing || !c.LastTransitionTime.Equal(&t1) {
		t.Fatalf("changed status: %+v", c)
	}
	rule := DegradeRuleStatus{ObservedGeneration: 7}
	rule.SetCondition(ConditionValid, false, ReasonExpiryPast, "past", t0)
	if c := rule.Conditions[0]; c.Type != ConditionValid || c.Status != metav1.ConditionFalse || c.ObservedGeneration != 7 {
		t.Fatalf("rule: %+v", c)
	}
}
