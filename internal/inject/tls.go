package inject

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"path"
	"slices"

	corev1 "k8s.io/api/core/v1"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// Upstream TLS material: for a quota whose spec.upstreamTLS names a CA bundle or a client
// certificate, the webhook mounts them into the agent's container, one read-only projected
// volume per quota, at UpstreamTLSDir(quota):
//
//	ca.crt   the caBundle's ConfigMap key
//	tls.crt  the clientCertificate Secret's tls.crt
//	tls.key  the clientCertificate Secret's tls.key
//
// Neither object is optional: a pod whose quota names a missing one does not start, and its
// events say which (the agent would otherwise fail every call). The kubelet, not the manager,
// reads them (the manager has no Secret access), and refreshes the files when the objects
// change; the agent reads them again then (package upstreamtls). The manager tells the agent
// the paths in its assignment (assignment.UpstreamTLS): UpstreamTLSFiles is the one place both
// take them from.
const (
	// UpstreamTLSRoot holds one directory per quota.
	UpstreamTLSRoot = "/var/run/apportion/upstream-tls"
	// The files' names in a quota's directory.
	UpstreamCAFile   = "ca.crt"
	UpstreamCertFile = corev1.TLSCertKey        // tls.crt
	UpstreamKeyFile  = corev1.TLSPrivateKeyKey  // tls.key
	upstreamTLSVol   = "apportion-upstream-tls" // + "-" + a hash of the quota's name
)

// UpstreamTLSDir is where quota's TLS material is mounted in the agent's container.
func UpstreamTLSDir(quota string) string { return path.Join(UpstreamTLSRoot, quota) }

// UpstreamTLSFiles returns the paths of quota's CA bundle, client certificate and key in the
// agent's container; "" for what t does not name (nil t: none).
func UpstreamTLSFiles(quota string, t *apportionv1.UpstreamTLS) (ca, cert, key string) {
	if t == nil {
		return "", "", ""
	}
	dir := UpstreamTLSDir(quota)
	if t.CABundle != nil {
		ca = path.Join(dir, UpstreamCAFile)
	}
	if t.ClientCertificate != nil {
		cert, key = path.Join(dir, UpstreamCertFile), path.Join(dir, UpstreamKeyFile)
	}
	return ca, cert, key
}

// upstreamTLSVolumeName is quota's volume: a DNS label whatever the quota's name (at most 63
// characters itself), unique per quota.
func upstreamTLSVolumeName(quota string) string {
	sum := sha256.Sum256([]byte(quota))
	return upstreamTLSVol + "-" + hex.EncodeToString(sum[:6])
}

// AddUpstreamTLS mounts the TLS material t names for quota into the injected agent of pod
// (after Mutate). Nothing to mount (nil t, or neither a CA bundle nor a client certificate):
// the pod is unchanged. An error, pod unchanged, when the pod has no injected agent or already
// uses the volume's name.
func AddUpstreamTLS(pod *corev1.Pod, quota string, t *apportionv1.UpstreamTLS) error {
	if t == nil || (t.CABundle == nil && t.ClientCertificate == nil) {
		return nil
	}
	agent := slices.IndexFunc(pod.Spec.InitContainers, func(c corev1.Container) bool { return c.Name == AgentContainerName })
	if agent < 0 {
		return fmt.Errorf("the pod has no injected agent to mount %s's TLS material into", quota)
	}
	name := upstreamTLSVolumeName(quota)
	if slices.ContainsFunc(pod.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == name }) {
		return fmt.Errorf("the pod already has a volume named %s, which the agent's TLS material for %s needs", name, quota)
	}
	var sources []corev1.VolumeProjection
	optional := false
	if c := t.CABundle; c != nil {
		key := c.Key
		if key == "" {
			key = apportionv1.DefaultCAKey
		}
		sources = append(sources, corev1.VolumeProjection{ConfigMap: &corev1.ConfigMapProjection{
			LocalObjectReference: corev1.LocalObjectReference{Name: c.Name},
			Items:                []corev1.KeyToPath{{Key: key, Path: UpstreamCAFile}},
			Optional:             &optional,
		}})
	}
	if s := t.ClientCertificate; s != nil {
		sources = append(sources, corev1.VolumeProjection{Secret: &corev1.SecretProjection{
			LocalObjectReference: corev1.LocalObjectReference{Name: s.Name},
			Items: []corev1.KeyToPath{
				{Key: corev1.TLSCertKey, Path: UpstreamCertFile},
				{Key: corev1.TLSPrivateKeyKey, Path: UpstreamKeyFile},
			},
			Optional: &optional,
		}})
	}
	pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{
		Name:         name,
		VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{Sources: sources}},
	})
	c := &pod.Spec.InitContainers[agent]
	c.VolumeMounts = append(c.VolumeMounts, corev1.VolumeMount{Name: name, MountPath: UpstreamTLSDir(quota), ReadOnly: true})
	return nil
}
