// Package fallback decides and renders what the agent answers when it cannot
// or must not call a downstream, and keeps the bounded cache of responses
// that ServeStale answers from.
//
// # Model
//
// Something stopped a call (the Reason: no permit, no rate token, an open
// breaker, a degrade switch, a full waiters' queue). The downstream's Config names the Action to
// take. Decide turns the two, plus the request's method and the cached
// response for it, into a Decision; Render turns a Decision into a
// Response; Write sends it. Decide and Render are pure.
//
// # Outcomes
//
//   - Reject: 503 with an RFC 9457 application/problem+json body naming the
//     reason (stable "type" URI and "code", see Problem), the downstream and
//     the reason. Retry-After is sent only when a retry time is known
//     (Input.RetryAfter > 0, e.g. the breaker's remaining open time), rounded
//     up to whole seconds.
//   - Static: the configured status (0 means 200), headers and body.
//   - ServeStale: the cached response, with Age (whole seconds since it was
//     stored, rounded down) replacing any Age it had.
//
// Every answer carries X-Apportion-Fallback (reject, static, serve-stale)
// and X-Apportion-Reason (the Reason), so clients and logs can tell a
// fallback from a real downstream answer.
//
// # Safety rules: when a configured Static or ServeStale becomes Reject
//
// A fallback must not pretend that a write happened. Static (with a success
// status, below 400) and ServeStale answer only methods in
// Config.AllowedMethods, which defaults to GET, HEAD and OPTIONS. That is
// deliberately narrower than RFC 9110's idempotent methods: PUT and DELETE
// are idempotent, but a fake 2xx for them would tell the client a write took
// place that never did; an operator who wants that must list them. Methods
// are case-sensitive (RFC 9110 §9.1). A Static with an error status (>= 400)
// claims nothing and answers every method.
//
// ServeStale further needs a GET (the cache holds GET responses only) and a
// cached entry younger than MaxStaleness (MaxStaleness <= 0 serves
// nothing). Otherwise the Decision is Reject, and Decision.Downgraded says
// why (for logs and metrics).
package fallback

import (
	"net/http"
	"slices"
	"time"
)

// Action is what to answer instead of calling the downstream.
type Action string

const (
	Reject     Action = "Reject"
	Static     Action = "Static"
	ServeStale Action = "ServeStale"
)

// Reason is why the downstream was not called. The values are stable: they
// appear in problem bodies, headers and metrics.
type Reason string

const (
	NoPermit    Reason = "no-permit"    // in-flight limit reached (semaphore)
	RateLimited Reason = "rate-limited" // no rate token within the wait allowed
	CircuitOpen Reason = "circuit-open" // breaker open, or half-open with no probe slot
	Degraded    Reason = "degraded"     // a degrade switch applies
	QueueFull   Reason = "queue-full"   // as many calls already wait for a permit as may
)

// Downgrade says why a configured Static or ServeStale was replaced by
// Reject.
type Downgrade string

const (
	MethodNotAllowed Downgrade = "method-not-allowed" // not in AllowedMethods
	StaleNeedsGET    Downgrade = "stale-needs-get"    // ServeStale on another method
	NoStaleEntry     Downgrade = "no-stale-entry"     // nothing cached for the request
	StaleTooOld      Downgrade = "stale-too-old"      // cached entry not younger than MaxStaleness
	UnknownAction    Downgrade = "unknown-action"     // Config.Action is not an Action
)

// Response is an HTTP response: a Static answer, a cached one, or a
// rendered Decision.
type Response struct {
	Status int // 0 means 200 in Static and cached responses
	Header http.Header
	Body   []byte
}

// Config is a downstream's (or a degrade switch's) fallback.
type Config struct {
	// Action is what to answer; "" means Reject.
	Action Action
	// Static is the Static answer. Hop-by-hop headers and Content-Length
	// in it are ignored (Content-Length is computed).
	Static Response
	// MaxStaleness is the age below which ServeStale serves a cached
	// response; <= 0 serves none.
	MaxStaleness time.Duration
	// AllowedMethods may be answered with success by Static and
	// ServeStale; empty means DefaultAllowedMethods.
	AllowedMethods []string
}

// DefaultAllowedMethods returns the methods a success fallback may answer
// when Config.AllowedMethods is empty: GET, HEAD, OPTIONS.
func DefaultAllowedMethods() []string {
	return []string{http.MethodGet, http.MethodHead, http.MethodOptions}
}

// allows reports whether method may get a success fallback under cfg.
func (c *Config) allows(method string) bool {
	if len(c.AllowedMethods) == 0 {
		switch method {
		case http.MethodGet, http.MethodHead, http.MethodOptions:
			return true
		}
		return false
	}
	return slices.Contains(c.AllowedMethods, method)
}

// Input is one stopped call.
type Input struct {
	Downstream string
	Reason     Reason
	Method     string
	// RetryAfter is when calling again may succeed, if known (e.g. the
	// breaker's retryAfter); 0 means unknown and sends no Retry-After.
	RetryAfter time.Duration
	// Stale is the cached response for this request (Cache.Get with Key),
	// or nil. Only ServeStale looks at it.
	Stale *Entry
	// Now is used for the stale entry's age.
	Now time.Time
}

// Decision is what to answer. Action is always Reject, Static or
// ServeStale; the fields for other actions are zero.
type Decision struct {
	Action     Action
	Reason     Reason
	Downstream string
	// Downgraded is why the configured action became Reject; "" if it
	// did not.
	Downgraded Downgrade

	RetryAfter time.Duration // Reject: as Input.RetryAfter
	Static     Response      // Static: Config.Static
	Stale      *Entry        // ServeStale: the entry to serve
	Age        time.Duration // ServeStale: how long ago it was stored (>= 0)
}

// Decide chooses the answer for in under cfg. It is pure.
func Decide(cfg Config, in Input) Decision {
	d := Decision{Reason: in.Reason, Downstream: in.Downstream}
	reject := func(why Downgrade) Decision {
		d.Action, d.Downgraded, d.RetryAfter = Reject, why, in.RetryAfter
		return d
	}
	switch cfg.Action {
	case Reject, "":
		return reject("")

	case Static:
		if statusOr200(cfg.Static.Status) < 400 && !cfg.allows(in.Method) {
			return reject(MethodNotAllowed)
		}
		d.Action, d.Static = Static, cfg.Static
		return d

	case ServeStale:
		switch {
		case !cfg.allows(in.Method):
			return reject(MethodNotAllowed)
		case in.Method != http.MethodGet:
			return reject(StaleNeedsGET)
		case in.Stale == nil:
			return reject(NoStaleEntry)
		}
		age := max(in.Now.Sub(in.Stale.StoredAt), 0) // stored "in the future": clock skew, treat as fresh
		if age >= cfg.MaxStaleness {
			return reject(StaleTooOld)
		}
		d.Action, d.Stale, d.Age = ServeStale, in.Stale, age
		return d

	default:
		return reject(UnknownAction)
	}
}

func statusOr200(s int) int {
	if s == 0 {
		return http.StatusOK
	}
	return s
}
