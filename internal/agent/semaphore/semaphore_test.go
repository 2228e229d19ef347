package semaphore

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/apportion/apportion/internal/testing/wait"
)

func waitWaiting(t *testing.T, s *Semaphore, n int) {
	t.Helper()
	wait.For(t, fmt.Sprintf("%d waiters", n), func() bool { return s.Stats().Waiting == n })
}

func wantStats(t *testing.T, s *Semaphore, want Stats) {
	t.Helper()
	if diff := cmp.Diff(want, s.Stats()); diff != "" {
		t.Fatalf("Stats() mismatch (-want +got):\n%s", diff)
	}
}

// TestScript drives the non-blocking operations through sequences and checks
// every intermediate state.
func TestScript(t *testing.T) {
	type op struct {
		do   string // "try", "release", "limit"
		n    int    // for "limit"
		ok   bool   // expected TryAcquire result
		want Stats
	}
	tests := []struct {
		name  string
		limit int
		ops   []op
	}{
		{"fills up to limit then refuses", 2, []op{
			{do: "try", ok: true, want: Stats{Limit: 2, InFlight: 1}},
			{do: "try", ok: true, want: Stats{Limit: 2, InFlight: 2}},
			{do: "try", ok: false, want: Stats{Limit: 2, InFlight: 2}},
			{do: "release", want: Stats{Limit: 2, InFlight: 1}},
			{do: "try", ok: true, want: Stats{Limit: 2, InFlight: 2}},
		}},
		{"zero limit admits nothing", 0, []op{
			{do: "try", ok: false, want: Stats{}},
			{do: "limit", n: 1, want: Stats{Limit: 1}},
			{do: "try", ok: true, want: Stats{Limit: 1, InFlight: 1}},
		}},
		{"lowering keeps holders and refuses until below new limit", 3, []op{
			{do: "try", ok: true, want: Stats{Limit: 3, InFlight: 1}},
			{do: "try", ok: true, want: Stats{Limit: 3, InFlight: 2}},
			{do: "try", ok: true, want: Stats{Limit: 3, InFlight: 3}},
			{do: "limit", n: 1, want: Stats{Limit: 1, InFlight: 3}},
			{do: "try", ok: false, want: Stats{Limit: 1, InFlight: 3}},
			{do: "release", want: Stats{Limit: 1, InFlight: 2}},
			{do: "try", ok: false, want: Stats{Limit: 1, InFlight: 2}},
			{do: "release", want: Stats{Limit: 1, InFlight: 1}},
			{do: "try", ok: false, want: Stats{Limit: 1, InFlight: 1}},
			{do: "release", want: Stats{Limit: 1}},
			{do: "try", ok: true, want: Stats{Limit: 1, InFlight: 1}},
		}},
		{"raising admits more at once", 1, []op{
			{do: "try", ok: true, want: Stats{Limit: 1, InFlight: 1}},
			{do: "try", ok: false, want: Stats{Limit: 1, InFlight: 1}},
			{do: "limit", n: 2, want: Stats{Limit: 2, InFlight: 1}},
			{do: "try", ok: true, want: Stats{Limit: 2, InFlight: 2}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := New(tt.limit)
			for i, o := range tt.ops {
				switch o.do {
				case "try":
					if got := s.TryAcquire(); got != o.ok {
						t.Fatalf("op %d: TryAcquire() = %v, want %v", i, got, o.ok)
					}
				case "release":
					s.Release()
				case "limit":
					s.SetLimit(o.n)
				}
				if diff := cmp.Diff(o.want, s.Stats()); diff != "" {
					t.Fatalf("op %d (%s): Stats() mismatch (-want +got):\n%s", i, o.do, diff)
				}
			}
		})
	}
}

// TestNoBarging checks that a released permit goes to the queued waiter, not
// to a TryAcquire or Acquire that arrives later.
func TestNoBarging(t *testing.T) {
	s := New(1)
	if !s.TryAcquire() {
		t.Fatal("TryAcquire on empty semaphore failed")
	}
	got := make(chan error, 1)
	go func() { got <- s.Acquire(context.Background()) }()
	waitWaiting(t, s, 1)

	if s.TryAcquire() {
		t.Fatal("TryAcquire overtook a waiter while full")
	}
	s.Release()
	// The handoff happens inside Release, before the waiter even runs.
	wantStats(t, s, Stats{Limit: 1, InFlight: 1})
	if s.TryAcquire() {
		t.Fatal("TryAcquire stole the permit handed to the waiter")
	}
	if err := wait.Recv(t, "waiter", got); err != nil {
		t.Fatalf("waiter Acquire = %v, want nil", err)
	}
	s.Release()
	wantStats(t, s, Stats{Limit: 1})
}

// enqueue starts n Acquire calls in a known queue order (each one is queued
// before the next starts). Waiter i sends i on the returned channel once it
// holds a permit, then blocks until its hold channel is closed and releases.
func enqueue(t *testing.T, s *Semaphore, n int) (granted chan int, hold []chan struct{}) {
	t.Helper()
	granted = make(chan int, n)
	hold = make([]chan struct{}, n)
	base := s.Stats().Waiting
	for i := range n {
		hold[i] = make(chan struct{})
		go func() {
			if err := s.Acquire(context.Background()); err != nil {
				t.Errorf("waiter %d: Acquire = %v", i, err)
				return
			}
			granted <- i
			<-hold[i]
			s.Release()
		}()
		waitWaiting(t, s, base+i+1)
	}
	return granted, hold
}

func TestFIFOOrder(t *testing.T) {
	const n = 20
	s := New(1)
	if !s.TryAcquire() {
		t.Fatal("TryAcquire failed")
	}
	granted, hold := enqueue(t, s, n)
	s.Release()
	for want := range n {
		// Only one permit exists, so waiter want must be the next and
		// only one granted.
		if got := wait.Recv(t, "grant", granted); got != want {
			t.Fatalf("grant #%d went to waiter %d, want %d", want, got, want)
		}
		wantStats(t, s, Stats{Limit: 1, InFlight: 1, Waiting: n - want - 1})
		close(hold[want])
	}
	wait.For(t, "all released", func() bool { return s.Stats().InFlight == 0 })
}

func TestRaiseLimitWakesInFIFOOrder(t *testing.T) {
	const n = 10
	s := New(0)
	granted, hold := enqueue(t, s, n)

	s.SetLimit(3)
	wantStats(t, s, Stats{Limit: 3, InFlight: 3, Waiting: n - 3})
	got := map[int]bool{}
	for range 3 {
		got[wait.Recv(t, "grant", granted)] = true
	}
	if diff := cmp.Diff(map[int]bool{0: true, 1: true, 2: true}, got); diff != "" {
		t.Fatalf("raising the limit woke the wrong waiters (-want +got):\n%s", diff)
	}

	s.SetLimit(n)
	wantStats(t, s, Stats{Limit: n, InFlight: n})
	for range n - 3 {
		wait.Recv(t, "grant", granted)
	}
	for _, h := range hold {
		close(h)
	}
	wait.For(t, "all released", func() bool { return s.Stats().InFlight == 0 })
}

func TestLowerLimitWaitsUntilBelowNewLimit(t *testing.T) {
	s := New(3)
	for range 3 {
		s.TryAcquire()
	}
	got := make(chan error, 1)
	go func() { got <- s.Acquire(context.Background()) }()
	waitWaiting(t, s, 1)

	s.SetLimit(1)
	s.Release() // 2 in flight, limit 1: still waits
	wantStats(t, s, Stats{Limit: 1, InFlight: 2, Waiting: 1})
	s.Release() // 1 in flight, limit 1: still waits
	wantStats(t, s, Stats{Limit: 1, InFlight: 1, Waiting: 1})
	s.Release() // 0 in flight: the waiter is granted
	wantStats(t, s, Stats{Limit: 1, InFlight: 1})
	if err := wait.Recv(t, "waiter", got); err != nil {
		t.Fatalf("Acquire = %v", err)
	}
}

func TestAcquireTimeout(t *testing.T) {
	s := New(1)
	s.TryAcquire()
	// The semaphore stays full for the whole call, so the only possible
	// outcome is the deadline; the duration just keeps the test quick.
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if err := s.Acquire(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Acquire = %v, want DeadlineExceeded", err)
	}
	wantStats(t, s, Stats{Limit: 1, InFlight: 1})
	s.Release()
	if !s.TryAcquire() {
		t.Fatal("permit leaked after timed-out Acquire")
	}
}

// TestCancelledWaiterInMiddleKeepsOrder cancels a waiter between two others:
// it must leave the queue without disturbing the order of the rest.
func TestCancelledWaiterInMiddleKeepsOrder(t *testing.T) {
	s := New(1)
	s.TryAcquire()
	granted, hold := enqueue(t, s, 1) // waiter 0

	ctx, cancel := context.WithCancel(context.Background())
	mid := make(chan error, 1)
	go func() { mid <- s.Acquire(ctx) }()
	waitWaiting(t, s, 2)

	last := make(chan error, 1)
	go func() { last <- s.Acquire(context.Background()) }()
	waitWaiting(t, s, 3)

	cancel()
	if err := wait.Recv(t, "cancelled waiter", mid); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled Acquire = %v, want Canceled", err)
	}
	wantStats(t, s, Stats{Limit: 1, InFlight: 1, Waiting: 2})

	s.Release()
	if got := wait.Recv(t, "grant", granted); got != 0 {
		t.Fatalf("first grant went to %d", got)
	}
	close(hold[0]) // waiter 0 releases: the last waiter is next
	if err := wait.Recv(t, "last waiter", last); err != nil {
		t.Fatalf("last Acquire = %v", err)
	}
	wantStats(t, s, Stats{Limit: 1, InFlight: 1})
}

func TestAcquireWithDoneContextFailsEvenIfFree(t *testing.T) {
	s := New(1)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Acquire(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Acquire = %v, want Canceled", err)
	}
	wantStats(t, s, Stats{Limit: 1})
}

// TestGrantRacingCancel forces the race in which a waiter is granted a permit
// after its context was cancelled but before it observed the cancellation.
// Holding the semaphore's lock, the test cancels and then hands over the
// permit, so both have happened whatever the scheduler does next. The waiter
// must return ctx.Err() and the permit must go on to the next waiter.
func TestGrantRacingCancel(t *testing.T) {
	for i := range 200 {
		s := New(1)
		s.TryAcquire()
		ctx, cancel := context.WithCancel(context.Background())
		first := make(chan error, 1)
		go func() { first <- s.Acquire(ctx) }()
		waitWaiting(t, s, 1)
		second := make(chan error, 1)
		go func() { second <- s.Acquire(context.Background()) }()
		waitWaiting(t, s, 2)

		s.mu.Lock()
		cancel()
		s.releaseLocked() // hands the permit to the first waiter
		s.mu.Unlock()

		if err := wait.Recv(t, "first waiter", first); !errors.Is(err, context.Canceled) {
			t.Fatalf("iteration %d: first Acquire = %v, want Canceled", i, err)
		}
		if err := wait.Recv(t, "second waiter", second); err != nil {
			t.Fatalf("iteration %d: second Acquire = %v, want nil (permit not passed on)", i, err)
		}
		wantStats(t, s, Stats{Limit: 1, InFlight: 1})
		s.Release()
		wantStats(t, s, Stats{Limit: 1})
	}
}

// TestWaitAfterGrantAndCancel covers the other side of the race: a waiter
// that had not parked yet finds both its grant and the cancellation ready,
// and Go picks either select case at random. Both must end the same way:
// ctx.Err() and the permit given back.
func TestWaitAfterGrantAndCancel(t *testing.T) {
	for i := range 100 {
		s := New(1)
		s.TryAcquire()
		ctx, cancel := context.WithCancel(context.Background())
		s.mu.Lock()
		w := s.getWaiter()
		s.pushLocked(w)
		cancel()
		s.releaseLocked() // grants w
		s.mu.Unlock()
		wantStats(t, s, Stats{Limit: 1, InFlight: 1})

		if err := s.wait(ctx, w); !errors.Is(err, context.Canceled) {
			t.Fatalf("iteration %d: wait = %v, want Canceled", i, err)
		}
		wantStats(t, s, Stats{Limit: 1})
	}
}

func TestPanics(t *testing.T) {
	tests := []struct {
		name string
		f    func()
	}{
		{"release without acquire", func() { New(1).Release() }},
		{"release more than acquired", func() {
			s := New(2)
			s.TryAcquire()
			s.Release()
			s.Release()
		}},
		{"negative New", func() { New(-1) }},
		{"negative SetLimit", func() { New(1).SetLimit(-1) }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Fatal("did not panic")
				}
			}()
			tt.f()
		})
	}
}

func TestUncontendedDoesNotAllocate(t *testing.T) {
	s := New(1)
	ctx := context.Background()
	if n := testing.AllocsPerRun(1000, func() {
		if err := s.Acquire(ctx); err != nil {
			t.Fatal(err)
		}
		s.Release()
	}); n != 0 {
		t.Errorf("Acquire+Release: %v allocs/op, want 0", n)
	}
	if n := testing.AllocsPerRun(1000, func() {
		s.TryAcquire()
		s.Release()
	}); n != 0 {
		t.Errorf("TryAcquire+Release: %v allocs/op, want 0", n)
	}
}

// TestConcurrentLimitChanges hammers the semaphore while the limit moves up
// and down. The onGrant hook runs under the semaphore's lock at the instant
// of every grant, so it sees the limit actually in force: a grant with
// inFlight > limit (after counting itself) would mean either the limit was
// exceeded or a permit was granted after lowering while inFlight was still
// >= the new limit.
func TestConcurrentLimitChanges(t *testing.T) {
	const (
		workers = 64
		rounds  = 300
	)
	s := New(4)
	var grants, violations int // guarded by s.mu (the hook runs under it)
	var firstViolation string
	s.onGrant = func(limit, inFlight int) {
		grants++
		if inFlight > limit {
			violations++
			if firstViolation == "" {
				firstViolation = fmt.Sprintf("grant with inFlight=%d > limit=%d", inFlight, limit)
			}
		}
	}

	// holders is counted by the test itself, independently of the
	// semaphore; it can never exceed the largest limit ever set.
	const maxLimit = 8
	var holders, maxHolders atomic.Int64
	stop := make(chan struct{})
	var ctl sync.WaitGroup
	ctl.Add(1)
	go func() {
		defer ctl.Done()
		r := rand.New(rand.NewPCG(1, 2))
		for {
			select {
			case <-stop:
				return
			default:
			}
			s.SetLimit(r.IntN(maxLimit + 1)) // 0..8, including 0
			runtime.Gosched()
		}
	}()

	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 3))
			for range rounds {
				var err error
				switch r.IntN(3) {
				case 0:
					if !s.TryAcquire() {
						continue
					}
				case 1:
					ctx, cancel := context.WithTimeout(context.Background(), time.Duration(r.IntN(50))*time.Microsecond)
					err = s.Acquire(ctx)
					cancel()
				default:
					// Cancelled from another goroutine at a random
					// moment, to exercise the grant/cancel race.
					ctx, cancel := context.WithCancel(context.Background())
					go func() { runtime.Gosched(); cancel() }()
					err = s.Acquire(ctx)
					cancel()
				}
				if err != nil {
					continue
				}
				h := holders.Add(1)
				for {
					m := maxHolders.Load()
					if h <= m || maxHolders.CompareAndSwap(m, h) {
						break
					}
				}
				runtime.Gosched()
				holders.Add(-1)
				s.Release()
			}
		}()
	}
	// Workers blocked on a zero limit are unblocked by the controller;
	// the ones with timeouts finish on their own.
	wg.Wait()
	close(stop)
	ctl.Wait()

	s.mu.Lock()
	g, v, first := grants, violations, firstViolation
	s.mu.Unlock()
	if v != 0 {
		t.Fatalf("%d of %d grants broke the limit; first: %s", v, g, first)
	}
	if g < workers {
		t.Fatalf("only %d grants: test did not exercise the semaphore", g)
	}
	if m := maxHolders.Load(); m > maxLimit {
		t.Fatalf("observed %d concurrent holders, max limit ever set is %d", m, maxLimit)
	}
	st := s.Stats()
	if st.InFlight != 0 || st.Waiting != 0 {
		t.Fatalf("after all workers finished: %+v, want nothing in flight or waiting (leak)", st)
	}
}

// TestMaxWaiting: with a bound on waiters, an Acquire that would wait beyond it fails at once
// with ErrQueueFull, queues nothing, and the bound frees up as waiters leave.
func TestMaxWaiting(t *testing.T) {
	s := New(1)
	if s.MaxWaiting() >= 0 {
		t.Fatalf("default bound %d, want none", s.MaxWaiting())
	}
	s.SetMaxWaiting(2)
	if !s.TryAcquire() {
		t.Fatal("TryAcquire failed")
	}
	granted, hold := enqueue(t, s, 2)
	if err := s.Acquire(context.Background()); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("third waiter: %v, want ErrQueueFull", err)
	}
	wantStats(t, s, Stats{Limit: 1, InFlight: 1, Waiting: 2})
	// A free permit is taken without waiting, whatever the bound.
	s.SetMaxWaiting(0)
	s.Release() // to waiter 0
	if got := <-granted; got != 0 {
		t.Fatalf("granted %d, want 0", got)
	}
	if err := s.Acquire(context.Background()); !errors.Is(err, ErrQueueFull) {
		t.Fatalf("bound 0 while one waits: %v, want ErrQueueFull", err)
	}
	close(hold[0]) // to waiter 1
	if got := <-granted; got != 1 {
		t.Fatalf("granted %d, want 1", got)
	}
	close(hold[1])
	waitWaiting(t, s, 0)
	for s.Stats().InFlight != 0 {
		runtime.Gosched()
	}
	if err := s.Acquire(context.Background()); err != nil {
		t.Fatalf("free permit with bound 0: %v", err)
	}
	s.SetMaxWaiting(-1)
	ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer cancel()
	if err := s.Acquire(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("no bound: %v, want to wait until the deadline", err)
	}
}
