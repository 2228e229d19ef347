package proxy

import (
	"context"
	"errors"
	"math/rand/v2"
	"net/http"
	"time"

	"k8s.io/utils/clock"

	"github.com/apportion/apportion/internal/agent/breaker"
	"github.com/apportion/apportion/internal/agent/deadline"
	"github.com/apportion/apportion/internal/agent/degrade"
	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/agent/semaphore"
)

// verdict is what the admission pipeline made of a call.
type verdict int

const (
	// admitted: the call holds a permit (and the breaker's ticket, when it has a breaker) and is
	// to be forwarded.
	admitted verdict = iota
	// refused: a fallback answers (admission.reason, .action, .retryAfter, .at); nothing is held.
	refused
	// appLeft: the app gave up while the call waited for a rate token or a permit; nothing is
	// held and nobody is to be answered.
	appLeft
	// stalled: admitting took far longer than it can (see stallSlack): the agent was frozen or
	// starved, the permit may have been handed to another pod meanwhile, and the call must not
	// be sent late; nothing is held.
	stalled
)

// admission is the outcome of admit.
type admission struct {
	verdict verdict
	// refused: the reason, the fallback to answer with (the downstream's, or the degrade
	// switch's action), the Retry-After to give (0: none) and the time of the refusal.
	reason     fallback.Reason
	action     *fallback.Config
	retryAfter time.Duration
	at         time.Time
	// admitted: the breaker's ticket (the zero Ticket when the downstream has no breaker).
	ticket breaker.Ticket
	// admitted, on a downstream with lanes: the lane permit held besides the downstream's
	// (lanes is nil without lanes); released by releaseLane after the downstream's permit.
	lanes *enforce.LaneSet
	lane  int
}

// releaseLane returns the call's lane permit, if it holds one.
func (a admission) releaseLane() {
	if a.lanes != nil {
		a.lanes.Sem.Release(a.lane)
	}
}

// admit runs a call to ds, whose configuration is cfg, through the admission pipeline, steps 2 to 6 of the package doc, in
// this order: a degrade switch of t that matches req refuses (reason degraded, its action,
// Retry-After the time until the switch expires when that is within maxDegradeRetryAfter); an
// open breaker refuses (circuit-open, Retry-After the time left until it admits probes) before a
// rate token or a permit is taken; no rate token within the wait allowed refuses (rate-limited,
// Retry-After when the limiter's next token accrues); no permit within what is left of the wait
// allowed, or at once when the effective limit is 0, refuses (no-permit), and a call that would
// wait while MaxWaiting calls already wait is refused at once (queue-full); then a closed or
// half-open breaker is asked for the call's ticket, with the permit held, and a half-open one
// whose probe slots are all taken refuses (circuit-open, no Retry-After) after the permit was
// released. The wait allowed is AcquireTimeout, or what is left of the app's budget when that is
// less: a call never waits for a token or a permit beyond the deadline its app stated. A probe ticket taken early (the breaker turned
// half-open between the two looks) is given back, unused and uncounted, when the call is
// refused or the app leaves later on.
//
// Time is clk's: the waits for a token or a permit are timed on it, and so is the time
// admitting took. Waiting ends early when ctx ends (the app left: appLeft). Every call is
// counted (requests, and rejections by reason) and the time it took to admit is observed
// (acquire wait); a call admitted more than 2×AcquireTimeout+stallSlack after it arrived is
// stalled, its permit released and its ticket cancelled.
func admit(ctx context.Context, clk clock.WithDelayedExecution, t *enforce.Table, ds *enforce.Downstream, cfg *enforce.Config, req degrade.RequestView, budget deadline.Budget) admission {
	now := clk.Now()
	start := now
	ds.CountRequest(now)
	// The wait allowed for a token and a permit together.
	maxWait := max(budget.Left(start, cfg.AcquireTimeout), 0)
	// The call's priority lane, when the downstream has lanes: refusals are counted per lane too,
	// and 5 takes the lane's permit before the downstream's.
	ls, lane := ds.Lanes(), -1
	if ls != nil {
		lane = ls.Match(req.Method, req.Path, req.Header)
	}
	countLane := func(reason int) {
		if ls != nil {
			ls.CountRejected(lane, reason)
		}
	}

	// 2. Degrade switches (1, unknown downstream, is the caller's).
	if len(t.Switches) > 0 {
		if sw := degrade.Select(t.Switches, ds.Name, req, now); sw != nil {
			ds.CountRejected(metrics.ReasonDegraded)
			countLane(metrics.ReasonDegraded)
			var retry time.Duration
			if left := sw.ExpiresAt.Sub(now); left <= maxDegradeRetryAfter {
				retry = left
			}
			return admission{verdict: refused, reason: fallback.Degraded, action: &sw.Action, retryAfter: retry, at: now}
		}
	}
	refuse := func(reason fallback.Reason, metric int, retryAfter time.Duration, at time.Time) admission {
		ds.CountRejected(metric)
		countLane(metric)
		return admission{verdict: refused, reason: reason, action: &cfg.Fallback, retryAfter: retryAfter, at: at}
	}
	// 3. Circuit breaker: an open one refuses here, before a token or a permit is taken. A
	// closed or half-open one is asked for the call's ticket once the permit is held (6),
	// because a ticket cannot be handed back unused: a half-open probe slot must go to a call
	// that is really forwarded.
	br := ds.Breaker()
	var tk breaker.Ticket
	haveTicket := false
	if br != nil && br.State(now) == breaker.Open {
		var retry time.Duration
		var ok bool
		if tk, retry, ok = br.Allow(now); !ok {
			return refuse(fallback.CircuitOpen, metrics.ReasonCircuitOpen, retry, now)
		}
		haveTicket = true // it became half-open in between: this call is a probe
	}
	// giveBack returns a probe ticket taken above for a call that is not forwarded after all:
	// the probe slot is freed and nothing is counted, so the breaker neither closes on a probe
	// that never reached the downstream nor reopens because of our own rate or permit limits.
	giveBack := func() {
		if haveTicket {
			tk.Cancel()
		}
	}
	// 4. Rate.
	if lim := ds.Limiter(); lim != nil {
		wait, ok := lim.Reserve(now, maxWait)
		if !ok {
			giveBack()
			// wait is when the limiter's next token accrues: the earliest a retry can pass it.
			return refuse(fallback.RateLimited, metrics.ReasonRateLimited, wait, now)
		}
		if wait > 0 && !sleep(ctx, clk, wait) {
			giveBack()
			return admission{verdict: appLeft}
		}
	}
	// 5. Permit (the lane's first, when the downstream has lanes), then 6, the ticket of a
	// closed or half-open breaker. The recovery limit (a ramp, an adaptive limit) changes when a
	// window ends: put it in force first.
	ds.Tick()
	// held is the lane permit taken (none yet); its releaseLane gives it back on every way out.
	var held admission
	if ls != nil {
		if !ls.Sem.TryAcquire(lane) {
			remaining := maxWait - clk.Since(start)
			if ds.Effective() == 0 || remaining <= 0 {
				giveBack()
				return refuse(fallback.NoPermit, metrics.ReasonNoPermit, 0, clk.Now())
			}
			wctx, cancel := context.WithCancel(ctx)
			timer := clk.AfterFunc(remaining, cancel)
			err := ls.Sem.Acquire(wctx, lane)
			timer.Stop()
			cancel()
			if err != nil {
				giveBack()
				if ctx.Err() != nil {
					return admission{verdict: appLeft}
				}
				return refuse(fallback.NoPermit, metrics.ReasonNoPermit, 0, clk.Now())
			}
		}
		held.lanes, held.lane = ls, lane
	}
	if !ds.Sem.TryAcquire() {
		remaining := maxWait - clk.Since(start)
		if ds.Effective() == 0 || remaining <= 0 {
			giveBack()
			held.releaseLane()
			return refuse(fallback.NoPermit, metrics.ReasonNoPermit, 0, clk.Now())
		}
		wctx, cancel := context.WithCancel(ctx)
		timer := clk.AfterFunc(remaining, cancel)
		err := ds.Sem.Acquire(wctx)
		timer.Stop()
		cancel()
		if err != nil {
			giveBack()
			held.releaseLane()
			switch {
			case errors.Is(err, semaphore.ErrQueueFull):
				return refuse(fallback.QueueFull, metrics.ReasonQueueFull, 0, clk.Now())
			case ctx.Err() != nil:
				return admission{verdict: appLeft}
			}
			return refuse(fallback.NoPermit, metrics.ReasonNoPermit, 0, clk.Now())
		}
	}
	if br != nil && !haveTicket {
		now := clk.Now()
		var retry time.Duration
		var ok bool
		if tk, retry, ok = br.Allow(now); !ok {
			ds.Sem.Release()
			held.releaseLane()
			return refuse(fallback.CircuitOpen, metrics.ReasonCircuitOpen, retry, now)
		}
	}
	waited := clk.Since(start)
	ds.Metrics.AcquireWait.Observe(waited.Seconds())
	// Admission takes at most the acquire timeout (plus a rate wait within it). Far longer means
	// this process was frozen or starved between admitting the call and forwarding it: its lease
	// may have passed meanwhile and the manager may have handed the permit to another pod, so the
	// call is not sent late. The permit is returned unused.
	if waited > 2*cfg.AcquireTimeout+stallSlack {
		ds.Sem.Release()
		held.releaseLane()
		if haveTicket || br != nil {
			tk.Cancel()
		}
		return admission{verdict: stalled}
	}
	held.verdict, held.ticket = admitted, tk
	return held
}

// requestView is what degrade switches look at in r.
func requestView(r *http.Request) degrade.RequestView {
	_, rest := splitPath(r.URL.EscapedPath())
	return degrade.RequestView{Method: r.Method, Header: r.Header, Path: rest, Rand: rand.Uint32}
}

// maxDegradeRetryAfter: a degrade switch that expires within this long gives its expiry as
// Retry-After; one that holds longer gives none, for a retry that far off is no advice a caller
// can act on (and the switch may well be lifted or extended before).
const maxDegradeRetryAfter = time.Minute

// stallSlack is added to twice the acquire timeout before a call admitted that long ago counts
// as stalled rather than slow to schedule.
const stallSlack = 500 * time.Millisecond

// sleep waits d on clk; false: ctx ended first.
func sleep(ctx context.Context, clk clock.Clock, d time.Duration) bool {
	t := clk.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C():
		return true
	case <-ctx.Done():
		return false
	}
}
