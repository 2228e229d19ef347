// Package v1alpha1 contains the apportion.io/v1alpha1 API: DownstreamQuota, one downstream's
// global contract and how it is shared, and DegradeRule, a person's expiring switch that degrades
// a downstream for a scope of traffic.
//
// +kubebuilder:object:generate=true
// +groupName=apportion.io
package v1alpha1

import (
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/scheme"
)

var (
	// GroupVersion is group version used to register these objects.
	GroupVersion = schema.GroupVersion{Group: "apportion.io", Version: "v1alpha1"}

	// SchemeBuilder is used to add go types to the GroupVersionKind scheme.
	SchemeBuilder = &scheme.Builder{GroupVersion: GroupVersion}

	// AddToScheme adds the types in this group-version to the given scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)
