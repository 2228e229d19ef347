package e2e

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/wait"
	"github.com/apportion/apportion/test/e2e/harness"
)

// TestHarnessDetectsViolations is the harness's own control, with no control plane and no
// manager: agents with fixed permits (test/e2e/fakeagent). Within the limit, the monitor and the
// downstream report nothing; above it, they must report violations and 429s — so the scenarios'
// "zero violations" is not vacuous. A stopped agent is modeled from its last state.
func TestHarnessDetectsViolations(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	ctx := t.Context()
	fake, err := harness.BuildPackage(ctx, "./test/e2e/fakeagent")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	_, priv, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	keys, err := harness.NewStaticTrustDir(filepath.Join(dir, "trust"), assignment.SigningKey{ID: "k1", Private: priv})
	if err != nil {
		t.Fatal(err)
	}
	keyDir := keys.Dir
	bin := &harness.Binaries{Agent: fake}
	ips := harness.NewIPPool()

	run := func(t *testing.T, permits int, stopOne bool) (harness.MonitorStats, harness.LoadStats) {
		const limit = 10
		ds, err := harness.StartDownstream(limit, 30*time.Millisecond)
		if err != nil {
			t.Fatal(err)
		}
		defer ds.Close()
		var agents harness.StaticAgents
		for i := range 4 {
			ip, err := ips.Next()
			if err != nil {
				t.Fatal(err)
			}
			a := harness.NewAgent(bin, "e2e", fmt.Sprintf("pod-%d", i), ip, keyDir, dir,
				"--upstream="+ds.URL, "--permits="+strconv.Itoa(permits))
			if err := a.Start(ctx); err != nil {
				t.Fatal(err)
			}
			defer a.Kill()
			agents = append(agents, a)
		}
		// A stand-in for the manager's ledger: what the agents were given, with every other
		// reading marked as taken while the manager recovers.
		var ledgerReads atomic.Int32
		ledger := func(context.Context) (harness.LedgerReading, error) {
			n := ledgerReads.Add(1)
			return harness.LedgerReading{Sum: int32(4 * permits), Recovering: n%2 == 0, Detail: "fixed permits"}, nil
		}
		mon, err := harness.StartMonitor(ctx, harness.MonitorConfig{Source: agents, Downstream: "logistics", Limit: limit,
			Key: keys.Key, RequestTimeout: time.Second, DS: ds, SafeDefault: func() int32 { return 1 }, Ledger: ledger})
		if err != nil {
			t.Fatal(err)
		}
		// The load runs until the monitor has taken enough samples of it, however slow a busy
		// machine makes the monitor; MaxDuration is only a backstop against a monitor that
		// never samples, which the sample count below then reports.
		const minSamples = 20
		loadStart := time.Now()
		load := harness.StartLoad(ctx, harness.LoadConfig{Source: agents, Downstream: "logistics", WorkersPerAgent: 5, MaxDuration: time.Minute})
		if stopOne {
			time.Sleep(500 * time.Millisecond)
			if err := agents[0].Suspend(); err != nil {
				t.Fatal(err)
			}
			// The monitor marks the stopped agent unreachable at its next samples and models it at
			// its last known permits (it may still hold them).
			if !wait.Within(30*time.Second, func() bool {
				cur, ok := mon.Current()
				return ok && cur.Unreachable == 1 && cur.Agents["pod-0"].Effective == int32(permits)
			}) {
				cur, _ := mon.Current()
				t.Errorf("a stopped agent: %d unreachable, modeled at %d, want 1 and %d", cur.Unreachable, cur.Agents["pod-0"].Effective, permits)
			}
			_ = agents[0].Resume()
		}
		// At least 1.6 s more of load after the stopped agent is back, and at least minSamples
		// samples in all.
		time.Sleep(1600 * time.Millisecond)
		wait.Within(time.Minute, func() bool { return mon.Stats().Samples >= minSamples })
		ls := load.Stop()
		st := mon.Stop()
		t.Logf("permits %d × 4, limit %d, load for %v\nload: %s\nmonitor: %s (%.1f Hz)", permits, limit,
			time.Since(loadStart).Round(time.Millisecond), ls, st, st.Hz())
		if st.Samples < minSamples {
			t.Errorf("%d samples, want at least %d", st.Samples, minSamples)
		}
		if ls.OK == 0 {
			t.Errorf("no successful call: %s", ls)
		}
		return st, ls
	}
	t.Run("within", func(t *testing.T) {
		st, _ := run(t, 2, true)
		if !st.Ok() || st.MaxSumPermits != 8 || st.LedgerSamples == 0 || st.LedgerOverRecovering != 0 {
			t.Errorf("want no violation, Σ permits 8 and ledger samples within the limit: %s", st)
		}
	})
	t.Run("above", func(t *testing.T) {
		st, ls := run(t, 4, false)
		if st.PermitViolations == 0 || st.Downstream.TooMany429 == 0 || ls.TooMany429 == 0 || st.Ok() {
			t.Errorf("want Σ-permit violations and 429s: %s", st)
		}
		// A ledger over the limit is a violation, except while the manager recovers.
		if st.LedgerViolations == 0 || st.LedgerOverRecovering == 0 || st.LedgerViolations+st.LedgerOverRecovering != st.LedgerSamples {
			t.Errorf("want ledger violations outside recovery and excused samples within it: %s", st)
		}
	})
}
