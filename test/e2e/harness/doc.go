// Package harness runs Apportion end to end on one machine: a local control plane (envtest's
// kube-apiserver and etcd), the real manager binary, real agent processes each bound to its own
// loopback address (127.x.y.z: all of 127.0.0.0/8 is loopback on Linux), a test downstream that
// enforces a global in-flight limit, a load generator and an invariant monitor.
//
// There is no kubelet, deployment controller or HPA controller in envtest. In the simulated mode
// Workload plays them: it writes the HPA's status and the Deployment's spec.replicas, creates a
// Pod object per agent (status.podIP = the agent's address, phase Running, Ready) and deletes it,
// optionally leaving it terminating behind a finalizer for a while. In the cluster mode
// (Env.Cluster, cluster.go) Kubernetes' own kube-controller-manager and kube-scheduler run, and
// kwok plays the nodes and the pods' lifecycle (kwok.go); Workload then only plays the HPA (its
// status, and spec.replicas through the scale subresource) and runs each pod's agent at the
// address kwok gave the pod (clusterpods.go).
//
// The package has no _test files so that hack/demo can import it; test/e2e holds the scenarios.
// Every process the harness starts runs in its own process group with a parent-death signal, and
// is stopped by Cleanup (or the owner's Stop), so that a test or the demo leaves none behind.
package harness
