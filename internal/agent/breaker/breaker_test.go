package breaker

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

var t0 = time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)

func at(d time.Duration) time.Time { return t0.Add(d) }

const (
	ms  = time.Millisecond
	sec = time.Second
)

// base is the configuration most cases start from: 1s buckets, trips at
// 50% failures over at least 4 calls, opens for 5s, 2 probes.
var base = Config{
	Window:             10 * sec,
	MinCalls:           4,
	FailureRatePercent: 50,
	OpenDuration:       5 * sec,
	HalfOpenProbes:     2,
}

// Script steps for next.
func allow(d time.Duration) event { return event{kind: evAllow, now: at(d)} }
func tick(d time.Duration) event  { return event{kind: evTick, now: at(d)} }
func ok(d time.Duration, gen uint64) event {
	return event{kind: evRecord, now: at(d), gen: gen, took: 10 * ms}
}
func fail(d time.Duration, gen uint64) event {
	return event{kind: evRecord, now: at(d), gen: gen, failed: true, took: 10 * ms}
}
func cancel(gen uint64) event { return event{kind: evCancel, gen: gen} }
func slowOK(d time.Duration, gen uint64) event {
	return event{kind: evRecord, now: at(d), gen: gen, took: 2 * sec}
}

// out is what a test sees after each step: the verdict and the state.
type out struct {
	OK         bool
	RetryAfter time.Duration
	Gen        uint64 // ticket generation when OK
	State      State
}

func (o out) String() string { return fmt.Sprintf("%+v", struct{ out }{o}) }

// Shorthands for expected outs.
func in(s State) out                           { return out{State: s} }
func granted(gen uint64, s State) out          { return out{OK: true, Gen: gen, State: s} }
func refused(retry time.Duration, s State) out { return out{RetryAfter: retry, State: s} }
func repeat(o out, n int) []out {
	r := make([]out, n)
	for i := range r {
		r[i] = o
	}
	return r
}
func cat(parts ...[]out) []out {
	var r []out
	for _, p := range parts {
		r = append(r, p...)
	}
	return r
}
func evs(parts ...[]event) []event {
	var r []event
	for _, p := range parts {
		r = append(r, p...)
	}
	return r
}
func times(n int, f func(i int) event) []event {
	r := make([]event, n)
	for i := range r {
		r[i] = f(i)
	}
	return r
}

// openAt is the script that opens a base breaker at d: four failures.
func openAt(d time.Duration) []event {
	return times(4, func(int) event { return fail(d, 1) })
}

var openedOuts = cat(repeat(in(Closed), 3), []out{in(Open)})

// halfOpen is the script that brings a base breaker to half-open (gen 3)
// at 5s, without admitting a probe.
var halfOpen = evs(openAt(0), []event{tick(5 * sec)})
var halfOpenOuts = cat(openedOuts, []out{in(HalfOpen)})

var snapOpts = cmp.Options{
	cmp.AllowUnexported(snapshot{}, window{}, bucket{}),
}

func TestNext(t *testing.T) {
	tests := []struct {
		name   string
		cfg    Config
		events []event
		want   []out
		// final, if set, is the whole expected snapshot at the end.
		final *snapshot
	}{
		{
			name:   "does not open below MinCalls",
			cfg:    base,
			events: times(3, func(int) event { return fail(0, 1) }),
			want:   repeat(in(Closed), 3),
		},
		{
			name:   "opens when the failure rate reaches the threshold",
			cfg:    base,
			events: []event{ok(0, 1), fail(0, 1), ok(0, 1), fail(0, 1)},
			want:   []out{in(Closed), in(Closed), in(Closed), in(Open)},
			final:  &snapshot{state: Open, gen: 2, openUntil: at(5 * sec)},
		},
		{
			name:   "stays closed below the failure rate",
			cfg:    base,
			events: []event{ok(0, 1), ok(0, 1), ok(0, 1), fail(0, 1), ok(0, 1), fail(0, 1), ok(0, 1)},
			want:   repeat(in(Closed), 7), // 1/4, 1/5, 2/6, 2/7
		},
		{
			name:   "opens on the slow-call rate alone",
			cfg:    Config{Window: 10 * sec, MinCalls: 2, SlowCallThreshold: sec, SlowCallRatePercent: 50},
			events: []event{slowOK(0, 1), ok(0, 1)},
			want:   []out{in(Closed), in(Open)},
		},
		{
			name:   "a call exactly at SlowCallThreshold is slow",
			cfg:    Config{Window: 10 * sec, MinCalls: 1, SlowCallThreshold: 2 * sec, SlowCallRatePercent: 100},
			events: []event{slowOK(0, 1)}, // took 2s
			want:   []out{in(Open)},
		},
		{
			name:   "slow calls do not trip without SlowCallRatePercent",
			cfg:    Config{Window: 10 * sec, MinCalls: 2, SlowCallThreshold: sec},
			events: []event{slowOK(0, 1), slowOK(0, 1), slowOK(0, 1)},
			want:   repeat(in(Closed), 3),
		},
		{
			name:   "failures do not trip without FailureRatePercent",
			cfg:    Config{Window: 10 * sec, MinCalls: 1},
			events: times(20, func(int) event { return fail(0, 1) }),
			want:   repeat(in(Closed), 20),
		},
		{
			name: "the window slides: failures 10s old have aged out",
			cfg:  base,
			// 3 failures at 0s, one success at 10s: the window (1s..10s]
			// holds only the success.
			events: evs(times(3, func(int) event { return fail(0, 1) }), []event{fail(10*sec, 1)}),
			want:   repeat(in(Closed), 4),
		},
		{
			name:   "the window slides: failures 9.999s old still count",
			cfg:    base,
			events: evs(times(3, func(int) event { return fail(0, 1) }), []event{ok(9*sec+999*ms, 1)}),
			want:   cat(repeat(in(Closed), 3), []out{in(Open)}),
		},
		{
			name:   "closed allows everything with the current generation",
			cfg:    base,
			events: []event{allow(0), allow(0), allow(sec)},
			want:   repeat(granted(1, Closed), 3),
		},
		{
			name:   "open refuses with the time left",
			cfg:    base,
			events: evs(openAt(0), []event{allow(2 * sec), allow(4*sec + 999*ms)}),
			want:   cat(openedOuts, []out{refused(3*sec, Open), refused(ms, Open)}),
		},
		{
			name:   "open becomes half-open after OpenDuration and admits a probe",
			cfg:    base,
			events: evs(openAt(0), []event{allow(5 * sec)}),
			want:   cat(openedOuts, []out{granted(3, HalfOpen)}),
			final:  &snapshot{state: HalfOpen, gen: 3, probes: 1},
		},
		{
			name:   "State (tick) moves to half-open without taking a probe",
			cfg:    base,
			events: evs(openAt(0), []event{tick(4 * sec), tick(5 * sec)}),
			want:   cat(openedOuts, []out{in(Open), in(HalfOpen)}),
			final:  &snapshot{state: HalfOpen, gen: 3},
		},
		{
			name:   "half-open admits HalfOpenProbes concurrent probes and refuses the next",
			cfg:    base,
			events: evs(halfOpen, []event{allow(5 * sec), allow(5 * sec), allow(5 * sec), allow(6 * sec)}),
			want:   cat(halfOpenOuts, []out{granted(3, HalfOpen), granted(3, HalfOpen), refused(0, HalfOpen), refused(0, HalfOpen)}),
			final:  &snapshot{state: HalfOpen, gen: 3, probes: 2},
		},
		{
			name: "a succeeded probe does not free a slot beyond the probes still needed",
			cfg:  base,
			events: evs(halfOpen, []event{
				allow(5 * sec), allow(5 * sec), ok(6*sec, 3), allow(6 * sec),
			}),
			want:  cat(halfOpenOuts, []out{granted(3, HalfOpen), granted(3, HalfOpen), in(HalfOpen), refused(0, HalfOpen)}),
			final: &snapshot{state: HalfOpen, gen: 3, probes: 1, probesOK: 1},
		},
		{
			name: "HalfOpenProbes successes close the breaker with an empty window",
			cfg:  base,
			events: evs(halfOpen, []event{
				allow(5 * sec), ok(6*sec, 3), allow(6 * sec), ok(7*sec, 3),
				allow(7 * sec),
				// One failure in the new window must not open it: the
				// four failures from before opening are gone.
				fail(7*sec, 4),
			}),
			want: cat(halfOpenOuts, []out{
				granted(3, HalfOpen), in(HalfOpen), granted(3, HalfOpen), in(Closed),
				granted(4, Closed), in(Closed),
			}),
		},
		{
			name: "a failed probe reopens for a fresh OpenDuration",
			cfg:  base,
			events: evs(halfOpen, []event{
				allow(5 * sec), allow(5 * sec), ok(6*sec, 3), fail(8*sec, 3),
				allow(12 * sec), allow(13 * sec),
			}),
			want: cat(halfOpenOuts, []out{
				granted(3, HalfOpen), granted(3, HalfOpen), in(HalfOpen), in(Open),
				refused(sec, Open), granted(5, HalfOpen),
			}),
		},
		{
			name: "a slow probe reopens when the slow-call rule is on",
			cfg:  Config{Window: 10 * sec, MinCalls: 1, SlowCallThreshold: sec, SlowCallRatePercent: 100, OpenDuration: 5 * sec, HalfOpenProbes: 1},
			events: []event{
				slowOK(0, 1),                     // opens
				allow(5 * sec), slowOK(6*sec, 3), // the probe is slow
			},
			want:  []out{in(Open), granted(3, HalfOpen), in(Open)},
			final: &snapshot{state: Open, gen: 4, openUntil: at(11 * sec)},
		},
		{
			name:   "a slow probe succeeds when only the failure rule is on",
			cfg:    Config{Window: 10 * sec, MinCalls: 1, FailureRatePercent: 50, SlowCallThreshold: sec, OpenDuration: 5 * sec, HalfOpenProbes: 1},
			events: []event{fail(0, 1), allow(5 * sec), slowOK(6*sec, 3)},
			want:   []out{in(Open), granted(3, HalfOpen), in(Closed)},
		},
		// Cancelled tickets.
		{
			name: "a cancelled probe gives its slot back and counts nothing",
			cfg:  base,
			events: evs(halfOpen, []event{
				allow(5 * sec), allow(5 * sec), allow(5 * sec), // two slots taken, third refused
				cancel(3),
				allow(5 * sec), // the slot is free again
			}),
			want: cat(halfOpenOuts, []out{
				granted(3, HalfOpen), granted(3, HalfOpen), refused(0, HalfOpen),
				in(HalfOpen),
				granted(3, HalfOpen),
			}),
			final: &snapshot{state: HalfOpen, gen: 3, probes: 2},
		},
		{
			name: "cancelling every probe neither closes nor reopens",
			cfg:  base,
			events: evs(halfOpen, []event{
				allow(5 * sec), allow(5 * sec), cancel(3), cancel(3),
				cancel(3), // one too many: ignored
			}),
			want:  cat(halfOpenOuts, []out{granted(3, HalfOpen), granted(3, HalfOpen), in(HalfOpen), in(HalfOpen), in(HalfOpen)}),
			final: &snapshot{state: HalfOpen, gen: 3},
		},
		{
			name: "cancel in closed state counts nothing",
			cfg:  base,
			events: evs(
				times(3, func(int) event { return fail(0, 1) }),
				[]event{allow(0), cancel(1), allow(0), cancel(1)},
			),
			want: cat(repeat(in(Closed), 3), []out{granted(1, Closed), in(Closed), granted(1, Closed), in(Closed)}),
		},
		{
			name: "a stale cancel does not free a slot of the new half-open period",
			cfg:  Config{Window: 10 * sec, MinCalls: 4, FailureRatePercent: 50, OpenDuration: 5 * sec, HalfOpenProbes: 1},
			events: evs(halfOpen, []event{
				allow(5 * sec), fail(5*sec, 3), // reopened: gen 4
				allow(10 * sec), // half-open again: gen 5, slot taken
				cancel(3),       // the old probe's ticket
				allow(10 * sec), // still taken
			}),
			want: cat(halfOpenOuts, []out{
				granted(3, HalfOpen), in(Open),
				granted(5, HalfOpen),
				in(HalfOpen),
				refused(0, HalfOpen),
			}),
		},
		// Stale tickets.
		{
			name: "a closed-state call finishing after the breaker opened is ignored",
			cfg:  base,
			events: evs(openAt(0), []event{
				fail(sec, 1), ok(sec, 1), // tickets of generation 1
			}),
			want:  cat(openedOuts, []out{in(Open), in(Open)}),
			final: &snapshot{state: Open, gen: 2, openUntil: at(5 * sec)},
		},
		{
			name: "a closed-state call finishing during half-open is not taken for a probe",
			cfg:  base,
			events: evs(halfOpen, []event{
				allow(5 * sec),
				ok(5*sec, 1), ok(5*sec, 1), // would close it if counted
				fail(5*sec, 1), // would reopen it if counted
			}),
			want:  cat(halfOpenOuts, []out{granted(3, HalfOpen), in(HalfOpen), in(HalfOpen), in(HalfOpen)}),
			final: &snapshot{state: HalfOpen, gen: 3, probes: 1},
		},
		{
			name: "a probe finishing after its half-open period ended is ignored",
			cfg:  base,
			events: evs(halfOpen, []event{
				allow(5 * sec), allow(5 * sec), fail(6*sec, 3), // reopened: gen 4
				fail(6*sec, 3),  // the other probe, late
				allow(11 * sec), // half-open again: gen 5
				ok(11*sec, 3),   // an old probe must not count here either
			}),
			want: cat(halfOpenOuts, []out{
				granted(3, HalfOpen), granted(3, HalfOpen), in(Open),
				in(Open),
				granted(5, HalfOpen),
				in(HalfOpen),
			}),
			final: &snapshot{state: HalfOpen, gen: 5, probes: 1},
		},
		{
			name: "more records than probes in flight (a ticket finished twice) are ignored",
			cfg:  base,
			events: evs(halfOpen, []event{
				allow(5 * sec), ok(5*sec, 3), ok(5*sec, 3),
			}),
			want:  cat(halfOpenOuts, []out{granted(3, HalfOpen), in(HalfOpen), in(HalfOpen)}),
			final: &snapshot{state: HalfOpen, gen: 3, probesOK: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := tt.cfg.withDefaults()
			s := snapshot{gen: 1}
			var got []out
			for _, ev := range tt.events {
				var v verdict
				s, v = next(s, ev, cfg)
				got = append(got, out{OK: v.ok, RetryAfter: v.retryAfter, Gen: v.gen, State: s.state})
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("outs mismatch (-want +got):\n%s", diff)
			}
			if tt.final != nil {
				if diff := cmp.Diff(*tt.final, s, snapOpts); diff != "" {
					t.Errorf("final snapshot mismatch (-want +got):\n%s", diff)
				}
			}
		})
	}
}

func TestWindow(t *testing.T) {
	type add struct {
		e            int64
		failed, slow bool
	}
	tests := []struct {
		name string
		adds []add
		at   int64
		want totals
	}{
		{"empty", nil, 100, totals{}},
		{"one bucket", []add{{100, true, false}, {100, false, true}, {100, false, false}}, 100,
			totals{calls: 3, failures: 1, slow: 1}},
		{"spread over the window", []add{{91, true, false}, {95, false, false}, {100, false, true}}, 100,
			totals{calls: 3, failures: 1, slow: 1}},
		{"oldest bucket ages out", []add{{90, true, false}, {95, false, false}}, 100,
			totals{calls: 1}},
		{"everything aged out", []add{{80, true, false}, {89, true, false}}, 100, totals{}},
		{"a slot reused by a later epoch forgets the old one", []add{{90, true, false}, {100, false, false}}, 100,
			totals{calls: 1}},
		{"a late add for an epoch whose slot moved on is dropped", []add{{100, false, false}, {90, true, false}}, 100,
			totals{calls: 1}},
		{"a late add within the window counts", []add{{100, false, false}, {95, true, false}}, 100,
			totals{calls: 2, failures: 1}},
		{"buckets ahead of the query time do not count", []add{{101, true, false}, {100, false, false}}, 100,
			totals{calls: 1}},
		{"negative epochs (before 1970)", []add{{-5, true, false}, {-1, false, false}}, -1,
			totals{calls: 2, failures: 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var w window
			for _, a := range tt.adds {
				w = w.add(a.e, a.failed, a.slow)
			}
			if diff := cmp.Diff(tt.want, w.sum(tt.at), cmp.AllowUnexported(totals{})); diff != "" {
				t.Errorf("sum(%d) mismatch (-want +got):\n%s", tt.at, diff)
			}
		})
	}
}

func TestEpoch(t *testing.T) {
	cfg := Config{Window: 10 * sec}
	tests := []struct {
		at   time.Time
		want int64
	}{
		{time.Unix(0, 0), 0},
		{time.Unix(0, 999_999_999), 0},
		{time.Unix(1, 0), 1},
		{time.Unix(0, -1), -1},
		{time.Unix(-1, 0), -1},
		{time.Unix(-1, -1), -2},
	}
	for _, tt := range tests {
		if got := epoch(tt.at, cfg); got != tt.want {
			t.Errorf("epoch(%v) = %d, want %d", tt.at.UnixNano(), got, tt.want)
		}
	}
}

func TestReconfigure(t *testing.T) {
	var w window
	w = w.add(epoch(t0, base), true, false)
	tests := []struct {
		name     string
		s        snapshot
		old, cur Config
		want     snapshot
	}{
		{
			name: "same bucket width keeps the window",
			s:    snapshot{gen: 1, win: w},
			old:  base, cur: Config{Window: 10 * sec, FailureRatePercent: 10},
			want: snapshot{gen: 1, win: w},
		},
		{
			name: "new bucket width clears the window",
			s:    snapshot{gen: 1, win: w},
			old:  base, cur: Config{Window: 20 * sec},
			want: snapshot{gen: 1},
		},
		{
			name: "open keeps its reopen time",
			s:    snapshot{state: Open, gen: 2, openUntil: at(5 * sec)},
			old:  base, cur: Config{OpenDuration: time.Hour},
			want: snapshot{state: Open, gen: 2, openUntil: at(5 * sec)},
		},
		{
			name: "half-open with enough successes for the new probe count closes",
			s:    snapshot{state: HalfOpen, gen: 3, probesOK: 1},
			old:  base, cur: Config{HalfOpenProbes: 1},
			want: snapshot{state: Closed, gen: 4},
		},
		{
			name: "half-open short of the new probe count stays",
			s:    snapshot{state: HalfOpen, gen: 3, probes: 1, probesOK: 1},
			old:  base, cur: Config{HalfOpenProbes: 3},
			want: snapshot{state: HalfOpen, gen: 3, probes: 1, probesOK: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := reconfigure(tt.s, tt.old.withDefaults(), tt.cur.withDefaults())
			if diff := cmp.Diff(tt.want, got, snapOpts); diff != "" {
				t.Errorf("mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

func TestDefaults(t *testing.T) {
	want := Config{
		Window:         DefaultWindow,
		MinCalls:       DefaultMinCalls,
		OpenDuration:   DefaultOpenDuration,
		HalfOpenProbes: DefaultHalfOpenProbes,
	}
	if diff := cmp.Diff(want, New(Config{}).Config()); diff != "" {
		t.Errorf("defaults (-want +got):\n%s", diff)
	}
	// The zero Config never opens.
	b := New(Config{})
	for i := range 1000 {
		tk, _, ok := b.Allow(t0)
		if !ok {
			t.Fatalf("call %d refused by a zero-Config breaker", i)
		}
		tk.Done(t0, true, time.Hour)
	}
	if s := b.State(t0); s != Closed {
		t.Errorf("zero-Config breaker state = %v, want closed", s)
	}
}

// TestBreaker drives the locking wrapper through a whole cycle and checks
// the transition hook.
func TestBreaker(t *testing.T) {
	b := New(base)
	type tr struct{ From, To State }
	var got []tr
	b.SetOnTransition(func(from, to State) { got = append(got, tr{from, to}) })

	for range 4 {
		tk, _, ok := b.Allow(t0)
		if !ok {
			t.Fatal("closed breaker refused a call")
		}
		tk.Done(t0, true, 0)
	}
	if _, retry, ok := b.Allow(at(sec)); ok || retry != 4*sec {
		t.Fatalf("Allow while open = (ok %v, retry %v), want (false, 4s)", ok, retry)
	}
	if s := b.State(at(5 * sec)); s != HalfOpen {
		t.Fatalf("State after OpenDuration = %v, want half-open", s)
	}
	p1, _, ok1 := b.Allow(at(5 * sec))
	p2, _, ok2 := b.Allow(at(5 * sec))
	_, retry, ok3 := b.Allow(at(5 * sec))
	if !ok1 || !ok2 || ok3 || retry != 0 {
		t.Fatalf("half-open Allows = %v %v %v (retry %v), want true true false (0)", ok1, ok2, ok3, retry)
	}
	p1.Done(at(6*sec), false, 0)
	p2.Done(at(6*sec), false, 0)
	if s := b.State(at(6 * sec)); s != Closed {
		t.Fatalf("State after probes succeeded = %v, want closed", s)
	}

	want := []tr{{Closed, Open}, {Open, HalfOpen}, {HalfOpen, Closed}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("transitions (-want +got):\n%s", diff)
	}
}

func TestSetConfigClosesHalfOpenAndNotifies(t *testing.T) {
	b := New(base) // 2 probes
	var got []State
	b.SetOnTransition(func(_, to State) { got = append(got, to) })
	for range 4 {
		tk, _, _ := b.Allow(t0)
		tk.Done(t0, true, 0)
	}
	p, _, _ := b.Allow(at(5 * sec))
	p.Done(at(5*sec), false, 0) // 1 of 2 successes, nothing in flight
	c := base
	c.HalfOpenProbes = 1
	b.SetConfig(c)
	if s := b.State(at(5 * sec)); s != Closed {
		t.Fatalf("state = %v, want closed", s)
	}
	if diff := cmp.Diff([]State{Open, HalfOpen, Closed}, got); diff != "" {
		t.Errorf("transitions (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(c, b.Config()); diff != "" {
		t.Errorf("Config() (-want +got):\n%s", diff)
	}
}

func TestForeignAndZeroTickets(t *testing.T) {
	a, b := New(base), New(base)
	for range 4 {
		tk, _, _ := a.Allow(t0)
		b.Record(tk, t0, true, 0) // a's tickets on b: ignored
	}
	if s := b.State(t0); s != Closed {
		t.Errorf("b opened from a's tickets: %v", s)
	}
	for range 4 {
		Ticket{}.Done(t0, true, 0)
		b.Record(Ticket{}, t0, true, 0)
	}
	if s := b.State(t0); s != Closed {
		t.Errorf("b opened from zero tickets: %v", s)
	}
}

func TestTicketCancel(t *testing.T) {
	c := base
	c.HalfOpenProbes = 1
	// Two breakers in identical states (half-open, generation 3, the one
	// probe slot taken), so a ticket of one looks valid to the other.
	probe := func(b *Breaker) Ticket {
		for range 4 {
			tk, _, _ := b.Allow(t0)
			tk.Done(t0, true, 0)
		}
		p, _, ok := b.Allow(at(5 * sec))
		if !ok {
			t.Fatal("no probe admitted")
		}
		return p
	}
	b, other := New(c), New(c)
	p, otherP := probe(b), probe(other)
	if _, _, ok := b.Allow(at(5 * sec)); ok {
		t.Fatal("second probe admitted with HalfOpenProbes 1")
	}
	b.Cancel(otherP) // another breaker's ticket: ignored
	if _, _, ok := b.Allow(at(5 * sec)); ok {
		t.Fatal("a foreign Cancel freed the slot")
	}
	p.Cancel()
	if s := b.State(at(5 * sec)); s != HalfOpen {
		t.Fatalf("state after cancelling the probe = %v, want half-open", s)
	}
	if _, _, ok := b.Allow(at(5 * sec)); !ok {
		t.Fatal("slot not given back by Cancel")
	}
	Ticket{}.Cancel() // no-op
}

func TestNilBreaker(t *testing.T) {
	var b *Breaker
	tk, retry, ok := b.Allow(t0)
	if !ok || retry != 0 {
		t.Fatalf("nil Allow = (%v, %v), want (true, 0)", ok, retry)
	}
	tk.Done(t0, true, 0)
	tk.Cancel()
	b.Record(tk, t0, true, 0)
	b.Cancel(tk)
	if s := b.State(t0); s != Closed {
		t.Errorf("nil State = %v", s)
	}
}

// TestConcurrentHalfOpenCap: many goroutines ask at the same instant; exactly
// HalfOpenProbes get through.
func TestConcurrentHalfOpenCap(t *testing.T) {
	c := base
	c.HalfOpenProbes = 3
	b := New(c)
	for range 4 {
		tk, _, _ := b.Allow(t0)
		tk.Done(t0, true, 0)
	}
	var (
		wg sync.WaitGroup
		mu sync.Mutex
		n  int
	)
	for range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, _, ok := b.Allow(at(5 * sec)); ok {
				mu.Lock()
				n++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if n != 3 {
		t.Errorf("%d probes admitted concurrently, want 3", n)
	}
}

// TestConcurrentUse runs random traffic through a breaker from many
// goroutines and checks that every transition reported is a legal edge and
// that, whenever the breaker is half-open, admitted probes never exceed the
// cap (read from the state under the lock after each Allow).
func TestConcurrentUse(t *testing.T) {
	c := Config{Window: 100 * ms, MinCalls: 5, FailureRatePercent: 40, OpenDuration: 2 * ms, HalfOpenProbes: 3}
	b := New(c)
	legal := map[[2]State]bool{
		{Closed, Open}: true, {Open, HalfOpen}: true, {HalfOpen, Open}: true, {HalfOpen, Closed}: true,
	}
	var (
		mu      sync.Mutex
		illegal []string
		count   = map[[2]State]int{}
	)
	b.SetOnTransition(func(from, to State) {
		mu.Lock()
		defer mu.Unlock()
		count[[2]State{from, to}]++
		if !legal[[2]State{from, to}] {
			illegal = append(illegal, fmt.Sprintf("%v->%v", from, to))
		}
	})
	var clockMu sync.Mutex
	clock := t0
	now := func() time.Time {
		clockMu.Lock()
		defer clockMu.Unlock()
		clock = clock.Add(50 * time.Microsecond)
		return clock
	}
	var wg sync.WaitGroup
	var overCap sync.Once
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 9))
			for range 2000 {
				tk, _, ok := b.Allow(now())
				b.mu.Lock()
				if b.s.state == HalfOpen && b.s.probes+b.s.probesOK > c.HalfOpenProbes {
					overCap.Do(func() { t.Errorf("half-open with %d+%d probes > %d", b.s.probes, b.s.probesOK, c.HalfOpenProbes) })
				}
				b.mu.Unlock()
				if ok {
					tk.Done(now(), r.IntN(2) == 0, 0)
				}
			}
		}()
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if len(illegal) > 0 {
		t.Fatalf("illegal transitions: %v", illegal)
	}
	if count[[2]State{Closed, Open}] == 0 || count[[2]State{Open, HalfOpen}] == 0 {
		t.Fatalf("traffic never exercised the breaker: %v", count)
	}
}

func TestStateString(t *testing.T) {
	got := []string{Closed.String(), Open.String(), HalfOpen.String(), State(7).String()}
	want := []string{"closed", "open", "half-open", "State(7)"}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		cfg     Config
		wantErr bool
	}{
		{Config{}, false},
		{base, false},
		{Config{FailureRatePercent: 101}, true},
		{Config{SlowCallRatePercent: -1}, true},
		{Config{Window: -sec}, true},
		{Config{HalfOpenProbes: -1}, true},
	}
	for _, tt := range tests {
		if err := tt.cfg.Validate(); (err != nil) != tt.wantErr {
			t.Errorf("%+v.Validate() = %v, wantErr %v", tt.cfg, err, tt.wantErr)
		}
	}
}
