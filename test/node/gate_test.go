//go:build linux

package node

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// agentGatesReady shows that the agent's readiness gates its pod's: the agent of one app pod is
// frozen (the cgroup v1 freezer on its container's cgroup, so it answers nothing, as a hung
// agent would) and the kubelet's readiness probe on its /readyz fails; the pod then turns
// NotReady -- with its app container still ready, so it is the sidecar's readiness alone -- and
// Ready again once the agent is thawed and answers. The ledger stays within the limit
// throughout. (The other half, a pod Ready only once its agent is, is checked on every pod the
// lane creates: injectedApps.)
func agentGatesReady(ctx context.Context, t *testing.T, n *node, replicas int) {
	pods := gatewayPods(ctx, t, n, replicas)
	p := pods[0]
	var id string
	for _, s := range p.Status.InitContainerStatuses {
		if s.Name == agentContainer {
			_, id, _ = strings.Cut(s.ContainerID, "://")
		}
	}
	if id == "" {
		t.Fatalf("pod %s: no agent container id in %+v", p.Name, p.Status.InitContainerStatuses)
	}
	state, err := n.freezerState(id)
	if err != nil {
		t.Fatal(err)
	}
	freeze := func(v string) {
		if err := os.WriteFile(state, []byte(v), 0o644); err != nil {
			t.Fatalf("%s: %v", state, err)
		}
	}
	t.Cleanup(func() { _ = os.WriteFile(state, []byte("THAWED"), 0o644) })
	start := time.Now()
	freeze("FROZEN")
	var got corev1.Pod
	key := types.NamespacedName{Namespace: "shop", Name: p.Name}
	waitFor(ctx, t, time.Minute, "pod "+p.Name+" NotReady with its agent frozen", func() (bool, error) {
		quotaSample(ctx, t, n)
		if err := n.c.Get(ctx, key, &got); err != nil {
			return false, err
		}
		return !podReady(&got), nil
	})
	notReady := time.Since(start)
	for _, s := range got.Status.InitContainerStatuses {
		if s.Name == agentContainer && (s.Ready || s.State.Running == nil) {
			t.Errorf("pod %s NotReady, agent status %+v: want running, not ready", p.Name, s)
		}
	}
	for _, s := range got.Status.ContainerStatuses {
		if !s.Ready || s.State.Running == nil {
			t.Errorf("pod %s: app container %s status %+v: want running and ready (the agent alone makes the pod NotReady)", p.Name, s.Name, s)
		}
	}
	freeze("THAWED")
	thawed := time.Now()
	waitFor(ctx, t, 2*time.Minute, "pod "+p.Name+" Ready again with its agent thawed", func() (bool, error) {
		quotaSample(ctx, t, n)
		failIfCrashing(ctx, t, n, "shop")
		if err := n.c.Get(ctx, key, &got); err != nil {
			return false, err
		}
		return podReady(&got), nil
	})
	t.Logf("figure: agent of %s frozen -> pod NotReady in %s; thawed -> pod Ready in %s",
		p.Name, notReady.Round(100*time.Millisecond), time.Since(thawed).Round(100*time.Millisecond))
	waitFor(ctx, t, time.Minute, "every agent holding its full share again", func() (bool, error) {
		return fullShares(quotaSample(ctx, t, n).Holdings, replicas, nil), nil
	})
}

// freezerState is the freezer.state file of the container's cgroup (the kubelet's cgroupfs
// driver names it by the container's id, under the run's cgroup root).
func (n *node) freezerState(containerID string) (string, error) {
	root := filepath.Join("/sys/fs/cgroup/freezer", n.cgroup)
	var found string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() && d.Name() == containerID {
			found = filepath.Join(p, "freezer.state")
			return filepath.SkipAll
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	if found == "" {
		return "", errors.New("no freezer cgroup named " + containerID + " under " + root)
	}
	return found, nil
}
