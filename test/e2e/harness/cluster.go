package harness

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// ClusterAssetsEnv names the environment variable holding where kube-controller-manager,
// kube-scheduler and kwok are: a search path (directories joined by ':'), as
// `hack/envtest-assets.sh --cluster` prints it.
const ClusterAssetsEnv = "E2E_CLUSTER_ASSETS"

// ErrNoClusterAssets is returned by StartCluster when ClusterAssetsEnv is not set.
var ErrNoClusterAssets = errors.New(ClusterAssetsEnv + " is not set: run `make test` (or export " + ClusterAssetsEnv +
	"=\"$(hack/envtest-assets.sh --cluster)\"), which builds kube-controller-manager, kube-scheduler and kwok")

// KwokNodeAnnotation marks the nodes kwok plays (its --manage-nodes-with-annotation-selector).
const KwokNodeAnnotation = "kwok.x-k8s.io/node"

// ClusterControllers are the kube-controller-manager's controllers the cluster mode runs: what
// turns a Deployment into pods, keeps nodes schedulable and cleans up after them. The HPA controller is not among them:
// its metrics would be a stand-in the harness writes, so the scenario writes the HPA's status
// and scales through the scale subresource itself, as that controller does.
var ClusterControllers = []string{
	"deployment-controller",
	"replicaset-controller",
	"garbage-collector-controller",
	"namespace-controller",
	"endpointslice-controller",
	"pod-garbage-collector-controller",
	"serviceaccount-controller",
	// The API server taints every new node not-ready (TaintNodesByCondition); this controller
	// lifts the taint once the node is Ready and keeps it Ready while kwok renews its Lease.
	"node-lifecycle-controller",
}

// ClusterConfig sizes the cluster mode.
type ClusterConfig struct {
	// Nodes is how many kwok nodes to create (default 3).
	Nodes int
	// Logf logs; nil discards.
	Logf func(format string, args ...any)
}

// Cluster is Kubernetes' own control loops around a ControlPlane: the real
// kube-controller-manager (ClusterControllers), the real kube-scheduler, and kwok playing the
// nodes and the pods' lifecycle on them (stages in kwokStages): it gives each scheduled pod an
// address from its node's podCIDR — a loopback /24, so a pod's IP is where its agent can
// listen — and phase Running; Ready once the harness's kubelet (clusterPods, through
// runAgent) has marked the pod's agent ready; and deletes a terminating pod once the harness
// has stopped its agent. Node i's podCIDR is 127.B.(200+i).0/24, B being the IPPool's.
type Cluster struct {
	CP  *ControlPlane
	Dir string
	// Procs are kube-controller-manager, kube-scheduler and kwok.
	KCM, Scheduler, Kwok *Proc

	cfg   ClusterConfig
	ips   *IPPool
	mu    sync.Mutex
	nodes []string
	next  int // index of the next node (its podCIDR)
}

// findAsset looks name up in the ClusterAssetsEnv search path.
func findAsset(name string) (string, error) {
	path := os.Getenv(ClusterAssetsEnv)
	if path == "" {
		return "", ErrNoClusterAssets
	}
	for _, dir := range filepath.SplitList(path) {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s not found in %s=%s", name, ClusterAssetsEnv, path)
}

// StartCluster starts kube-controller-manager, kube-scheduler and kwok against cp (their logs
// in dir) and creates cfg.Nodes kwok nodes, waiting until they are Ready.
func StartCluster(ctx context.Context, cp *ControlPlane, ips *IPPool, dir string, cfg ClusterConfig) (_ *Cluster, err error) {
	if cfg.Nodes == 0 {
		cfg.Nodes = 3
	}
	if cfg.Logf == nil {
		cfg.Logf = func(string, ...any) {}
	}
	paths := map[string]string{}
	for _, n := range []string{"kube-controller-manager", "kube-scheduler", "kwok"} {
		if paths[n], err = findAsset(n); err != nil {
			return nil, err
		}
	}
	c := &Cluster{CP: cp, Dir: dir, cfg: cfg, ips: ips}
	defer func() {
		if err != nil {
			c.Stop()
		}
	}()
	stages := filepath.Join(dir, "kwok-stages.yaml")
	if err := os.WriteFile(stages, []byte(kwokStages), 0o644); err != nil {
		return nil, err
	}
	c.KCM = &Proc{Name: "kube-controller-manager", Path: paths["kube-controller-manager"], LogPath: filepath.Join(dir, "kube-controller-manager.log"), Args: []string{
		"--kubeconfig=" + cp.Kubeconfig,
		"--leader-elect=false",
		"--secure-port=0",
		"--controllers=" + strings.Join(ClusterControllers, ","),
		"--use-service-account-credentials=false",
		"--kube-api-qps=200", "--kube-api-burst=400",
		"--concurrent-deployment-syncs=5", "--concurrent-replicaset-syncs=5",
		"--v=2",
	}}
	c.Scheduler = &Proc{Name: "kube-scheduler", Path: paths["kube-scheduler"], LogPath: filepath.Join(dir, "kube-scheduler.log"), Args: []string{
		"--kubeconfig=" + cp.Kubeconfig,
		"--leader-elect=false",
		"--secure-port=0",
		"--kube-api-qps=200", "--kube-api-burst=400",
	}}
	c.Kwok = &Proc{Name: "kwok", Path: paths["kwok"], LogPath: filepath.Join(dir, "kwok.log"), Args: []string{
		"--kubeconfig=" + cp.Kubeconfig,
		"--config=" + stages,
		"--manage-nodes-with-annotation-selector=" + KwokNodeAnnotation + "=fake",
		"--node-ip=127.0.0.1",
		"--node-lease-duration-seconds=40",
		"--cidr=" + c.ips.podCIDR(255),
	}}
	for _, p := range []*Proc{c.KCM, c.Scheduler, c.Kwok} {
		if err := p.Start(); err != nil {
			return nil, err
		}
	}
	for range cfg.Nodes {
		if _, err := c.AddNode(ctx); err != nil {
			return nil, err
		}
	}
	if err := c.waitNodesReady(ctx, time.Minute); err != nil {
		return nil, err
	}
	cfg.Logf("cluster: kube-controller-manager, kube-scheduler, kwok with %d nodes", cfg.Nodes)
	return c, nil
}

// podCIDR is the loopback /24 of the cluster's node i: 127.B.(200+i).0/24, far from the
// addresses the pool hands out for simulated pods (127.B.x.y counts up from x = 0).
func (p *IPPool) podCIDR(i int) string {
	return fmt.Sprintf("127.%d.%d.0/24", p.b, (200+i)%256)
}

// AddNode creates a kwok node with the next loopback podCIDR and returns its name.
func (c *Cluster) AddNode(ctx context.Context) (string, error) {
	c.mu.Lock()
	i := c.next
	c.next++
	c.mu.Unlock()
	if i > 55 {
		return "", errors.New("cluster: out of podCIDRs")
	}
	name := fmt.Sprintf("kwok-node-%d", i)
	node := &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name:        name,
			Annotations: map[string]string{KwokNodeAnnotation: "fake"},
			Labels:      map[string]string{"type": "kwok", corev1.LabelHostname: name},
		},
		Spec: corev1.NodeSpec{PodCIDR: c.ips.podCIDR(i), PodCIDRs: []string{c.ips.podCIDR(i)}},
	}
	if err := c.CP.Client.Create(ctx, node); err != nil {
		return "", fmt.Errorf("creating node %s: %w", name, err)
	}
	c.mu.Lock()
	c.nodes = append(c.nodes, name)
	c.mu.Unlock()
	return name, nil
}

// Nodes lists the nodes the cluster created and did not delete.
func (c *Cluster) Nodes() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.nodes...)
}

// DeleteNode deletes node name's Node object: the machine is gone. What ran on it is the
// caller's to kill (Workload.LoseNode); the pod garbage collector deletes its pods later.
func (c *Cluster) DeleteNode(ctx context.Context, name string) error {
	c.mu.Lock()
	for i, n := range c.nodes {
		if n == name {
			c.nodes = append(c.nodes[:i], c.nodes[i+1:]...)
			break
		}
	}
	c.mu.Unlock()
	err := c.CP.Client.Delete(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}})
	if err != nil && !apierrors.IsNotFound(err) {
		return err
	}
	c.cfg.Logf("node %s deleted", name)
	return nil
}

func (c *Cluster) waitNodesReady(ctx context.Context, timeout time.Duration) error {
	return poll(ctx, timeout, 100*time.Millisecond, func() error {
		var list corev1.NodeList
		err := c.CP.Client.List(ctx, &list, client.HasLabels{"type"})
		ready := 0
		for _, n := range list.Items {
			for _, cond := range n.Status.Conditions {
				if cond.Type == corev1.NodeReady && cond.Status == corev1.ConditionTrue {
					ready++
				}
			}
		}
		if err == nil && ready >= len(c.Nodes()) {
			return nil
		}
		for _, p := range []*Proc{c.KCM, c.Scheduler, c.Kwok} {
			if !p.Running() {
				return fatal(fmt.Errorf("%s exited (%w): see %s", p.Name, exitCause(p.ExitErr()), p.LogPath))
			}
		}
		if err != nil {
			return fmt.Errorf("kwok nodes not Ready after %s: listing them: %w", timeout, err)
		}
		return fmt.Errorf("kwok nodes not Ready after %s (%d of %d): see %s", timeout, ready, len(c.Nodes()), c.Kwok.LogPath)
	})
}

// Stop stops the three processes.
func (c *Cluster) Stop() {
	for _, p := range []*Proc{c.Kwok, c.Scheduler, c.KCM} {
		if p != nil && p.Running() {
			_ = p.Stop(5 * time.Second)
		}
	}
}
