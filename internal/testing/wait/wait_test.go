package wait

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestForSeesAConditionAnotherGoroutineMeets: the condition turns true on another goroutine
// after some checks; For returns (the test does not fail) and has checked more than once.
func TestForSeesAConditionAnotherGoroutineMeets(t *testing.T) {
	var flag atomic.Bool
	var checks atomic.Int64
	go func() {
		for checks.Load() < 3 {
			runtime.Gosched()
		}
		flag.Store(true)
	}()
	For(t, "the flag", func() bool { checks.Add(1); return flag.Load() })
	if n := checks.Load(); n < 3 {
		t.Fatalf("%d checks, want at least 3", n)
	}
}

// recorder is a testing.TB whose Fatalf records the message and ends its goroutine, as the
// real one does, so that a failure of the helpers under test can be observed.
type recorder struct {
	testing.TB
	msg string
}

func (r *recorder) Helper() {}

func (r *recorder) Fatalf(format string, args ...any) {
	r.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// failure runs f with a recorder on its own goroutine and returns what it failed with ("" when
// it returned).
func failure(f func(tb testing.TB)) string {
	r := &recorder{}
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(r)
	}()
	<-done
	return r.msg
}

func TestForContextFailsWhenTheConditionNeverHolds(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Millisecond)
	defer cancel()
	var checks atomic.Int64
	msg := failure(func(tb testing.TB) {
		ForContext(ctx, tb, "the impossible", func() bool { checks.Add(1); return false })
	})
	if !strings.Contains(msg, "waiting for the impossible") || !strings.Contains(msg, context.DeadlineExceeded.Error()) {
		t.Fatalf("failure %q", msg)
	}
	// A figure only (most checks are the first Spin's; then about a dozen sleeps doubling from
	// 50 µs to MaxInterval): the bound below is loose so that a busy machine cannot fail it.
	t.Logf("%d checks in 30 ms", checks.Load())
	if n := checks.Load(); n < 2 {
		t.Fatalf("%d checks, want more than one", n)
	}
}

func TestWithinReportsAMissAndChecksOnceAtLeast(t *testing.T) {
	if Within(10*time.Millisecond, func() bool { return false }) {
		t.Fatal("Within reported a condition that never held")
	}
	if !Within(0, func() bool { return true }) {
		t.Fatal("Within(0) did not check a condition that holds")
	}
}

func TestRecv(t *testing.T) {
	ch := make(chan int, 1)
	ch <- 7
	if v := Recv(t, "seven", ch); v != 7 {
		t.Fatalf("Recv = %d", v)
	}
}
