package controller

import (
	"fmt"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/push"
	"github.com/apportion/apportion/internal/testing/builders"
)

// A pod whose agent claimed an epoch no manager holds (push.Report.Misbehaving) is named in the
// PodsReachable condition as misbehaving, among the unreachable ones.
func TestComputeStatusNamesMisbehavingPods(t *testing.T) {
	dq := builders.MakeDownstreamQuota("", "").Generation(1).Limit(50).Upstream("").Obj()
	var pods []corev1.Pod
	for i := range 3 {
		pods = append(pods, *builders.MakePod(fmt.Sprintf("gateway-%d", i), "").Running("10.0.0.1").AgentPort(15000).Obj())
	}
	obs := []targetObservation{{Target: apportionv1.Target{Kind: apportionv1.KindDeployment, Name: "gateway"}, Found: true, SpecReplicas: 3, Pods: pods}}
	rep := &push.Report{Converged: false, Unreachable: []string{"gateway-1", "gateway-2"}, Misbehaving: []string{"gateway-2"}}
	st := computeStatus(dq, obs, splitFor(dq, obs, 0), rep, metav1.Now())
	c := meta.FindStatusCondition(st.Conditions, apportionv1.ConditionPodsReachable)
	if c == nil || c.Status != metav1.ConditionFalse || c.Reason != apportionv1.ReasonAgentsUnreachable ||
		!strings.Contains(c.Message, "agents not reachable: gateway-1, gateway-2") ||
		!strings.Contains(c.Message, "gateway-2 answered with an epoch newer than any manager's (misbehaving") {
		t.Fatalf("PodsReachable = %+v", c)
	}
	rep.Misbehaving = nil
	st = computeStatus(dq, obs, splitFor(dq, obs, 0), rep, metav1.Now())
	if c := meta.FindStatusCondition(st.Conditions, apportionv1.ConditionPodsReachable); strings.Contains(c.Message, "misbehaving") {
		t.Fatalf("PodsReachable without misbehaving pods = %+v", c)
	}
}
