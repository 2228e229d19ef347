package push

import (
	"context"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/keys"
)

// TestTakeSignedBatchVersusUrgent: a renewal signed in a batch is sent at once when nothing
// urgent is ready; when a request of a band before renewals is ready (here a change of a proven
// pod), the renewal waits for it until half its PushTimeout has passed since it was started, then
// goes first. Driven by a fake clock alone: the decision reads the engine's clock, not the
// request's socket deadline (real time), so no real time has to pass and none may decide.
func TestTakeSignedBatchVersusUrgent(t *testing.T) {
	const timeout = 4 * time.Second
	clk := testingclock.NewFakeClock(time.Date(2026, 7, 1, 12, 0, 0, 0, time.UTC))
	e, err := New(Options{
		Client:      keys.NewSigningClient(nil, testKeys(t)),
		Clock:       clk,
		PushTimeout: timeout,
		Epoch:       EpochFunc(func(context.Context) (int64, error) { return 1, nil }),
	})
	if err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.takeSigned() {
		t.Fatal("takeSigned with nothing signed")
	}
	renewal := &podState{uid: "r", name: "r", namespace: "ns"}
	e.signed = []*work{{pod: renewal, kind: kindPush, sentAt: clk.Now(), deadline: socketDeadline(timeout)}}
	if !e.takeSigned() {
		t.Fatal("nothing urgent is ready, yet the signed renewal waits")
	}

	change := &podState{uid: "c", name: "c", namespace: "other", known: true}
	e.core.sched.ready.push(change.namespace, bandChange, change)
	if !e.core.sched.hasUrgent() {
		t.Fatal("a change of a proven pod is not urgent")
	}
	for _, c := range []struct {
		elapsed time.Duration
		want    bool
	}{
		{0, false},
		{timeout/2 - time.Nanosecond, false}, // more than half its PushTimeout left: the change first
		{timeout / 2, true},                  // half of it passed: the renewal first
		{timeout, true},
	} {
		clk.SetTime(e.signed[0].sentAt.Add(c.elapsed))
		if got := e.takeSigned(); got != c.want {
			t.Errorf("%s after the renewal started, with a change ready: takeSigned = %v, want %v", c.elapsed, got, c.want)
		}
	}
}
