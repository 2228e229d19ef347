package controller

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"github.com/apportion/apportion/internal/promreg"
)

// DefaultStatusWriters is how many status writes are in flight at once by default.
const DefaultStatusWriters = 8

// Retry backoff of a failed status write, per object: doubled on each failure from the first to
// the last, reset by a success. Only failures back off: a newer desired status is written at once.
const (
	statusRetryFirst = 50 * time.Millisecond
	statusRetryLast  = 30 * time.Second
)

// WriteOutcome is how a status write ended when it did not fail.
type WriteOutcome int

const (
	// StatusWritten: the API server took the desired status.
	StatusWritten WriteOutcome = iota
	// StatusUnchanged: the object already had the desired status; nothing was sent.
	StatusUnchanged
	// StatusDropped: the object is gone, or is another object of the same name (deleted and
	// created again): the desired status regards nothing that exists, and is forgotten.
	StatusDropped
)

var outcomeNames = [...]string{StatusWritten: "written", StatusUnchanged: "unchanged", StatusDropped: "dropped"}

// StatusWriterOptions configures a StatusWriter.
type StatusWriterOptions[T any] struct {
	// Name names the work queue (its workqueue_* metrics carry it as the label name) and the
	// kind label of the writer's own metrics, e.g. "downstreamquota_status".
	Name string
	// Workers bounds the writes in flight at once; 0 means DefaultStatusWriters.
	Workers int
	// Write writes one object's desired status. It returns an error for what a retry may mend
	// (a conflict, a timeout, the API server unavailable): the desired status is kept, unless a
	// newer one came meanwhile, and tried again after a backoff. Required.
	Write func(ctx context.Context, key types.NamespacedName, desired T) (WriteOutcome, error)
	// Merge folds a desired status that was not written yet into the newer one that replaces it
	// (e.g. to keep the Events each carries); nil means the newer one simply replaces it.
	Merge func(older, newer T) T
	// Clock times the retry backoff; nil means the real clock.
	Clock clock.WithTicker
	// RateLimiter decides the retry backoff; nil means per-object exponential, statusRetryFirst
	// to statusRetryLast.
	RateLimiter workqueue.TypedRateLimiter[types.NamespacedName]
	// Registry receives the writer's counters; nil registers none.
	Registry prometheus.Registerer
	// Logger logs failed writes.
	Logger logr.Logger
}

// StatusWriter writes objects' statuses from its own bounded workers, so that a reconcile hands
// its decision over and never waits on the API server for it.
//
// The model: per object (keyed by namespace/name) there is at most one desired status waiting, in
// a map under a mutex, and the object's key in a work queue (client-go's, rate limited). Set puts
// a desired status in the map — replacing, through Merge, one that was not written yet: latest
// wins — and adds the key. A worker takes the key and the desired status out and calls Write:
//   - a success (written, found unchanged or dropped) forgets the key's backoff;
//   - a failure puts the desired status back (merged under a newer one if Set came meanwhile) and
//     adds the key again after the per-object backoff;
//   - Set during a write queues the key once more: the work queue hands a key to one worker at a
//     time, so at most one write per object is in flight, and the newer status follows at once.
//
// So the last desired status of every object is eventually written, found equal, or dropped with
// its object, and intermediate ones that the latest replaced are never sent. It runs only on the
// leader: a follower decides nothing.
type StatusWriter[T any] struct {
	name    string
	workers int
	write   func(context.Context, types.NamespacedName, T) (WriteOutcome, error)
	merge   func(older, newer T) T
	queue   workqueue.TypedRateLimitingInterface[types.NamespacedName]
	log     logr.Logger

	mu      sync.Mutex
	desired map[types.NamespacedName]T

	writes    *prometheus.CounterVec
	coalesced prometheus.Counter
}

var (
	_ manager.Runnable               = (*StatusWriter[int])(nil)
	_ manager.LeaderElectionRunnable = (*StatusWriter[int])(nil)
)

// NewStatusWriter makes a StatusWriter; Set may be called before Start (the writes wait for it).
func NewStatusWriter[T any](o StatusWriterOptions[T]) (*StatusWriter[T], error) {
	if o.Write == nil {
		return nil, errors.New("status writer: Write is required")
	}
	if o.Workers <= 0 {
		o.Workers = DefaultStatusWriters
	}
	if o.Merge == nil {
		o.Merge = func(_, newer T) T { return newer }
	}
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	if o.RateLimiter == nil {
		o.RateLimiter = workqueue.NewTypedItemExponentialFailureRateLimiter[types.NamespacedName](statusRetryFirst, statusRetryLast)
	}
	w := &StatusWriter[T]{
		name: o.Name, workers: o.Workers, write: o.Write, merge: o.Merge, log: o.Logger,
		desired: map[types.NamespacedName]T{},
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(o.RateLimiter,
			workqueue.TypedRateLimitingQueueConfig[types.NamespacedName]{Name: o.Name, Clock: o.Clock}),
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "apportion_manager_status_writes_total",
			Help: "Status writes handed to the status writer, by kind and outcome: written, unchanged (already so), dropped (object gone or recreated), failed (retried after a backoff).",
		}, []string{"kind", "outcome"}),
	}
	coalesced := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "apportion_manager_status_coalesced_total",
		Help: "Desired statuses replaced by a newer one before they were written (never sent), by kind.",
	}, []string{"kind"})
	if o.Registry != nil {
		var err error
		if w.writes, err = promreg.Register(o.Registry, w.writes); err != nil {
			return nil, err
		}
		if coalesced, err = promreg.Register(o.Registry, coalesced); err != nil {
			return nil, err
		}
	}
	w.coalesced = coalesced.WithLabelValues(o.Name)
	return w, nil
}

// Set hands over the desired status of the object key; it never blocks on I/O.
func (w *StatusWriter[T]) Set(key types.NamespacedName, desired T) {
	w.mu.Lock()
	if older, ok := w.desired[key]; ok {
		desired = w.merge(older, desired)
		w.coalesced.Inc()
	}
	w.desired[key] = desired
	w.mu.Unlock()
	w.queue.Add(key)
}

// Pending is how many objects have a desired status not written yet.
func (w *StatusWriter[T]) Pending() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.desired)
}

// NeedLeaderElection implements manager.LeaderElectionRunnable: only the leader writes status.
func (w *StatusWriter[T]) NeedLeaderElection() bool { return true }

// Start implements manager.Runnable: it runs the workers until ctx is done, then shuts the queue
// down (a write in flight sees ctx done and is not retried).
func (w *StatusWriter[T]) Start(ctx context.Context) error {
	var wg sync.WaitGroup
	for range w.workers {
		wg.Go(func() {
			for {
				if !w.next(ctx) {
					return
				}
			}
		})
	}
	<-ctx.Done()
	w.queue.ShutDown()
	wg.Wait()
	return nil
}

// next takes one key from the queue and writes its desired status; false once the queue is shut
// down.
func (w *StatusWriter[T]) next(ctx context.Context) bool {
	key, shutdown := w.queue.Get()
	if shutdown {
		return false
	}
	defer w.queue.Done(key)
	w.mu.Lock()
	d, ok := w.desired[key]
	delete(w.desired, key)
	w.mu.Unlock()
	if !ok {
		// A retry queued after a newer status was written meanwhile: nothing is left to do.
		w.queue.Forget(key)
		return true
	}
	outcome, err := w.write(ctx, key, d)
	if err == nil {
		w.writes.WithLabelValues(w.name, outcomeNames[outcome]).Inc()
		w.queue.Forget(key)
		return true
	}
	w.writes.WithLabelValues(w.name, "failed").Inc()
	if ctx.Err() == nil {
		w.log.Error(err, "writing status; retrying", "kind", w.name, "object", key, "attempt", w.queue.NumRequeues(key)+1)
	}
	w.mu.Lock()
	if newer, ok := w.desired[key]; ok {
		w.desired[key] = w.merge(d, newer)
	} else {
		w.desired[key] = d
	}
	w.mu.Unlock()
	w.queue.AddRateLimited(key)
	return true
}
