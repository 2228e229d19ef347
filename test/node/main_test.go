//go:build linux

package node

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

const (
	// enableEnv turns the lane on (`make test-node` sets it). Without it every test skips, so
	// `go test ./...` stays free of a node; with it, a missing requirement fails the run.
	enableEnv = "APPORTION_NODE"
	// innerEnv is set on the re-executed test binary: the run directory, in the node's namespaces.
	innerEnv = "APPORTION_NODE_INNER"
	// baseEnv overrides where run directories live.
	baseEnv = "APPORTION_NODE_DIR"
	// laneEnv "short" runs the short lane `make test` runs (install, inject, scale step,
	// failover, uninstall); "hold" brings the node up and holds it for a walk by hand
	// (`make node-up`); anything else the whole walk (`make test-node`).
	laneEnv = "APPORTION_NODE_LANE"
)

// baseDir holds one directory per run; on ext4/xfs, since containerd's overlayfs snapshots
// cannot sit on an overlay root.
func baseDir() string {
	if d := os.Getenv(baseEnv); d != "" {
		return d
	}
	return "/var/tmp/apportion-node"
}

// TestMain splits the lane into two processes. The outer one (this binary as go test started
// it) checks the machine, builds the images, then runs this same binary again in a new network
// namespace and a new, private mount namespace -- the node -- and waits for it. Whatever way
// the inner one ends (pass, fail, panic, timeout, SIGKILL), the outer one then tears the node
// down: every process in the node's network namespace, the cgroups the kubelet created, the
// run directory. Mounts (the containers' overlays, the volumes' tmpfs) exist only in the
// node's mount namespace and go with its last process. A run killed with its outer process
// is cleaned up by the next run (cleanupLeftovers).
func TestMain(m *testing.M) {
	if os.Getenv(enableEnv) != "1" {
		os.Exit(m.Run()) // every test skips: see skipUnlessEnabled
	}
	if dir := os.Getenv(innerEnv); dir != "" {
		os.Exit(m.Run())
	}
	os.Exit(outer())
}

func skipUnlessEnabled(t *testing.T) {
	t.Helper()
	if os.Getenv(enableEnv) != "1" {
		t.Skip("the real-node lane runs with `make test-node` (" + enableEnv + "=1)")
	}
	if os.Getenv(innerEnv) == "" {
		t.Fatal("test/node: the node tests run only inside the node's namespaces (TestMain re-executes the binary)")
	}
}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "node: "+format+"\n", args...)
}

func outer() (rc int) {
	start := time.Now()
	for _, a := range []struct{ env, flag string }{
		{"KUBEBUILDER_ASSETS", ""}, {"E2E_CLUSTER_ASSETS", "--cluster"}, {"NODE_ASSETS", "--node"},
	} {
		if err := ensureAssets(a.env, a.flag); err != nil {
			// preflight names what is then missing.
			logf("%v", err)
		}
	}
	logf("assets looked up in %s", time.Since(start).Round(time.Millisecond))
	if missing := preflight(); len(missing) > 0 {
		fmt.Fprintf(os.Stderr, "FAIL: this machine cannot run the real-node lane (test/node):\n  - %s\n",
			strings.Join(missing, "\n  - "))
		return 1
	}
	base := baseDir()
	if err := os.MkdirAll(base, 0o755); err != nil {
		logf("FAIL: %v", err)
		return 1
	}
	cleanupLeftovers(base)

	var b [4]byte
	_, _ = rand.Read(b[:])
	id := hex.EncodeToString(b[:])
	run := &runState{ID: id, Dir: filepath.Join(base, id), Owner: os.Getpid(), Cgroup: "apportion-node-" + id}
	if err := os.MkdirAll(run.Dir, 0o755); err != nil {
		logf("FAIL: %v", err)
		return 1
	}
	if err := run.save(); err != nil {
		logf("FAIL: %v", err)
		return 1
	}
	rc = 1
	defer func() {
		if left := run.teardown(); len(left) > 0 {
			logf("FAIL: teardown left behind: %s", strings.Join(left, "; "))
			rc = 1
		}
	}()
	if err := prepareImages(run); err != nil {
		logf("FAIL: %v", err)
		return 1
	}
	logf("assets and images ready in %s", time.Since(start).Round(time.Millisecond))

	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	// TMPDIR: envtest's etcd data and certificates go into the run directory too, so a killed
	// run leaves nothing in the machine's /tmp.
	tmp := filepath.Join(run.Dir, "tmp")
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		logf("FAIL: %v", err)
		return 1
	}
	cmd.Env = append(os.Environ(), innerEnv+"="+run.Dir, "APPORTION_NODE_CGROUP="+run.Cgroup, "APPORTION_NODE_REPO="+repoRoot(), "TMPDIR="+tmp)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: syscall.CLONE_NEWNET | syscall.CLONE_NEWNS,
		// An orphaned node stops; its remains are the next run's leftovers.
		Pdeathsig: syscall.SIGTERM,
	}
	// Interrupts reach the whole process group; the outer process stays to tear down.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		logf("FAIL: starting the node's namespaces (CLONE_NEWNET|CLONE_NEWNS): %v", err)
		return 1
	}
	if ino, err := netnsInode(cmd.Process.Pid); err == nil {
		run.Netns = ino
		_ = run.save()
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var err error
	select {
	case err = <-done:
	case s := <-sigs:
		logf("%v: stopping the node", s)
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err = <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			err = <-done
		}
	}
	if err == nil {
		rc = 0
	}
	logf("lane done in %s (outer exit %d)", time.Since(start).Round(time.Millisecond), rc)
	return rc
}

// ensureAssets sets env to what `hack/envtest-assets.sh flag` prints when it is unset, so that
// `go test ./...` (make test) needs no variable: the script builds what is missing (or waits
// for the build make test started in the background) and answers in a second when it is cached.
func ensureAssets(env, flag string) error {
	if os.Getenv(env) != "" {
		return nil
	}
	args := []string{filepath.Join(repoRoot(), "hack", "envtest-assets.sh")}
	if flag != "" {
		args = append(args, flag)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("hack/envtest-assets.sh %s: %w", flag, err)
	}
	return os.Setenv(env, strings.TrimSpace(string(out)))
}
