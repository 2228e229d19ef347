package proxy

import (
	"context"
	"errors"
	"sync"
	"time"

	"k8s.io/utils/clock"

	"github.com/apportion/apportion/internal/agent/breaker"
	"github.com/apportion/apportion/internal/agent/degrade"
	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/agent/semaphore"
)

// observe is the chain of a downstream under Observe: every call is admitted at once, and each
// step only notes what it would have done; the first step that would have refused the call
// names the reason counted (CountWouldRefuse), as under Enforce the first refusal ends the
// chain. No step makes the call wait, so it is delayed by the steps' own work only:
//
//   - degrade: a switch in force or a dry-run one matches (reason degraded);
//   - openBreaker: the breaker is open (circuit-open); no probe ticket is taken;
//   - rate: no token within the wait allowed (rate-limited). A token within it is reserved as
//     Enforce reserves it, without the wait, so the limiter sees the calls Enforce would send;
//   - ticket: a closed or half-open breaker's ticket, so that it judges the calls' outcomes as
//     under Enforce; a half-open one whose probe slots are taken (circuit-open) gives none, and
//     the call is forwarded without one;
//   - permit: Enforce's wait for a permit is played in the downstream's shadow semaphore
//     (enforce.Downstream.Shadow: the same limit and waiters' bound), beside the call: a shadow
//     permit free at once is held for the call's duration; otherwise a shadow waiter waits what
//     is left of the wait allowed and, granted, holds its permit from then on for as long as the
//     call took (shadowWaiter). Refused, it counts no-permit, or queue-full at once when the
//     waiters' bound is reached: Enforce's own outcomes, on the calls Observe sees. (Priority
//     lanes are not played: their reserves are not modelled, only the downstream's permits.)
//
// Besides, the call takes the real lane's and downstream's permits with Force, beyond the limit
// when none is free, and releases them as any admitted call: the calls forwarded under Observe
// are in the in-flight count the agent reports and count against the permits until they end,
// which is what makes a switch to Enforce a lowering (docs/protocol.md §11b). No stall check:
// nothing is promised about Observe's calls in flight.
func (a *admitting) observe(t *enforce.Table, req degrade.RequestView) {
	would := -1
	note := func(reason int) {
		if would < 0 {
			would = reason
		}
	}
	if (len(t.Switches) > 0 && degrade.Select(t.Switches, a.ds.Name, req, a.start) != nil) ||
		(len(t.DryRun) > 0 && degrade.Select(t.DryRun, a.ds.Name, req, a.start) != nil) {
		note(metrics.ReasonDegraded)
	}
	a.br = a.ds.Breaker()
	if a.br != nil && a.br.State(a.start) == breaker.Open {
		note(metrics.ReasonCircuitOpen)
	}
	var rateWait time.Duration
	if lim := a.ds.Limiter(); lim != nil && would < 0 {
		wait, ok := lim.Reserve(a.start, a.maxWait)
		if !ok {
			note(metrics.ReasonRateLimited)
		}
		rateWait = wait
	}
	a.ds.Tick()
	if a.lanes != nil {
		a.lanes.Sem.Force(a.lane)
		a.held.lane = true
	}
	a.ds.Sem.Force()
	a.held.permit = true
	if a.br != nil {
		if tk, _, ok := a.br.Allow(a.start); ok {
			a.tk, a.held.ticket = tk, true
		} else {
			note(metrics.ReasonCircuitOpen)
		}
	}
	if would >= 0 {
		a.ds.CountWouldRefuse(would)
	} else {
		a.shadowPermit(a.maxWait - rateWait)
	}
	a.ds.Metrics.AcquireWait.Observe(a.clk.Since(a.start).Seconds())
	a.out.verdict, a.out.ticket = admitted, a.tk
	if a.held.lane {
		a.out.lanes, a.out.lane = a.lanes, a.lane
	}
}

// shadowPermit plays Enforce's permit step in the shadow semaphore (see observe), within wait.
func (a *admitting) shadowPermit(wait time.Duration) {
	sh := a.ds.Shadow
	if sh.TryAcquire() {
		a.out.shadowHeld = sh
		return
	}
	if a.ds.Effective() == 0 || wait <= 0 {
		a.ds.CountWouldRefuse(metrics.ReasonNoPermit)
		return
	}
	// The waiters' bound, looked at here first: most calls of an overload end this way, and a
	// waiter refused at once needs no goroutine. (A waiter that left meanwhile may make this
	// count one queue-full where Acquire would have queued: a look, not a lock, is enough for
	// a count.)
	if mw := sh.MaxWaiting(); mw >= 0 && sh.Stats().Waiting >= mw {
		a.ds.CountWouldRefuse(metrics.ReasonQueueFull)
		return
	}
	w := &shadowWaiter{ds: a.ds, clk: a.clk, start: a.start, waited: make(chan struct{})}
	a.out.shadowWait = w
	go w.run(wait)
}

// endShadow ends the call's place in the shadow semaphore, when it has one: the call ended.
func (ad *admission) endShadow(clk clock.PassiveClock) {
	if ad.shadowHeld != nil {
		ad.shadowHeld.Release()
		ad.shadowHeld = nil
	}
	if ad.shadowWait != nil {
		ad.shadowWait.end(clk.Now())
		ad.shadowWait = nil
	}
}

// shadowWaiter is an Observe call that found no shadow permit free: it waits for one as the
// call would have under Enforce, and, granted at g, holds it until g plus the call's duration —
// when the call would have ended under Enforce, having started at g. Whichever of the grant and
// the call's end comes second releases it (both under mu): exactly once.
type shadowWaiter struct {
	ds    *enforce.Downstream
	clk   clock.WithDelayedExecution
	start time.Time // when the call arrived

	mu        sync.Mutex
	grantedAt time.Time // zero: not granted (yet, or ever)
	endedAt   time.Time // zero: the call still runs

	waited chan struct{} // closed when the wait is over, granted or not (for tests)
}

// run waits for a shadow permit for wait at most; refused, it counts what Enforce would have
// refused.
func (w *shadowWaiter) run(wait time.Duration) {
	ctx, cancel := context.WithCancel(context.Background())
	timer := w.clk.AfterFunc(wait, cancel)
	err := w.ds.Shadow.Acquire(ctx)
	timer.Stop()
	cancel()
	defer close(w.waited)
	if err != nil {
		reason := metrics.ReasonNoPermit
		if errors.Is(err, semaphore.ErrQueueFull) {
			reason = metrics.ReasonQueueFull
		}
		w.ds.CountWouldRefuse(reason)
		return
	}
	w.mu.Lock()
	w.grantedAt = w.clk.Now()
	ended := w.endedAt
	w.mu.Unlock()
	if !ended.IsZero() {
		w.releaseAfter(ended.Sub(w.start)) // the call's duration, from the grant
	}
}

// end notes the call's end at now.
func (w *shadowWaiter) end(now time.Time) {
	w.mu.Lock()
	w.endedAt = now
	granted := w.grantedAt
	w.mu.Unlock()
	if !granted.IsZero() {
		w.releaseAfter(granted.Sub(w.start)) // granted + (now − start) is that far from now
	}
}

func (w *shadowWaiter) releaseAfter(d time.Duration) {
	if d <= 0 {
		w.ds.Shadow.Release()
		return
	}
	w.clk.AfterFunc(d, w.ds.Shadow.Release)
}
