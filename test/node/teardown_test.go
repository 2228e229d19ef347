//go:build linux

package node

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// runState is what a run leaves in its directory (run.json) so that it, or the next run after
// it was killed, can remove everything it made.
type runState struct {
	ID  string `json:"id"`
	Dir string `json:"dir"`
	// Owner is the outer test process; a run whose owner is gone is a leftover.
	Owner int `json:"owner"`
	// Netns is the node's network namespace ("net:[inode]"): every process in it is the node's.
	Netns string `json:"netns"`
	// Cgroup is the kubelet's cgroupRoot, created in every cgroup v1 hierarchy.
	Cgroup string `json:"cgroup"`
}

func (r *runState) save() error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	tmp := filepath.Join(r.Dir, "run.json.tmp")
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(r.Dir, "run.json"))
}

func netnsInode(pid int) (string, error) {
	return os.Readlink(fmt.Sprintf("/proc/%d/ns/net", pid))
}

// netnsProcs lists the processes whose network namespace is ns.
func netnsProcs(ns string) []int {
	if ns == "" {
		return nil
	}
	ents, _ := os.ReadDir("/proc")
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		if l, err := netnsInode(pid); err == nil && l == ns {
			pids = append(pids, pid)
		}
	}
	return pids
}

// cgroupHierarchies are the cgroup v1 hierarchies mounted under /sys/fs/cgroup (the kubelet's
// cgroupfs driver creates its tree in each), without the empty v2 at "unified".
func cgroupHierarchies() []string {
	ents, _ := os.ReadDir("/sys/fs/cgroup")
	var hs []string
	for _, e := range ents {
		if e.IsDir() && e.Name() != "unified" {
			hs = append(hs, filepath.Join("/sys/fs/cgroup", e.Name()))
		}
	}
	return hs
}

// cgroupDirs lists name's directories in every hierarchy, deepest first: the v1 ones and the
// (empty) v2 one, where the kubelet's cgroupfs driver mirrors its tree in hybrid mode.
func cgroupDirs(name string) []string {
	var dirs []string
	for _, h := range append(cgroupHierarchies(), "/sys/fs/cgroup/unified") {
		root := filepath.Join(h, name)
		_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				dirs = append(dirs, p)
			}
			return nil
		})
	}
	sort.Slice(dirs, func(i, j int) bool { return strings.Count(dirs[i], "/") > strings.Count(dirs[j], "/") })
	return dirs
}

func cgroupProcs(name string) []int {
	seen := map[int]bool{}
	var pids []int
	for _, d := range cgroupDirs(name) {
		b, _ := os.ReadFile(filepath.Join(d, "cgroup.procs"))
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil && !seen[pid] {
				seen[pid] = true
				pids = append(pids, pid)
			}
		}
	}
	return pids
}

// teardown kills every process of the node (in its network namespace or its cgroups), removes
// its cgroups and its directory, and returns what it could not remove (nothing, normally).
func (r *runState) teardown() []string {
	start := time.Now()
	deadline := start.Add(30 * time.Second)
	var procs []int
	killed := map[int]bool{}
	for {
		procs = append(netnsProcs(r.Netns), cgroupProcs(r.Cgroup)...)
		if len(procs) == 0 || time.Now().After(deadline) {
			break
		}
		for _, pid := range procs {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			killed[pid] = true
		}
		time.Sleep(100 * time.Millisecond)
	}
	// A killed process leaves its namespaces before it is gone: wait until each has exited
	// (or is a zombie its parent, if alive, reaps).
	for pid := range killed {
		for alive(pid) && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if alive(pid) {
			procs = append(procs, pid)
		}
	}
	var left []string
	if len(procs) > 0 {
		left = append(left, fmt.Sprintf("processes %v", procs))
	}
	// A frozen cgroup (freezer) would keep its killed processes; thaw before removing.
	for _, d := range cgroupDirs(r.Cgroup) {
		_ = os.WriteFile(filepath.Join(d, "freezer.state"), []byte("THAWED"), 0o644)
	}
	for i := 0; i < 50; i++ {
		var busy []string
		for _, d := range cgroupDirs(r.Cgroup) {
			if err := syscall.Rmdir(d); err != nil && !errors.Is(err, syscall.ENOENT) {
				busy = append(busy, d)
			}
		}
		if len(busy) == 0 {
			break
		}
		if i == 49 {
			left = append(left, fmt.Sprintf("cgroups %v", busy))
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The node's mounts lived in its own mount namespace, gone with its last process; but a
	// mount that leaked to this namespace would make RemoveAll fail or recurse into it.
	if m := mountsUnder(r.Dir); len(m) > 0 {
		for i := len(m) - 1; i >= 0; i-- {
			_ = syscall.Unmount(m[i], syscall.MNT_DETACH)
		}
		left = append(left, fmt.Sprintf("mounts (detached) %v", m))
	}
	if _, err := os.Stat(filepath.Join(r.Dir, createdCNICacheDir)); err == nil {
		// The node created the mount point; empty unless another node mounts it right now.
		_ = syscall.Rmdir(cniCacheDir)
	}
	if err := os.RemoveAll(r.Dir); err != nil {
		// containerd leaves some directories read-only or immutable to the owner.
		_ = exec.Command("chmod", "-R", "u+w", r.Dir).Run()
		if _, err := os.Stat(filepath.Join(r.Dir, createdCNICacheDir)); err == nil {
			// The node created the mount point; empty unless another node mounts it right now.
			_ = syscall.Rmdir(cniCacheDir)
		}
		if err := os.RemoveAll(r.Dir); err != nil {
			left = append(left, err.Error())
		}
	}
	logf("teardown of run %s in %s: %d process(es) killed, left %v", r.ID, time.Since(start).Round(time.Millisecond), len(killed), left)
	return left
}

// mountsUnder lists this mount namespace's mount points at or under dir, in mount order.
func mountsUnder(dir string) []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var ms []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			ms = append(ms, f[4])
		}
	}
	return ms
}

// cleanupLeftovers tears down the runs under base whose outer process is gone (killed with
// SIGKILL, or the machine's test runner stopped): so an interrupted run never makes the next one
// collide or leak.
func cleanupLeftovers(base string) {
	ents, _ := os.ReadDir(base)
	for _, e := range ents {
		dir := filepath.Join(base, e.Name())
		var r runState
		b, err := os.ReadFile(filepath.Join(dir, "run.json"))
		if err == nil {
			err = json.Unmarshal(b, &r)
		}
		if err != nil {
			// No state: a run killed before it wrote any; nothing but the directory to remove,
			// once it is old enough not to be a run starting right now.
			if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > time.Hour {
				_ = os.RemoveAll(dir)
			}
			continue
		}
		if r.Owner > 0 && syscall.Kill(r.Owner, 0) == nil {
			if cmd, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", r.Owner)); strings.Contains(string(cmd), "node.test") {
				continue // still running
			}
		}
		r.Dir = dir
		logf("removing the leftovers of run %s (owner %d gone)", r.ID, r.Owner)
		r.teardown()
	}
}

// preflight returns what this machine lacks to run a node, each said exactly.
func preflight() []string {
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, fmt.Sprintf("root: the lane runs containerd and the kubelet, which need uid 0 (running as uid %d)", os.Geteuid()))
	}
	if b, err := os.ReadFile("/proc/filesystems"); err != nil || !strings.Contains(string(b), "\toverlay\n") {
		missing = append(missing, "overlayfs: 'overlay' is not in /proc/filesystems (modprobe overlay), containerd's snapshotter needs it")
	}
	if _, err := os.Stat("/proc/self/ns/net"); err != nil {
		missing = append(missing, "network namespaces: /proc/self/ns/net is missing (kernel without CONFIG_NET_NS)")
	}
	hs := cgroupHierarchies()
	hasMemory := false
	for _, h := range hs {
		if filepath.Base(h) == "memory" {
			hasMemory = true
			probe := filepath.Join(h, fmt.Sprintf("apportion-node-probe-%d", os.Getpid()))
			if err := os.Mkdir(probe, 0o755); err != nil {
				missing = append(missing, fmt.Sprintf("writable cgroups: cannot create %s: %v", probe, err))
			} else {
				_ = syscall.Rmdir(probe)
			}
		}
	}
	if !hasMemory {
		missing = append(missing, "cgroup v1 hierarchies under /sys/fs/cgroup (the lane configures the kubelet for cgroupfs on v1; found none with 'memory')")
	}
	need := func(env, name, how string) {
		for _, d := range filepath.SplitList(os.Getenv(env)) {
			if d == "" {
				continue
			}
			if fi, err := os.Stat(filepath.Join(d, name)); err == nil && fi.Mode()&0o111 != 0 {
				return
			}
		}
		missing = append(missing, fmt.Sprintf("%s: not found in %s=%q (%s)", name, env, os.Getenv(env), how))
	}
	need("KUBEBUILDER_ASSETS", "kube-apiserver", `export KUBEBUILDER_ASSETS="$(hack/envtest-assets.sh)"`)
	need("KUBEBUILDER_ASSETS", "etcd", `export KUBEBUILDER_ASSETS="$(hack/envtest-assets.sh)"`)
	need("KUBEBUILDER_ASSETS", "kubectl", `export KUBEBUILDER_ASSETS="$(hack/envtest-assets.sh)"`)
	need("E2E_CLUSTER_ASSETS", "kube-controller-manager", `export E2E_CLUSTER_ASSETS="$(hack/envtest-assets.sh --cluster)"`)
	need("E2E_CLUSTER_ASSETS", "kube-scheduler", `export E2E_CLUSTER_ASSETS="$(hack/envtest-assets.sh --cluster)"`)
	need("NODE_ASSETS", "kubelet", `export NODE_ASSETS="$(hack/envtest-assets.sh --node)"`)
	for _, p := range []string{containerdBin, ctrBin, runcBin, cniDir + "/bridge", cniDir + "/host-local", cniDir + "/loopback", "/usr/sbin/iptables"} {
		if _, err := os.Stat(p); err != nil {
			missing = append(missing, p+": missing (hack/envtest-assets.sh --node installs Debian's containerd, runc, containernetworking-plugins, iptables)")
		}
	}
	if _, err := exec.LookPath("ip"); err != nil {
		missing = append(missing, "ip (iproute2): not in PATH")
	}
	return missing
}

const (
	// cniCacheDir is libcni's fixed cache directory; createdCNICacheDir marks (in the run
	// directory) that this run created it, so teardown removes it.
	cniCacheDir        = "/var/lib/cni"
	createdCNICacheDir = "created-var-lib-cni"

	containerdBin = "/usr/bin/containerd"
	ctrBin        = "/usr/bin/ctr"
	runcBin       = "/usr/sbin/runc"
	cniDir        = "/usr/lib/cni"
)

func assetPath(env, name string) string {
	for _, d := range filepath.SplitList(os.Getenv(env)) {
		if p := filepath.Join(d, name); d != "" {
			if _, err := os.Stat(p); err == nil {
				return p
			}
		}
	}
	return name
}

// repoRoot is the module root (the test runs in test/node).
func repoRoot() string {
	if r := os.Getenv("APPORTION_NODE_REPO"); r != "" {
		return r
	}
	wd, _ := os.Getwd()
	return filepath.Clean(filepath.Join(wd, "..", ".."))
}

// alive reports whether pid exists and is not a zombie.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command's closing parenthesis.
	i := strings.LastIndexByte(string(b), ')')
	return i < 0 || i+2 >= len(b) || b[i+2] != 'Z'
}
