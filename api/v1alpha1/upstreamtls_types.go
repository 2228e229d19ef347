package v1alpha1

// TLSVersion is a TLS protocol version the agent accepts at least.
// +kubebuilder:validation:Enum="1.2";"1.3"
type TLSVersion string

const (
	TLSVersion12 TLSVersion = "1.2"
	TLSVersion13 TLSVersion = "1.3"
)

// UpstreamTLS says how agents speak TLS to an https upstream: which name the server's
// certificate must carry, which CAs it must chain to, and the client certificate a partner that
// requires mutual TLS wants. Verification is always on; insecureSkipVerifyDangerous is the only
// way out, and the quota then carries a Warning condition and Event.
//
// The ConfigMap and the Secret are read by nobody but the kubelet: the injection webhook mounts
// them into the agent's container (read-only, not optional: a missing object keeps the pod from
// starting, and says so in its events), and the agent reads the files, again when they rotate.
// A tls block added to a quota applies to pods created after it (a pod's volumes are fixed when
// it is created).
// +kubebuilder:validation:XValidation:rule="!(has(self.insecureSkipVerifyDangerous) && self.insecureSkipVerifyDangerous && has(self.caBundle))",message="caBundle has no use with insecureSkipVerifyDangerous: the server's certificate is not verified",fieldPath=".caBundle"
type UpstreamTLS struct {
	// serverName is the name sent in SNI and that the server's certificate must carry; the
	// upstream URL's host when empty (an IP address is verified against the certificate's IP
	// addresses and not sent in SNI).
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$') || isIP(self)",message="serverName must be a lower-case DNS name or an IP address"
	// +optional
	ServerName string `json:"serverName,omitempty"`
	// caBundle is a ConfigMap key, in the quota's namespace, holding the PEM CA certificates
	// the server's chain must lead to; the system roots of the agent's image when absent.
	// +optional
	CABundle *ConfigMapKey `json:"caBundle,omitempty"`
	// clientCertificate is a Secret of type kubernetes.io/tls (keys tls.crt and tls.key), in
	// the quota's namespace, the agent presents to a server that asks for one (mutual TLS).
	// +optional
	ClientCertificate *SecretName `json:"clientCertificate,omitempty"`
	// minVersion is the lowest TLS version the agent accepts: "1.2" (the default) or "1.3".
	// +kubebuilder:default="1.2"
	// +optional
	MinVersion TLSVersion `json:"minVersion,omitempty"`
	// insecureSkipVerifyDangerous: the agent accepts any certificate from the server, which
	// anyone on the path can then impersonate. For a test bench only; the quota's
	// UpstreamTLSVerified condition is False (a Warning) while it is set.
	// +optional
	InsecureSkipVerifyDangerous bool `json:"insecureSkipVerifyDangerous,omitempty"`
}

// ConfigMapKey is a key of a ConfigMap in the quota's namespace.
type ConfigMapKey struct {
	// name of the ConfigMap.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')",message="name must be a DNS-1123 subdomain: lower-case letters, digits, '-' and '.'"
	// +required
	Name string `json:"name"`
	// key in the ConfigMap; ca.crt when empty.
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self.matches('^[-._a-zA-Z0-9]+$') && self != '.' && self != '..'",message="key must be a ConfigMap key: letters, digits, '-', '_' and '.'"
	// +kubebuilder:default="ca.crt"
	// +optional
	Key string `json:"key,omitempty"`
}

// SecretName names a Secret in the quota's namespace.
type SecretName struct {
	// name of the Secret.
	// +kubebuilder:validation:MinLength=1
	// +kubebuilder:validation:MaxLength=253
	// +kubebuilder:validation:XValidation:rule="self.matches('^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$')",message="name must be a DNS-1123 subdomain: lower-case letters, digits, '-' and '.'"
	// +required
	Name string `json:"name"`
}

// DefaultCAKey is the ConfigMap key a caBundle names when it names none.
const DefaultCAKey = "ca.crt"

// ConditionUpstreamTLSVerified, on a quota with spec.upstreamTLS only: False (reason
// VerificationDisabled, with a Warning Event) while insecureSkipVerifyDangerous is set, True
// (reason Verified) otherwise.
const (
	ConditionUpstreamTLSVerified = "UpstreamTLSVerified"
	ReasonVerified               = "Verified"
	ReasonVerificationDisabled   = "VerificationDisabled"
)
