// Package wait is the tests' one way to wait for what another goroutine or process does: For
// fails the test unless a condition holds within Timeout, ForContext unless it holds before a
// context ends, Within reports whether it held (for a caller that decides what a miss means), and
// Recv takes a value from a channel within Timeout.
//
// The bound only turns a hang (a lost wake-up, a leaked permit, a process that never came up)
// into a readable failure; it never decides an assertion. A test that must show something
// happens by some time asserts it against an injected clock, not against this bound, so a busy
// machine slows these waits down without failing them.
//
// The polling first yields the processor (runtime.Gosched) for Spin, so that a condition another
// goroutine meets within microseconds (a waiter queued on a semaphore) is seen at once, then
// sleeps with an interval that doubles up to MaxInterval, so that a long wait (an API server, a
// process starting) costs little CPU on a shared machine and asks a server at most about
// 1/MaxInterval times a second.
//
// It is for tests only and imports nothing outside the standard library, so the agent's tests
// may use it (the agent's dependency check, cmd/agent/deps_test.go).
package wait

import (
	"context"
	"runtime"
	"testing"
	"time"
)

const (
	// Timeout bounds For and Recv.
	Timeout = 10 * time.Second
	// Spin is how long the polling yields the processor before it starts sleeping.
	Spin = time.Millisecond
	// MaxInterval is the longest sleep between two checks of the condition.
	MaxInterval = 20 * time.Millisecond

	firstInterval = 50 * time.Microsecond
)

// For fails t unless cond holds within Timeout; what names the condition in the failure.
func For(t testing.TB, what string, cond func() bool) {
	t.Helper()
	if !Within(Timeout, cond) {
		t.Fatalf("timed out after %v waiting for %s", Timeout, what)
	}
}

// ForContext fails t unless cond holds before ctx is done; what names the condition in the
// failure.
func ForContext(ctx context.Context, t testing.TB, what string, cond func() bool) {
	t.Helper()
	if !poll(ctx, cond) {
		t.Fatalf("waiting for %s: %v", what, context.Cause(ctx))
	}
}

// Within reports whether cond held within d. cond is checked at least once, even when d <= 0.
func Within(d time.Duration, cond func() bool) bool {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return poll(ctx, cond)
}

// Recv returns the next value from ch, or fails t when none came within Timeout; what names the
// value in the failure.
func Recv[T any](t testing.TB, what string, ch <-chan T) T {
	t.Helper()
	timer := time.NewTimer(Timeout)
	defer timer.Stop()
	select {
	case v := <-ch:
		return v
	case <-timer.C:
		t.Fatalf("timed out after %v waiting for %s", Timeout, what)
		panic("unreachable: Fatalf stops the test's goroutine")
	}
}

// poll checks cond until it holds (true) or ctx is done (false), with one last check after ctx
// is done, so that a condition met while the poller slept is not reported as a miss.
func poll(ctx context.Context, cond func() bool) bool {
	start := time.Now()
	interval := firstInterval
	for !cond() {
		if ctx.Err() != nil {
			return cond()
		}
		if time.Since(start) < Spin {
			runtime.Gosched()
			continue
		}
		timer := time.NewTimer(interval)
		select {
		case <-ctx.Done():
		case <-timer.C:
		}
		timer.Stop()
		interval = min(2*interval, MaxInterval)
	}
	return true
}
