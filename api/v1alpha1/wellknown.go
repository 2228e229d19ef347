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
	// AgentPortAnnotation on a pod names its agent's control port (a number); the manager looks
	// for it first.
	AgentPortAnnotation = "apportion.io/agent-port"
	// AgentPortName is the name of the agent container's control port; the manager uses the
	// container port of that name when the pod has no AgentPortAnnotation.
	AgentPortName = "apportion-ctl"
)
