package lanes

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/apportion/apportion/internal/testing/wait"
)

func noRecv[T any](t *testing.T, what string, ch <-chan T) {
	t.Helper()
	select {
	case v := <-ch:
		t.Fatalf("%s: got %v, want nothing", what, v)
	default:
	}
}

func TestReserves(t *testing.T) {
	tests := []struct {
		n            int
		specs        []Spec
		wantR, wantC []int
	}{
		{10, []Spec{{50, 40}, {0, 0}}, []int{5, 0}, []int{2, 0}},
		{2, []Spec{{30, 100}, {0, 0}}, []int{1, 0}, []int{1, 0}},
		{2, []Spec{{33, 100}, {33, 100}, {34, 100}}, []int{1, 0, 1}, []int{1, 0, 1}},
		{0, []Spec{{50, 50}, {50, 50}}, []int{0, 0}, []int{0, 0}},
		{7, []Spec{{100, 50}}, []int{7}, []int{3}},
		{10, []Spec{{-5, 200}, {150, -1}}, []int{0, 10}, []int{0, 0}},
	}
	for _, tt := range tests {
		r, c := Reserves(tt.n, tt.specs)
		if !cmp.Equal(r, tt.wantR) || !cmp.Equal(c, tt.wantC) {
			t.Errorf("Reserves(%d, %v) = %v, %v; want %v, %v", tt.n, tt.specs, r, c, tt.wantR, tt.wantC)
		}
	}
	// Σ reserves ≤ n for any percentages summing to ≤ 100.
	rnd := rand.New(rand.NewPCG(3, 15))
	for range 10000 {
		n := rnd.IntN(50)
		k := 1 + rnd.IntN(6)
		specs := make([]Spec, k)
		left := 100
		for i := range specs {
			p := rnd.IntN(left + 1)
			left -= p
			specs[i] = Spec{ReservePercent: p, LendPercent: rnd.IntN(101)}
		}
		r, c := Reserves(n, specs)
		total := 0
		for i := range r {
			total += r[i]
			if c[i] > r[i] || c[i] < 0 || r[i] < 0 {
				t.Fatalf("Reserves(%d, %v) = %v, %v: bad lane %d", n, specs, r, c, i)
			}
		}
		if total > n {
			t.Fatalf("Reserves(%d, %v) = %v: Σ %d > %d", n, specs, r, total, n)
		}
	}
}

// core is lane 0 (reserve 50 %, 40 % of it lendable), default is lane 1 (no reserve).
func coreAndDefault(limit int) *Semaphore {
	return New(limit, []Spec{{ReservePercent: 50, LendPercent: 40}, {}})
}

func TestBoundsPerLane(t *testing.T) {
	s := coreAndDefault(10) // core reserve 5, lendable 2; shared 5
	n := 0
	for s.TryAcquire(1) {
		n++
	}
	if n != 7 {
		t.Fatalf("default lane got %d permits, want shared 5 + lendable 2 = 7", n)
	}
	// Core still has the rest of its reserve: 3.
	c := 0
	for s.TryAcquire(0) {
		c++
	}
	if c != 3 {
		t.Fatalf("core got %d with the default lane borrowing 2 of its reserve, want 3", c)
	}
	if st := s.Stats(); st.InFlight != 10 || st.Borrowed != 2 || st.Lanes[1].Borrowed != 2 || st.Lanes[1].Overflow != 7 {
		t.Fatalf("stats %+v", st)
	}
	// Core alone can use its reserve plus the shared pool.
	s = coreAndDefault(10)
	c = 0
	for s.TryAcquire(0) {
		c++
	}
	if c != 10 {
		t.Fatalf("core alone got %d, want 10", c)
	}
}

// TestBorrowedAfterLowering: a lowered limit revokes nothing, so borrowers may hold more than
// the new limit for as long as their calls run. Borrowed counts only what they hold of the
// reserves there are (never more than the reserves, here core's whole reserve of the lowered
// limit), OverLimit what they hold beyond the limit; no grant is made until the calls granted
// before end, and then the cap holds again. (Borrowed was ΣO − S: 8 − 3 = 5 borrowed of a
// reserve of 3, which an agent whose lease lapsed reported as borrowing above the cap.)
func TestBorrowedAfterLowering(t *testing.T) {
	s := coreAndDefault(10) // core reserve 5, lendable 2; shared 5
	for range 7 {
		if !s.TryAcquire(1) {
			t.Fatal("default lane: shared 5 + lendable 2 not granted")
		}
	}
	if st := s.Stats(); st.Borrowed != 2 || st.OverLimit != 0 {
		t.Fatalf("at limit 10: %+v, want Borrowed 2, OverLimit 0", st)
	}
	s.SetLimit(6) // core reserve 3, lendable 1; shared 3
	st := s.Stats()
	if st.Borrowed != 3 || st.Lanes[1].Borrowed != 3 || st.OverLimit != 1 || st.Lanes[1].Overflow != 7 {
		t.Fatalf("at limit 6 with 7 held: %+v, want Borrowed 3 (core's whole reserve), OverLimit 1", st)
	}
	if st.Borrowed > st.Lanes[0].Reserve {
		t.Fatalf("borrowed %d of a reserve of %d", st.Borrowed, st.Lanes[0].Reserve)
	}
	if s.TryAcquire(1) || s.TryAcquire(0) {
		t.Fatal("granted while the held permits exceed the lowered limit")
	}
	// The borrowers' calls end until the cap of the limit in force holds: 3 shared + 1 lendable.
	for range 3 {
		s.Release(1)
	}
	if st := s.Stats(); st.Borrowed != 1 || st.OverLimit != 0 {
		t.Fatalf("4 held at limit 6: %+v, want Borrowed 1, OverLimit 0", st)
	}
	if s.TryAcquire(1) {
		t.Fatal("default lane borrowed beyond the lendable 1 of the lowered limit")
	}
	for range 2 {
		if !s.TryAcquire(0) {
			t.Fatal("core did not get the unlent part of its reserve")
		}
	}
}

// enqueue starts n Acquire calls on lane l one at a time (each queued before the next starts) and
// returns a channel that receives tag+i as each is granted, and channels to release them.
func enqueue(t *testing.T, s *Semaphore, l, n int, tag string) (granted chan string, hold []chan struct{}) {
	t.Helper()
	granted = make(chan string, n)
	for i := range n {
		h := make(chan struct{})
		hold = append(hold, h)
		before := s.Stats().Lanes[l].Waiting
		go func() {
			if err := s.Acquire(context.Background(), l); err != nil {
				t.Errorf("Acquire: %v", err)
				return
			}
			granted <- fmt.Sprintf("%s%d", tag, i)
			<-h
			s.Release(l)
		}()
		wait.For(t, "waiter queued", func() bool { return s.Stats().Lanes[l].Waiting == before+1 })
	}
	return granted, hold
}

// TestReclaimOrder: with borrowers holding part of core's reserve and both lanes waiting, every
// permit released goes to core's waiters first, even though the borrowers queued earlier.
func TestReclaimOrder(t *testing.T) {
	s := coreAndDefault(10)
	for range 7 {
		if !s.TryAcquire(1) {
			t.Fatal("default lane could not fill shared + lendable")
		}
	}
	for range 3 {
		if !s.TryAcquire(0) {
			t.Fatal("core could not take the rest of its reserve")
		}
	}
	defGranted, defHold := enqueue(t, s, 1, 2, "default")
	coreGranted, coreHold := enqueue(t, s, 0, 2, "core")
	if s.TryAcquire(1) || s.TryAcquire(0) {
		t.Fatal("barged past waiters")
	}
	// A borrower finishes: the permit goes to core (reclaim), not to the older default waiter.
	s.Release(1)
	if got := wait.Recv(t, "core grant", coreGranted); got != "core0" {
		t.Fatalf("granted %s", got)
	}
	noRecv(t, "default grant after the first release", defGranted)
	s.Release(1)
	if got := wait.Recv(t, "core grant", coreGranted); got != "core1" {
		t.Fatalf("granted %s", got)
	}
	noRecv(t, "default grant after the second release", defGranted)
	// Core now holds its whole reserve; default holds 5 = shared. Core finishing one frees a
	// lendable permit: the default lane's oldest waiter gets it.
	close(coreHold[0])
	if got := wait.Recv(t, "default grant", defGranted); got != "default0" {
		t.Fatalf("granted %s", got)
	}
	close(coreHold[1])
	if got := wait.Recv(t, "default grant", defGranted); got != "default1" {
		t.Fatalf("granted %s", got)
	}
	for _, h := range defHold {
		close(h)
	}
	wait.For(t, "released", func() bool { return s.Stats().InFlight == 8 }) // 3 core + 5 default TryAcquired
}

// TestNoBorrowWhileReserveWaits: a core waiter that cannot be served stops every grant beyond a
// reserve, so a permit that is free in the shared pool is not taken by a borrower either.
func TestNoBorrowWhileReserveWaits(t *testing.T) {
	s := New(10, []Spec{{ReservePercent: 50, LendPercent: 100}, {}}) // core 5, all lendable
	for range 10 {
		if !s.TryAcquire(1) {
			t.Fatal("default should borrow the whole idle reserve")
		}
	}
	coreGranted, coreHold := enqueue(t, s, 0, 1, "core")
	s.Release(1) // 9 default in flight; core fits: O 9 ≤ S 5 + B min(5, 4) = 9
	wait.Recv(t, "core grant", coreGranted)
	defGranted, defHold := enqueue(t, s, 1, 1, "default")
	close(coreHold[0])
	// Core gone: 9 default + 1 free; the default waiter takes it.
	wait.Recv(t, "default grant", defGranted)
	close(defHold[0])
}

func TestFIFOWithinLane(t *testing.T) {
	s := New(2, []Spec{{}, {}})
	s.TryAcquire(0)
	s.TryAcquire(0)
	granted, hold := enqueue(t, s, 1, 5, "w")
	for i := range 5 {
		if i < 2 {
			s.Release(0)
		} else {
			close(hold[i-2])
		}
		if got, want := wait.Recv(t, "grant", granted), fmt.Sprintf("w%d", i); got != want {
			t.Fatalf("grant %d went to %s", i, got)
		}
	}
	close(hold[3])
	close(hold[4])
}

// TestFIFOAcrossLanesBeyondReserves: overflow waiters of different lanes are served in arrival
// order.
func TestFIFOAcrossLanesBeyondReserves(t *testing.T) {
	s := New(1, []Spec{{}, {}})
	s.TryAcquire(0)
	a, ah := enqueue(t, s, 1, 1, "a")
	b, bh := enqueue(t, s, 0, 1, "b")
	s.Release(0)
	wait.Recv(t, "a", a)
	noRecv(t, "b", b)
	close(ah[0])
	wait.Recv(t, "b", b)
	close(bh[0])
}

func TestCancelledReserveWaiterUnblocksOverflow(t *testing.T) {
	s := New(4, []Spec{{ReservePercent: 50, LendPercent: 100}, {}}) // core 2, lendable 2, shared 2
	for range 4 {
		s.TryAcquire(1)
	}
	ctx, cancel := context.WithCancel(context.Background())
	coreErr := make(chan error, 1)
	go func() { coreErr <- s.Acquire(ctx, 0) }()
	wait.For(t, "core waiting", func() bool { return s.Stats().Lanes[0].Waiting == 1 })
	defGranted, defHold := enqueue(t, s, 1, 1, "default")
	s.Release(1) // core can be served: it takes the permit
	if err := wait.Recv(t, "core", coreErr); err != nil {
		t.Fatal(err)
	}
	s.Release(0)
	// 3 default in flight, core idle: the default waiter borrows.
	wait.Recv(t, "default grant", defGranted)
	close(defHold[0])
	cancel()
}

func TestAcquireTimeoutAndDoneContext(t *testing.T) {
	s := New(1, []Spec{{}})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := s.Acquire(ctx, 0); !errors.Is(err, context.Canceled) {
		t.Fatalf("done ctx: %v", err)
	}
	s.TryAcquire(0)
	tctx, tcancel := context.WithTimeout(context.Background(), time.Millisecond)
	defer tcancel()
	if err := s.Acquire(tctx, 0); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("timeout: %v", err)
	}
	if st := s.Stats(); st.InFlight != 1 || st.Waiting != 0 {
		t.Fatalf("after timeout %+v", st)
	}
}

func TestPanics(t *testing.T) {
	for name, f := range map[string]func(){
		"negative limit":  func() { New(-1, []Spec{{}}) },
		"no lane":         func() { New(1, nil) },
		"release nothing": func() { New(1, []Spec{{}}).Release(0) },
		"set negative":    func() { New(1, []Spec{{}}).SetLimit(-1) },
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: no panic", name)
				}
			}()
			f()
		}()
	}
}

func TestUncontendedDoesNotAllocate(t *testing.T) {
	s := coreAndDefault(4)
	ctx := context.Background()
	if a := testing.AllocsPerRun(1000, func() {
		if err := s.Acquire(ctx, 1); err != nil {
			t.Fatal(err)
		}
		s.Release(1)
	}); a != 0 {
		t.Fatalf("%v allocations per uncontended Acquire/Release", a)
	}
}

// checkGrant is the invariant checked under the lock at every grant: feasibility (which bounds
// every lane and every reserve's lending), Σ ≤ limit, and the reclaim rule (a grant beyond the
// reserve is never made while a reserve waiter exists).
func checkGrant(s *Semaphore, l int) error {
	total, over, lend, shared := 0, 0, 0, s.limit
	for i := range s.lanes {
		ln := &s.lanes[i]
		total += ln.inFlight
		shared -= ln.reserve
		over += max(0, ln.inFlight-ln.reserve)
		lend += min(ln.lendable, max(0, ln.reserve-ln.inFlight))
	}
	if total > s.limit {
		return fmt.Errorf("Σ in flight %d > limit %d", total, s.limit)
	}
	if over > shared+lend {
		return fmt.Errorf("overflow %d > shared %d + lendable idle %d", over, shared, lend)
	}
	bound := s.lanes[l].reserve + shared
	for j := range s.lanes {
		if j != l {
			bound += s.lanes[j].lendable
		}
	}
	if s.lanes[l].inFlight > bound {
		return fmt.Errorf("lane %d holds %d > its bound %d", l, s.lanes[l].inFlight, bound)
	}
	if s.lanes[l].inFlight > s.lanes[l].reserve {
		for j := range s.lanes {
			if ln := &s.lanes[j]; ln.head != nil && ln.inFlight < ln.reserve {
				return fmt.Errorf("lane %d granted beyond its reserve while lane %d waits within its reserve", l, j)
			}
		}
	}
	return nil
}

// TestConcurrentProperties hammers the semaphore from many goroutines on random lanes, with
// random timeouts and limit changes, and checks the invariants at every grant.
func TestConcurrentProperties(t *testing.T) {
	for seed := range uint64(6) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rnd := rand.New(rand.NewPCG(seed, 15))
			k := 1 + rnd.IntN(4)
			specs := make([]Spec, k)
			left := 100
			for i := range specs {
				p := rnd.IntN(left + 1)
				left -= p
				specs[i] = Spec{ReservePercent: p, LendPercent: rnd.IntN(101)}
			}
			s := New(1+rnd.IntN(12), specs)
			var mu sync.Mutex
			var failure error
			s.onGrant = func(l int) {
				if err := checkGrant(s, l); err != nil && failure == nil {
					mu.Lock()
					failure = err
					mu.Unlock()
				}
			}
			var wg sync.WaitGroup
			const workers, perWorker = 24, 300
			for w := range workers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(seed, uint64(w)))
					for range perWorker {
						l := r.IntN(k)
						var err error
						if r.IntN(4) == 0 {
							if !s.TryAcquire(l) {
								continue
							}
						} else {
							ctx, cancel := context.WithTimeout(context.Background(), time.Duration(r.IntN(300))*time.Microsecond)
							err = s.Acquire(ctx, l)
							cancel()
						}
						if err != nil {
							continue
						}
						for range r.IntN(50) {
							runtime.Gosched()
						}
						s.Release(l)
					}
				}()
			}
			stop := make(chan struct{})
			done := make(chan struct{})
			go func() {
				defer close(done)
				r := rand.New(rand.NewPCG(seed, 99))
				for {
					select {
					case <-stop:
						return
					default:
					}
					s.SetLimit(r.IntN(12))
					runtime.Gosched()
				}
			}()
			wg.Wait()
			close(stop)
			<-done
			if failure != nil {
				t.Fatal(failure)
			}
			if st := s.Stats(); st.InFlight != 0 || st.Waiting != 0 {
				t.Fatalf("leaked: %+v", st)
			}
		})
	}
}

// TestModel drives the non-blocking operations through random sequences and compares every
// TryAcquire with a direct evaluation of the rules on the counts.
func TestModel(t *testing.T) {
	rnd := rand.New(rand.NewPCG(7, 15))
	for iter := range 2000 {
		k := 1 + rnd.IntN(4)
		specs := make([]Spec, k)
		left := 100
		for i := range specs {
			p := rnd.IntN(left + 1)
			left -= p
			specs[i] = Spec{ReservePercent: p, LendPercent: rnd.IntN(101)}
		}
		limit := rnd.IntN(15)
		s := New(limit, specs)
		held := make([]int, k)
		for step := range 60 {
			l := rnd.IntN(k)
			switch op := rnd.IntN(5); {
			case op == 0 && held[l] > 0:
				s.Release(l)
				held[l]--
			case op == 1:
				limit = rnd.IntN(15)
				s.SetLimit(limit)
			default:
				r, c := Reserves(limit, specs)
				over, lend, shared := 0, 0, limit
				for i := range held {
					u := held[i]
					if i == l {
						u++
					}
					shared -= r[i]
					over += max(0, u-r[i])
					lend += min(c[i], max(0, r[i]-u))
				}
				want := over <= shared+lend
				if got := s.TryAcquire(l); got != want {
					t.Fatalf("#%d step %d: TryAcquire(%d) = %v, model %v (limit %d specs %v held %v)", iter, step, l, got, want, limit, specs, held)
				}
				if want {
					held[l]++
				}
			}
		}
	}
}
