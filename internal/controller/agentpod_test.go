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

func TestAgentBootstraps(t *testing.T) {
	for _, tc := range []struct {
		name    string
		command []string
		args    []string
		want    bool
	}{
		{"no flags", nil, nil, false},
		{"other flags", []string{"/agent"}, []string{"--listen=:15001", "--bootstrap-not-this"}, false},
		{"a value that says bootstrap", []string{"/agent"}, []string{"--key-file", "bootstrap"}, false},
		{"--bootstrap FILE", []string{"/agent"}, []string{"--bootstrap", "/etc/boot.json"}, true},
		{"--bootstrap=FILE", nil, []string{"--bootstrap=/etc/boot.json"}, true},
		{"-bootstrap in the command", []string{"/agent", "-bootstrap", "/b.json"}, nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := &corev1.Pod{Spec: corev1.PodSpec{Containers: []corev1.Container{
				{Name: "app", Args: []string{"serve"}},
				{Name: "agent", Command: tc.command, Args: tc.args},
			}}}
			if got := agentBootstraps(p); got != tc.want {
				t.Fatalf("agentBootstraps(%q %q) = %v, want %v", tc.command, tc.args, got, tc.want)
			}
		})
	}
}

func TestAgentOf(t *testing.T) {
	always := corev1.ContainerRestartPolicyAlways
	ctl := []corev1.ContainerPort{{Name: apportionv1.AgentPortName, ContainerPort: 15000}}
	appCtl := []corev1.ContainerPort{{Name: apportionv1.AgentPortName, ContainerPort: 8080}}
	annotated := func(port string) metav1.ObjectMeta {
		return metav1.ObjectMeta{Annotations: map[string]string{apportionv1.AgentPortAnnotation: port}}
	}
	// injected is a pod as the webhook leaves it: the agent as the first native sidecar, and the
	// annotation the webhook writes.
	injected := func(meta metav1.ObjectMeta, app ...corev1.Container) corev1.Pod {
		return corev1.Pod{ObjectMeta: meta, Spec: corev1.PodSpec{
			Containers:     append([]corev1.Container{{Name: "app"}}, app...),
			InitContainers: []corev1.Container{{Name: apportionv1.AgentContainerName, RestartPolicy: &always, Ports: ctl}},
		}}
	}
	for _, tc := range []struct {
		name string
		pod  corev1.Pod
		want podAgent
	}{
		{"nothing", corev1.Pod{Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "app"}}}}, podAgent{}},
		{"annotation", corev1.Pod{ObjectMeta: annotated("15100")}, podAgent{Port: 15100}},
		{"annotation wins over another container's named port", corev1.Pod{ObjectMeta: annotated("15100"),
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "agent", Ports: ctl}}}}, podAgent{Port: 15100}},
		{"a bad annotation falls back to the named port", corev1.Pod{ObjectMeta: annotated("ctl"),
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "agent", Ports: ctl}}}}, podAgent{Port: 15000}},
		{"named port in a container", corev1.Pod{Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "app"}, {Name: "agent", Ports: ctl}}}}, podAgent{Port: 15000}},
		{"native sidecar with port and --bootstrap", corev1.Pod{Spec: corev1.PodSpec{
			Containers:     []corev1.Container{{Name: "app"}},
			InitContainers: []corev1.Container{{Name: "apportion-agent", RestartPolicy: &always, Ports: ctl, Args: []string{"--bootstrap=/b.json"}}},
		}}, podAgent{Port: 15000, Bootstrap: true}},
		{"a plain init container is not an agent", corev1.Pod{Spec: corev1.PodSpec{
			Containers:     []corev1.Container{{Name: "app"}},
			InitContainers: []corev1.Container{{Name: "setup", Ports: ctl, Args: []string{"--bootstrap"}}},
		}}, podAgent{}},
		// An injected pod: its agent is the injected container, whatever the pod says.
		{"injected", injected(annotated("15000")), podAgent{Port: 15000}},
		{"injected, the pod's own annotation names its app", injected(annotated("8080")), podAgent{Port: 15000}},
		{"injected, annotation edited to a bad value", injected(annotated("ctl")), podAgent{Port: 15000}},
		{"injected, the app names a port apportion-ctl", injected(metav1.ObjectMeta{}, corev1.Container{Name: "web", Ports: appCtl}), podAgent{Port: 15000}},
		{"injected, both", injected(annotated("8080"), corev1.Container{Name: "web", Ports: appCtl}), podAgent{Port: 15000}},
		{"a hand-written apportion-agent container wins over the annotation", corev1.Pod{ObjectMeta: annotated("8080"),
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "web", Ports: appCtl}, {Name: apportionv1.AgentContainerName, Ports: ctl}}}}, podAgent{Port: 15000}},
		{"an apportion-agent without a named port: the annotation", corev1.Pod{ObjectMeta: annotated("15100"),
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "web", Ports: appCtl}, {Name: apportionv1.AgentContainerName}}}}, podAgent{Port: 15100}},
		{"an apportion-agent plain init container is not looked at", corev1.Pod{ObjectMeta: annotated("15100"),
			Spec: corev1.PodSpec{InitContainers: []corev1.Container{{Name: apportionv1.AgentContainerName, Ports: ctl}}}}, podAgent{Port: 15100}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := agentOf(&tc.pod); got != tc.want {
				t.Fatalf("agentOf = %+v, want %+v", got, tc.want)
			}
			// The manager reads pods from its cache: the stripped pod must say the same.
			stripped, err := StripPod(tc.pod.DeepCopy())
			if err != nil {
				t.Fatal(err)
			}
			if got := agentOf(stripped.(*corev1.Pod)); got != tc.want {
				t.Fatalf("agentOf(StripPod) = %+v, want %+v", got, tc.want)
			}
		})
	}
}

// computeStatus with the Pusher's report: pods without an agent make PodsReachable false (it
// no longer claims every agent answered) and Ready false, and are named, capped; unreachable
// agents take precedence in PodsReachable.
func TestComputeStatusPodsWithoutAgent(t *testing.T) {
	dq := builders.MakeDownstreamQuota("", "").Generation(1).Limit(50).Upstream("").Obj()
	target := apportionv1.Target{Kind: apportionv1.KindDeployment, Name: "gateway"}
	var pods []corev1.Pod
	for i := range 14 {
		p := builders.MakePod(fmt.Sprintf("gateway-%02d", i), "").Running("10.0.0.1")
		if i < 2 {
			p.AgentPort(15000)
		}
		pods = append(pods, *p.Obj())
	}
	pods = append(pods, *builders.MakePod("gateway-pending", "").Obj()) // no IP: not calling
	obs := []targetObservation{{Target: target, Found: true, SpecReplicas: 15, Pods: pods}}
	split := splitFor(dq, obs, 0)
	now := metav1.Now()
	cond := func(st apportionv1.DownstreamQuotaStatus, typ string) metav1.Condition {
		c := meta.FindStatusCondition(st.Conditions, typ)
		if c == nil {
			t.Fatalf("no %s condition", typ)
		}
		return *c
	}

	st := computeStatus(dq, obs, split, &push.Report{Converged: true}, now)
	if st.Pods != 15 {
		t.Fatalf("pods counted %d, want 15 (pods without an agent stay counted)", st.Pods)
	}
	c := cond(st, apportionv1.ConditionPodsWithoutAgent)
	if c.Status != metav1.ConditionTrue || c.Reason != apportionv1.ReasonAgentNotFound ||
		!strings.Contains(c.Message, "12 pods have no agent") ||
		!strings.Contains(c.Message, "gateway-02, gateway-03, gateway-04, gateway-05, gateway-06, gateway-07, gateway-08, gateway-09, gateway-10, gateway-11 and 2 more") ||
		strings.Contains(c.Message, "gateway-00") || strings.Contains(c.Message, "pending") {
		t.Fatalf("PodsWithoutAgent = %+v", c)
	}
	if c := cond(st, apportionv1.ConditionPodsReachable); c.Status != metav1.ConditionFalse || c.Reason != apportionv1.ReasonAgentNotFound {
		t.Fatalf("PodsReachable = %+v", c)
	}
	if c := cond(st, apportionv1.ConditionReady); c.Status != metav1.ConditionFalse || c.Reason != apportionv1.ConditionPodsWithoutAgent {
		t.Fatalf("Ready = %+v", c)
	}

	st = computeStatus(dq, obs, split, &push.Report{Converged: true, Unreachable: []string{"gateway-00"}}, now)
	if c := cond(st, apportionv1.ConditionPodsReachable); c.Status != metav1.ConditionFalse || c.Reason != apportionv1.ReasonAgentsUnreachable {
		t.Fatalf("PodsReachable with an unreachable agent = %+v", c)
	}

	obs[0].Pods = pods[:2]
	obs[0].SpecReplicas = 2
	st = computeStatus(dq, obs, splitFor(dq, obs, 0), &push.Report{Converged: true}, now)
	for _, typ := range []string{apportionv1.ConditionPodsReachable, apportionv1.ConditionReady} {
		if c := cond(st, typ); c.Status != metav1.ConditionTrue {
			t.Fatalf("%s with every agent = %+v", typ, c)
		}
	}
	if c := cond(st, apportionv1.ConditionPodsWithoutAgent); c.Status != metav1.ConditionFalse {
		t.Fatalf("PodsWithoutAgent with every agent = %+v", c)
	}
}

// The safe default's replica bound: HPA maxReplicas while there is an HPA, the kept bound
// (never lower than replicas) without one.
func TestMaxReplicasKeepsTheBound(t *testing.T) {
	hpa := &apportionv1.HPAStatus{MaxReplicas: 16, DesiredReplicas: 8, CurrentReplicas: 8}
	for _, tc := range []struct {
		name string
		o    targetObservation
		want int64
	}{
		{"HPA", targetObservation{Found: true, SpecReplicas: 8, HPA: hpa, Kept: 4}, 16},
		{"HPA below the pods", targetObservation{Found: true, SpecReplicas: 20, HPA: hpa}, 20},
		{"no HPA, nothing kept", targetObservation{Found: true, SpecReplicas: 8}, 8},
		{"no HPA, kept from a deleted HPA", targetObservation{Found: true, SpecReplicas: 8, Kept: 16}, 16},
		{"no HPA, scaled above the kept bound", targetObservation{Found: true, SpecReplicas: 20, Kept: 16}, 20},
	} {
		if got := tc.o.maxReplicas(); got != tc.want {
			t.Errorf("%s: maxReplicas = %d, want %d", tc.name, got, tc.want)
		}
	}
}
