package v1alpha1

// Labels, annotations and names that users and the agent's pod spec carry. They are part of the
// API: the injection webhook, the manager and the manifests read them, and each is defined here
// only. (The webhook's namespaceSelector in internal/inject's +kubebuilder:webhook marker spells
// InjectionLabel=InjectionEnabled out, as markers cannot name constants; a test in
// internal/inject checks the generated manifest against these constants.)
const (
	// InjectionLabel on a namespace, set to InjectionEnabled, asks for agents in its pods: the
	// injection webhook's namespaceSelector. The manager also keeps the trust ConfigMap in
	// every such namespace, so that it exists before the first agent there starts.
	InjectionLabel = "apportion.io/injection"
	// InjectionEnabled is the value of InjectionLabel that opts a namespace in.
	InjectionEnabled = "enabled"
	// InjectAnnotation set to "false" on a pod opts it out of injection; "true" is the same as
	// absent.
	InjectAnnotation = "apportion.io/inject"
	// AgentContainerName is the name of the agent's container: the native sidecar the injection
	// webhook adds, or a hand-written one. It marks a pod as having its agent (the webhook leaves
	// such a pod alone), and the manager talks to that container's AgentPortName port, whatever
	// else the pod says.
	AgentContainerName = "apportion-agent"
	// AgentPortAnnotation on a pod names its agent's control port (a number) for a pod whose
	// agent is not a container named AgentContainerName with an AgentPortName port; such a
	// container's port wins over it.
	AgentPortAnnotation = "apportion.io/agent-port"
	// AgentPortName is the name of the agent container's control port.
	AgentPortName = "apportion-ctl"
	// TrustConfigMap is the name of the ConfigMap of the manager's public keys that agents
	// verify its pushes with, kept by the manager in every namespace with agents and mounted by
	// every injected agent. The name is reserved in those namespaces: the manager's RBAC
	// (resourceNames) and the admission policy that keeps tenants from writing it name it too,
	// so it is not configurable.
	TrustConfigMap = "apportion-trust"
)
