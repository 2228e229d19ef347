package v1alpha1

import metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

// FallbackAction is what an agent answers instead of calling the downstream.
// +kubebuilder:validation:Enum=Reject;Static;ServeStale
type FallbackAction string

const (
	// FallbackReject answers 503 application/problem+json naming the downstream and the reason.
	FallbackReject FallbackAction = "Reject"
	// FallbackStatic answers a configured status, headers and body.
	FallbackStatic FallbackAction = "Static"
	// FallbackServeStale answers the last successful response to the same GET URL, if it is
	// younger than maxStaleness; otherwise it rejects.
	FallbackServeStale FallbackAction = "ServeStale"
)

// StaticResponse is a canned answer.
// +kubebuilder:validation:XValidation:rule="!has(self.body) || size(self.body) == 0 || !has(self.status) || (self.status != 204 && self.status != 304)",message="a static answer with status 204 or 304 has no body"
type StaticResponse struct {
	// status is the HTTP status code of the canned answer: a final status, 200 to 599 (an
	// interim 1xx answer cannot end a call).
	// +kubebuilder:validation:Minimum=200
	// +kubebuilder:validation:Maximum=599
	// +kubebuilder:default=200
	// +optional
	Status int32 `json:"status,omitempty"`
	// headers are added to the canned answer.
	// +kubebuilder:validation:MaxProperties=32
	// +optional
	Headers map[string]string `json:"headers,omitempty"`
	// body is the canned answer's body.
	// +kubebuilder:validation:MaxLength=65536
	// +optional
	Body string `json:"body,omitempty"`
}

// HTTPMethod is an HTTP request method.
// +kubebuilder:validation:Enum=GET;HEAD;OPTIONS;POST;PUT;PATCH;DELETE;TRACE
type HTTPMethod string

// Fallback says how an agent answers when it cannot or must not call the downstream.
// +kubebuilder:validation:XValidation:rule="self.action != 'Static' || has(self.static)",message="static is required when action is Static"
type Fallback struct {
	// action is Reject (default), Static or ServeStale.
	// +kubebuilder:default=Reject
	// +optional
	Action FallbackAction `json:"action,omitempty"`
	// static is the canned answer of the Static action.
	// +optional
	Static *StaticResponse `json:"static,omitempty"`
	// maxStaleness bounds the age of a response that ServeStale may serve.
	// +kubebuilder:validation:XValidation:rule="duration(self) >= duration('1s') && duration(self) <= duration('24h')",message="maxStaleness must be between 1s and 24h"
	// +kubebuilder:default="5m"
	// +optional
	MaxStaleness *metav1.Duration `json:"maxStaleness,omitempty"`
	// allowedMethods lists the methods that Static and ServeStale may answer with success.
	// By default only GET, HEAD and OPTIONS are: a canned success for a write would tell the
	// app that a write happened when it did not. Other methods are rejected.
	// +kubebuilder:validation:MaxItems=8
	// +listType=set
	// +optional
	AllowedMethods []HTTPMethod `json:"allowedMethods,omitempty"`
}
