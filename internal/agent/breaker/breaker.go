// Package breaker is the agent's per-downstream circuit breaker.
//
// # Model
//
// A Breaker is in one of three states:
//
//   - Closed: every call is allowed. Finished calls are counted in a sliding
//     window of Window, kept as Buckets buckets of Window/Buckets each, so
//     calls age out one bucket at a time. After each recorded call, if the
//     window holds at least MinCalls calls and either the failure rate
//     reaches FailureRatePercent or the slow-call rate (calls that took at
//     least SlowCallThreshold) reaches SlowCallRatePercent, the breaker
//     opens.
//   - Open: every call is refused, with retryAfter = the time left until
//     OpenDuration has passed since opening. At that moment the breaker is
//     half-open (the move happens on the next Allow or State call).
//   - HalfOpen: at most HalfOpenProbes calls (probes) are allowed, and never
//     more than are still needed: a call is allowed while probes in flight +
//     probes succeeded < HalfOpenProbes; others are refused with retryAfter 0
//     (unknown). A probe that fails, or that is slow while the slow-call rule
//     is enabled, reopens the breaker for a fresh OpenDuration. When
//     HalfOpenProbes probes have succeeded the breaker closes with an empty
//     window.
//
// Whether a call failed is the caller's verdict (the proxy counts 5xx, 429,
// timeouts and connection errors); the breaker only counts.
//
// Every allowed call gets a Ticket, which must be finished exactly once:
// with Ticket.Done (or Breaker.Record) if the call was made, or with
// Ticket.Cancel (or Breaker.Cancel) if it was not (say the rate limit or the
// semaphore refused it after the breaker allowed it). Cancel counts nothing
// and gives a half-open probe slot back, so a probe that never reached the
// downstream can neither close nor reopen the breaker. A ticket belongs to the state period it
// was issued in: every transition starts a new generation, and a ticket from
// an earlier generation is ignored when it finishes. So a call allowed while
// closed that finishes after the breaker opened neither counts towards the
// (cleared) window nor looks like a probe. A probe whose ticket is never
// finished keeps its probe slot, so the proxy must finish tickets on every
// path, including timeouts and panics.
//
// # Configuration
//
// Zero fields take defaults: Window DefaultWindow, MinCalls DefaultMinCalls,
// OpenDuration DefaultOpenDuration, HalfOpenProbes DefaultHalfOpenProbes.
// The trip rules are opt-in: FailureRatePercent <= 0 disables the failure
// rule; SlowCallThreshold <= 0 or SlowCallRatePercent <= 0 disables the
// slow-call rule. So the zero Config never opens: the Breaker only counts.
// Percentages above 100 can never be reached. SetConfig changes the
// configuration at run time; see its documentation.
//
// A nil *Breaker is a valid, always-closed breaker: Allow admits every call
// with a ticket whose Done does nothing, State reports Closed. (SetConfig
// and SetOnTransition on nil panic: there is nowhere to keep them.)
//
// Time is passed in; nothing reads the clock. The transition logic is the
// pure function next; Breaker adds only the lock and the hook.
package breaker

import (
	"fmt"
	"sync"
	"time"

	"github.com/apportion/apportion/api/v1alpha1/defaults"
)

// State is a breaker state.
type State int

const (
	Closed State = iota
	Open
	HalfOpen
)

func (s State) String() string {
	switch s {
	case Closed:
		return "closed"
	case Open:
		return "open"
	case HalfOpen:
		return "half-open"
	}
	return fmt.Sprintf("State(%d)", int(s))
}

// Defaults for zero Config fields: the CRD's (spec.agent.circuitBreaker), from the one package
// that states them for the API and the agent alike. And the window's resolution.
const (
	DefaultWindow         = defaults.BreakerWindow
	DefaultMinCalls       = defaults.BreakerMinimumCalls
	DefaultOpenDuration   = defaults.BreakerOpenDuration
	DefaultHalfOpenProbes = defaults.BreakerHalfOpenProbes

	// Buckets is the number of buckets the window is divided into: calls
	// age out in steps of Window/Buckets.
	Buckets = 10
)

// Config configures a Breaker. See the package documentation for zero
// values.
type Config struct {
	Window              time.Duration // length of the sliding window
	MinCalls            int           // calls in the window before a rule may trip
	FailureRatePercent  int           // failures*100/calls that opens the breaker
	SlowCallThreshold   time.Duration // a call this long or longer is slow
	SlowCallRatePercent int           // slow*100/calls that opens the breaker
	OpenDuration        time.Duration // how long the breaker stays open
	HalfOpenProbes      int           // probes allowed, and successes needed to close
}

// Validate reports values that cannot be meant: negative durations or
// counts, and percentages outside 0..100.
func (c Config) Validate() error {
	switch {
	case c.Window < 0 || c.SlowCallThreshold < 0 || c.OpenDuration < 0:
		return fmt.Errorf("breaker: negative duration in %+v", c)
	case c.MinCalls < 0 || c.HalfOpenProbes < 0:
		return fmt.Errorf("breaker: negative count in %+v", c)
	case c.FailureRatePercent < 0 || c.FailureRatePercent > 100:
		return fmt.Errorf("breaker: failureRatePercent %d outside 0..100", c.FailureRatePercent)
	case c.SlowCallRatePercent < 0 || c.SlowCallRatePercent > 100:
		return fmt.Errorf("breaker: slowCallRatePercent %d outside 0..100", c.SlowCallRatePercent)
	}
	return nil
}

// withDefaults fills zero (or negative) fields that have defaults.
func (c Config) withDefaults() Config {
	if c.Window <= 0 {
		c.Window = DefaultWindow
	}
	if c.MinCalls <= 0 {
		c.MinCalls = DefaultMinCalls
	}
	if c.OpenDuration <= 0 {
		c.OpenDuration = DefaultOpenDuration
	}
	if c.HalfOpenProbes <= 0 {
		c.HalfOpenProbes = DefaultHalfOpenProbes
	}
	return c
}

func (c Config) bucketWidth() time.Duration { return max(c.Window/Buckets, 1) }

func (c Config) slowRuleOn() bool { return c.SlowCallThreshold > 0 && c.SlowCallRatePercent > 0 }

// Breaker is a circuit breaker. It is safe for concurrent use.
type Breaker struct {
	mu           sync.Mutex
	cfg          Config // with defaults applied
	s            snapshot
	onTransition func(from, to State)
}

// New returns a closed Breaker.
func New(cfg Config) *Breaker {
	return &Breaker{cfg: cfg.withDefaults(), s: snapshot{gen: 1}}
}

// Ticket is the permission for one call. The zero Ticket (from a refused
// Allow or a nil Breaker) may be finished; it does nothing.
type Ticket struct {
	b   *Breaker
	gen uint64
}

// Done finishes the call: failed is the caller's verdict, took its duration.
// It is b.Record(t, now, failed, took).
func (t Ticket) Done(now time.Time, failed bool, took time.Duration) {
	if t.b != nil {
		t.b.Record(t, now, failed, took)
	}
}

// Cancel finishes the ticket of a call that was not made after all. It is
// b.Cancel(t).
func (t Ticket) Cancel() {
	if t.b != nil {
		t.b.Cancel(t)
	}
}

// SetOnTransition installs fn, called once per state change with the old
// and new state (for metrics). It runs on the goroutine that caused the
// change, after the breaker's lock is released, so it may call the Breaker;
// calls caused by different goroutines may arrive out of order.
func (b *Breaker) SetOnTransition(fn func(from, to State)) {
	b.mu.Lock()
	b.onTransition = fn
	b.mu.Unlock()
}

// Allow asks to make one call at now. If ok, the caller must finish ticket
// exactly once. If not, retryAfter is how long the breaker stays open, or 0
// when that is unknown (half-open with all probe slots taken).
func (b *Breaker) Allow(now time.Time) (ticket Ticket, retryAfter time.Duration, ok bool) {
	if b == nil {
		return Ticket{}, 0, true
	}
	v, _ := b.apply(event{kind: evAllow, now: now})
	if !v.ok {
		return Ticket{}, v.retryAfter, false
	}
	return Ticket{b: b, gen: v.gen}, 0, true
}

// Record finishes the call t was issued for. Tickets of another Breaker or
// of an earlier generation are ignored (see the package documentation).
func (b *Breaker) Record(t Ticket, now time.Time, failed bool, took time.Duration) {
	if b == nil || t.b != b {
		return
	}
	b.apply(event{kind: evRecord, now: now, gen: t.gen, failed: failed, took: took})
}

// Cancel finishes, without counting it, the ticket of a call that was not
// made; a half-open probe slot is given back. Tickets of another Breaker or
// of an earlier generation are ignored.
func (b *Breaker) Cancel(t Ticket) {
	if b == nil || t.b != b {
		return
	}
	b.apply(event{kind: evCancel, gen: t.gen})
}

// State returns the state at now, moving from Open to HalfOpen if
// OpenDuration has passed.
func (b *Breaker) State(now time.Time) State {
	if b == nil {
		return Closed
	}
	_, st := b.apply(event{kind: evTick, now: now})
	return st
}

// Config returns the configuration in force, with defaults applied.
func (b *Breaker) Config() Config {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.cfg
}

// SetConfig changes the configuration. The state is kept, with these
// adjustments: a new bucket width (Window) clears the window, since old
// buckets no longer line up; an open breaker keeps the reopen time it had;
// a half-open breaker that already has the (new) HalfOpenProbes successes
// closes at once.
func (b *Breaker) SetConfig(cfg Config) {
	b.mu.Lock()
	old := b.s
	cfg = cfg.withDefaults()
	b.s = reconfigure(b.s, b.cfg, cfg)
	b.cfg = cfg
	cur, fn := b.s, b.onTransition
	b.mu.Unlock()
	notify(fn, old, cur)
}

// apply runs one event through next under the lock, then the hook. It
// returns the verdict and the state after the event.
func (b *Breaker) apply(ev event) (verdict, State) {
	b.mu.Lock()
	old := b.s
	s, v := next(b.s, ev, b.cfg)
	b.s = s
	fn := b.onTransition
	b.mu.Unlock()
	notify(fn, old, s)
	return v, s.state
}

// notify calls fn if a transition happened between old and cur. Every
// transition bumps the generation and next makes at most one per event.
func notify(fn func(from, to State), old, cur snapshot) {
	if fn != nil && cur.gen != old.gen {
		fn(old.state, cur.state)
	}
}

// ---- pure state machine ----

type eventKind int

const (
	evAllow  eventKind = iota // a call asks to go
	evRecord                  // a call finished
	evTick                    // time passed (State)
	evCancel                  // an allowed call was not made
)

type event struct {
	kind   eventKind
	now    time.Time
	gen    uint64 // evRecord, evCancel: the ticket's generation
	failed bool   // evRecord
	took   time.Duration
}

// verdict is what an event answers.
type verdict struct {
	ok         bool          // evAllow: allowed
	retryAfter time.Duration // evAllow refused: time until half-open, 0 if unknown
	gen        uint64        // evAllow allowed: the ticket's generation
}

// snapshot is the whole state of a breaker; a value, so next is pure.
type snapshot struct {
	state     State
	gen       uint64    // bumped on every transition; tickets carry it
	openUntil time.Time // Open: when it becomes half-open
	probes    int       // HalfOpen: probes in flight
	probesOK  int       // HalfOpen: probes succeeded
	win       window    // Closed: recent calls
}

// next is the breaker's transition function: the state after ev, and the
// answer to ev. cfg has defaults applied. It makes at most one transition.
func next(s snapshot, ev event, cfg Config) (snapshot, verdict) {
	switch ev.kind {
	case evTick:
		return expire(s, ev.now), verdict{}

	case evAllow:
		s = expire(s, ev.now)
		switch s.state {
		case Closed:
			return s, verdict{ok: true, gen: s.gen}
		case Open:
			return s, verdict{retryAfter: s.openUntil.Sub(ev.now)}
		default: // HalfOpen
			if s.probes+s.probesOK >= cfg.HalfOpenProbes {
				return s, verdict{}
			}
			s.probes++
			return s, verdict{ok: true, gen: s.gen}
		}

	case evCancel:
		if ev.gen == s.gen && s.state == HalfOpen && s.probes > 0 {
			s.probes-- // the slot is free again; nothing was learnt
		}
		return s, verdict{}

	case evRecord:
		if ev.gen != s.gen {
			return s, verdict{} // issued before a transition: not ours to count
		}
		slow := cfg.SlowCallThreshold > 0 && ev.took >= cfg.SlowCallThreshold
		switch s.state {
		case Closed:
			s.win = s.win.add(epoch(ev.now, cfg), ev.failed, slow)
			if trips(s.win.sum(epoch(ev.now, cfg)), cfg) {
				return open(s, ev.now, cfg), verdict{}
			}
		case HalfOpen:
			if s.probes == 0 {
				return s, verdict{} // more records than probes: a ticket finished twice
			}
			s.probes--
			// A slow probe counts as failed when slow calls can trip the
			// breaker; otherwise a slow downstream would close it only to
			// trip it again a window later.
			if ev.failed || (slow && cfg.slowRuleOn()) {
				return open(s, ev.now, cfg), verdict{}
			}
			s.probesOK++
			if s.probesOK >= cfg.HalfOpenProbes {
				return closed(s), verdict{}
			}
		}
		// Open issues no tickets of its own generation: nothing to do.
	}
	return s, verdict{}
}

// reconfigure adapts s from configuration old to cur (both with defaults).
func reconfigure(s snapshot, old, cur Config) snapshot {
	if old.bucketWidth() != cur.bucketWidth() {
		s.win = window{}
	}
	if s.state == HalfOpen && s.probesOK >= cur.HalfOpenProbes {
		// No further probe would be admitted, and none may be in flight
		// to finish the job: close now rather than never.
		return closed(s)
	}
	return s
}

// expire moves an Open breaker whose time is up to HalfOpen.
func expire(s snapshot, now time.Time) snapshot {
	if s.state == Open && !now.Before(s.openUntil) {
		return snapshot{state: HalfOpen, gen: s.gen + 1}
	}
	return s
}

func open(s snapshot, now time.Time, cfg Config) snapshot {
	return snapshot{state: Open, gen: s.gen + 1, openUntil: now.Add(cfg.OpenDuration)}
}

func closed(s snapshot) snapshot {
	return snapshot{state: Closed, gen: s.gen + 1}
}

// trips reports whether the window's totals open the breaker.
func trips(t totals, cfg Config) bool {
	if t.calls < cfg.MinCalls {
		return false
	}
	if cfg.FailureRatePercent > 0 && t.failures*100 >= cfg.FailureRatePercent*t.calls {
		return true
	}
	return cfg.slowRuleOn() && t.slow*100 >= cfg.SlowCallRatePercent*t.calls
}

// ---- sliding window ----

// epoch numbers the bucket-width intervals since the Unix epoch.
func epoch(now time.Time, cfg Config) int64 {
	w := int64(cfg.bucketWidth())
	n := now.UnixNano()
	e := n / w
	if n%w < 0 { // floor for times before 1970
		e--
	}
	return e
}

type bucket struct {
	epoch                 int64
	calls, failures, slow int
}

type totals struct{ calls, failures, slow int }

// window is a ring of Buckets buckets; bucket i holds the interval whose
// epoch is congruent to i. A bucket whose epoch is not within the last
// Buckets epochs is stale and counts for nothing.
type window struct {
	b [Buckets]bucket
}

func slot(e int64) int { return int(((e % Buckets) + Buckets) % Buckets) }

// add counts one call finished in epoch e.
func (w window) add(e int64, failed, slow bool) window {
	b := &w.b[slot(e)]
	switch {
	case b.calls == 0 || b.epoch < e:
		*b = bucket{epoch: e} // unused, or its interval aged out: reuse it
	case b.epoch > e:
		return w // older than the slot's interval: already aged out
	}
	b.calls++
	if failed {
		b.failures++
	}
	if slow {
		b.slow++
	}
	return w
}

// sum adds up the buckets of the window ending with epoch e.
func (w window) sum(e int64) totals {
	var t totals
	for _, b := range w.b {
		if b.epoch <= e && b.epoch > e-Buckets {
			t.calls += b.calls
			t.failures += b.failures
			t.slow += b.slow
		}
	}
	return t
}
