// Package ratelimit limits the rate of calls the agent makes to one
// downstream.
//
// # Model
//
// A Limiter is a token bucket (golang.org/x/time/rate underneath) in one of
// two modes:
//
//   - TokenBucket: tokens accrue at PerSecond up to Burst; a call takes one.
//     After an idle period up to Burst calls go at once, then calls are
//     spaced 1/PerSecond apart.
//   - Pacing: the same bucket with Burst forced to 1, so calls are evenly
//     spaced at least 1/PerSecond apart and never bunch up, whatever Burst
//     says.
//
// A bucket of one token is the smallest that admits a call, so Burst 0 in
// TokenBucket mode is a bucket of one: the pod is paced exactly as in Pacing
// mode. The manager sends Burst 0 when the pods outnumber the contract's
// burst (internal/apportion.SplitRate): such a pod has no share of the burst,
// and is paced rather than refused.
//
// A call reserves its token in advance: Reserve tells the caller how long to
// wait before proceeding, and the reservation counts from that moment, so
// concurrent callers are queued one interval apart rather than stampeding
// when a token appears.
//
// Time is always passed in (now), so the behaviour is a function of the
// calls and their times; no method reads the clock or sleeps. A now earlier
// than one already seen is treated as the latest time seen, so a clock step
// backwards cannot mint tokens.
//
// # Outcomes of Reserve(now, maxWait)
//
//   - (0, true): a token is available now; proceed.
//   - (w, true), w > 0: a token was reserved for now+w; sleep w, then
//     proceed. w <= maxWait.
//   - (w, false): no token within maxWait; nothing was consumed and the
//     limiter is unchanged. w > maxWait is when the next token accrues if
//     nobody else takes it: what an honest Retry-After says. The caller
//     answers with its fallback.
//
// An unlimited Limiter (PerSecond <= 0, NaN or +Inf) always answers (0, true).
//
// # Why x/time/rate, and what is added around it
//
// x/time/rate is used for the bucket arithmetic. Three things are added: the
// maxWait check must not consume a token when it fails, so the wait is
// computed from TokensAt first (with the same formula rate uses) and a
// reservation is made only when it fits — under this package's mutex, so
// the check and the reservation are one step; unlimited is handled here
// (no bucket at all) rather than with rate.Inf, so switching between
// unlimited and limited has simple, documented semantics; and the mode and
// burst normalisation. Reserve does not allocate (rate.ReserveN's
// *Reservation is inlined and stays on the stack); a test guards this.
package ratelimit

import (
	"fmt"
	"math"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// Mode selects how tokens may be spent.
type Mode string

const (
	// TokenBucket allows bursts of up to Config.Burst calls.
	TokenBucket Mode = "TokenBucket"
	// Pacing spaces calls evenly, at most one per 1/PerSecond; Burst is
	// ignored.
	Pacing Mode = "Pacing"
)

// Config is a rate limit.
type Config struct {
	// PerSecond is the steady rate. <= 0 (and NaN, +Inf) means unlimited.
	PerSecond float64
	// Burst is the bucket size in TokenBucket mode; 0 (no share of a burst)
	// is a bucket of one token, which paces exactly as Pacing mode does.
	// Ignored in Pacing mode. Negative values are treated as 0; Validate
	// reports them.
	Burst int
	// Mode is TokenBucket or Pacing. The empty Mode, and any unknown one,
	// behave as TokenBucket; Validate reports unknown modes.
	Mode Mode
}

// Validate reports configuration that New and Set would silently
// normalise: an unknown Mode, a negative Burst, or a NaN rate.
func (c Config) Validate() error {
	switch {
	case c.Mode != "" && c.Mode != TokenBucket && c.Mode != Pacing:
		return fmt.Errorf("ratelimit: unknown mode %q", c.Mode)
	case math.IsNaN(c.PerSecond):
		return fmt.Errorf("ratelimit: perSecond is NaN")
	case c.Burst < 0:
		return fmt.Errorf("ratelimit: burst %d < 0", c.Burst)
	}
	return nil
}

// params is a Config reduced to what the bucket needs.
type params struct {
	unlimited bool
	limit     rate.Limit
	burst     int
}

func (c Config) params() params {
	if !(c.PerSecond > 0) || math.IsInf(c.PerSecond, 1) { // !(>0) also catches NaN
		return params{unlimited: true}
	}
	burst := c.Burst
	if c.Mode == Pacing || burst < 1 {
		burst = 1 // Pacing, and Burst 0: a bucket of one token
	}
	return params{limit: rate.Limit(c.PerSecond), burst: burst}
}

// Limiter is one downstream's rate limit. It is safe for concurrent use.
type Limiter struct {
	mu   sync.Mutex
	cfg  Config
	p    params
	lim  *rate.Limiter // nil when unlimited
	last time.Time     // latest now seen; earlier times are clamped to it
}

// New returns a Limiter for cfg whose bucket is full at now.
func New(cfg Config, now time.Time) *Limiter {
	l := &Limiter{cfg: cfg, p: cfg.params(), last: now}
	l.lim = newBucket(l.p, now)
	return l
}

// newBucket returns a full bucket for p at now, or nil if p is unlimited.
func newBucket(p params, now time.Time) *rate.Limiter {
	if p.unlimited {
		return nil
	}
	lim := rate.NewLimiter(p.limit, p.burst)
	// Anchor the bucket's clock at now; it is full (a bucket created at
	// the zero time has had "forever" to fill).
	lim.SetBurstAt(now, p.burst)
	return lim
}

// Config returns the configuration in force, as given to New or Set.
func (l *Limiter) Config() Config {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cfg
}

// Set changes the configuration at now, keeping what is still meaningful:
//
//   - limited to limited (rate, burst or mode change): the tokens in the
//     bucket and any debt from reservations already handed out are kept;
//     from now on they accrue at the new rate and are capped at the new
//     burst (so switching to Pacing, or lowering Burst, removes the ability
//     to burst at once; raising Burst does not grant tokens, they accrue).
//   - to unlimited: the bucket is dropped.
//   - unlimited to limited: a new, full bucket.
//   - an unchanged configuration is a no-op.
func (l *Limiter) Set(cfg Config, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now = l.clamp(now)
	l.cfg = cfg
	p := cfg.params()
	if p == l.p {
		return
	}
	switch {
	case p.unlimited:
		l.lim = nil
	case l.lim == nil:
		l.lim = newBucket(p, now)
	default:
		l.lim.SetLimitAt(now, p.limit)
		l.lim.SetBurstAt(now, p.burst)
	}
	l.p = p
}

// Reserve asks for one call at now, waiting at most maxWait (negative means
// 0). See the package documentation for the outcomes.
func (l *Limiter) Reserve(now time.Time, maxWait time.Duration) (wait time.Duration, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.lim == nil {
		return 0, true
	}
	now = l.clamp(now)
	maxWait = max(maxWait, 0)

	tokens := l.lim.TokensAt(now)
	if tokens >= 1 {
		return 0, l.lim.AllowN(now, 1) // always true here; allocation-free
	}
	// The wait rate itself would compute for this reservation: it takes
	// the token, leaving tokens-1, and waits for -(tokens-1) == 1-tokens
	// (negation is exact in IEEE 754) to accrue.
	if need := durationFromTokens(1-tokens, l.p.limit); need > maxWait {
		return need, false // nothing reserved, nothing consumed
	}
	// We hold l.mu, so nothing happened to the bucket since TokensAt: the
	// reservation's delay is exactly need.
	return l.lim.ReserveN(now, 1).DelayFrom(now), true
}

// durationFromTokens mirrors rate.Limit.durationFromTokens (unexported).
func durationFromTokens(tokens float64, limit rate.Limit) time.Duration {
	d := tokens / float64(limit) * float64(time.Second)
	if d > math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(d)
}

// clamp returns now, or the latest time seen if now is earlier, and records
// it. A backwards step would otherwise credit the bucket twice for the same
// interval.
func (l *Limiter) clamp(now time.Time) time.Time {
	if now.Before(l.last) {
		return l.last
	}
	l.last = now
	return now
}
