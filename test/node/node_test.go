//go:build linux

package node

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/envtest"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// The node's addresses. They exist only in the node's own network namespace (one per run), so
// two runs never collide even with the same numbers, and nothing outside is ever a target.
const (
	// podCIDR is the bridge CNI's subnet; its .1 is the bridge, the pods' gateway.
	podCIDR   = "10.88.0.0/24"
	podGW     = "10.88.0.1"
	serviceIP = "10.97.0.1"
	// serviceCIDR is the API server's --service-cluster-ip-range. Its first address is the
	// "kubernetes" Service's ClusterIP, and the API server itself listens there (on lo, port
	// 443): a pod's in-cluster client (KUBERNETES_SERVICE_HOST:443) reaches it by plain
	// routing through the bridge, and the serving certificate names it -- no kube-proxy.
	serviceCIDR = "10.97.0.0/24"
	nodeName    = "apportion-node"
)

// node is a control plane, containerd and a kubelet, all in this (the inner) process's network
// and mount namespaces.
type node struct {
	t      *testing.T
	dir    string
	cgroup string
	env    *envtest.Environment
	cfg    *rest.Config
	c      client.Client
	scheme *runtime.Scheme
	// kubeconfig is an admin's (system:masters), for kubectl.
	kubeconfig string
	sock       string
	procs      []*exec.Cmd
}

func sh(ctx context.Context, name string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil {
		return out.String(), fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, out.String())
	}
	return out.String(), nil
}

// startNode brings the node up, step by step, failing t at the first step that does not work.
// Its processes are stopped by t.Cleanup; the outer process removes whatever remains.
func startNode(ctx context.Context, t *testing.T) *node {
	n := &node{t: t, dir: os.Getenv(innerEnv), cgroup: os.Getenv("APPORTION_NODE_CGROUP")}
	t.Cleanup(n.stop)
	step := func(name string, f func() error) {
		t.Helper()
		start := time.Now()
		if err := f(); err != nil {
			t.Fatalf("node: %s: %v", name, err)
		}
		t.Logf("node: %s: ok in %s", name, time.Since(start).Round(time.Millisecond))
	}
	step("private mounts and loopback", n.network)
	step("cgroup root "+n.cgroup, n.cgroupRoot)
	step("control plane (etcd, kube-apiserver on "+serviceIP+":443)", n.controlPlane)
	step("kube-controller-manager and kube-scheduler", n.controllers)
	step("containerd", n.containerd)
	step("ctr images import (sandbox image)", func() error {
		return n.importImages(ctx, filepath.Join(n.dir, "testimage.tar"))
	})
	step("kubelet registered, node Ready, lease renewed", func() error { return n.kubelet(ctx) })
	return n
}

func (n *node) network() error {
	// Nothing this namespace mounts (overlays, volumes) propagates back to the machine's.
	if err := syscall.Mount("none", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making / private: %w", err)
	}
	// Where containerd 1.6 and libcni keep state at fixed paths (shim sockets and runc state in
	// /run/containerd, CNI results in /var/lib/cni), the node gets a tmpfs of its own, so
	// nothing of it is left on the machine and two nodes do not share it.
	if err := syscall.Mount("tmpfs", "/run", "tmpfs", 0, "mode=0755"); err != nil {
		return fmt.Errorf("tmpfs on /run: %w", err)
	}
	if _, err := os.Stat(cniCacheDir); os.IsNotExist(err) {
		if err := os.WriteFile(filepath.Join(n.dir, createdCNICacheDir), nil, 0o644); err != nil {
			return err
		}
		if err := os.MkdirAll(cniCacheDir, 0o700); err != nil {
			return err
		}
	}
	if err := syscall.Mount("tmpfs", cniCacheDir, "tmpfs", 0, "mode=0700"); err != nil {
		return fmt.Errorf("tmpfs on %s: %w", cniCacheDir, err)
	}
	ctx := context.Background()
	for _, args := range [][]string{
		{"link", "set", "lo", "up"},
		{"addr", "add", serviceIP + "/32", "dev", "lo"},
	} {
		if _, err := sh(ctx, "ip", args...); err != nil {
			return err
		}
	}
	// Sanity: this namespace has nothing but lo (the bridge comes with the first pod).
	ifs, err := net.Interfaces()
	if err != nil {
		return err
	}
	for _, i := range ifs {
		if i.Name != "lo" {
			return fmt.Errorf("the node's network namespace already has interface %s", i.Name)
		}
	}
	return nil
}

// cgroupRoot creates the kubelet's cgroupRoot in every v1 hierarchy (it must exist), so all
// the node's pods live under one name of this run that teardown removes.
func (n *node) cgroupRoot() error {
	for _, h := range cgroupHierarchies() {
		d := filepath.Join(h, n.cgroup)
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
		if filepath.Base(h) == "cpuset" {
			// A new cpuset cgroup starts with no CPUs and no memory nodes.
			for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
				v, err := os.ReadFile(filepath.Join(h, f))
				if err != nil {
					return err
				}
				if err := os.WriteFile(filepath.Join(d, f), v, 0o644); err != nil {
					return fmt.Errorf("%s: %w", f, err)
				}
			}
		}
	}
	return nil
}

func (n *node) controlPlane() error {
	n.scheme = runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(n.scheme); err != nil {
		return err
	}
	if err := apportionv1.AddToScheme(n.scheme); err != nil {
		return err
	}
	n.env = &envtest.Environment{
		BinaryAssetsDirectory:    os.Getenv("KUBEBUILDER_ASSETS"),
		ControlPlaneStartTimeout: 3 * time.Minute,
		ControlPlaneStopTimeout:  time.Minute,
	}
	api := n.env.ControlPlane.GetAPIServer()
	// The secure serving address (SecureServing.ListenAddr); the serving certificate names it.
	api.Address = serviceIP
	api.Port = "443"
	args := api.Configure()
	args.Set("service-cluster-ip-range", serviceCIDR)
	args.Set("advertise-address", serviceIP)
	// envtest turns the ServiceAccount admission plugin off; a node needs it (pods' tokens).
	args.Disable("disable-admission-plugins")
	// The API server calls the webhook at its Service's endpoint (the manager pod's address on
	// the bridge) instead of its ClusterIP, which only kube-proxy would serve.
	args.Set("enable-aggregator-routing", "true")
	cfg, err := n.env.Start()
	if err != nil {
		return fmt.Errorf("envtest: %w", err)
	}
	n.cfg = rest.CopyConfig(cfg)
	if n.c, err = client.New(n.cfg, client.Options{Scheme: n.scheme}); err != nil {
		return err
	}
	user, err := n.env.AddUser(envtest.User{Name: "node-admin", Groups: []string{"system:masters"}}, nil)
	if err != nil {
		return err
	}
	kc, err := user.KubeConfig()
	if err != nil {
		return err
	}
	n.kubeconfig = filepath.Join(n.dir, "admin.kubeconfig")
	return os.WriteFile(n.kubeconfig, kc, 0o600)
}

// start runs a node process with its output in <dir>/<name>.log.
func (n *node) start(name, bin string, args ...string) error {
	logf, err := os.Create(filepath.Join(n.dir, name+".log"))
	if err != nil {
		return err
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		_ = logf.Close()
		return fmt.Errorf("starting %s: %w", name, err)
	}
	_ = logf.Close()
	n.procs = append(n.procs, cmd)
	go func() { _ = cmd.Wait() }()
	return nil
}

// logTail is the end of a node process's log, for failure messages.
func (n *node) logTail(name string, lines int) string {
	b, _ := os.ReadFile(filepath.Join(n.dir, name+".log"))
	ls := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(ls) > lines {
		ls = ls[len(ls)-lines:]
	}
	return strings.Join(ls, "\n")
}

// controllers are the kube-controller-manager's loops a Deployment needs to become running
// pods on this node, and the scheduler that binds them to it.
var controllers = []string{
	"deployment-controller", "replicaset-controller", "garbage-collector-controller",
	"namespace-controller", "endpoints-controller", "endpointslice-controller",
	"pod-garbage-collector-controller", "serviceaccount-controller",
	"root-ca-certificate-publisher-controller", "node-lifecycle-controller",
}

func (n *node) controllers() error {
	if err := n.start("kube-controller-manager", assetPath("E2E_CLUSTER_ASSETS", "kube-controller-manager"),
		"--kubeconfig="+n.kubeconfig, "--leader-elect=false", "--secure-port=0",
		"--controllers="+strings.Join(controllers, ","), "--use-service-account-credentials=false", "--v=2"); err != nil {
		return err
	}
	return n.start("kube-scheduler", assetPath("E2E_CLUSTER_ASSETS", "kube-scheduler"),
		"--kubeconfig="+n.kubeconfig, "--leader-elect=false", "--secure-port=0")
}

func (n *node) containerd() error {
	root := filepath.Join(n.dir, "containerd")
	n.sock = filepath.Join(root, "containerd.sock")
	cni := filepath.Join(n.dir, "cni")
	if err := os.MkdirAll(filepath.Join(cni, "net.d"), 0o755); err != nil {
		return err
	}
	conflist := fmt.Sprintf(`{
  "cniVersion": "1.0.0",
  "name": "apportion-node",
  "plugins": [
    {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": %q, "ranges": [[{"subnet": %q, "gateway": %q}]],
              "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "loopback"}
  ]
}
`, filepath.Join(cni, "ipam"), podCIDR, podGW)
	if err := os.WriteFile(filepath.Join(cni, "net.d", "10-apportion.conflist"), []byte(conflist), 0o644); err != nil {
		return err
	}
	cfg := fmt.Sprintf(`version = 2
root = %q
state = %q
[grpc]
  address = %q
[plugins."io.containerd.internal.v1.opt"]
  path = %q
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %q
  # The machine lacks CAP_SYS_RESOURCE: runc cannot lower a sandbox's oom_score_adj to -998.
  restrict_oom_score_adj = true
  # The pods' network namespaces are bind-mounted under the run's state directory instead of
  # the machine's /var/run/netns, where they would outlive the node's mount namespace as files.
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = %q
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %q
    conf_dir = %q
`, filepath.Join(root, "root"), filepath.Join(root, "state"), n.sock, filepath.Join(root, "opt"),
		testImage, runcBin, cniDir, filepath.Join(cni, "net.d"))
	conf := filepath.Join(root, "config.toml")
	if err := os.MkdirAll(root, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(conf, []byte(cfg), 0o644); err != nil {
		return err
	}
	if err := n.start("containerd", containerdBin, "--config", conf); err != nil {
		return err
	}
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		if _, err := sh(context.Background(), ctrBin, "--address", n.sock, "version"); err == nil {
			return nil
		}
		time.Sleep(200 * time.Millisecond)
	}
	return fmt.Errorf("containerd did not answer on %s within a minute:\n%s", n.sock, n.logTail("containerd", 20))
}

// importImages imports docker archives into the CRI's namespace, as docs/install.md tells a
// user of a local node to: `ctr -n k8s.io images import <archive>`.
func (n *node) importImages(ctx context.Context, archives ...string) error {
	for _, a := range archives {
		if out, err := sh(ctx, ctrBin, "--address", n.sock, "-n", "k8s.io", "images", "import", a); err != nil {
			return err
		} else {
			n.t.Logf("ctr images import %s: %s", filepath.Base(a), strings.TrimSpace(out))
		}
	}
	return nil
}

func (n *node) kubelet(ctx context.Context) error {
	kdir := filepath.Join(n.dir, "kubelet")
	if err := os.MkdirAll(kdir, 0o755); err != nil {
		return err
	}
	// The kubelet's client identity: its node name in group system:nodes. envtest's API server
	// authorizes by RBAC only (no Node authorizer), so the node gets system:masters as well.
	user, err := n.env.AddUser(envtest.User{Name: "system:node:" + nodeName, Groups: []string{"system:nodes", "system:masters"}}, nil)
	if err != nil {
		return err
	}
	kc, err := user.KubeConfig()
	if err != nil {
		return err
	}
	kubeconfig := filepath.Join(kdir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, kc, 0o600); err != nil {
		return err
	}
	cfg := fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# The machine has cgroup v1 hierarchies (an empty v2 at /sys/fs/cgroup/unified).
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /%s
cgroupsPerQOS: true
containerRuntimeEndpoint: unix://%s
podLogsDir: %s
address: %s
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
failSwapOn: false
# A loaded development machine must not evict the lane's pods or collect its images.
evictionHard: {"memory.available": "1Mi", "nodefs.available": "1%%", "imagefs.available": "1%%", "nodefs.inodesFree": "1%%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# How often the kubelet re-reads Secret and ConfigMap volumes (default 1m): the manager's
# webhook certificate reaches its pod within this.
syncFrequency: 10s
nodeStatusUpdateFrequency: 5s
serializeImagePulls: false
`, n.cgroup, n.sock, filepath.Join(n.dir, "pod-logs"), serviceIP)
	conf := filepath.Join(kdir, "config.yaml")
	if err := os.WriteFile(conf, []byte(cfg), 0o644); err != nil {
		return err
	}
	if err := n.start("kubelet", assetPath("NODE_ASSETS", "kubelet"),
		"--config="+conf, "--kubeconfig="+kubeconfig, "--root-dir="+filepath.Join(kdir, "root"),
		"--cert-dir="+filepath.Join(kdir, "pki"), "--hostname-override="+nodeName, "--node-ip="+serviceIP, "--v=2"); err != nil {
		return err
	}
	deadline := time.Now().Add(3 * time.Minute)
	for time.Now().Before(deadline) {
		var no corev1.Node
		if err := n.c.Get(ctx, types.NamespacedName{Name: nodeName}, &no); err == nil && nodeReady(&no) && !hasNotReadyTaint(&no) {
			var lease coordinationv1.Lease
			if err := n.c.Get(ctx, types.NamespacedName{Namespace: "kube-node-lease", Name: nodeName}, &lease); err == nil &&
				lease.Spec.RenewTime != nil && time.Since(lease.Spec.RenewTime.Time) < time.Minute {
				return nil
			}
		}
		time.Sleep(time.Second)
	}
	return fmt.Errorf("node %s not Ready (untainted, lease renewed) within 3 minutes; kubelet log:\n%s", nodeName, n.logTail("kubelet", 30))
}

func nodeReady(no *corev1.Node) bool {
	for _, c := range no.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

func hasNotReadyTaint(no *corev1.Node) bool {
	for _, t := range no.Spec.Taints {
		if t.Key == corev1.TaintNodeNotReady || t.Key == corev1.TaintNodeUnreachable {
			return true
		}
	}
	return false
}

// stop stops the node's processes: the kubelet first (it would restart what is killed under
// it), then the control loops, containerd and the control plane. The containers and shims are
// the outer process's to kill (it kills everything in this network namespace).
func (n *node) stop() {
	for i := len(n.procs) - 1; i >= 0; i-- {
		p := n.procs[i]
		if p.Process != nil {
			_ = syscall.Kill(-p.Process.Pid, syscall.SIGTERM)
		}
	}
	time.Sleep(time.Second)
	for _, p := range n.procs {
		if p.Process != nil {
			_ = syscall.Kill(-p.Process.Pid, syscall.SIGKILL)
		}
	}
	if n.env != nil {
		_ = n.env.Stop()
	}
	if n.t.Failed() {
		for _, name := range []string{"kubelet", "containerd", "kube-controller-manager"} {
			n.t.Logf("--- last lines of %s.log:\n%s", name, n.logTail(name, 15))
		}
		// The containers' own logs (<pod-logs>/<ns>_<pod>_<uid>/<container>/<n>.log).
		logs, _ := filepath.Glob(filepath.Join(n.dir, "pod-logs", "*", "*", "*.log"))
		for _, l := range logs {
			rel, _ := filepath.Rel(filepath.Join(n.dir, "pod-logs"), l)
			n.t.Logf("--- last lines of container log %s:\n%s", rel, n.logTail(strings.TrimSuffix(filepath.Join("pod-logs", rel), ".log"), 10))
		}
	}
}
