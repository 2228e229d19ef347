//go:build linux

package node

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"testing"
)

// holdNode is `make node-up`: the node up with the user's images imported, and nothing of
// Apportion installed, held until the test is interrupted, so a contributor walks
// docs/install.md on it by hand from a shell in its namespaces. Ctrl-C stops it; the outer
// process then tears it down as after any run.
func holdNode(ctx context.Context, t *testing.T, n *node) {
	importUserImages(ctx, t, n)
	pid := os.Getpid()
	fmt.Fprintf(os.Stderr, `
node: up, with dist/images imported. In another shell, as root:

  nsenter --net=/proc/%[1]d/ns/net --mount=/proc/%[1]d/ns/mnt --wd=%[8]s -- env PATH=%[2]s:$PATH KUBECONFIG=%[3]s bash
  kubectl get nodes                      # %[4]s, Ready
  kubectl apply -f dist/install.yaml     # then steps 4 to 6 of docs/install.md
  ctr --address %[5]s -n k8s.io images ls

Pods get addresses in %[6]s, reachable from that shell only. kubectl logs and exec do not
work here (the API server does not reach the kubelet); every container's log is under
%[7]s/pod-logs.
Ctrl-C here stops the node and removes everything of it.
`, pid, filepath.Dir(assetPath("KUBEBUILDER_ASSETS", "kubectl")), n.kubeconfig, nodeName, n.sock, podCIDR, n.dir, repoRoot())
	// Ctrl-C reaches this process and the outer one, which then sends SIGTERM too: the
	// notification stays on, so the second signal does not kill the node before its cleanup.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	select {
	case s := <-sig:
		t.Logf("%v: stopping the node", s)
	case <-ctx.Done():
	}
}
