package inject

import (
	corev1 "k8s.io/api/core/v1"

	"github.com/apportion/apportion/internal/push"
)

// TrustVolumeName names the volume of the agent's trust material.
const TrustVolumeName = "apportion-keys"

// TrustMountPath is where the agent reads it.
const TrustMountPath = "/etc/apportion/keys"

// TrustMaterial is what an agent needs to tell the manager's pushes from anyone else's: the
// volume, its mount in the agent and the agent's flag that points at it. Today it is the agents'
// HMAC key Secret (push.DefaultAgentKeySecret), which the manager keeps in every namespace
// labelled for injection and every namespace with a DownstreamQuota, so it exists before the
// first injected pod starts. This is the ONE place that says so: a change of trust model changes
// this function and nothing else in the injector.
func TrustMaterial() (corev1.Volume, corev1.VolumeMount, []string) {
	vol := corev1.Volume{
		Name: TrustVolumeName,
		VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{
			SecretName: push.DefaultAgentKeySecret,
			// The files stay at the default mode 0644: they are owned by root, and the agent runs
			// as a non-root user with no fsGroup of its own. Only the agent mounts the volume.
		}},
	}
	mount := corev1.VolumeMount{Name: TrustVolumeName, MountPath: TrustMountPath, ReadOnly: true}
	return vol, mount, []string{"--key-dir=" + TrustMountPath}
}
