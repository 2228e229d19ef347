package main

import (
	"errors"
	"fmt"

	utilversion "k8s.io/apimachinery/pkg/util/version"
	"k8s.io/apimachinery/pkg/version"
)

// minKubernetes is the oldest Kubernetes release Apportion supports (README, docs/install.md):
//   - the injected agent is a native sidecar, an init container with restartPolicy: Always (the
//     SidecarContainers feature: beta and on by default since 1.29, GA in 1.33);
//   - the trust ConfigMap's guard is a ValidatingAdmissionPolicy of admissionregistration.k8s.io/v1
//     (GA in 1.30).
const minKubernetes = "1.30.0"

// checkServerVersion says what goes wrong on an API server older than minKubernetes, or nil. It
// does not stop the manager: running pods keep their agents, and on 1.29 injection still works;
// the manager logs it at start so that an operator reading its log learns why pods of labelled
// namespaces are not created (on 1.28 and older the API server drops restartPolicy from the
// agent's init container and then refuses the pod, whose init container may not have probes:
// a FailedCreate event on its ReplicaSet) or why the trust guard is missing (1.29).
func checkServerVersion(info *version.Info) error {
	if info == nil {
		return errors.New("the API server reported no version")
	}
	v, err := utilversion.ParseGeneric(info.GitVersion)
	if err != nil {
		return fmt.Errorf("the API server's version %q: %w", info.GitVersion, err)
	}
	if v.AtLeast(utilversion.MustParseGeneric(minKubernetes)) {
		return nil
	}
	if !v.AtLeast(utilversion.MustParseGeneric("1.29.0")) {
		return fmt.Errorf("the cluster runs Kubernetes %s, older than %s, the oldest Apportion supports: native sidecars (SidecarContainers) "+
			"are off before 1.29, so the API server drops the injected agent's restartPolicy: Always and refuses every pod the "+
			"webhook injects (an init container may not have probes): look for FailedCreate events on the workloads' ReplicaSets; "+
			"remove the apportion.io/injection label from the namespaces or upgrade the cluster", info.GitVersion, minKubernetes)
	}
	return fmt.Errorf("the cluster runs Kubernetes %s, older than %s, the oldest Apportion supports: agents are injected (native sidecars are on "+
		"since 1.29), but the ValidatingAdmissionPolicy apportion-trust-guard (admissionregistration.k8s.io/v1, GA in 1.30) "+
		"cannot be installed, so namespace editors can write the agents' trust ConfigMap (the manager puts it back, "+
		"docs/protocol.md §10); upgrade the cluster", info.GitVersion, minKubernetes)
}
