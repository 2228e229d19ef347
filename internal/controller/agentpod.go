package controller

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	corev1 "k8s.io/api/core/v1"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// podAgent is what a pod's spec says about its Apportion agent.
type podAgent struct {
	// Port is the agent's control port; 0 when the pod has none the manager can find.
	Port int
	// Bootstrap is true when an agent container runs with a --bootstrap flag.
	Bootstrap bool
}

// agentOf is the one place that finds a pod's agent. The containers it looks at are the pod's
// containers and its native sidecars (init containers with restartPolicy Always, where an
// injected agent runs); other init containers finish before the app starts. The control port is,
// first that applies:
//
//  1. the port named apportion-ctl of the container named apportion-agent
//     (apportionv1.AgentContainerName): the container the injection webhook adds — the name is
//     its marker, and the webhook injects no pod that already has it. Nothing else the pod says
//     moves the manager off it, so a pod that passed an admission policy requiring the genuine
//     sidecar talks to the manager through that sidecar: its own apportion.io/agent-port
//     annotation (mutable on a running pod) and any other container's apportion-ctl port are
//     ignored;
//  2. the port of the pod's apportion.io/agent-port annotation, when it is a port number (a
//     hand-written agent of another name);
//  3. the first port named apportion-ctl of any of those containers.
//
// Bootstrap is a --bootstrap flag in the command or arguments of any of those containers (the
// ledger then counts the pod at its safe default until its agent answers: claiming it only
// costs the pod's own quota room).
func agentOf(p *corev1.Pod) podAgent {
	var a podAgent
	agent, named := 0, 0 // the apportion-agent container's port; the first named port elsewhere
	check := func(c *corev1.Container) {
		for _, cp := range c.Ports {
			if !isAgentPort(cp) {
				continue
			}
			if c.Name == apportionv1.AgentContainerName && agent == 0 {
				agent = int(cp.ContainerPort)
			}
			if named == 0 {
				named = int(cp.ContainerPort)
			}
		}
		for _, list := range [][]string{c.Command, c.Args} {
			if slices.ContainsFunc(list, isBootstrapArg) {
				a.Bootstrap = true
			}
		}
	}
	for i := range p.Spec.Containers {
		check(&p.Spec.Containers[i])
	}
	for i := range p.Spec.InitContainers {
		if c := &p.Spec.InitContainers[i]; isNativeSidecar(c) {
			check(c)
		}
	}
	switch {
	case agent != 0:
		a.Port = agent
	case annotatedPort(p) != 0:
		a.Port = annotatedPort(p)
	default:
		a.Port = named
	}
	return a
}

// annotatedPort is the port of the pod's apportion.io/agent-port annotation; 0 when it has none
// or it is not a port number.
func annotatedPort(p *corev1.Pod) int {
	if v, ok := p.Annotations[apportionv1.AgentPortAnnotation]; ok {
		if n, err := strconv.Atoi(v); err == nil && n > 0 && n < 65536 {
			return n
		}
	}
	return 0
}

// isAgentPort says whether a container port is an agent's control port (named apportion-ctl).
func isAgentPort(cp corev1.ContainerPort) bool {
	return cp.Name == apportionv1.AgentPortName && cp.ContainerPort > 0
}

// isBootstrapArg says whether one word of a command or its arguments is the agent's --bootstrap
// flag (-bootstrap, --bootstrap, --bootstrap=FILE), not a value that merely says bootstrap.
func isBootstrapArg(arg string) bool {
	flag, _, _ := strings.Cut(strings.TrimLeft(arg, "-"), "=")
	return strings.HasPrefix(arg, "-") && flag == "bootstrap"
}

// isNativeSidecar says whether an init container runs beside the app (restartPolicy Always),
// where an injected agent runs; other init containers finish before the app starts.
func isNativeSidecar(c *corev1.Container) bool {
	return c.RestartPolicy != nil && *c.RestartPolicy == corev1.ContainerRestartPolicyAlways
}

// agentEndpoint is the pod's agent control URL, or "" when the pod has no IP or no agent port.
func agentEndpoint(p *corev1.Pod) string {
	port := agentOf(p).Port
	if p.Status.PodIP == "" || port == 0 {
		return ""
	}
	host := p.Status.PodIP
	if strings.Contains(host, ":") {
		host = "[" + host + "]"
	}
	return fmt.Sprintf("http://%s:%d", host, port)
}

// agentBootstraps says whether the pod's agent runs with a --bootstrap flag (in its command or
// arguments): such an agent may call on its safe default before the manager reached it, so the
// ledger counts it at that until it answers.
func agentBootstraps(p *corev1.Pod) bool { return agentOf(p).Bootstrap }

// withoutAgent says whether the pod may be calling (it has an IP) but has no agent the manager
// can find: it is counted at its share, and nothing enforces it.
func withoutAgent(p *corev1.Pod) bool { return p.Status.PodIP != "" && agentOf(p).Port == 0 }
