package controller

import (
	"context"
	"errors"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	clocktesting "k8s.io/utils/clock/testing"
)

// fakeWrites is a StatusWriter's Write that an API server would answer: it records each call,
// tells when one starts, holds it until the test releases it (when gated), and answers what
// answer says (nil: written).
type fakeWrites struct {
	gated   bool
	release chan struct{}
	started chan write
	answer  func(call int, key types.NamespacedName, v []int) (WriteOutcome, error)

	mu                     sync.Mutex
	calls                  []write
	inFlight               map[types.NamespacedName]int
	total, maxPerKey, maxN int
}

type write struct {
	key types.NamespacedName
	v   []int
}

func newFakeWrites(gated bool) *fakeWrites {
	return &fakeWrites{gated: gated, release: make(chan struct{}), started: make(chan write, 100),
		inFlight: map[types.NamespacedName]int{}}
}

func (f *fakeWrites) write(ctx context.Context, key types.NamespacedName, v []int) (WriteOutcome, error) {
	f.mu.Lock()
	f.calls = append(f.calls, write{key, v})
	call := len(f.calls)
	f.inFlight[key]++
	f.total++
	f.maxPerKey = max(f.maxPerKey, f.inFlight[key])
	f.maxN = max(f.maxN, f.total)
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.inFlight[key]--
		f.total--
		f.mu.Unlock()
	}()
	f.started <- write{key, v}
	if f.gated {
		select {
		case <-f.release:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	if f.answer != nil {
		return f.answer(call, key, v)
	}
	return StatusWritten, nil
}

func (f *fakeWrites) callsOf(key types.NamespacedName) [][]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out [][]int
	for _, c := range f.calls {
		if c.key == key {
			out = append(out, c.v)
		}
	}
	return out
}

// startWriter runs a StatusWriter of []int whose Merge appends, so that a write shows every value
// it coalesced, the latest last.
func startWriter(t *testing.T, f *fakeWrites, workers int, clk *clocktesting.FakeClock) *StatusWriter[[]int] {
	t.Helper()
	w, err := NewStatusWriter(StatusWriterOptions[[]int]{
		Name: "test", Workers: workers, Write: f.write, Clock: clk, Registry: prometheus.NewRegistry(),
		Merge: func(older, newer []int) []int { return append(slices.Clone(older), newer...) },
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = w.Start(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return w
}

// next waits for the next write to start; the timeout only keeps a broken writer from hanging
// the test.
func (f *fakeWrites) next(t *testing.T) write {
	t.Helper()
	select {
	case c := <-f.started:
		return c
	case <-time.After(10 * time.Second):
		t.Fatal("no write started")
		return write{}
	}
}

// settle waits until the writer holds nothing and no write is in flight.
func settle(t *testing.T, w *StatusWriter[[]int], f *fakeWrites) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		f.mu.Lock()
		busy := f.total
		f.mu.Unlock()
		if w.Pending() == 0 && w.queue.Len() == 0 && busy == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("writer not idle: %d pending, %d queued, %d in flight", w.Pending(), w.queue.Len(), busy)
		}
		runtime.Gosched()
	}
}

var keyA, keyB = types.NamespacedName{Namespace: "ns", Name: "a"}, types.NamespacedName{Namespace: "ns", Name: "b"}

// While a write is in flight, newer statuses replace one another: the next write carries the
// latest (and, through Merge, the ones it replaced), and no second write of the object starts
// before the first ends.
func TestStatusWriterLatestWins(t *testing.T) {
	f := newFakeWrites(true)
	w := startWriter(t, f, 4, clocktesting.NewFakeClock(time.Unix(0, 0)))

	w.Set(keyA, []int{1})
	if c := f.next(t); !slices.Equal(c.v, []int{1}) {
		t.Fatalf("first write %v; want [1]", c.v)
	}
	w.Set(keyA, []int{2})
	w.Set(keyA, []int{3})
	f.release <- struct{}{}
	if c := f.next(t); !slices.Equal(c.v, []int{2, 3}) {
		t.Fatalf("second write %v; want [2 3] (3 latest, 2 merged into it)", c.v)
	}
	f.release <- struct{}{}
	settle(t, w, f)

	if got := f.callsOf(keyA); len(got) != 2 {
		t.Errorf("writes %v; want two", got)
	}
	if f.maxPerKey != 1 {
		t.Errorf("%d writes of one object in flight at once; want 1", f.maxPerKey)
	}
	if n := testutil.ToFloat64(w.coalesced); n != 1 {
		t.Errorf("coalesced %v; want 1", n)
	}
	if n := testutil.ToFloat64(w.writes.WithLabelValues("test", "written")); n != 2 {
		t.Errorf("written %v; want 2", n)
	}
}

// No more writes are in flight than workers, one per object at most, and every object's last
// status is written.
func TestStatusWriterBoundedConcurrency(t *testing.T) {
	f := newFakeWrites(true)
	w := startWriter(t, f, 2, clocktesting.NewFakeClock(time.Unix(0, 0)))
	keys := []types.NamespacedName{keyA, keyB, {Namespace: "ns", Name: "c"}, {Namespace: "ns", Name: "d"}}
	for _, k := range keys {
		w.Set(k, []int{1})
	}
	f.next(t)
	f.next(t)
	// Two writes hold both workers: the other two objects wait in the queue.
	if n := w.queue.Len(); n != 2 {
		t.Errorf("%d objects queued while both workers write; want 2", n)
	}
	// A newer status of every object, while some are being written.
	for _, k := range keys {
		w.Set(k, []int{2})
	}
	// Six writes: a and b with [1], c and d with [1 2] (queued, merged), a and b again with [2]
	// (they were in flight). Each is released in turn; each release lets the next one start.
	for started, released := 2, 0; released < 6; released++ {
		f.release <- struct{}{}
		if started < 6 {
			f.next(t)
			started++
		}
	}
	settle(t, w, f)
	if f.maxN > 2 {
		t.Errorf("%d writes in flight at once; want at most 2 (workers)", f.maxN)
	}
	if f.maxPerKey != 1 {
		t.Errorf("%d writes of one object in flight at once; want 1", f.maxPerKey)
	}
	for _, k := range keys {
		got := f.callsOf(k)
		if len(got) == 0 || got[len(got)-1][len(got[len(got)-1])-1] != 2 {
			t.Errorf("%s: writes %v; want the last to carry 2", k, got)
		}
	}
}

// A write that fails is tried again after the backoff (on the writer's clock), with the same
// status; a newer status that came meanwhile is written at once, carrying the failed one.
func TestStatusWriterRetriesAfterConflict(t *testing.T) {
	conflict := apierrors.NewConflict(schema.GroupResource{Group: "apportion.io", Resource: "downstreamquotas"}, "a", errors.New("changed"))
	conflictFirst := func(call int, _ types.NamespacedName, _ []int) (WriteOutcome, error) {
		if call == 1 {
			return 0, conflict
		}
		return StatusWritten, nil
	}
	clk := clocktesting.NewFakeClock(time.Unix(0, 0))

	t.Run("backoff", func(t *testing.T) {
		f := newFakeWrites(false)
		f.answer = conflictFirst
		w := startWriter(t, f, 2, clk)
		w.Set(keyA, []int{1})
		f.next(t)
		// Step the clock until the retry starts: it must take at least the first backoff.
		var stepped time.Duration
		deadline := time.Now().Add(10 * time.Second)
		var retry write
	wait:
		for {
			select {
			case retry = <-f.started:
				break wait
			default:
			}
			if time.Now().After(deadline) {
				t.Fatal("no retry")
			}
			clk.Step(5 * time.Millisecond)
			stepped += 5 * time.Millisecond
			runtime.Gosched()
		}
		if !slices.Equal(retry.v, []int{1}) {
			t.Errorf("retry wrote %v; want [1]", retry.v)
		}
		if stepped < statusRetryFirst {
			t.Errorf("retried after %s of the clock; want at least %s", stepped, statusRetryFirst)
		}
		settle(t, w, f)
		if n := testutil.ToFloat64(w.writes.WithLabelValues("test", "failed")); n != 1 {
			t.Errorf("failed %v; want 1", n)
		}
	})

	t.Run("newer status meanwhile", func(t *testing.T) {
		f := newFakeWrites(true)
		f.answer = conflictFirst
		w := startWriter(t, f, 2, clk)
		w.Set(keyA, []int{1})
		f.next(t)
		w.Set(keyA, []int{2})
		f.release <- struct{}{} // the conflict
		if c := f.next(t); !slices.Equal(c.v, []int{1, 2}) {
			t.Errorf("write after the conflict %v; want [1 2] (the newer, carrying the failed one), without waiting for the clock", c.v)
		}
		f.release <- struct{}{}
		settle(t, w, f)
	})
}

// A write that finds its object gone (or another object under its name) drops the status: it is
// not tried again, and the object's next status is written as usual.
func TestStatusWriterDropsGoneObjects(t *testing.T) {
	f := newFakeWrites(false)
	f.answer = func(call int, _ types.NamespacedName, _ []int) (WriteOutcome, error) {
		if call == 1 {
			return StatusDropped, nil
		}
		return StatusWritten, nil
	}
	clk := clocktesting.NewFakeClock(time.Unix(0, 0))
	w := startWriter(t, f, 2, clk)
	w.Set(keyA, []int{1})
	f.next(t)
	settle(t, w, f)
	clk.Step(time.Hour) // any retry would be due by now
	if n := w.queue.NumRequeues(keyA); n != 0 {
		t.Errorf("%d retries of a dropped status; want 0", n)
	}
	if n := testutil.ToFloat64(w.writes.WithLabelValues("test", "dropped")); n != 1 {
		t.Errorf("dropped %v; want 1", n)
	}
	w.Set(keyA, []int{2})
	if c := f.next(t); !slices.Equal(c.v, []int{2}) {
		t.Errorf("next write %v; want [2]", c.v)
	}
	settle(t, w, f)
	if got := f.callsOf(keyA); len(got) != 2 {
		t.Errorf("writes %v; want [[1] [2]]", got)
	}
}

func TestFoldEvents(t *testing.T) {
	rb := func(note string) statusEvent { return statusEvent{"Normal", "Rebalanced", "Rebalance", note} }
	sd := func(note string) statusEvent { return statusEvent{"Normal", "SafeDefaultChanged", "Rebalance", note} }
	got := foldEvents([]statusEvent{rb("8→10"), sd("5→4"), rb("10→16"), rb("10→16"), sd("4→2")})
	want := []statusEvent{rb("8→10; then 10→16"), sd("5→4; then 4→2")}
	if !slices.Equal(got, want) {
		t.Errorf("foldEvents = %v; want %v", got, want)
	}
	long := string(make([]byte, maxEventNote-2))
	if got := foldEvents([]statusEvent{rb(long), rb("last")}); !slices.Equal(got, []statusEvent{rb("last")}) {
		t.Errorf("an over-long fold keeps %d bytes; want the last note alone", len(got[0].Note))
	}
}
