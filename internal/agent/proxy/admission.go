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
	// admitted under Observe: the call's place in Enforce's model (observe.go): the shadow
	// semaphore whose permit it holds from the start (shadowHeld), or its waiter there (nil:
	// none); endShadow ends it with the call.
	shadowHeld *semaphore.Semaphore
	shadowWait *shadowWaiter
}

// releaseLane returns the call's lane permit, if it holds one.
func (a admission) releaseLane() {
	if a.lanes != nil {
		a.lanes.Sem.Release(a.lane)
	}
}

// admit runs a call to ds, whose configuration is cfg, through the admission chain, steps 2 to 6
// of the package doc. Each step is a method of admitting, the call's state, and either passes the
// call on to the next (true) or ends its admission (false) with admitting.out set, explicitly, by
// refuse or leave; the first that ends it ends the chain. In this order:
//
//	degrade → openBreaker → rate → lanePermit → permit → ticket → admitted
//
// (degrade switches, an open breaker, a rate token, the lane's permit, the downstream's permit,
// a closed or half-open breaker's ticket; each step's doc says what it refuses with). The wait
// allowed for a token and a permit together is AcquireTimeout, or what is left of the app's budget
// when that is less: a call never waits for either beyond the deadline its app stated.
//
// Whatever way a call leaves the chain other than admitted, it holds nothing: what the steps
// before took (a probe ticket, the lane's permit, the downstream's) is given back (giveBack).
// Time is clk's: the waits for a token or a permit are timed on it, and so is the time admitting
// took. Waiting ends early when ctx ends (the app left: appLeft). Every call is counted (requests,
// and rejections by reason, per lane too) and the time admitting took is observed (acquire wait)
// for every call that got through the chain, stalled ones included.
//
// Under Observe (cfg.Observe) the chain is observe instead: every call is admitted at once and
// what the steps would have refused is only counted. Under Enforce a dry-run switch that matches
// is counted (would-refuse degraded) and the chain goes on as if it were off.
func admit(ctx context.Context, clk clock.WithDelayedExecution, t *enforce.Table, ds *enforce.Downstream, cfg *enforce.Config, req degrade.RequestView, budget deadline.Budget) admission {
	now := clk.Now()
	ds.CountRequest(now)
	// Set field by field: a composite literal this large is built aside and copied, which
	// BenchmarkAdmit shows on the hot path.
	var a admitting
	a.ctx, a.clk, a.ds, a.cfg, a.start = ctx, clk, ds, cfg, now
	a.maxWait, a.lane = max(budget.Left(now, cfg.AcquireTimeout), 0), -1
	// The call's lane is known before any step: every step's refusals are counted per lane too.
	if a.lanes = ds.Lanes(); a.lanes != nil {
		a.lane = a.lanes.Match(req.Method, req.Path, req.Header)
	}
	if cfg.Observe {
		a.observe(t, req)
		return a.out
	}
	if len(t.DryRun) > 0 && degrade.Select(t.DryRun, ds.Name, req, now) != nil {
		ds.CountWouldRefuse(metrics.ReasonDegraded) // and on through the chain, as if it were off
	}
	if a.degrade(t.Switches, req) && a.openBreaker() && a.rate() && a.lanePermit() && a.permit() && a.ticket() {
		a.admitted()
	}
	return a.out
}

// admitting is one call's state in the admission chain: what its steps read (set by admit before
// the first) and what they have taken so far (held), which giveBack returns.
type admitting struct {
	ctx     context.Context // the app's: when it ends, every wait ends (appLeft)
	clk     clock.WithDelayedExecution
	ds      *enforce.Downstream
	cfg     *enforce.Config
	start   time.Time     // when the call arrived: the time of the steps before any wait
	maxWait time.Duration // the wait allowed for a rate token and a permit together
	lanes   *enforce.LaneSet
	lane    int              // the call's lane; -1 when lanes is nil (the downstream has none)
	br      *breaker.Breaker // the downstream's breaker as openBreaker found it; nil: none
	tk      breaker.Ticket   // the breaker's ticket, once held.ticket
	held    struct{ ticket, lane, permit bool }
	out     admission // the outcome: set by refuse or leave, or by admitted at the chain's end
}

// degrade: a degrade switch of switches that matches req refuses (reason degraded) with the
// switch's action, not the downstream's fallback, and Retry-After the time until the switch
// expires when that is within maxDegradeRetryAfter. (Step 1, unknown downstream, is the caller's.)
func (a *admitting) degrade(switches []degrade.Switch, req degrade.RequestView) bool {
	if len(switches) == 0 {
		return true
	}
	sw := degrade.Select(switches, a.ds.Name, req, a.start)
	if sw == nil {
		return true
	}
	var retry time.Duration
	if left := sw.ExpiresAt.Sub(a.start); left <= maxDegradeRetryAfter {
		retry = left
	}
	a.refuse(fallback.Degraded, metrics.ReasonDegraded, retry, a.start)
	a.out.action = &sw.Action
	return false
}

// openBreaker: an open breaker refuses (circuit-open, Retry-After the time left until it admits
// probes) before a rate token or a permit is taken. A closed or half-open one is asked for the
// call's ticket only once the permit is held (ticket), because a ticket cannot be handed back
// unused: a half-open probe slot must go to a call that is really forwarded. One that turned
// half-open between the two looks gives this call a probe ticket here, which giveBack cancels,
// unused and uncounted, if the call is not forwarded after all: the breaker then neither closes on
// a probe that never reached the downstream nor reopens because of our own rate or permit limits.
func (a *admitting) openBreaker() bool {
	a.br = a.ds.Breaker()
	if a.br == nil || a.br.State(a.start) != breaker.Open {
		return true
	}
	tk, retry, ok := a.br.Allow(a.start)
	if !ok {
		return a.refuse(fallback.CircuitOpen, metrics.ReasonCircuitOpen, retry, a.start)
	}
	a.tk, a.held.ticket = tk, true // it became half-open in between: this call is a probe
	return true
}

// rate: no rate token within the wait allowed refuses (rate-limited, Retry-After when the
// limiter's next token accrues: the earliest a retry can pass it); a token within it is waited
// for on the clock.
func (a *admitting) rate() bool {
	lim := a.ds.Limiter()
	if lim == nil {
		return true
	}
	wait, ok := lim.Reserve(a.start, a.maxWait)
	if !ok {
		return a.refuse(fallback.RateLimited, metrics.ReasonRateLimited, wait, a.start)
	}
	if wait > 0 && !sleep(a.ctx, a.clk, wait) {
		return a.leave(appLeft)
	}
	return true
}

// lanePermit puts the recovery limit (a ramp, an adaptive limit: it changes when a window ends)
// in force on both semaphores first; then, on a downstream with lanes, it takes the call's lane
// permit, before the downstream's: none within what is left of the wait allowed, or at once when
// the effective limit is 0, refuses (no-permit; see wait).
func (a *admitting) lanePermit() bool {
	a.ds.Tick()
	if a.lanes == nil {
		return true
	}
	sem, lane := a.lanes.Sem, a.lane
	if !sem.TryAcquire(lane) && !a.wait(func(ctx context.Context) error { return sem.Acquire(ctx, lane) }) {
		return false
	}
	a.held.lane = true
	return true
}

// permit takes the downstream's permit: no permit within what is left of the wait allowed, or
// at once when the effective limit is 0, refuses (no-permit), and one that would wait while
// MaxWaiting calls already wait refuses at once (queue-full); see wait.
func (a *admitting) permit() bool {
	if !a.ds.Sem.TryAcquire() && !a.wait(a.ds.Sem.Acquire) {
		return false
	}
	a.held.permit = true
	return true
}

// wait is the lane's and the downstream's wait for a permit that was not free at once: acquire
// (the semaphore's Acquire) for what is left of the wait allowed, timed on the clock. It refuses
// (no-permit) at once when the effective limit is 0 or nothing is left of the wait, and when the
// wait ends without a permit; queue-full when acquire says so (semaphore.ErrQueueFull: the lanes
// never do); appLeft when the app left meanwhile. True: the permit is held.
func (a *admitting) wait(acquire func(context.Context) error) bool {
	remaining := a.maxWait - a.clk.Since(a.start)
	if a.ds.Effective() == 0 || remaining <= 0 {
		return a.refuse(fallback.NoPermit, metrics.ReasonNoPermit, 0, a.clk.Now())
	}
	wctx, cancel := context.WithCancel(a.ctx)
	timer := a.clk.AfterFunc(remaining, cancel)
	err := acquire(wctx)
	timer.Stop()
	cancel()
	switch {
	case err == nil:
		return true
	case errors.Is(err, semaphore.ErrQueueFull):
		return a.refuse(fallback.QueueFull, metrics.ReasonQueueFull, 0, a.clk.Now())
	case a.ctx.Err() != nil:
		return a.leave(appLeft)
	}
	return a.refuse(fallback.NoPermit, metrics.ReasonNoPermit, 0, a.clk.Now())
}

// ticket asks a closed or half-open breaker for the call's ticket, with the permit held (see
// openBreaker); a half-open one whose probe slots are all taken refuses (circuit-open, no
// Retry-After) and the permits are given back.
func (a *admitting) ticket() bool {
	if a.br == nil || a.held.ticket {
		return true
	}
	now := a.clk.Now()
	tk, retry, ok := a.br.Allow(now)
	if !ok {
		return a.refuse(fallback.CircuitOpen, metrics.ReasonCircuitOpen, retry, now)
	}
	a.tk, a.held.ticket = tk, true
	return true
}

// admitted ends the chain of a call that passed every step: the time admitting took is observed,
// and the call is admitted (out), holding what it took, unless it stalled. Admission takes at most the
// acquire timeout (plus a rate wait within it). Far longer (2×AcquireTimeout+stallSlack) means
// this process was frozen or starved between the call's arrival and now: its lease may have
// passed meanwhile and the manager may have handed the permit to another pod, so the call is not
// sent late (stalled) and what it took is given back unused.
func (a *admitting) admitted() {
	waited := a.clk.Since(a.start)
	a.ds.Metrics.AcquireWait.Observe(waited.Seconds())
	if waited > 2*a.cfg.AcquireTimeout+stallSlack {
		a.leave(stalled)
		return
	}
	a.out.verdict, a.out.ticket = admitted, a.tk
	if a.held.lane {
		a.out.lanes, a.out.lane = a.lanes, a.lane
	}
}

// refuse ends the chain with a refusal for reason (counted under metric, for the downstream and
// the call's lane) answered by the downstream's fallback, after giving back what the call holds.
// It returns false, the step's verdict.
func (a *admitting) refuse(reason fallback.Reason, metric int, retryAfter time.Duration, at time.Time) bool {
	a.giveBack()
	a.ds.CountRejected(metric)
	if a.lanes != nil {
		a.lanes.CountRejected(a.lane, metric)
	}
	a.out = admission{verdict: refused, reason: reason, action: &a.cfg.Fallback, retryAfter: retryAfter, at: at}
	return false
}

// leave ends the chain with v (appLeft or stalled: nobody is answered by admission), after giving
// back what the call holds. It returns false, the step's verdict.
func (a *admitting) leave(v verdict) bool {
	a.giveBack()
	a.out = admission{verdict: v}
	return false
}

// giveBack returns what the call holds: the downstream's permit first, then the lane's (the lanes
// never grant beyond what the downstream semaphore admits, see enforce.LaneSet), then the
// breaker's ticket is cancelled, unused and uncounted.
func (a *admitting) giveBack() {
	if a.held.permit {
		a.ds.Sem.Release()
	}
	if a.held.lane {
		a.lanes.Sem.Release(a.lane)
	}
	if a.held.ticket {
		a.tk.Cancel()
	}
	a.held.permit, a.held.lane, a.held.ticket = false, false, false
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
