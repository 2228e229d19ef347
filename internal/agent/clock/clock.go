// Package clock is the agent's source of time, so that everything driven by the clock (the
// lease, degrade switch expiry, breaker windows, the stale cache's ages, the peak-rate ring) can
// be tested with a Fake clock and no sleeps.
//
// Real reads time.Now and schedules with time.AfterFunc. Fake only moves when told: Advance and
// Set run, in the caller's goroutine and in deadline order, every function whose deadline has
// been reached, with Now already at that deadline.
package clock

import (
	"sort"
	"sync"
	"time"
)

// Clock tells the time and schedules functions.
type Clock interface {
	Now() time.Time
	// AfterFunc calls f in its own goroutine (Real) or in Advance's (Fake) once d has passed.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a scheduled function.
type Timer interface {
	// Stop prevents the call if it has not happened; it reports whether it did prevent it.
	Stop() bool
}

// Real is the system clock.
type Real struct{}

// Now returns time.Now().
func (Real) Now() time.Time { return time.Now() }

// AfterFunc is time.AfterFunc.
func (Real) AfterFunc(d time.Duration, f func()) Timer { return time.AfterFunc(d, f) }

// Fake is a manual clock for tests. The zero value is not usable; use NewFake.
type Fake struct {
	mu     sync.Mutex
	now    time.Time
	timers []*fakeTimer
	seq    int
}

// NewFake returns a Fake clock reading start.
func NewFake(start time.Time) *Fake { return &Fake{now: start} }

type fakeTimer struct {
	c    *Fake
	at   time.Time
	seq  int
	f    func()
	done bool
}

// Now returns the fake time.
func (c *Fake) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// AfterFunc schedules f at Now()+d; d <= 0 runs at the next Advance (even by 0).
func (c *Fake) AfterFunc(d time.Duration, f func()) Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seq++
	t := &fakeTimer{c: c, at: c.now.Add(d), seq: c.seq, f: f}
	c.timers = append(c.timers, t)
	return t
}

// Stop unschedules the timer.
func (t *fakeTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	if t.done {
		return false
	}
	t.done = true
	for i, x := range t.c.timers {
		if x == t {
			t.c.timers = append(t.c.timers[:i], t.c.timers[i+1:]...)
			break
		}
	}
	return true
}

// Advance moves the clock forward by d, running due functions in deadline order.
func (c *Fake) Advance(d time.Duration) { c.Set(c.Now().Add(d)) }

// Set moves the clock to t (never backwards), running due functions in deadline order.
func (c *Fake) Set(t time.Time) {
	for {
		c.mu.Lock()
		sort.Slice(c.timers, func(i, j int) bool {
			if !c.timers[i].at.Equal(c.timers[j].at) {
				return c.timers[i].at.Before(c.timers[j].at)
			}
			return c.timers[i].seq < c.timers[j].seq
		})
		if len(c.timers) == 0 || c.timers[0].at.After(t) {
			if t.After(c.now) {
				c.now = t
			}
			c.mu.Unlock()
			return
		}
		next := c.timers[0]
		c.timers = c.timers[1:]
		next.done = true
		if next.at.After(c.now) {
			c.now = next.at
		}
		c.mu.Unlock()
		next.f()
	}
}

// Pending is the number of scheduled functions.
func (c *Fake) Pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.timers)
}
