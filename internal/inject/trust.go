package inject

import (
	corev1 "k8s.io/api/core/v1"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// TrustVolumeName names the volume of the agent's trust material.
const TrustVolumeName = "apportion-trust"

// TrustMountPath is where the agent reads it.
const TrustMountPath = "/etc/apportion/trust"

// TrustMaterial is what an agent needs to tell the manager's pushes from anyone else's: the
// volume, its mount in the agent, the agent's flag that points at it, and the agent's own
// identity, which every signed push must name (docs/protocol.md §10). The volume is the
// manager's public keys, the ConfigMap apportionv1.TrustConfigMap — the one name the manager's
// trust reconciler keeps (in every namespace labelled for injection and every namespace with a
// DownstreamQuota, so it exists before the first injected pod starts), its RBAC names and the
// admission policy that keeps tenants from writing it guards; nothing in it can sign. The pod's name is not
// known at admission (a ReplicaSet's pods are named by generateName after the webhook ran), so
// the identity comes from the downward API. This is the ONE place that says so: a change of
// trust model changes this function and nothing else in the injector.
func TrustMaterial() (corev1.Volume, corev1.VolumeMount, []string, []corev1.EnvVar) {
	vol := corev1.Volume{
		Name: TrustVolumeName,
		VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{
			LocalObjectReference: corev1.LocalObjectReference{Name: apportionv1.TrustConfigMap},
			// No items and no subPath: the kubelet then refreshes the files when the manager
			// publishes or withdraws a key, and the agent re-reads them without a restart.
		}},
	}
	mount := corev1.VolumeMount{Name: TrustVolumeName, MountPath: TrustMountPath, ReadOnly: true}
	env := []corev1.EnvVar{
		{Name: "POD_NAMESPACE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.namespace"}}},
		{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
	}
	return vol, mount, []string{"--trust-dir=" + TrustMountPath}, env
}
