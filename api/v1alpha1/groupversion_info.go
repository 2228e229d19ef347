// Package v1alpha1 contains the apportion.io/v1alpha1 API: DownstreamQuota, one downstream's
// global contract and how it is shared, and DegradeRule, a person's expiring switch that degrades
// a downstream for a scope of traffic.
//
// +kubebuilder:object:generate=true
// +groupName=apportion.io
package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

var (
	// GroupVersion is group version used to register these objects.
	GroupVersion = schema.GroupVersion{Group: "apportion.io", Version: "v1alpha1"}

	// SchemeBuilder collects the functions that add this group-version's types to a scheme.
	SchemeBuilder = runtime.NewSchemeBuilder(addKnownTypes)

	// AddToScheme adds the types in this group-version to the given scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

func addKnownTypes(s *runtime.Scheme) error {
	s.AddKnownTypes(GroupVersion,
		&DownstreamQuota{}, &DownstreamQuotaList{},
		&DegradeRule{}, &DegradeRuleList{},
		&GlobalQuota{}, &GlobalQuotaList{},
		&ClusterSlice{}, &ClusterSliceList{},
	)
	metav1.AddToGroupVersion(s, GroupVersion)
	return nil
}
