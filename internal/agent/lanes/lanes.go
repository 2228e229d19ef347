// Package lanes provides a counting semaphore whose permits are divided among priority lanes: a
// lane may hold a reserve that only it can use, other lanes may borrow the idle part of a reserve
// up to a cap, and a lane that wants its reserve back is served before any borrower. The agent
// uses one per downstream that declares lanes, in front of the downstream's semaphore.
//
// # Model
//
// The semaphore has a limit L (the pod's permits for the downstream) and lanes 0..k−1, each with
// a reserve rᵢ and a lendable part cᵢ ≤ rᵢ, both in permits, derived from percentages whenever
// the limit changes (see Reserves). The shared pool is S = L − Σ rᵢ ≥ 0. With uᵢ the permits
// lane i holds, its overflow is Oᵢ = max(0, uᵢ − rᵢ) (calls beyond its own reserve, on the shared
// pool or on another lane's reserve), and what lane j can lend now is Bⱼ = min(cⱼ, max(0, rⱼ −
// uⱼ)), the lendable part of its idle reserve. The semaphore grants a permit only if, after the
// grant,
//
//	Σ Oᵢ ≤ S + Σ Bⱼ                                                    (feasibility)
//
// which implies Σ uᵢ ≤ L: lanes divide the limit, they never add to it. Reading it per lane:
// lane i never holds more than rᵢ + S + Σ_{j≠i} cⱼ, and the reserve of lane j is never occupied
// by other lanes beyond cⱼ at the moment of a grant.
//
// Order. Each lane has its own FIFO queue. Waiters are served in two classes:
//
//  1. reclaim: a lane's head waiter whose grant would stay within its reserve (uᵢ < rᵢ) is served
//     as soon as feasibility allows, before anyone else, lanes in index order;
//  2. overflow: while any lane has such a reserve waiter that cannot be served, no grant beyond a
//     reserve is made at all (a borrower is never admitted while the reserving lane waits, so the
//     next permit released goes to the reserving lane); otherwise the oldest head waiter among the
//     lanes, by arrival across lanes, is served if feasibility allows.
//
// There is no barging: TryAcquire and a fresh Acquire succeed at once only when their lane has no
// waiter and, for a grant beyond the reserve, no lane has a waiter at all. The invariant kept
// after every operation is that no waiter could be served under the rules above. Permits already
// held are never revoked: lowering the limit (or a lane's reserve) makes grants wait until
// feasibility holds again, and a lane reclaims its reserve only as borrowers' calls finish.
//
// # Outcomes
//
//   - TryAcquire(l) returns true holding a permit of lane l if one can be granted at once under
//     the rules above; otherwise false, changing nothing.
//   - Acquire(ctx, l) returns nil holding a permit, or ctx.Err() holding nothing (the same
//     choices as package semaphore when ctx ends before or at the moment of the grant).
//   - Release(l) returns a permit of lane l; it panics if the lane holds none.
//   - SetLimit(n) recomputes the reserves from their percentages; it never revokes permits. A
//     negative n panics. An out-of-range lane panics everywhere.
//
// Each operation takes one mutex and does O(k) work; a waiter record is allocated only when the
// caller has to wait, and recycled through a sync.Pool.
package lanes

import (
	"context"
	"sync"
)

// Spec is one lane's configuration.
type Spec struct {
	// ReservePercent is the share of the limit kept for this lane (0..100; Σ over lanes ≤ 100).
	ReservePercent int
	// LendPercent is the part of the reserve other lanes may borrow while it is idle (0..100).
	LendPercent int
}

// Reserves turns percentages into permits for limit n: rᵢ = ⌈n·pᵢ/100⌉, then, while Σ rᵢ > n,
// the reserve rounded up the most (ties: the later lane) is lowered by one; cᵢ = ⌊rᵢ·lendᵢ/100⌋.
// Rounding up first keeps a small pod's core lane from a reserve of 0 (a 30 % reserve of 2
// permits is 1); the trimming keeps Σ rᵢ ≤ n. Percentages outside 0..100 are clamped.
func Reserves(n int, specs []Spec) (reserve, lendable []int) {
	reserve, lendable = make([]int, len(specs)), make([]int, len(specs))
	n = max(n, 0)
	total := 0
	for i, sp := range specs {
		p := min(max(sp.ReservePercent, 0), 100)
		reserve[i] = (n*p + 99) / 100
		total += reserve[i]
	}
	for total > n {
		best, bestUp := -1, -1
		for i, sp := range specs {
			if reserve[i] == 0 {
				continue
			}
			up := reserve[i]*100 - n*min(max(sp.ReservePercent, 0), 100) // rounded up by up/100
			if up >= bestUp {
				best, bestUp = i, up
			}
		}
		reserve[best]--
		total--
	}
	for i, sp := range specs {
		lendable[i] = reserve[i] * min(max(sp.LendPercent, 0), 100) / 100
	}
	return reserve, lendable
}

// LaneStats is a snapshot of one lane.
type LaneStats struct {
	Reserve  int // permits kept for the lane
	Lendable int // of which other lanes may borrow while idle
	InFlight int // permits the lane holds
	Waiting  int // the lane's callers blocked in Acquire
	// Overflow is what the lane holds beyond its reserve: on the shared pool, borrowed, or
	// beyond the limit after it was lowered.
	Overflow int
	// Borrowed bounds what the lane holds of other lanes' reserves: min(Overflow, the
	// semaphore's Borrowed). Exact when one lane overflows; an upper bound when several do.
	Borrowed int
}

// Stats is a consistent snapshot of a Semaphore.
type Stats struct {
	Limit    int
	InFlight int
	Waiting  int
	Shared   int // L − Σ reserves
	// Borrowed is reserve capacity held by lanes that do not own it: what the lanes hold beyond
	// their reserves and the shared pool, within the limit. With Iᵢ = max(0, rᵢ − uᵢ) the part
	// of a reserve its lane does not use, Σ Oᵢ − S = Σ Iᵢ + (Σ uᵢ − L), so Borrowed is
	// min(max(0, Σ Oᵢ − S), Σ Iᵢ): never more than the reserves there are. After every grant it
	// is at most Σ cⱼ (Σ uᵢ ≤ L then); only a lowered limit (or reserve) can leave it above that,
	// until the calls granted before end.
	Borrowed int
	// OverLimit is what is held beyond the limit, max(0, Σ uᵢ − L): permits granted before the
	// limit was lowered, which are never revoked and drain as their calls end. It is not counted
	// in Borrowed: those calls hold no reserve, there is none left for them.
	OverLimit int
	Lanes     []LaneStats
}

// Semaphore is a lane-divided counting semaphore. It must be created with New and is safe for
// concurrent use.
type Semaphore struct {
	mu    sync.Mutex
	specs []Spec
	limit int
	lanes []lane
	seq   uint64 // arrival counter across lanes

	pool sync.Pool // of *waiter

	// onGrant, if set, is called under mu after every grant with the lane granted; tests use it
	// to check the invariants at the exact moment of each grant.
	onGrant func(l int)
}

type lane struct {
	reserve, lendable int
	inFlight, waiting int
	head, tail        *waiter
}

type waiter struct {
	ready      chan struct{}
	granted    bool
	lane       int
	seq        uint64
	prev, next *waiter
}

// New returns a semaphore with limit permits divided among len(specs) lanes. It panics if limit
// is negative or there is no lane.
func New(limit int, specs []Spec) *Semaphore {
	if limit < 0 {
		panic("lanes: negative limit")
	}
	if len(specs) == 0 {
		panic("lanes: no lane")
	}
	s := &Semaphore{specs: append([]Spec(nil), specs...), lanes: make([]lane, len(specs))}
	s.setLimitLocked(limit)
	return s
}

// Specs returns the lanes' configuration.
func (s *Semaphore) Specs() []Spec { return append([]Spec(nil), s.specs...) }

// NumLanes is the number of lanes.
func (s *Semaphore) NumLanes() int { return len(s.lanes) }

// TryAcquire takes a permit of lane l without blocking (see the package doc).
func (s *Semaphore) TryAcquire(l int) bool {
	s.mu.Lock()
	ok := s.canBargeLocked(l)
	if ok {
		s.grantLocked(l)
	}
	s.mu.Unlock()
	return ok
}

// Force takes a permit of lane l at once, whatever the limit and the waiters: a call admitted
// under Observe, which counts against the lanes until it is released (Release). It reports
// whether TryAcquire would have taken it.
func (s *Semaphore) Force(l int) (free bool) {
	s.mu.Lock()
	free = s.canBargeLocked(l)
	s.lanes[l].inFlight++ // not grantLocked: onGrant checks grants within the limits
	s.mu.Unlock()
	return free
}

// Acquire takes a permit of lane l, waiting in the lane's FIFO queue until one is granted or
// ctx is done. It returns nil if the permit was taken and ctx.Err() otherwise; on error the
// caller holds nothing.
func (s *Semaphore) Acquire(ctx context.Context, l int) error {
	done := ctx.Done()
	s.mu.Lock()
	select {
	case <-done:
		s.mu.Unlock()
		return ctx.Err()
	default:
	}
	if s.canBargeLocked(l) {
		s.grantLocked(l)
		s.mu.Unlock()
		return nil
	}
	w := s.getWaiter()
	w.lane = l
	s.seq++
	w.seq = s.seq
	s.pushLocked(w)
	s.mu.Unlock()

	select {
	case <-w.ready:
		s.pool.Put(w)
		select {
		case <-done:
			s.Release(l)
			return ctx.Err()
		default:
			return nil
		}
	case <-done:
		s.mu.Lock()
		if w.granted {
			<-w.ready
			s.lanes[l].inFlight--
		} else {
			s.removeLocked(w)
		}
		// Unlike a single FIFO, leaving can unblock others: a reserve waiter that gives up
		// lifts the stop on overflow grants.
		s.notifyLocked()
		s.mu.Unlock()
		s.pool.Put(w)
		return ctx.Err()
	}
}

// Release returns a permit of lane l. It panics if the lane holds none.
func (s *Semaphore) Release(l int) {
	s.mu.Lock()
	if s.lanes[l].inFlight == 0 {
		s.mu.Unlock()
		panic("lanes: Release without Acquire")
	}
	s.lanes[l].inFlight--
	s.notifyLocked()
	s.mu.Unlock()
}

// SetLimit changes the limit and recomputes the reserves (see Reserves). Permits held are never
// revoked. It panics if n is negative.
func (s *Semaphore) SetLimit(n int) {
	if n < 0 {
		panic("lanes: negative limit")
	}
	s.mu.Lock()
	s.setLimitLocked(n)
	s.notifyLocked()
	s.mu.Unlock()
}

func (s *Semaphore) setLimitLocked(n int) {
	s.limit = n
	r, c := Reserves(n, s.specs)
	for i := range s.lanes {
		s.lanes[i].reserve, s.lanes[i].lendable = r[i], c[i]
	}
}

// Stats returns a consistent snapshot.
func (s *Semaphore) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Stats{Limit: s.limit, Shared: s.limit, Lanes: make([]LaneStats, len(s.lanes))}
	overflow, unused := 0, 0
	for i, ln := range s.lanes {
		st.InFlight += ln.inFlight
		st.Waiting += ln.waiting
		st.Shared -= ln.reserve
		o := max(0, ln.inFlight-ln.reserve)
		overflow += o
		unused += max(0, ln.reserve-ln.inFlight)
		st.Lanes[i] = LaneStats{Reserve: ln.reserve, Lendable: ln.lendable, InFlight: ln.inFlight, Waiting: ln.waiting, Overflow: o}
	}
	st.Borrowed = min(max(0, overflow-st.Shared), unused)
	st.OverLimit = max(0, st.InFlight-st.Limit)
	for i := range st.Lanes {
		st.Lanes[i].Borrowed = min(st.Lanes[i].Overflow, st.Borrowed)
	}
	return st
}

// feasibleLocked reports whether one more permit for lane g keeps Σ O ≤ S + Σ B.
func (s *Semaphore) feasibleLocked(g int) bool {
	shared := s.limit
	over, lend := 0, 0
	for i := range s.lanes {
		ln := &s.lanes[i]
		u := ln.inFlight
		if i == g {
			u++
		}
		shared -= ln.reserve
		over += max(0, u-ln.reserve)
		lend += min(ln.lendable, max(0, ln.reserve-u))
	}
	return over <= shared+lend
}

// canBargeLocked: may a newcomer of lane l be granted at once without overtaking a waiter?
func (s *Semaphore) canBargeLocked(l int) bool {
	ln := &s.lanes[l]
	if ln.head != nil {
		return false
	}
	if ln.inFlight >= ln.reserve {
		// Beyond the reserve: behind every waiter of every lane (each is either a reserve
		// waiter, which stops overflow grants, or an earlier overflow waiter).
		for i := range s.lanes {
			if s.lanes[i].head != nil {
				return false
			}
		}
	}
	return s.feasibleLocked(l)
}

// notifyLocked serves waiters under the order of the package doc until none can be served.
func (s *Semaphore) notifyLocked() {
	for {
		served, reserveBlocked := false, false
		for i := range s.lanes {
			ln := &s.lanes[i]
			if ln.head == nil || ln.inFlight >= ln.reserve {
				continue
			}
			if s.feasibleLocked(i) {
				s.serveHeadLocked(i)
				served = true
				break
			}
			reserveBlocked = true
		}
		if served {
			continue
		}
		if reserveBlocked {
			return
		}
		oldest := -1
		for i := range s.lanes {
			if h := s.lanes[i].head; h != nil && (oldest < 0 || h.seq < s.lanes[oldest].head.seq) {
				oldest = i
			}
		}
		// Every overflow grant changes feasibility alike (its lane has no idle reserve), so if
		// the oldest cannot be served, no one can.
		if oldest < 0 || !s.feasibleLocked(oldest) {
			return
		}
		s.serveHeadLocked(oldest)
	}
}

func (s *Semaphore) serveHeadLocked(l int) {
	w := s.lanes[l].head
	s.removeLocked(w)
	w.granted = true
	s.grantLocked(l)
	w.ready <- struct{}{} // buffered, never blocks
}

func (s *Semaphore) grantLocked(l int) {
	s.lanes[l].inFlight++
	if s.onGrant != nil {
		s.onGrant(l)
	}
}

func (s *Semaphore) getWaiter() *waiter {
	if w, ok := s.pool.Get().(*waiter); ok {
		w.granted = false
		return w
	}
	return &waiter{ready: make(chan struct{}, 1)}
}

func (s *Semaphore) pushLocked(w *waiter) {
	ln := &s.lanes[w.lane]
	w.prev, w.next = ln.tail, nil
	if ln.tail == nil {
		ln.head = w
	} else {
		ln.tail.next = w
	}
	ln.tail = w
	ln.waiting++
}

func (s *Semaphore) removeLocked(w *waiter) {
	ln := &s.lanes[w.lane]
	if w.prev == nil {
		ln.head = w.next
	} else {
		w.prev.next = w.next
	}
	if w.next == nil {
		ln.tail = w.prev
	} else {
		w.next.prev = w.prev
	}
	w.prev, w.next = nil, nil
	ln.waiting--
}
