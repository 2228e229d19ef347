// Package semaphore provides a FIFO-fair counting semaphore whose limit can be
// changed at run time. The agent uses one per downstream to cap the number of
// requests in flight.
//
// # Model
//
// A Semaphore has a limit, a count of permits in flight and a FIFO queue of
// waiters. A permit is granted only while inFlight < limit, and only to the
// caller at the head of the queue: there is no barging, so a TryAcquire or a
// fresh Acquire never overtakes a caller that is already waiting. When a
// permit is released and someone is waiting, the permit is handed directly to
// the head waiter under the lock, so it cannot be stolen between the release
// and the waiter waking up.
//
// The invariant kept after every operation is: if anyone is waiting, then
// inFlight >= limit. Each grant therefore happens with inFlight < limit at
// the moment of the grant, whatever the limit was before.
//
// # Outcomes
//
//   - TryAcquire returns true and holds a permit if inFlight < limit and no
//     one is waiting; otherwise it returns false and changes nothing.
//   - Acquire returns nil holding a permit, or ctx.Err() holding nothing. If
//     ctx is already done when Acquire is called it fails, even if a permit
//     is free (the same choice as golang.org/x/sync/semaphore: the
//     cancellation happened before the call). If the permit is granted at the
//     same moment ctx becomes done, Acquire gives the permit back (to the
//     next waiter, in order) and returns ctx.Err(): a caller that gets an
//     error never holds a permit.
//   - With a bound on waiters (SetMaxWaiting(n), n >= 0), an Acquire that would have to wait
//     while n callers already wait returns ErrQueueFull at once, holding nothing and queueing
//     nothing. A negative bound (the default) is no bound. Lowering the bound never drops
//     callers already waiting.
//   - Force takes a permit at once, whatever the limit and the queue: the permits of calls
//     admitted under Observe (the agent forwards every call and only counts what it would
//     have refused). It may leave inFlight above the limit, as a lowered limit does, and
//     keeps the invariant (inFlight only grows); such permits are released like any other.
//   - Release returns one permit; it panics if no permit is held.
//   - SetLimit(n) never revokes permits already held. Lowering the limit
//     makes new acquisitions wait until inFlight drops below n; raising it
//     grants waiters in FIFO order up to the new limit. SetLimit(0) makes
//     every acquisition wait. A negative n panics.
//
// Uncontended Acquire/Release take a mutex and allocate nothing; a waiter
// record (with its channel) is needed only when the caller has to wait, and
// those records are recycled through a per-semaphore sync.Pool.
package semaphore

import (
	"context"
	"errors"
	"sync"
)

// ErrQueueFull is Acquire's answer when it would have to wait and the waiters' bound is reached.
var ErrQueueFull = errors.New("semaphore: too many waiters")

// Stats is a snapshot of a Semaphore.
type Stats struct {
	Limit    int // current limit
	InFlight int // permits held; may exceed Limit just after the limit was lowered
	Waiting  int // callers blocked in Acquire
}

// Semaphore is a FIFO-fair counting semaphore with a resizable limit. It must
// be created with New and is safe for concurrent use.
type Semaphore struct {
	mu       sync.Mutex
	limit    int
	inFlight int
	waiting  int
	// maxWaiting bounds waiting; negative: no bound.
	maxWaiting int
	head       *waiter // oldest waiter, next to be granted
	tail       *waiter

	pool sync.Pool // of *waiter

	// onGrant, if set, is called under mu after every grant with the limit
	// in force and the new inFlight. Tests use it to check, at the exact
	// moment of each grant, that the grant respected the limit.
	onGrant func(limit, inFlight int)
}

// waiter is one blocked Acquire. Its fields other than ready are guarded by
// the semaphore's mutex.
type waiter struct {
	// ready receives one value when the permit is granted. It is buffered
	// so that the granter, which holds the lock, never blocks.
	ready      chan struct{}
	granted    bool
	prev, next *waiter
}

// New returns a semaphore that admits up to limit concurrent holders. It
// panics if limit is negative.
func New(limit int) *Semaphore {
	if limit < 0 {
		panic("semaphore: negative limit")
	}
	return &Semaphore{limit: limit, maxWaiting: -1}
}

// MaxWaiting is the bound on waiters; negative: none.
func (s *Semaphore) MaxWaiting() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.maxWaiting
}

// SetMaxWaiting bounds the callers that may wait in Acquire; n < 0 removes the bound.
func (s *Semaphore) SetMaxWaiting(n int) {
	s.mu.Lock()
	s.maxWaiting = n
	s.mu.Unlock()
}

// TryAcquire takes a permit without blocking. It succeeds only if a permit is
// free and no one is waiting for one.
func (s *Semaphore) TryAcquire() bool {
	s.mu.Lock()
	// By the invariant, a non-empty queue implies inFlight >= limit, so
	// the head check is implied; it is kept so that no-barging does not
	// rest on a property proved elsewhere.
	ok := s.head == nil && s.inFlight < s.limit
	if ok {
		s.grantLocked()
	}
	s.mu.Unlock()
	return ok
}

// Force takes a permit at once, whatever the limit and whoever waits (see the package doc). It
// reports whether the permit was free: whether TryAcquire would have taken it.
func (s *Semaphore) Force() (free bool) {
	s.mu.Lock()
	free = s.head == nil && s.inFlight < s.limit
	s.inFlight++ // not grantLocked: onGrant checks grants within the limit, and this is none
	s.mu.Unlock()
	return free
}

// Acquire takes a permit, waiting in FIFO order behind earlier callers until
// one is available or ctx is done. It returns nil if the permit was taken,
// ErrQueueFull at once if it would have to wait while the bound on waiters is
// reached, and ctx.Err() otherwise; on error the caller holds nothing.
func (s *Semaphore) Acquire(ctx context.Context) error {
	done := ctx.Done() // nil for context.Background: the selects below then never pick it

	s.mu.Lock()
	select {
	case <-done:
		s.mu.Unlock()
		return ctx.Err()
	default:
	}
	if s.head == nil && s.inFlight < s.limit {
		// Fast path: nothing to wait for, nothing to allocate.
		s.grantLocked()
		s.mu.Unlock()
		return nil
	}
	if s.maxWaiting >= 0 && s.waiting >= s.maxWaiting {
		s.mu.Unlock()
		return ErrQueueFull
	}
	w := s.getWaiter()
	s.pushLocked(w)
	s.mu.Unlock()
	return s.wait(ctx, w)
}

// wait blocks a queued waiter until it is granted or ctx is done.
func (s *Semaphore) wait(ctx context.Context, w *waiter) error {
	done := ctx.Done()
	select {
	case <-w.ready:
		// The permit is already counted in inFlight. If ctx was done by
		// now too, honour the cancellation and pass the permit on, so the
		// outcome does not depend on which select case Go happened to pick.
		s.pool.Put(w)
		select {
		case <-done:
			s.Release()
			return ctx.Err()
		default:
			return nil
		}
	case <-done:
		s.mu.Lock()
		if w.granted {
			// Granted just as ctx fired: the value is in the buffer
			// (it was sent under the lock we now hold). Drain it so the
			// waiter can be reused, and pass the permit on.
			<-w.ready
			s.releaseLocked()
		} else {
			// Still queued. Removing it frees no permit and, by the
			// invariant, the waiters behind it cannot proceed either.
			s.removeLocked(w)
		}
		s.mu.Unlock()
		s.pool.Put(w)
		return ctx.Err()
	}
}

// Release returns a permit. It panics if no permit is held.
func (s *Semaphore) Release() {
	s.mu.Lock()
	if s.inFlight == 0 {
		s.mu.Unlock()
		panic("semaphore: Release without Acquire")
	}
	s.releaseLocked()
	s.mu.Unlock()
}

// SetLimit changes the limit. Permits already held are never revoked; see
// the package documentation. It panics if n is negative.
func (s *Semaphore) SetLimit(n int) {
	if n < 0 {
		panic("semaphore: negative limit")
	}
	s.mu.Lock()
	s.limit = n
	s.notifyLocked()
	s.mu.Unlock()
}

// Stats returns a consistent snapshot of the semaphore.
func (s *Semaphore) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return Stats{Limit: s.limit, InFlight: s.inFlight, Waiting: s.waiting}
}

func (s *Semaphore) grantLocked() {
	s.inFlight++
	if s.onGrant != nil {
		s.onGrant(s.limit, s.inFlight)
	}
}

func (s *Semaphore) releaseLocked() {
	s.inFlight--
	s.notifyLocked()
}

// notifyLocked hands permits to waiters, oldest first, while the limit
// allows. It restores the invariant "waiting => inFlight >= limit".
func (s *Semaphore) notifyLocked() {
	for s.head != nil && s.inFlight < s.limit {
		w := s.head
		s.removeLocked(w)
		w.granted = true
		s.grantLocked()
		w.ready <- struct{}{} // buffered, never blocks
	}
}

func (s *Semaphore) getWaiter() *waiter {
	if w, ok := s.pool.Get().(*waiter); ok {
		// A pooled waiter always has an empty channel: every value sent
		// was received, either by the select or by the drain above.
		w.granted = false
		return w
	}
	return &waiter{ready: make(chan struct{}, 1)}
}

func (s *Semaphore) pushLocked(w *waiter) {
	w.prev, w.next = s.tail, nil
	if s.tail == nil {
		s.head = w
	} else {
		s.tail.next = w
	}
	s.tail = w
	s.waiting++
}

func (s *Semaphore) removeLocked(w *waiter) {
	if w.prev == nil {
		s.head = w.next
	} else {
		w.prev.next = w.next
	}
	if w.next == nil {
		s.tail = w.prev
	} else {
		w.next.prev = w.prev
	}
	w.prev, w.next = nil, nil
	s.waiting--
}
