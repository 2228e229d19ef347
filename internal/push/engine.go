package push

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"github.com/apportion/apportion/internal/assignment"
)

// ErrFenced is returned by Start when an agent answered with a newer epoch and the epoch record
// (Options.Record) confirms that a newer manager took one: another manager took over, and this
// one must stop (the manager process exits and restarts). An agent's answer alone never fences
// (docs/protocol.md §9).
var ErrFenced = errors.New("push: an agent holds a newer epoch; this manager is stale")

// Engine delivers every pod's permits and degrade switches to its agent and keeps, per quota, a
// ledger of what every pod may be using, so that the permits live pods hold never sum above the
// quota's limit. See docs/protocol.md.
//
// The controllers call SetQuota, DeleteQuota, Report and SwitchApplied from any goroutine; the
// manager runs Start (a leader-election Runnable).
type Engine struct {
	opts    Options
	clock   clock.Clock
	metrics *metrics

	mu         sync.Mutex
	cond       *sync.Cond // signalled when work is ready or the engine stops
	core       *core
	stopping   bool
	waitingFor time.Time // the scheduler's current deadline; zero when it waits without one
	// signed holds requests started and signed in a batch by one worker, for any worker to send.
	signed []*work

	kick      chan struct{}
	claimCh   chan struct{} // signalled when a claim of a newer epoch waits for the record
	fencedCh  chan struct{}
	fenceOnce sync.Once
	started   atomic.Bool

	notifyMu     sync.Mutex
	notifyKeys   map[types.NamespacedName]struct{}
	notifyEvents []Event
	notifyCh     chan struct{}
}

// New builds an Engine. It pushes nothing until Start.
func New(opts Options) (*Engine, error) {
	if err := opts.setDefaults(); err != nil {
		return nil, err
	}
	m, err := newMetrics(opts.Registry)
	if err != nil {
		return nil, fmt.Errorf("push: registering metrics: %w", err)
	}
	if sc, ok := opts.Client.(signCounter); ok && opts.Registry != nil {
		if err := registerSignStats(opts.Registry, sc); err != nil {
			return nil, fmt.Errorf("push: registering metrics: %w", err)
		}
	}
	e := &Engine{
		opts:       opts,
		clock:      opts.Clock,
		metrics:    m,
		kick:       make(chan struct{}, 1),
		claimCh:    make(chan struct{}, 1),
		fencedCh:   make(chan struct{}),
		notifyKeys: map[types.NamespacedName]struct{}{},
		notifyCh:   make(chan struct{}, 1),
	}
	e.cond = sync.NewCond(&e.mu)
	e.core = newCore(&e.opts, m)
	return e, nil
}

// The manager finds NeedLeaderElection by a type assertion at run time: without it the engine
// would run on every replica. These make a changed signature a compile error.
var (
	_ manager.Runnable               = (*Engine)(nil)
	_ manager.LeaderElectionRunnable = (*Engine)(nil)
)

// NeedLeaderElection makes the manager run the engine only on the leader.
func (e *Engine) NeedLeaderElection() bool { return true }

// Start takes a new epoch, then runs recovery and the push loops until ctx is done. It returns
// ErrFenced if a newer manager took over, nil when ctx ends. It may be called once.
func (e *Engine) Start(ctx context.Context) error {
	if !e.started.CompareAndSwap(false, true) {
		return errors.New("push: Engine.Start called twice")
	}
	epoch, err := e.nextEpoch(ctx)
	if err != nil {
		return err
	}
	if epoch == 0 {
		return nil // ctx ended first
	}
	e.opts.Logger.Info("push engine starting", "epoch", epoch, "leaseTTL", e.opts.LeaseTTL, "renewEvery", e.opts.RenewEvery)

	e.mu.Lock()
	e.core.begin(epoch, e.clock.Now())
	e.afterLocked()
	e.mu.Unlock()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	for range e.opts.Workers {
		wg.Go(func() { e.worker(ctx) })
	}
	wg.Go(func() { e.scheduler(ctx) })
	wg.Go(func() { e.verifier(ctx) })
	go e.notifier(ctx) // not waited for: OnChange may block on a consumer that stopped

	var res error
	select {
	case <-ctx.Done():
	case <-e.fencedCh:
		res = ErrFenced
	}
	e.mu.Lock()
	e.stopping = true
	e.cond.Broadcast()
	e.mu.Unlock()
	cancel()
	wg.Wait()
	return res
}

func (e *Engine) nextEpoch(ctx context.Context) (int64, error) {
	delay := e.opts.RetryBase
	for {
		epoch, err := e.opts.Epoch.NextEpoch(ctx)
		if err == nil {
			if epoch < 1 {
				return 0, fmt.Errorf("push: epoch source returned %d; epochs start at 1", epoch)
			}
			return epoch, nil
		}
		if ctx.Err() != nil {
			return 0, nil //nolint:nilerr // shutting down is not a failure to take an epoch
		}
		e.opts.Logger.Error(err, "taking a new epoch; retrying", "in", delay)
		select {
		case <-ctx.Done():
			return 0, nil
		case <-e.clock.After(delay):
		}
		delay = min(delay*2, e.opts.RetryMax)
	}
}

// SetQuota hands over what every pod of one quota should hold. It returns at once; the engine
// lowers, raises and pushes in the background. Calling it again with the same content is cheap.
func (e *Engine) SetQuota(d DesiredQuota) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.core.setQuota(d, e.clock.Now())
	e.afterLocked()
}

// DeleteQuota takes a quota out of service: its pods are lowered to 0 permits, and its
// downstream leaves each pod's assignment once the pod counts nothing for it any more (calls
// ended, lease passed). Until then its ledger lives on, and a quota set again under the same key
// (deleted and re-created) goes on from it.
func (e *Engine) DeleteQuota(key types.NamespacedName) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.core.deleteQuota(key, e.clock.Now())
	e.afterLocked()
}

// Report is what the engine knows of one quota now; the zero Report (with Recovering) for a
// quota it does not know.
func (e *Engine) Report(key types.NamespacedName) Report {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.core.reports.report(key, e.clock.Now())
}

// SwitchApplied counts, for the degrade switch named name ("<namespace>/<DegradeRule name>"),
// the pods (with an agent endpoint) whose assignment carries the switch in its current form
// (total) and those whose agent acknowledged exactly that form (applied). (0, 0) when no pod
// should hold it, e.g. once it was switched off.
func (e *Engine) SwitchApplied(name string) (applied, total int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.core.reports.switchApplied(name)
}

// Epoch is the engine's fencing epoch; 0 before Start took one.
func (e *Engine) Epoch() int64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.core.ledger.epoch
}

// afterLocked wakes workers for ready work, the scheduler for an earlier deadline, the
// notifier for changed reports, and Start when fenced. e.mu is held.
func (e *Engine) afterLocked() {
	if e.core.sched.hasReady() {
		e.cond.Broadcast()
	}
	if e.core.marks.needsFlush() {
		// Replans are the scheduler's: answers arriving together are planned once.
		select {
		case e.kick <- struct{}{}:
		default:
		}
	} else if next := e.core.sched.nextWake(); !next.IsZero() && (e.waitingFor.IsZero() || next.Before(e.waitingFor)) {
		e.waitingFor = next
		select {
		case e.kick <- struct{}{}:
		default:
		}
	}
	keys, evs := e.core.reports.takeChanged(), e.core.reports.takeEvents()
	if e.opts.OnChange == nil {
		keys = nil
	}
	if e.opts.OnEvent == nil {
		evs = nil
	}
	if len(keys) > 0 || len(evs) > 0 {
		e.notifyMu.Lock()
		for _, k := range keys {
			e.notifyKeys[k] = struct{}{}
		}
		e.notifyEvents = append(e.notifyEvents, evs...)
		e.notifyMu.Unlock()
		select {
		case e.notifyCh <- struct{}{}:
		default:
		}
	}
	if _, ok := e.core.claims.pendingClaim(); ok {
		select {
		case e.claimCh <- struct{}{}:
		default:
		}
	}
	if e.core.ledger.fenced {
		e.fenceOnce.Do(func() { close(e.fencedCh) })
	}
}

// recordReadTimeout bounds one read of the epoch record.
const recordReadTimeout = 10 * time.Second

// verifier decides the claims of a newer epoch (claims.go): while one waits, it reads the epoch
// record, outside the engine's lock, at most once per EpochCheckEvery — every claim made before
// a read is decided by it, so however many pods claim, the API server sees at most one read per
// interval — and hands the result to the core. A failed read is retried with doubling intervals
// (up to RetryMax × 6) and never fences.
func (e *Engine) verifier(ctx context.Context) {
	every := e.opts.EpochCheckEvery
	interval := every
	var last time.Time // when the last read started
	for {
		select {
		case <-ctx.Done():
			return
		case <-e.claimCh:
		}
		for {
			e.mu.Lock()
			upTo, ok := e.core.claims.pendingClaim()
			e.mu.Unlock()
			if !ok {
				break
			}
			if !last.IsZero() {
				if wait := last.Add(interval).Sub(e.clock.Now()); wait > 0 {
					select {
					case <-ctx.Done():
						return
					case <-e.clock.After(wait):
					}
				}
			}
			last = e.clock.Now()
			rctx, cancel := context.WithTimeout(ctx, recordReadTimeout)
			record, err := e.opts.Record.CurrentEpoch(rctx)
			cancel()
			if ctx.Err() != nil {
				return
			}
			e.mu.Lock()
			switch {
			case err != nil:
				e.metrics.recordReads.WithLabelValues(recordError).Inc()
				interval = min(interval*2, max(every, 6*e.opts.RetryMax))
			case record > e.core.ledger.epoch:
				e.metrics.recordReads.WithLabelValues(recordNewer).Inc()
			default:
				e.metrics.recordReads.WithLabelValues(recordNotNewer).Inc()
				interval = every
			}
			e.core.claims.recordRead(upTo, record, err, e.clock.Now())
			e.afterLocked()
			e.mu.Unlock()
		}
	}
}

func (e *Engine) scheduler(ctx context.Context) {
	for {
		e.mu.Lock()
		now := e.clock.Now()
		e.core.advance(now)
		next := e.core.sched.nextWake()
		e.waitingFor = next
		e.afterLocked()
		e.mu.Unlock()

		var tc <-chan time.Time
		var t clock.Timer
		if !next.IsZero() {
			t = e.clock.NewTimer(next.Sub(now))
			tc = t.C()
		}
		select {
		case <-ctx.Done():
			if t != nil {
				t.Stop()
			}
			return
		case <-tc:
		case <-e.kick:
		}
		if t != nil {
			t.Stop()
		}
	}
}

func (e *Engine) worker(ctx context.Context) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for {
		for !e.stopping && len(e.signed) == 0 && !e.core.sched.hasReady() {
			e.cond.Wait()
		}
		if e.stopping {
			return
		}
		var w *work
		if e.takeSigned() {
			w = e.signed[0]
			e.signed[0] = nil
			e.signed = e.signed[1:]
		} else if w = e.core.startWork(e.core.sched.popReady(), e.clock.Now()); w == nil {
			continue
		} else if bs, ok := e.opts.Client.(BatchSigner); ok && batchable(w) {
			if !e.signTogether(bs, w) {
				return
			}
		}
		e.mu.Unlock()
		st, body, err := e.do(ctx, w)
		e.mu.Lock()
		if e.stopping {
			return
		}
		w.encoded(body)
		e.core.finishWork(w, st, err, e.clock.Now())
		e.afterLocked()
	}
}

// takeSigned says whether a worker should send the next renewal signed in a batch (e.signed)
// rather than start the next ready request: yes, unless a request of a band before renewals (a
// lowering, a change or a probe of a proven pod, readyQueue) may start and the signed one can
// wait, with more than half its PushTimeout left. (A signed renewal was counted against its
// namespace's bound when it was started, so sending it takes nothing more from the queue.) A change then does not queue behind a batch of renewals, and no
// renewal waits so long that its own deadline ends it. e.mu is held.
//
// The decision reads the engine's clock: the signed renewal was started (sentAt) PushTimeout
// before its socket deadline, so "half its PushTimeout left" is "half of it passed since sentAt".
func (e *Engine) takeSigned() bool {
	if len(e.signed) == 0 {
		return false
	}
	return !e.core.sched.hasUrgent() || e.clock.Since(e.signed[0].sentAt) >= e.opts.PushTimeout/2
}

// maxSignBatch bounds the renewals one worker starts and signs together.
const maxSignBatch = 64

// signTogether starts the other renewals ready now that may share w's signature, signs them
// with w outside the lock (one Ed25519 signature: the costliest step of a renewal), and leaves
// all but w for the other workers to send. e.mu is held; false when the engine stopped
// meanwhile.
func (e *Engine) signTogether(bs BatchSigner, w *work) bool {
	batch := []*work{w}
	now := e.clock.Now()
	batch = append(batch, e.core.startRenewals(maxSignBatch-1, now)...)
	if len(batch) == 1 {
		return true
	}
	// Every request of the batch ends PushTimeout after it was started, not after a worker
	// takes it up: a push can land only within the land window of its start (sentAt), which
	// the ledger relies on (docs/protocol.md §4).
	deadline := socketDeadline(e.opts.PushTimeout)
	for _, b := range batch {
		b.deadline = deadline
	}
	e.mu.Unlock()
	outs := make([]*assignment.Outgoing, 0, len(batch))
	for _, b := range batch {
		if o, err := assignment.NewOutgoing(b.to, b.assignment, b.body); err == nil {
			b.out = o
			outs = append(outs, o)
		} // else the request fails as it would unbatched
	}
	bs.SignTogether(outs)
	e.mu.Lock()
	if e.stopping {
		return false
	}
	e.signed = append(e.signed, batch[1:]...)
	e.cond.Broadcast()
	return true
}

// do sends one request, bounded by PushTimeout, and records its metrics. For a push through an
// EncodedPusher it returns the JSON sent, for the version to reuse (work.encoded). The bound is
// the request context's deadline: with a timer (context.WithTimeout) unless the client ends a
// request at its deadline by itself (DeadlineBounded, requestContext).
func (e *Engine) do(ctx context.Context, w *work) (*assignment.State, []byte, error) {
	deadline := w.deadline
	if deadline.IsZero() {
		deadline = socketDeadline(e.opts.PushTimeout)
	}
	rctx, cancel := requestContext(ctx, e.opts.Client, deadline)
	defer cancel()
	start := time.Now() // the request's latency, for its metric: measured on the wire's clock, as its deadline
	var st *assignment.State
	var err error
	body, to := w.body, w.to
	if bs, ok := e.opts.Client.(BatchSigner); ok && w.out != nil {
		st, err = bs.Send(rctx, w.out)
	} else if ep, ok := e.opts.Client.(EncodedPusher); ok && w.kind == kindPush {
		if body == nil {
			if err = w.assignment.Validate(); err != nil {
				err = fmt.Errorf("refusing to push an invalid assignment: %w", err)
			} else {
				body, err = json.Marshal(w.assignment)
			}
		}
		if err == nil {
			st, err = ep.PushEncoded(rctx, to, w.assignment, body)
		} else {
			body = nil
		}
	} else if w.kind == kindPush {
		st, err = e.opts.Client.Push(rctx, to, w.assignment)
	} else {
		st, err = e.opts.Client.State(rctx, to, w.epoch)
	}
	if err == nil && st == nil {
		err = errors.New("agent client returned no state")
	}
	result := resultOK
	var se *assignment.StatusError
	switch {
	case err == nil:
	case errors.As(err, new(*assignment.StaleError)):
		result = resultStale
	case errors.As(err, &se) && se.StatusCode < 500:
		result = resultRefused
	case ctx.Err() != nil:
		result = resultUnavailable
	case errors.Is(rctx.Err(), context.DeadlineExceeded), errors.Is(err, os.ErrDeadlineExceeded),
		errors.Is(err, context.DeadlineExceeded):
		// The second and third: a client that bounds the exchange by its connection's deadline
		// (h1: a read or write past it, a dial past it) returns before, or without, a timer
		// ending the context (DeadlineBounded).
		result = resultTimeout
	default:
		result = resultError
	}
	e.metrics.request(w.kind, result, time.Since(start).Seconds())
	return st, body, err
}

func (e *Engine) notifier(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-e.notifyCh:
		}
		e.notifyMu.Lock()
		keys := make([]types.NamespacedName, 0, len(e.notifyKeys))
		for k := range e.notifyKeys {
			keys = append(keys, k)
		}
		clear(e.notifyKeys)
		evs := e.notifyEvents
		e.notifyEvents = nil
		e.notifyMu.Unlock()
		for _, ev := range evs {
			if ctx.Err() != nil {
				return
			}
			e.opts.OnEvent(ev)
		}
		for _, k := range keys {
			if ctx.Err() != nil {
				return
			}
			e.opts.OnChange(k)
		}
	}
}
