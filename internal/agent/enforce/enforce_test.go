package enforce

import (
	"errors"
	"io"
	"log/slog"
	"testing"
	"time"

	"k8s.io/utils/clock"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/agent/semaphore"
	"github.com/apportion/apportion/internal/assignment"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func newTestEnforcer(t *testing.T) (*Enforcer, *clocktesting.FakeClock) {
	t.Helper()
	clk := clocktesting.NewFakeClock(t0)
	e := New(Options{Clock: clk, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	return e, clk
}

func ds(name string, permits, safe int32) assignment.Downstream {
	return assignment.Downstream{
		Name: name, Upstream: "http://127.0.0.1:9/" + name, Permits: permits, SafeDefaultPermits: safe,
		AcquireTimeout: assignment.Duration(50 * time.Millisecond), RequestTimeout: assignment.Duration(time.Second),
		Fallback: assignment.Fallback{Action: assignment.ActionReject},
	}
}

func asg(epoch, gen int64, ttl time.Duration, dss ...assignment.Downstream) *assignment.Assignment {
	return &assignment.Assignment{Epoch: epoch, Generation: gen, LeaseTTL: assignment.Duration(ttl), Downstreams: dss}
}

func mustApply(t *testing.T, e *Enforcer, a *assignment.Assignment) assignment.State {
	t.Helper()
	st, err := e.Apply(a, time.Time{})
	if err != nil {
		t.Fatalf("Apply(%d,%d): %v", a.Epoch, a.Generation, err)
	}
	return st
}

// limits returns name -> (effective permits, semaphore limit), checking they agree.
func effective(t *testing.T, e *Enforcer, name string) int {
	t.Helper()
	d := e.Table().Lookup(name)
	if d == nil {
		t.Fatalf("downstream %s not in the table", name)
	}
	if got, sem := d.Effective(), d.Sem.Stats().Limit; got != sem {
		t.Fatalf("%s: effective %d but semaphore limit %d", name, got, sem)
	}
	return d.Effective()
}

func TestLeaseExpiryAndRenewal(t *testing.T) {
	e, clk := newTestEnforcer(t)
	a := asg(1, 1, 10*time.Second, ds("a", 10, 3), ds("b", 4, 9))
	st := mustApply(t, e, a)
	if st.LeaseExpired || !st.LeaseExpiresAt.Equal(t0.Add(10*time.Second)) || !st.Configured {
		t.Fatalf("state after apply = %+v", st)
	}
	if effective(t, e, "a") != 10 || effective(t, e, "b") != 4 {
		t.Fatal("permits not in force")
	}
	clk.Step(10*time.Second - time.Millisecond)
	if effective(t, e, "a") != 10 || e.State().LeaseExpired {
		t.Fatal("lease expired early")
	}
	clk.Step(time.Millisecond)
	if got := effective(t, e, "a"); got != 3 {
		t.Fatalf("after expiry a = %d, want safe default 3", got)
	}
	if got := effective(t, e, "b"); got != 4 {
		t.Fatalf("after expiry b = %d, want min(permits 4, safe 9) = 4", got)
	}
	st = e.State()
	if !st.LeaseExpired || st.Downstreams[0].Permits != 10 || st.Downstreams[0].EffectivePermits != 3 {
		t.Fatalf("state after expiry = %+v", st)
	}

	// Renewal (same pair) restores Permits and restarts the lease from now.
	clk.Step(5 * time.Second)
	st = mustApply(t, e, a)
	if st.LeaseExpired || effective(t, e, "a") != 10 || !st.LeaseExpiresAt.Equal(clk.Now().Add(10*time.Second)) {
		t.Fatalf("renewal did not restore: %+v", st)
	}
	// Renewing before expiry pushes expiry out.
	clk.Step(8 * time.Second)
	mustApply(t, e, a)
	clk.Step(8 * time.Second)
	if effective(t, e, "a") != 10 {
		t.Fatal("lease expired although it was renewed")
	}
	clk.Step(2 * time.Second)
	if effective(t, e, "a") != 3 {
		t.Fatal("renewed lease did not expire")
	}
	if clk.Waiters() != 0 {
		t.Fatalf("%d timers left after expiry", clk.Waiters())
	}
}

func TestLeaseExpiryFailClosed(t *testing.T) {
	e, clk := newTestEnforcer(t)
	d := ds("a", 10, 3)
	d.FailClosed = true
	mustApply(t, e, asg(1, 1, time.Second, d))
	clk.Step(time.Second)
	if got := effective(t, e, "a"); got != 0 {
		t.Fatalf("FailClosed after expiry = %d, want 0", got)
	}
	if e.Table().Lookup("a").Sem.TryAcquire() {
		t.Fatal("a permit was granted with FailClosed after expiry")
	}
}

// The lease dropping the limit never aborts calls in flight, and never grants above the limit.
func TestLeaseExpiryKeepsCallsInFlight(t *testing.T) {
	e, clk := newTestEnforcer(t)
	mustApply(t, e, asg(1, 1, time.Second, ds("a", 4, 1)))
	d := e.Table().Lookup("a")
	for range 3 {
		if !d.Sem.TryAcquire() {
			t.Fatal("permit refused under the limit")
		}
	}
	clk.Step(time.Second)
	st := e.State().Downstreams[0]
	if st.InFlight != 3 || st.EffectivePermits != 1 {
		t.Fatalf("after expiry %+v, want inFlight 3, effective 1", st)
	}
	d.Sem.Release()
	d.Sem.Release()
	if d.Sem.TryAcquire() {
		t.Fatal("granted with inFlight 1 >= limit 1")
	}
	d.Sem.Release()
	if !d.Sem.TryAcquire() {
		t.Fatal("refused with inFlight 0 < limit 1")
	}
}

func TestFencing(t *testing.T) {
	e, _ := newTestEnforcer(t)
	mustApply(t, e, asg(2, 5, time.Minute, ds("a", 10, 3)))
	for _, p := range [][2]int64{{2, 4}, {1, 9}, {1, 100}} {
		st, err := e.Apply(asg(p[0], p[1], time.Minute, ds("a", 99, 3), ds("x", 1, 1)), time.Time{})
		if !errors.Is(err, assignment.ErrStale) {
			t.Fatalf("Apply(%v) = %v, want ErrStale", p, err)
		}
		if st.Epoch != 2 || st.Generation != 5 {
			t.Fatalf("stale answer carries %d/%d, want the held 2/5", st.Epoch, st.Generation)
		}
		if effective(t, e, "a") != 10 || e.Table().Lookup("x") != nil {
			t.Fatal("a stale assignment changed something")
		}
	}
	// Same pair: a renewal; its (different) content is not applied.
	st := mustApply(t, e, asg(2, 5, time.Minute, ds("a", 99, 3)))
	if st.Generation != 5 || effective(t, e, "a") != 10 {
		t.Fatalf("renewal applied content: %+v", st)
	}
	// A higher generation, then a higher epoch with a lower generation, are applied.
	mustApply(t, e, asg(2, 6, time.Minute, ds("a", 7, 3)))
	if effective(t, e, "a") != 7 {
		t.Fatal("higher generation not applied")
	}
	st = mustApply(t, e, asg(3, 1, time.Minute, ds("a", 8, 3)))
	if st.Epoch != 3 || st.Generation != 1 || effective(t, e, "a") != 8 {
		t.Fatalf("higher epoch not applied: %+v", st)
	}
	// An invalid assignment is refused whole.
	bad := asg(4, 1, time.Minute, ds("a", 1, 1), ds("b", -1, 0))
	if _, err := e.Apply(bad, time.Time{}); err == nil || errors.Is(err, assignment.ErrStale) {
		t.Fatalf("Apply(invalid) = %v", err)
	}
	if effective(t, e, "a") != 8 || e.State().Epoch != 3 {
		t.Fatal("an invalid assignment was half applied")
	}
}

func TestReconfigureKeepsRuntimeObjects(t *testing.T) {
	e, _ := newTestEnforcer(t)
	mustApply(t, e, asg(1, 1, time.Minute, ds("a", 3, 1), ds("b", 2, 1)))
	a1, b1 := e.Table().Lookup("a"), e.Table().Lookup("b")
	for _, sem := range []*semaphore.Semaphore{a1.Sem, a1.Sem, b1.Sem} {
		if !sem.TryAcquire() {
			t.Fatal("acquire")
		}
	}
	mustApply(t, e, asg(1, 2, time.Minute, ds("a", 1, 1)))
	a2 := e.Table().Lookup("a")
	if a2 != a1 || a2.Sem != a1.Sem {
		t.Fatal("a kept downstream got new runtime objects")
	}
	if e.Table().Lookup("b") != nil {
		t.Fatal("removed downstream still in the table")
	}
	st := e.State()
	if len(st.Downstreams) != 1 || st.Downstreams[0].InFlight != 2 || st.Downstreams[0].EffectivePermits != 1 {
		t.Fatalf("state = %+v", st)
	}
	if a2.Sem.TryAcquire() {
		t.Fatal("granted above the lowered limit")
	}
	b1.Sem.Release() // the removed downstream's call finishes on the objects it holds
	a1.Sem.Release()
	a1.Sem.Release()
	if !a2.Sem.TryAcquire() {
		t.Fatal("refused under the limit")
	}
	// Re-adding b creates fresh objects.
	mustApply(t, e, asg(1, 3, time.Minute, ds("a", 1, 1), ds("b", 2, 1)))
	if e.Table().Lookup("b") == b1 {
		t.Fatal("a removed downstream came back with its old objects")
	}
}

func TestReadinessAndBootstrap(t *testing.T) {
	e, clk := newTestEnforcer(t)
	if e.Ready() || e.State().Configured {
		t.Fatal("ready before any configuration")
	}
	d := ds("a", 10, 3)
	if err := e.ApplyBootstrap(&assignment.Assignment{Downstreams: []assignment.Downstream{d}}); err != nil {
		t.Fatal(err)
	}
	st := e.State()
	if !e.Ready() || !st.Configured || !st.LeaseExpired || st.Epoch != 0 || st.Generation != 0 || !st.LeaseExpiresAt.IsZero() {
		t.Fatalf("after bootstrap ready=%v state=%+v", e.Ready(), st)
	}
	if effective(t, e, "a") != 3 {
		t.Fatal("bootstrap not on safe defaults")
	}
	clk.Step(time.Hour)
	if effective(t, e, "a") != 3 {
		t.Fatal("bootstrap limit changed with time")
	}
	// Any manager push replaces the bootstrap.
	mustApply(t, e, asg(1, 1, time.Second, ds("a", 10, 3)))
	if effective(t, e, "a") != 10 || e.State().LeaseExpired {
		t.Fatal("push did not replace the bootstrap")
	}
	e.SetDraining()
	if e.Ready() {
		t.Fatal("ready while draining")
	}
}

func TestSwitchStates(t *testing.T) {
	e, clk := newTestEnforcer(t)
	a := asg(1, 1, time.Minute, ds("a", 1, 1))
	a.Switches = []assignment.Switch{
		{Name: "ns/z", Downstream: "a", ExpiresAt: t0.Add(time.Minute), Percent: 100, Action: assignment.Fallback{Action: assignment.ActionReject}},
		{Name: "ns/y", Downstream: "a", ExpiresAt: t0.Add(2 * time.Minute), Percent: 100, Action: assignment.Fallback{Action: assignment.ActionReject}},
	}
	st := mustApply(t, e, a)
	if len(st.Switches) != 2 || st.Switches[0].Name != "ns/y" || !st.Switches[0].Active || !st.Switches[1].Active {
		t.Fatalf("switches = %+v", st.Switches)
	}
	clk.Step(time.Minute)
	st = e.State()
	if !st.Switches[0].Active || st.Switches[1].Active {
		t.Fatalf("after 1m switches = %+v", st.Switches)
	}
	snap := e.MetricsSnapshot()
	if len(snap.Switches) != 2 || snap.Generation != 1 || len(snap.Downstreams) != 1 {
		t.Fatalf("snapshot = %+v", snap)
	}
}

// A push addressed to another agent process is refused as stale, whatever its pair: the manager
// must learn of the restart (the old process's calls may still run) before granting anything.
func TestPushForAnotherInstanceIsRefused(t *testing.T) {
	e, _ := newTestEnforcer(t)
	st := mustApply(t, e, asg(2, 5, time.Minute, ds("a", 10, 3)))
	if st.Instance == "" {
		t.Fatal("State carries no instance id")
	}
	a := asg(2, 6, time.Minute, ds("a", 20, 3))
	a.Instance = "someone-else"
	st2, err := e.Apply(a, time.Time{})
	if !errors.Is(err, assignment.ErrStale) {
		t.Fatalf("Apply for another instance = %v, want ErrStale", err)
	}
	if st2.Instance != st.Instance || st2.Generation != 5 || effective(t, e, "a") != 10 {
		t.Fatalf("refused push changed something or hid the instance: %+v", st2)
	}
	// Addressed to this instance, it applies, and a renewal with the instance set is a plain renewal.
	a.Instance = st.Instance
	mustApply(t, e, a)
	if effective(t, e, "a") != 20 {
		t.Fatal("push for this instance not applied")
	}
	mustApply(t, e, a)
	if effective(t, e, "a") != 20 {
		t.Fatal("renewal changed the permits")
	}
}

// The State tells the process's age, so that a manager meeting it for the first time knows
// whether an earlier process of the pod may still have calls running.
func TestStateReportsUptime(t *testing.T) {
	e, clk := newTestEnforcer(t)
	if got := e.State().Uptime.D(); got != time.Millisecond {
		t.Fatalf("uptime at start = %s, want the 1ms floor (0 would read as not reported)", got)
	}
	clk.Step(90 * time.Second)
	if got := e.State().Uptime.D(); got != 90*time.Second {
		t.Fatalf("uptime = %s, want 1m30s", got)
	}
}

// stuckTimers is a clock whose timers never fire: the lease timer of a process that was frozen
// and has not run its timer goroutine yet after resuming.
type stuckTimers struct{ *clocktesting.FakeClock }

type noTimer struct{ clock.Timer }

func (noTimer) Stop() bool { return true }

func (stuckTimers) AfterFunc(time.Duration, func()) clock.Timer { return noTimer{} }

// A lease that passed while its timer has not fired yet is expired by the data plane's first
// look at the table: no call is admitted on a lapsed lease.
func TestLeasePassedBeforeItsTimerFiredIsExpiredOnLookup(t *testing.T) {
	clk := stuckTimers{clocktesting.NewFakeClock(t0)}
	e := New(Options{Clock: clk, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	mustApply(t, e, asg(1, 1, 10*time.Second, ds("a", 10, 3)))
	clk.Step(9 * time.Second)
	if got := effective(t, e, "a"); got != 10 {
		t.Fatalf("limit %d within the lease, want 10", got)
	}
	clk.Step(time.Second)
	if got := effective(t, e, "a"); got != 3 {
		t.Fatalf("limit %d once the lease passed (timer not fired), want the safe default 3", got)
	}
	if st := e.State(); !st.LeaseExpired {
		t.Fatal("State does not say the lease expired")
	}
	// A renewal restores the permits and a fresh lease.
	mustApply(t, e, asg(1, 1, 10*time.Second, ds("a", 10, 3)))
	if got := effective(t, e, "a"); got != 10 {
		t.Fatalf("limit %d after the renewal, want 10", got)
	}
}

// Regression (issue 11, defect 6): a lease is anchored to the push's signed time, so replaying a
// captured push within the signature's window neither revives a lapsed lease nor extends one.
func TestLeaseAnchoredToSignedTime(t *testing.T) {
	e, clk := newTestEnforcer(t)
	a := asg(1, 1, 10*time.Second, ds("a", 10, 3))
	signed := clk.Now()
	if _, err := e.Apply(a, signed); err != nil {
		t.Fatal(err)
	}
	if got := effective(t, e, "a"); got != 10 {
		t.Fatalf("effective %d, want 10", got)
	}
	clk.Step(11 * time.Second)
	if got := effective(t, e, "a"); got != 3 {
		t.Fatalf("after the lease: effective %d, want the safe default 3", got)
	}
	// The captured push, replayed 11 s after it was signed (well within the 2-minute window).
	st, err := e.Apply(a, signed)
	if err != nil {
		t.Fatal(err)
	}
	if got := effective(t, e, "a"); got != 3 || !st.LeaseExpired {
		t.Fatalf("replay revived the lease: effective %d, leaseExpired %v", got, st.LeaseExpired)
	}

	// A genuine renewal, signed now, restores the permits until signed + TTL.
	renewal := clk.Now()
	st = mustApply(t, e, a) // unsigned: from acceptance
	if got := effective(t, e, "a"); got != 10 || !st.LeaseExpiresAt.Equal(renewal.Add(10*time.Second)) {
		t.Fatalf("renewal: effective %d, lease until %s", got, st.LeaseExpiresAt)
	}
	// A push signed 4 s ago renews to signed + TTL, which is earlier than the lease held: a
	// renewal never shortens a lease.
	clk.Step(2 * time.Second)
	st, err = e.Apply(a, clk.Now().Add(-4*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if !st.LeaseExpiresAt.Equal(renewal.Add(10 * time.Second)) {
		t.Fatalf("an older renewal moved the lease to %s", st.LeaseExpiresAt)
	}
	// One signed 1 s ago extends it to signed + TTL, not acceptance + TTL.
	st, err = e.Apply(a, clk.Now().Add(-time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if want := clk.Now().Add(9 * time.Second); !st.LeaseExpiresAt.Equal(want) {
		t.Fatalf("lease until %s, want signed+TTL %s", st.LeaseExpiresAt, want)
	}
	// A signature from the future (manager clock ahead) counts from acceptance.
	st, err = e.Apply(a, clk.Now().Add(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if want := clk.Now().Add(10 * time.Second); !st.LeaseExpiresAt.Equal(want) {
		t.Fatalf("lease until %s, want acceptance+TTL %s", st.LeaseExpiresAt, want)
	}

	// A new pair signed longer than its TTL ago is applied on its fallbacks at once.
	st, err = e.Apply(asg(1, 2, 10*time.Second, ds("a", 12, 2)), clk.Now().Add(-11*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if got := effective(t, e, "a"); got != 2 || !st.LeaseExpired || st.Generation != 2 {
		t.Fatalf("late new pair: effective %d, leaseExpired %v, generation %d", got, st.LeaseExpired, st.Generation)
	}
	// ... and its timer does not fire later into anything.
	clk.Step(time.Minute)
	if got := effective(t, e, "a"); got != 2 {
		t.Fatalf("effective %d, want 2", got)
	}
}
