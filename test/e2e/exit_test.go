package e2e

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/apportion/apportion/test/e2e/harness"
)

// The manager process stops by itself, after start-up, on exactly two kinds of evidence that
// another manager is in charge (docs/protocol.md, "When the manager stops"). These tests run the
// real binary and watch it exit.

// waitExit waits for the process to exit and for its log to contain want.
func waitExit(t *testing.T, m *harness.Manager, within time.Duration, want string) {
	t.Helper()
	select {
	case <-m.Done():
	case <-time.After(within):
		t.Fatalf("the manager did not exit within %s; see %s", within, m.LogPath)
	}
	if m.ExitErr() == nil {
		t.Errorf("the manager exited with status 0, want 1")
	}
	b, err := os.ReadFile(m.LogPath)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), want) {
		t.Errorf("the manager's log does not say %q; see %s", want, m.LogPath)
	}
}

// TestManagerExitsWhenFenced: a second manager starts beside the first (as a new leader would);
// it takes a higher epoch and reaches the agents, and the first, meeting that epoch at an agent,
// stops: "push: an agent holds a newer epoch; this manager is stale", exit status 1.
func TestManagerExitsWhenFenced(t *testing.T) {
	s := scenario(t, harness.ScenarioConfig{NoLoad: true, NoMonitor: true})
	ctx := t.Context()
	mustConverge(t, ctx, s)
	opts := s.Manager.Opts
	opts.NoWebhook = true // the first one serves the control plane's webhook address
	second, err := harness.NewManager(s.Env.Bin, s.Env.CP, filepath.Join(s.Dir, "second"), opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(s.Dir, "second"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = second.Stop(5 * time.Second) })
	if err := second.Start(ctx); err != nil {
		t.Fatal(err)
	}
	waitExit(t, s.Manager, 60*time.Second, "an agent holds a newer epoch; this manager is stale")
	if !second.Running() {
		t.Fatalf("the newer manager stopped too: %v", second.ExitErr())
	}
}

// TestManagerExitsWhenLeaderElectionLost: a manager run with --leader-elect whose Lease another
// replica takes over stops pushing and exits ("leader election lost"): a new leader may be
// pushing already.
func TestManagerExitsWhenLeaderElectionLost(t *testing.T) {
	e := env(t)
	ctx := t.Context()
	ns := "e2e-leader-" + strings.ToLower(time.Now().Format("150405"))
	if err := e.CP.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(e.Dir, ns)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	m, err := harness.NewManager(e.Bin, e.CP, dir, harness.ManagerOptions{Namespace: ns,
		ExtraArgs: []string{"--leader-elect", "--manager-namespace=" + ns}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Kill() })
	if err := m.Start(ctx); err != nil {
		t.Fatal(err)
	}
	key := client.ObjectKey{Namespace: ns, Name: "manager.apportion.io"}
	var lease coordinationv1.Lease
	deadline := time.Now().Add(60 * time.Second)
	for {
		err := e.CP.Client.Get(ctx, key, &lease)
		if err == nil && lease.Spec.HolderIdentity != nil && *lease.Spec.HolderIdentity != "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the manager took no Lease: %v", err)
		}
		_ = sleep(ctx, 100*time.Millisecond)
	}
	t.Logf("leader: %s", *lease.Spec.HolderIdentity)
	// Another replica takes the Lease (as one would once this one failed to renew in time).
	for {
		lease.Spec.HolderIdentity = ptr.To("another-replica")
		lease.Spec.LeaseDurationSeconds = ptr.To[int32](3600)
		lease.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
		lease.Spec.AcquireTime = lease.Spec.RenewTime
		err := e.CP.Client.Update(ctx, &lease)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("taking the Lease: %v", err)
		}
		if err := e.CP.Client.Get(ctx, key, &lease); err != nil {
			t.Fatal(err)
		}
	}
	// controller-runtime's defaults: renew deadline 10 s, retry period 2 s.
	waitExit(t, m, 60*time.Second, "leader election lost")
}

// TestManagerStopsOnSIGTERM: SIGTERM (a rollout, a node drain) stops the manager cleanly, status 0.
func TestManagerStopsOnSIGTERM(t *testing.T) {
	e := env(t)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	ns := "e2e-sigterm-" + strings.ToLower(time.Now().Format("150405"))
	if err := e.CP.CreateNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(e.Dir, ns)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	m, err := harness.NewManager(e.Bin, e.CP, dir, harness.ManagerOptions{Namespace: ns})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Kill() })
	if err := m.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := m.Stop(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	if err := m.ExitErr(); err != nil {
		t.Fatalf("the manager exited with %v after SIGTERM, want status 0; see %s", err, m.LogPath)
	}
}
