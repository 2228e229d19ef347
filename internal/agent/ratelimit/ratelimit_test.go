package ratelimit

import (
	"math"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

var t0 = time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)

const ms = time.Millisecond

// step is one call on a Limiter: either Set (set != nil) or Reserve.
type step struct {
	at      time.Duration // offset from t0
	set     *Config
	maxWait time.Duration
}

// result is what a Reserve step returned; Set steps record {Set: true}.
type result struct {
	Wait time.Duration
	OK   bool
	Set  bool
}

func run(cfg Config, steps []step) []result {
	l := New(cfg, t0)
	var got []result
	for _, s := range steps {
		now := t0.Add(s.at)
		if s.set != nil {
			l.Set(*s.set, now)
			got = append(got, result{Set: true})
			continue
		}
		w, ok := l.Reserve(now, s.maxWait)
		if !ok {
			// A refusal says when the next token accrues, beyond maxWait (checked
			// exactly in TestRefusalSaysWhen); the tables compare the outcome only.
			if w <= max(s.maxWait, 0) {
				w = -1 // shows up as a mismatch
			} else {
				w = 0
			}
		}
		got = append(got, result{Wait: w, OK: ok})
	}
	return got
}

func reserve(at, maxWait time.Duration) step { return step{at: at, maxWait: maxWait} }
func set(at time.Duration, c Config) step    { return step{at: at, set: &c} }
func now(w time.Duration) result             { return result{Wait: w, OK: true} }

var (
	refused = result{}
	wasSet  = result{Set: true}
)

func TestReserve(t *testing.T) {
	bucket10x3 := Config{PerSecond: 10, Burst: 3, Mode: TokenBucket}
	tests := []struct {
		name  string
		cfg   Config
		steps []step
		want  []result
	}{
		{
			name:  "token bucket allows Burst at once, then spaces 1/r",
			cfg:   bucket10x3,
			steps: []step{reserve(0, 0), reserve(0, 0), reserve(0, 0), reserve(0, time.Second), reserve(0, time.Second)},
			want:  []result{now(0), now(0), now(0), now(100 * ms), now(200 * ms)},
		},
		{
			name:  "token bucket refills over time up to Burst only",
			cfg:   bucket10x3,
			steps: []step{reserve(0, 0), reserve(0, 0), reserve(0, 0), reserve(10*time.Second, 0), reserve(10*time.Second, 0), reserve(10*time.Second, 0), reserve(10*time.Second, 0)},
			want:  []result{now(0), now(0), now(0), now(0), now(0), now(0), refused},
		},
		{
			name:  "token bucket partial refill",
			cfg:   bucket10x3,
			steps: []step{reserve(0, 0), reserve(0, 0), reserve(0, 0), reserve(150*ms, 0), reserve(150*ms, time.Second)},
			want:  []result{now(0), now(0), now(0), now(0), now(50 * ms)},
		},
		{
			name:  "pacing spaces exactly 1/r and ignores Burst",
			cfg:   Config{PerSecond: 10, Burst: 50, Mode: Pacing},
			steps: []step{reserve(0, time.Second), reserve(0, time.Second), reserve(0, time.Second), reserve(0, time.Second), reserve(0, time.Second)},
			want:  []result{now(0), now(100 * ms), now(200 * ms), now(300 * ms), now(400 * ms)},
		},
		{
			name: "pacing accumulates no burst while idle",
			cfg:  Config{PerSecond: 4, Mode: Pacing},
			steps: []step{
				reserve(0, 0),
				reserve(10*time.Second, 0),           // idle 10s: one call at once...
				reserve(10*time.Second, 0),           // ...but not a second one
				reserve(10*time.Second, time.Second), // it waits a full interval
			},
			want: []result{now(0), now(0), refused, now(250 * ms)},
		},
		{
			name: "pacing spacing counts from the previous slot, not the call",
			cfg:  Config{PerSecond: 10, Mode: Pacing},
			steps: []step{
				reserve(0, 0),
				reserve(30*ms, time.Second),  // next slot is 100ms
				reserve(60*ms, time.Second),  // then 200ms
				reserve(250*ms, time.Second), // 200ms slot taken: 300ms
				reserve(400*ms, 0),           // caught up
			},
			want: []result{now(0), now(70 * ms), now(140 * ms), now(50 * ms), now(0)},
		},
		{
			name: "maxWait refusal consumes nothing",
			cfg:  Config{PerSecond: 10, Burst: 1},
			steps: []step{
				reserve(0, 0),
				reserve(0, 99*ms), // needs 100ms: refused
				reserve(0, 99*ms), // still 100ms: the refusal took nothing
				reserve(0, 100*ms-1),
				reserve(0, 100*ms), // exactly maxWait: accepted
				reserve(0, 150*ms), // now needs 200ms
				reserve(200*ms, 0), // the 100ms reservation's debt is repaid at 200ms
			},
			want: []result{now(0), refused, refused, refused, now(100 * ms), refused, now(0)},
		},
		{
			name:  "negative maxWait means no waiting",
			cfg:   Config{PerSecond: 10, Burst: 1},
			steps: []step{reserve(0, -time.Second), reserve(0, -time.Second)},
			want:  []result{now(0), refused},
		},
		{
			name:  "burst 0 (no share of the burst) is paced, as burst 1",
			cfg:   Config{PerSecond: 10, Burst: 0},
			steps: []step{reserve(0, 0), reserve(0, 0), reserve(0, time.Second)},
			want:  []result{now(0), refused, now(100 * ms)},
		},
		{
			name:  "empty mode is token bucket",
			cfg:   Config{PerSecond: 10, Burst: 2},
			steps: []step{reserve(0, 0), reserve(0, 0), reserve(0, 0)},
			want:  []result{now(0), now(0), refused},
		},
		{
			// Without clamping, the call at 0 would move the bucket's
			// clock back and the interval 0..1s would be credited again.
			name:  "a clock step backwards does not mint tokens",
			cfg:   Config{PerSecond: 1, Burst: 2},
			steps: []step{reserve(time.Second, 0), reserve(0, 0), reserve(time.Second, 0), reserve(2*time.Second, 0), reserve(2*time.Second, 0)},
			want:  []result{now(0), now(0), refused, now(0), refused},
		},
		// Runtime changes.
		{
			name: "raising the rate repays debt faster",
			cfg:  Config{PerSecond: 10, Burst: 1},
			steps: []step{
				reserve(0, 0),
				set(0, Config{PerSecond: 20, Burst: 1}),
				reserve(0, time.Second),
			},
			want: []result{now(0), wasSet, now(50 * ms)},
		},
		{
			name: "token bucket to pacing drops the saved burst",
			cfg:  Config{PerSecond: 10, Burst: 5},
			steps: []step{
				set(0, Config{PerSecond: 10, Mode: Pacing}),
				reserve(0, time.Second),
				reserve(0, time.Second),
			},
			want: []result{wasSet, now(0), now(100 * ms)},
		},
		{
			name: "raising burst grants no tokens at once; they accrue",
			cfg:  Config{PerSecond: 10, Burst: 1},
			steps: []step{
				reserve(0, 0),
				set(0, Config{PerSecond: 10, Burst: 3}),
				reserve(0, 0),
				reserve(300*ms, 0), reserve(300*ms, 0), reserve(300*ms, 0), reserve(300*ms, 0),
			},
			want: []result{now(0), wasSet, refused, now(0), now(0), now(0), refused},
		},
		{
			name: "setting the same configuration keeps the state",
			cfg:  Config{PerSecond: 10, Burst: 2},
			steps: []step{
				reserve(0, 0), reserve(0, 0),
				set(0, Config{PerSecond: 10, Burst: 2}),
				reserve(0, 0),
			},
			want: []result{now(0), now(0), wasSet, refused},
		},
		{
			name: "pacing ignores a burst change",
			cfg:  Config{PerSecond: 10, Burst: 1, Mode: Pacing},
			steps: []step{
				reserve(0, 0),
				set(0, Config{PerSecond: 10, Burst: 9, Mode: Pacing}),
				reserve(0, 0),
			},
			want: []result{now(0), wasSet, refused},
		},
		{
			name: "limited to unlimited and back starts with a full bucket",
			cfg:  Config{PerSecond: 1, Burst: 2},
			steps: []step{
				reserve(0, 0), reserve(0, 0), reserve(0, 0),
				set(0, Config{}),
				reserve(0, 0), reserve(0, 0), reserve(0, 0),
				set(0, Config{PerSecond: 1, Burst: 2}),
				reserve(0, 0), reserve(0, 0), reserve(0, 0),
			},
			want: []result{
				now(0), now(0), refused,
				wasSet,
				now(0), now(0), now(0),
				wasSet,
				now(0), now(0), refused,
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, run(tt.cfg, tt.steps)); diff != "" {
				t.Errorf("results mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

func TestUnlimited(t *testing.T) {
	for _, ps := range []float64{0, -1, math.NaN(), math.Inf(1), math.Inf(-1)} {
		l := New(Config{PerSecond: ps, Burst: 1, Mode: Pacing}, t0)
		for i := range 1000 {
			if w, ok := l.Reserve(t0, 0); !ok || w != 0 {
				t.Fatalf("PerSecond=%v call %d: Reserve = (%v, %v), want (0, true)", ps, i, w, ok)
			}
		}
	}
}

// TestConcurrentReserveIsAtomic has many goroutines reserve at the same
// instant. With the check and the reservation done as one step the number
// admitted is exact: Burst at once plus one per interval within maxWait.
func TestConcurrentReserveIsAtomic(t *testing.T) {
	l := New(Config{PerSecond: 10, Burst: 5}, t0)
	var (
		mu    sync.Mutex
		waits = map[time.Duration]int{}
		wg    sync.WaitGroup
	)
	for range 100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if w, ok := l.Reserve(t0, time.Second); ok {
				mu.Lock()
				waits[w]++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	want := map[time.Duration]int{0: 5}
	for i := 1; i <= 10; i++ {
		want[time.Duration(i)*100*ms] = 1
	}
	if diff := cmp.Diff(want, waits); diff != "" {
		t.Errorf("waits handed out (-want +got):\n%s", diff)
	}
}

// Reserve runs on every proxied call and refusals happen under overload,
// when garbage hurts most: no outcome may allocate.
func TestReserveAllocations(t *testing.T) {
	l := New(Config{PerSecond: 1e9, Burst: 1 << 20}, t0)
	if n := testing.AllocsPerRun(1000, func() { l.Reserve(t0, 0) }); n != 0 {
		t.Errorf("Reserve with a token available: %v allocs, want 0", n)
	}
	l = New(Config{PerSecond: 1, Burst: 1}, t0)
	l.Reserve(t0, 0)
	if n := testing.AllocsPerRun(1000, func() {
		if _, ok := l.Reserve(t0, 0); ok {
			t.Fatal("Reserve succeeded on an empty bucket")
		}
	}); n != 0 {
		t.Errorf("refused Reserve: %v allocs, want 0", n)
	}
	l = New(Config{PerSecond: 2, Burst: 1}, t0)
	l.Reserve(t0, 0) // empty the bucket: every call below is delayed
	if n := testing.AllocsPerRun(1000, func() {
		if w, ok := l.Reserve(t0, time.Hour); !ok || w == 0 {
			t.Fatalf("Reserve = (%v, %v), want a delayed grant", w, ok)
		}
	}); n != 0 {
		t.Errorf("delayed Reserve: %v allocs, want 0", n)
	}
}

func TestConfigReturnsWhatWasSet(t *testing.T) {
	c1 := Config{PerSecond: 3, Burst: 7, Mode: Pacing}
	l := New(c1, t0)
	if diff := cmp.Diff(c1, l.Config()); diff != "" {
		t.Errorf("Config() after New (-want +got):\n%s", diff)
	}
	c2 := Config{PerSecond: 5, Burst: 0}
	l.Set(c2, t0)
	if diff := cmp.Diff(c2, l.Config()); diff != "" {
		t.Errorf("Config() after Set (-want +got):\n%s", diff)
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		cfg     Config
		wantErr bool
	}{
		{Config{PerSecond: 10, Burst: 1, Mode: TokenBucket}, false},
		{Config{PerSecond: 10, Mode: Pacing}, false},
		{Config{}, false}, // unlimited
		{Config{PerSecond: 10, Burst: 0, Mode: TokenBucket}, false}, // no share of the burst: paced
		{Config{PerSecond: 10, Burst: -1, Mode: TokenBucket}, true},
		{Config{PerSecond: 10, Burst: 1, Mode: "Leaky"}, true},
		{Config{PerSecond: math.NaN(), Burst: 1}, true},
	}
	for _, tt := range tests {
		if err := tt.cfg.Validate(); (err != nil) != tt.wantErr {
			t.Errorf("%+v.Validate() = %v, wantErr %v", tt.cfg, err, tt.wantErr)
		}
	}
}

// TestRefusalSaysWhen: a refused Reserve returns when the next token accrues, the figure an
// honest Retry-After is made of, and consumes nothing.
func TestRefusalSaysWhen(t *testing.T) {
	l := New(Config{PerSecond: 4, Burst: 1}, t0)
	if w, ok := l.Reserve(t0, 0); !ok || w != 0 {
		t.Fatalf("first: %v %v", w, ok)
	}
	if w, ok := l.Reserve(t0.Add(50*time.Millisecond), 10*time.Millisecond); ok || w != 200*time.Millisecond {
		t.Fatalf("refused: %v %v, want 200ms false", w, ok)
	}
	if w, ok := l.Reserve(t0.Add(250*time.Millisecond), 0); !ok || w != 0 {
		t.Fatalf("the token it named: %v %v, want it there at 250ms", w, ok)
	}
	if w, ok := New(Config{}, t0).Reserve(t0, 0); !ok || w != 0 {
		t.Fatalf("unlimited: %v %v", w, ok)
	}
}
