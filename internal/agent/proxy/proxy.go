// Package proxy is the agent's data plane: the HTTP handler of the local listener (default
// 127.0.0.1:15001) between the app and its downstreams.
//
// Addressing: the app calls http://127.0.0.1:PORT/<downstream>/<path>?<query>; the call is
// forwarded to the downstream's Upstream with /<path> appended to the upstream's path and the
// query appended to the upstream's query. Request and response bodies are streamed (a chunked
// response is flushed as it arrives); hop-by-hop headers (Connection and the headers it names,
// Keep-Alive, Proxy-*, TE, Trailer, Transfer-Encoding, Upgrade) are removed, the app's address
// is appended to X-Forwarded-For (other forwarding headers the app sent pass unchanged), and the
// Host header is the upstream's.
//
// Every call, in this order:
//
//  1. Unknown downstream: 404 application/problem+json, code APPORTION_UNKNOWN_DOWNSTREAM. A
//     malformed deadline header (X-Apportion-Timeout, grpc-timeout: package deadline) is 400; a
//     valid one starts the call's budget, which bounds every wait below and the upstream call.
//  2. A degrade switch matches: its action answers (reason degraded; Retry-After the time until
//     the switch expires, when that is within maxDegradeRetryAfter).
//  3. The circuit breaker is open: the fallback answers (reason circuit-open, Retry-After =
//     the time left until it admits probes), before a rate token or a permit is taken.
//  4. No rate token within the wait allowed (AcquireTimeout, or what is left of the app's budget
//     when less): the fallback answers (reason rate-limited, Retry-After when the limiter's next
//     token accrues).
//  5. No permit within what is left of the wait allowed (at once when the effective limit is 0):
//     the fallback answers (reason no-permit); a call that would wait while MaxWaiting calls
//     already wait is answered at once (reason queue-full). The effective limit is the permits
//     narrowed by the recovery ramp and the adaptive limit (package recovery), put in force
//     before the permit is asked for. Calls never queue at the downstream.
//  6. A closed or half-open breaker is asked for the call's ticket only now, with the permit
//     held, because a ticket cannot be handed back unused: a half-open probe slot must go to a
//     call that is really forwarded. A half-open breaker whose probe slots are all taken
//     refuses: the permit is released and the fallback answers (reason circuit-open, no
//     Retry-After).
//  7. Forwarded, with the earlier of RequestTimeout and the app's budget as its deadline (a budget
//     spent while waiting: 504 APPORTION_DEADLINE_EXCEEDED, not forwarded), what is left told to
//     the upstream in DeadlineHeader (and grpc-timeout rewritten), holding the permit until the
//     response body has been copied. The upstream's answer is passed through as is, 429 and its
//     Retry-After included. Nothing is ever retried, not even by the HTTP transport (a call is
//     sent once).
//     - No response: 504 problem+json (code APPORTION_UPSTREAM_TIMEOUT) when RequestTimeout
//     passed, 502 (code APPORTION_UPSTREAM_UNAVAILABLE) for any other error (refused, reset,
//     closed), 502 (APPORTION_UPSTREAM_BAD_RESPONSE) for an answer that is not HTTP/1.1 (a
//     head over maxResponseHeaderBytes, malformed, a 101 nobody asked for).
//     - The app's fault: a malformed or cut request body is 400 (APPORTION_BAD_REQUEST), one
//     still incomplete at RequestTimeout 408 (APPORTION_REQUEST_TIMEOUT); the connection
//     closes and the breaker does not count the call. Reading the app's body and writing its
//     answer are bounded by the call's deadline (see call.appDeadlines).
//     - The upstream fails after its header was passed on: the answer to the app is cut
//     (the connection is aborted), the only honest signal left.
//  8. The permit is released — for a call abandoned at its deadline only AbandonedHold after its
//     upstream connection was closed (see call.release) — and the breaker and the recovery
//     windows record the outcome: a failure is a 5xx, a 429,
//     no response (a timeout, a connection error, or the app giving up first: from its side
//     the call failed) or a body that broke on the upstream's side; a slow call is one at or
//     above the breaker's threshold, measured to the response header on the Enforcer's clock
//     (k8s.io/utils/clock: a fake one in tests can make a call slow).
//
// Steps 2 to 6 are admit (admission.go), a function of the downstream's state and the clock
// that is tested without HTTP: a chain of small steps over one call's state, each of which passes
// the call on or refuses it (degrade, open breaker, rate, lane permit, permit, ticket), with one
// wait shared by the lane's and the downstream's permits.
//
// Observe (the downstream's Config.Observe): steps 2 to 6 only look, never wait nor refuse
// (admitting.observe); every call is forwarded holding a permit, beyond the limit when none is
// free, and the first step that would have refused it is counted (would_refuse_total). A dry-run
// degrade switch is counted the same way under Enforce, and the chain goes on as if it were off.
//
// Every answer that is not the upstream's carries X-Apportion-Fallback and X-Apportion-Reason
// (fallbacks) or is a problem+json with a stable code (404, 502, 504). Nothing is logged per
// call at info level.
//
// Fallback answers are chosen by package fallback: Reject is 503 problem+json naming the
// downstream and the reason (with Retry-After only when known), Static is the configured answer
// and ServeStale the last GET 2xx response for the same URL younger than MaxStaleness, with Age
// and X-Apportion-Fallback headers. A method that is not allowed (by default all but GET,
// HEAD and OPTIONS) never gets a canned success: it is rejected. GET 2xx responses of a
// downstream whose fallback or a switch is ServeStale are copied, while streamed to the app,
// into the stale cache, which is bounded in bytes.
//
// Serving and forwarding: the agent serves Handler with the HTTP/1.1 engine's server
// (h1.Server, with Refusal for the requests it refuses itself; Handler stays an http.Handler
// that works under net/http's server too), and sends calls to http and https upstreams with the
// engine's client (h1.Client, forward.go; https over crypto/tls with the downstream's
// upstreamtls.Upstream: its CA, server name, client certificate, rotation and session cache).
// Protocol upgrades, Expect: 100-continue and a Transport given in Options go through
// httputil.ReverseProxy and http.Transport (for https, one http.Transport per Upstream dialling
// through it: the same verification).
//
// TLS failures (upstreamtls.Classify) are answered with a code of their own (502, or 504 for a
// handshake timeout: APPORTION_UPSTREAM_TLS_*, answer.go) and counted in
// upstream_tls_failures_total{reason}. All but the handshake timeout are misconfigurations (of
// the agent's material or the downstream's certificates) that the breaker and the recovery
// windows do not judge. A call that never reached the downstream (no connection, no completed
// handshake, or material that cannot be used: nothing sent) gives its permit back at once, never
// held for AbandonedHold. Both ways share the admission (admission.go), the call's state, the answers on
// failure and the recording; the engine's client drops informational (1xx) answers, which the
// ReverseProxy passes on. This package holds the policy; the engine knows nothing of it.
//
// HTTP/2 (h2.go): the server hands h2c connections to net/http's HTTP/2 server, which serves
// Handler one stream at a time; each stream is a call as above, with its own permit held until
// it ended, forwarded over HTTP/2 (the caller's protocol) by forwardH2 over one HTTP/2
// transport per downstream. A gRPC caller's refusals are gRPC statuses, not problem+json.
package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"

	"github.com/apportion/apportion/internal/agent/breaker"
	"github.com/apportion/apportion/internal/agent/deadline"
	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/agent/upstreamtls"
	"github.com/apportion/apportion/internal/h1"
)

// Options configure a Handler.
type Options struct {
	Enforcer *enforce.Enforcer
	// Transport sends calls upstream; nil means the lean HTTP/1.1 client (http and https) and
	// NewTransport() for the rest (upgrades, Expect: 100-continue; for https one per
	// downstream's upstreamtls.Upstream). A Transport given here sends every call.
	Transport http.RoundTripper
	// StaleCacheBytes bounds the stale cache; 0 disables ServeStale's cache (it then rejects).
	StaleCacheBytes int64
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// UpstreamTLS, if set, replaces the downstream's own TLS settings (enforce.Config.TLS, from
	// spec.upstreamTLS) for a new HTTP/2 connection to its https upstream (h2.go: asked at every
	// connection, so that a rotated one applies to the next; ALPN is set by the caller, h2
	// only); a nil configuration means crypto/tls's defaults (the system's roots, the upstream
	// URL's host as the server name). nil (as the agent runs): the downstream's own settings, or
	// those defaults for a downstream without them. http upstreams are h2c and never ask.
	UpstreamTLS func(cfg *enforce.Config) (*tls.Config, error)
}

// Handler is the data plane handler.
type Handler struct {
	enf   *enforce.Enforcer
	clock clock.WithDelayedExecution // the Enforcer's: admission, the calls' durations, the stale cache's ages
	rp    *httputil.ReverseProxy
	up    *h1.Client // the lean client; nil when Options.Transport sends every call
	// h2up are the downstreams' HTTP/2 transports, over which forwardH2 sends the calls that
	// came over HTTP/2 (h2.go); nil when Options.Transport sends every call.
	h2up        *h2Upstreams
	upstreamTLS func(cfg *enforce.Config) (*tls.Config, error)
	stale       *fallback.Cache // nil: nothing is cached
	// maxEntry bounds one cached response body: an eighth of the cache, at most 1 MiB.
	maxEntry int64
	log      *slog.Logger
	// tlsTransports are the http.Transports of the https downstreams' calls the lean client
	// does not send (upgrades, Expect: 100-continue), one per *upstreamtls.Upstream
	// (upstreamTransport).
	tlsTransports sync.Map
}

// NewTransport returns the shared upstream transport: keep-alive pools large enough for the
// permits, no environment proxy, no transparent compression (bodies pass through unchanged).
func NewTransport() *http.Transport {
	return &http.Transport{
		Proxy: nil,
		DialContext: (&net.Dialer{
			Timeout:   10 * time.Second,
			KeepAlive: 30 * time.Second,
		}).DialContext,
		ForceAttemptHTTP2:      true,
		MaxIdleConns:           0, // no global cap; per host below
		MaxIdleConnsPerHost:    1024,
		IdleConnTimeout:        90 * time.Second,
		TLSHandshakeTimeout:    10 * time.Second,
		ExpectContinueTimeout:  time.Second,
		DisableCompression:     true,
		WriteBufferSize:        16 << 10,
		ReadBufferSize:         16 << 10,
		MaxResponseHeaderBytes: h1.MaxResponseHeaderBytes, // as the lean client's
	}
}

// New returns the data plane handler.
func New(o Options) *Handler {
	var up *h1.Client
	h := &Handler{enf: o.Enforcer, clock: o.Enforcer.Clock()}
	if o.Transport == nil {
		o.Transport = &upstreamTransport{h: h, plain: NewTransport()}
		up = h1.NewClient()
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	h.log, h.up, h.upstreamTLS = o.Logger, up, o.UpstreamTLS
	if o.StaleCacheBytes > 0 {
		h.stale = fallback.NewCache(o.StaleCacheBytes)
		h.maxEntry = min(o.StaleCacheBytes/8, 1<<20)
	}
	h.rp = &httputil.ReverseProxy{
		Rewrite:        h.rewrite,
		Transport:      o.Transport,
		ModifyResponse: h.modifyResponse,
		ErrorHandler:   h.errorHandler,
		ErrorLog:       slog.NewLogLogger(o.Logger.Handler(), slog.LevelDebug),
		BufferPool:     bufferPool,
	}
	if up != nil {
		h.h2up = &h2Upstreams{h: h}
	}
	return h
}

// CloseIdleConnections closes the idle upstream connections (of both clients).
func (h *Handler) CloseIdleConnections() {
	if h.up != nil {
		h.up.CloseIdleConnections()
	}
	if ci, ok := h.rp.Transport.(interface{ CloseIdleConnections() }); ok {
		ci.CloseIdleConnections()
	}
	if h.h2up != nil {
		h.h2up.CloseIdleConnections()
	}
	h.tlsTransports.Range(func(_, v any) bool {
		v.(*http.Transport).CloseIdleConnections()
		return true
	})
}

type callKey struct{}

// call is one forwarded call's state, shared by ServeHTTP and the ReverseProxy hooks.
type call struct {
	h      *Handler
	ds     *enforce.Downstream
	cfg    *enforce.Config
	rest   string // escaped path after /<downstream>, "" or starting with "/"
	appCtx context.Context
	// deadline is now + RequestTimeout at admission, on the wall clock (ioDeadline); ctx is
	// appCtx without its cancellation
	// and with that deadline, for the ReverseProxy path only (the lean client puts the
	// deadline on its connection: no timer per call).
	deadline time.Time
	// byApp: the deadline is the app's (its budget ended before requestTimeout would have).
	byApp bool
	ctx   context.Context

	// sent is when the request was sent and took how long the answer's head took to come, both
	// on the injected clock: took is what the breaker judges slow.
	sent    time.Time
	took    time.Duration
	status  int
	err     error // no response
	body    io.ReadCloser
	bodyErr error // the upstream body failed
	tee     *staleTee
	key     string // stale cache key; "" when the response is not to be cached

	// The app's request body as the upstream client reads it (see appBody); appFault: the call
	// failed because of the app (its body malformed, cut or late), which the breaker does not
	// count against the downstream.
	ab       appBody
	appFault bool
	// tls is what failed in the connection's TLS (upstreamtls.Classify), if that is why the
	// call got no response.
	tls upstreamtls.Reason
	// dl sets the app connection's deadlines (nil: the server cannot).
	dl deadliner
	// h2: the call came over HTTP/2 (one stream of a connection); res: the upstream's
	// response, kept for a gRPC caller only (its status is in the trailers, see h2.go).
	h2, grpc bool
	res      *http.Response
	// lazyDeadlines: the app's stream deadlines are set only if the call is still forwarding at
	// its deadline (forwardH2, deadlinesAtExpiry), not by appDeadlines; ended (under
	// expiryMu): the call's forwarding returned, the deadlines are not to be set.
	lazyDeadlines bool
	expiryMu      sync.Mutex
	ended         bool
}

// deadliner is the part of http.ResponseController's interface to a ResponseWriter that sets
// the connection's deadlines (net/http's server and Server both have it).
type deadliner interface {
	SetReadDeadline(time.Time) error
	SetWriteDeadline(time.Time) error
}

// appDeadlines sets the call's deadline on reading the app's request body and writing its
// answer, and wraps the body to learn how its reading ended; clearDeadlines removes the
// deadlines. Not for protocol upgrades: the connection becomes a tunnel that outlives the call's
// deadline by design.
func (c *call) appDeadlines(w http.ResponseWriter, r *http.Request) {
	if r.Body != nil && r.Body != http.NoBody {
		c.ab.rc = r.Body
		r.Body = &c.ab
	}
	dl, ok := w.(deadliner)
	if !ok {
		return
	}
	if _, upgrade := r.Header["Upgrade"]; upgrade {
		return
	}
	c.dl = dl
	if c.lazyDeadlines {
		return
	}
	if c.ab.rc != nil {
		_ = dl.SetReadDeadline(c.deadline)
	}
	_ = dl.SetWriteDeadline(c.deadline.Add(answerWriteGrace))
}

// ioDeadline is a call's deadline, RequestTimeout from now on the wall clock, not the injected
// one: it is the deadline of the call's sockets (the upstream connection's, and the app's
// through the server), which only the wall clock drives. The call's duration, which the breaker
// judges, is measured on the injected clock (call.sent, call.took).
func ioDeadline(requestTimeout time.Duration) time.Time { return time.Now().Add(requestTimeout) }

// pastDeadline reports whether the call's (wall-clock) deadline has passed: an error that is
// not a timeout but came at the deadline is one (see ioDeadline).
func (c *call) pastDeadline() bool { return !time.Now().Before(c.deadline) }

// past is a deadline already passed: set on a connection, it ends a read or write in progress.
var past = time.Unix(1, 0)

// answerWriteGrace is how long after the call's deadline the answer may still be written: the
// upstream side ends at the deadline, and its 504 (or the app's 408) is written just then.
const answerWriteGrace = time.Second

func (c *call) clearDeadlines() {
	if c.dl == nil || c.lazyDeadlines {
		return
	}
	if c.ab.rc != nil {
		_ = c.dl.SetReadDeadline(time.Time{})
	}
	_ = c.dl.SetWriteDeadline(time.Time{})
}

// abortBodyRead ends a read of the app's request body in progress (the call is over: its
// answer came or failed, and the app has not finished sending); the connection is then closed
// after the answer, as for any body not read to its end.
func (c *call) abortBodyRead() {
	if c.dl != nil && c.ab.rc != nil && !c.ab.eof.Load() {
		c.ab.cut.Store(true)
		_ = c.dl.SetReadDeadline(past)
	}
}

// appBody is the app's request body, read by the upstream client (the lean client's body
// writer or http.Transport's): it notes how reading it ended, so that a failed call can be told
// apart as the app's fault (a malformed or cut body, or one that stopped coming) rather than the
// downstream's.
type appBody struct {
	rc  io.ReadCloser
	eof atomic.Bool
	// reading: a Read is in progress; err: the first error but io.EOF (under mu, with cut:
	// errors after abortBodyRead are its doing, not the app's).
	reading atomic.Bool
	cut     atomic.Bool
	mu      sync.Mutex
	err     error
}

func (b *appBody) Read(p []byte) (int, error) {
	b.reading.Store(true)
	n, err := b.rc.Read(p)
	b.reading.Store(false)
	switch {
	case err == io.EOF:
		b.eof.Store(true)
	case err != nil && !b.cut.Load():
		b.mu.Lock()
		if b.err == nil {
			b.err = err
		}
		b.mu.Unlock()
	}
	return n, err
}

func (b *appBody) Close() error { return b.rc.Close() }

// appError is the app's share in a call that failed: a malformed or cut request body (400), or
// a body still incomplete when the call ran out of time (408); ok false: none, the failure is
// the downstream's. Call it once the body's reader has stopped.
func (c *call) appError(upstreamErr error) (status int, code, detail string, ok bool) {
	if c.ab.rc == nil {
		return 0, "", "", false
	}
	c.ab.mu.Lock()
	err := c.ab.err
	c.ab.mu.Unlock()
	if err != nil && !isTimeout(err) {
		return http.StatusBadRequest, CodeBadRequest, "the request body is malformed or was cut: " + appBodyError(err), true
	}
	if !c.ab.eof.Load() && (err != nil || c.ab.cut.Load() || c.ab.reading.Load()) &&
		(isTimeout(upstreamErr) || c.pastDeadline()) {
		return http.StatusRequestTimeout, CodeRequestTimeout,
			"the request body did not arrive within the downstream's requestTimeout of " + c.cfg.RequestTimeout.String(), true
	}
	return 0, "", "", false
}

// appBodyError describes a body read error without the connection's addresses.
func appBodyError(err error) string {
	var ne *net.OpError
	switch {
	case errors.Is(err, io.ErrUnexpectedEOF), errors.As(err, &ne):
		return "the connection ended before the body did"
	}
	return err.Error() // net/http's body readers: "malformed chunked encoding", ...
}

func isTimeout(err error) bool {
	return errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded)
}

// failApp answers a call that failed through the app's fault (see appError) and marks it so
// that the breaker does not count it; false: the failure is not the app's.
func (c *call) failApp(w http.ResponseWriter, upstreamErr error) bool {
	status, code, detail, ok := c.appError(upstreamErr)
	if !ok {
		return false
	}
	c.appFault = true
	c.err = upstreamErr
	if c.appCtx.Err() == nil {
		if !c.h2 {
			// The rest of the body cannot be told from a next request: the connection closes.
			// (An HTTP/2 stream's body is its own: the connection serves on.)
			w.Header().Set("Connection", "close")
		}
		writeProblem(w, status, code, http.StatusText(status), detail, c.cfg.Name)
	}
	return true
}

// refuseMethod answers CONNECT with 405: the agent forwards calls to its downstreams and is no
// forward proxy; a CONNECT forwarded upstream could turn a pooled connection into a tunnel that
// another app's call would be written into.
func refuseMethod(w http.ResponseWriter, r *http.Request) bool {
	if r.Method != http.MethodConnect {
		return false
	}
	h := w.Header()
	h.Set("Allow", "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS, TRACE")
	if r.ProtoMajor == 1 {
		h.Set("Connection", "close") // over HTTP/2, it would end every stream of the connection
	}
	writeProblem(w, http.StatusMethodNotAllowed, CodeMethodNotAllowed, "Method not allowed",
		"the agent forwards calls to its downstreams and does not tunnel: CONNECT is refused", "")
	return true
}

func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w = callerWriter(w, r) // a gRPC caller's answers are gRPC statuses (h2.go)
	if refuseMethod(w, r) {
		return
	}
	name, rest := splitPath(r.URL.EscapedPath())
	t := h.enf.Table()
	ds := t.Lookup(name)
	if ds == nil {
		name, rest, ds = byAuthority(w, r, t, name, rest) // a gRPC call may name it in :authority (h2.go)
	}
	if ds == nil && !h.enf.Ready() {
		// No assignment yet (or shutting down): the downstream may well exist, it is just not
		// ours to call yet. The app gets a fallback-shaped 503, not a misleading 404, and no
		// Retry-After: when the manager's first push comes is not known here.
		writeRefusal(w, http.StatusServiceUnavailable, CodeNotConfigured, "Agent not configured",
			"the agent has no assignment from the manager yet; no call is forwarded until it has one", name)
		return
	}
	if ds == nil {
		// Not (or no longer) a DownstreamQuota this pod belongs to: a deleted quota ends here
		// once its pods' calls drained. Answered like every other refusal.
		writeRefusal(w, http.StatusNotFound, CodeUnknownDownstream, "Unknown downstream",
			"no downstream called "+quote(name)+" is configured for this pod (no DownstreamQuota of that name lists its workload, or it was deleted); call http://127.0.0.1:PORT/<downstream>/<path>", name)
		return
	}
	// The app's own deadline, if it stated one (package deadline).
	var budget deadline.Budget
	if d, ok, err := deadline.Parse(r.Header); err != nil {
		writeProblem(w, http.StatusBadRequest, CodeBadRequest, "Bad request", err.Error(), name)
		return
	} else if ok {
		budget = deadline.New(h.clock.Now(), d, true)
	}
	// 2 to 6: admission.
	cfg := ds.Config()
	rv := requestView(r)
	rv.Path = rest
	ad := admit(r.Context(), h.clock, t, ds, cfg, rv, budget)
	switch ad.verdict {
	case refused:
		h.answerFallback(w, r, ds, ad.action, ad.reason, ad.retryAfter, ad.at)
		return
	case appLeft:
		return
	case stalled:
		// No Retry-After: nothing is known about when the agent runs normally again.
		writeProblem(w, http.StatusServiceUnavailable, CodeStalled, "Agent stalled",
			"the agent stalled after admitting the call; it was not forwarded", name)
		return
	}
	tk := ad.ticket

	// 7. Forward; 8, release and record, in the deferred function. The upstream gets what is left
	// of the app's budget, if that is less than requestTimeout. The budget is on the agent's clock;
	// the call's deadline is its sockets', on the wall clock (ioDeadline).
	now := h.clock.Now()
	dl, byApp := budget.Upstream(now, cfg.RequestTimeout)
	if byApp && !dl.After(now) {
		// The app's deadline passed while the call waited: nobody is waiting for its answer.
		ds.Sem.Release()
		ad.releaseLane()
		ad.endShadow(h.clock)
		tk.Cancel()
		ds.CountRejected(metrics.ReasonDeadline)
		writeProblem(w, http.StatusGatewayTimeout, CodeDeadlineExceeded, "Deadline exceeded",
			"the call's own deadline passed before it could be forwarded", name)
		return
	}
	c := &call{h: h, ds: ds, cfg: cfg, rest: rest, appCtx: r.Context(), deadline: ioDeadline(dl.Sub(now)), byApp: byApp}
	if r.ProtoMajor == 2 {
		_, c.grpc = w.(*grpcCaller)
		c.h2 = true
		c.lazyDeadlines = h.h2up != nil // forwardH2 sets them only if the call outlives them
	}
	if budget.Set() {
		passDeadline(r, dl.Sub(now))
	}
	if cfg.DeadlineHeader != "" {
		r.Header.Set(cfg.DeadlineHeader, deadline.Format(cfg.DeadlineHeader, dl.Sub(now)))
	}
	// The app's side is bounded by the call's deadline too: reading its request body and
	// writing the answer hold the permit, and an app that stops sending or reading must not
	// hold it past requestTimeout (see appDeadlines).
	c.appDeadlines(w, r)
	defer func() {
		c.clearDeadlines()
		c.release(ad.lanes, ad.lane)
		ad.endShadow(h.clock)
		c.finish(tk)
	}()
	if cfg.CacheStale && r.Method == http.MethodGet && h.stale != nil {
		c.key = fallback.Key(name, r.URL.RequestURI())
	}
	// Two ways out, sharing everything but the HTTP exchange itself (the call's state, the
	// answers on failure, the body wrapper, the outcome): the lean HTTP/1.1 client for http and
	// https upstreams, and httputil.ReverseProxy + http.Transport for what it does not do
	// (protocol upgrades, Expect: 100-continue, a Transport given in Options).
	//
	// The upstream call is not cancelled when the app gives up: the downstream would keep working
	// on it while the permit went to the next call, and its in-flight count would exceed ours.
	// The permit is held until the downstream answered or RequestTimeout passed.
	if cfg.TLS != nil {
		if err := cfg.TLS.Err(); err != nil {
			// The agent's TLS material cannot be used: nothing is sent (see upstreamtls).
			c.fail(w, &upstreamtls.HandshakeError{Err: err})
			return
		}
	}
	if c.h2 && h.h2up != nil {
		h.forwardH2(w, r, c) // HTTP/2 in, HTTP/2 out (h2.go)
		return
	}
	if h.up != nil && h1.CanSend(r, cfg.Upstream) && (cfg.TLS != nil || cfg.Upstream.Scheme == "http") {
		h.forwardLean(w, r, c) // the deadline is the connection's
		return
	}
	ctx, cancel := context.WithDeadline(context.WithoutCancel(r.Context()), c.deadline)
	defer cancel()
	c.ctx = ctx
	h.rp.ServeHTTP(w, r.WithContext(context.WithValue(ctx, callKey{}, c)))
}

// passDeadline rewrites the app's deadline headers for the upstream: X-Apportion-Timeout is the
// agent's and is not passed on; grpc-timeout, when the app sent one, says what is left (passing
// the app's own on would promise the upstream more time than there is).
func passDeadline(r *http.Request, left time.Duration) {
	delete(r.Header, deadline.Header)
	if _, ok := r.Header[deadline.GRPCHeader]; ok {
		r.Header.Set(deadline.GRPCHeader, deadline.FormatGRPC(left))
	}
}

// release gives the call's permit back, at once for a call that ended, or AbandonedHold after
// its upstream connection was closed for a call abandoned at its deadline (no answer, or a body
// cut by the deadline): the downstream may still be working on it, and a permit is a promise
// about the downstream's work, not about our wait. Until then the call stays in the in-flight
// count the agent reports, and the manager's ledger counts it. Both clients have closed the
// upstream connection of a timed-out call by the time this runs.
//
// lanes and lane are the call's lane permit (admission.lanes, .lane; lanes nil: none). Passed as
// they are rather than as a function: a function value made per call, and the closure over it,
// were two of a call's allocations.
func (c *call) release(lanes *enforce.LaneSet, lane int) {
	hold := c.cfg.AbandonedHold
	// A call that never reached the downstream (no connection, no TLS handshake: nothing was
	// sent) is not abandoned there, whatever timed out.
	abandoned := (isTimeout(c.err) && !neverSent(c.err)) || isTimeout(c.bodyErr)
	if hold <= 0 || !abandoned || c.appFault {
		c.free(lanes, lane)
		return
	}
	c.ds.CountAbandoned()
	left := holdLeft(hold, time.Since(c.deadline))
	if left <= 0 {
		c.free(lanes, lane)
		return
	}
	c.h.clock.AfterFunc(left, func() { c.free(lanes, lane) }) // the only closure: abandoned calls
}

// free returns the downstream's permit first, then the lane's: the lanes never grant beyond
// what the downstream semaphore admits (enforce.LaneSet).
func (c *call) free(lanes *enforce.LaneSet, lane int) {
	c.ds.Sem.Release()
	if lanes != nil {
		lanes.Sem.Release(lane)
	}
}

// holdLeft is how much of an abandoned call's hold is left when its permit is released late
// past its deadline. Normally the release comes at the deadline (the sockets' deadline ends the
// call), give or take the scheduler's jitter, and the whole hold is kept from then on: the
// conservative reading, and the one every test on an injected clock relies on. After a freeze
// (SIGSTOP, a paused VM: the release comes stallSlack or more past the deadline) the hold is
// counted from the deadline instead, when the call was to be abandoned: a call whose deadline
// and hold both passed while the process was frozen is released at once when it resumes. Held
// from the resume, it would keep a permit the manager has regranted after the lapsed lease plus
// the calls' bound (docs/protocol.md §12, frozen agents), and the pod's in-flight would stand
// above its fallback beside the others' new permits (TestFrozenAgentResumes). late is measured
// on the wall clock, as the deadline is (ioDeadline).
func holdLeft(hold, late time.Duration) time.Duration {
	if late < stallSlack {
		return hold
	}
	return hold - late
}

// finish records the outcome; it runs even when the answer to the app is aborted.
//
// The breaker's verdict: no response at all (timeout, connection error, or the app giving up
// first: from its side the call failed), a 5xx, a 429, or a response body that broke on the
// upstream's side are failures.
func (c *call) finish(tk breaker.Ticket) {
	if c.appFault {
		tk.Cancel() // the app's error says nothing about the downstream
		return
	}
	if c.tls.Misconfigured() {
		// Neither does a TLS misconfiguration (of the agent's material or of the downstream's
		// certificates): the call never reached the service, whose load and health it does
		// not tell. Counted as a call without a response, not judged.
		c.ds.Metrics.Upstream[metrics.ClassError].Inc()
		tk.Cancel()
		return
	}
	class := metrics.ClassError
	failed := true
	if c.err == nil && c.grpc {
		c.grpcOutcome() // judged by its grpc-status
	}
	if c.err == nil {
		class = metrics.ClassOf(c.status)
		failed = c.status >= 500 || c.status == http.StatusTooManyRequests || (c.bodyErr != nil && c.appCtx.Err() == nil)
	}
	if c.err != nil && c.sent.IsZero() {
		c.took = 0
	}
	c.ds.Metrics.Upstream[class].Inc()
	c.ds.Metrics.UpstreamDuration.Observe(c.took.Seconds())
	tk.Done(c.h.clock.Now(), failed, c.took)
	c.ds.Observe(c.took, failed) // the recovery windows judge the same outcome
}

// upstreamTarget returns the escaped path and the query of the upstream request: the
// downstream's path after /<downstream> appended to the upstream's path, the app's query
// appended to the upstream's query.
func (c *call) upstreamTarget(appQuery string) (escapedPath, rawQuery string) {
	u := c.cfg.Upstream
	escapedPath = u.EscapedPath()
	if c.rest != "" {
		escapedPath = strings.TrimSuffix(escapedPath, "/") + c.rest
	}
	rawQuery = appQuery
	if u.RawQuery != "" {
		if rawQuery == "" {
			rawQuery = u.RawQuery
		} else {
			rawQuery = u.RawQuery + "&" + rawQuery
		}
	}
	return escapedPath, rawQuery
}

// forwardedHeaders are the forwarding headers the app sent that pass unchanged. The agent adds
// none of its own but X-Forwarded-For: it is the app's egress, and the upstream must not take
// 127.0.0.1:15001 for the host its links should name.
var forwardedHeaders = [...]string{"Forwarded", "X-Forwarded-Host", "X-Forwarded-Proto"}

// forwardedFor is the X-Forwarded-For the upstream gets: the app's chain, if any, plus the app's
// address; ok is false when the app's address is unknown (the upstream then gets none).
//
// A chain the app named in its Connection field is a hop-by-hop field, and dropped, as net/http's
// ReverseProxy does (RFC 9110 §7.6.1).
func forwardedFor(in http.Header, remoteAddr string) (string, bool) {
	ip, _, err := net.SplitHostPort(remoteAddr)
	if err != nil {
		return "", false
	}
	if prior := in["X-Forwarded-For"]; len(prior) > 0 && !h1.NamedInConnection(in, "X-Forwarded-For") {
		ip = strings.Join(prior, ", ") + ", " + ip
	}
	return ip, true
}

func (h *Handler) rewrite(pr *httputil.ProxyRequest) {
	c := pr.In.Context().Value(callKey{}).(*call)
	u := c.cfg.Upstream
	out := pr.Out
	out.URL.Scheme = u.Scheme
	out.URL.Host = u.Host
	joined, query := c.upstreamTarget(out.URL.RawQuery)
	if p, err := url.PathUnescape(joined); err == nil {
		out.URL.Path, out.URL.RawPath = p, joined
	} else {
		out.URL.Path, out.URL.RawPath = joined, ""
	}
	out.URL.RawQuery = query
	out.Host = ""
	// The ReverseProxy removed the forwarding headers; put back the app's.
	in := pr.In.Header
	for _, k := range forwardedHeaders {
		if v, ok := in[k]; ok && !h1.NamedInConnection(in, k) {
			out.Header[k] = v
		}
	}
	if xff, ok := forwardedFor(in, pr.In.RemoteAddr); ok {
		out.Header["X-Forwarded-For"] = []string{xff}
	}
	if out.Body == nil && !c.h2 {
		// (HTTP/2's client retries only a request the upstream provably did not process, see
		// newH2Transport: a request without a body there ends its stream with its header.)
		// A request without a body is "replayable" to http.Transport, which then re-sends it
		// when a kept-alive connection fails before the first response byte. The upstream may
		// have received it: the agent never retries, so make the request non-replayable. The
		// transport probes the body, finds it empty and sends no body.
		out.Body = noRetryBody{}
		out.ContentLength = 0
	}
	c.sent = c.h.clock.Now()
}

func (h *Handler) modifyResponse(res *http.Response) error {
	c := res.Request.Context().Value(callKey{}).(*call)
	c.gotResponse(res)
	return nil
}

// gotResponse notes the upstream's answer and, unless it is an upgrade (whose writable body the
// ReverseProxy needs), puts the call in front of the response body: see Read.
func (c *call) gotResponse(res *http.Response) {
	c.status = res.StatusCode
	c.took = c.h.clock.Since(c.sent)
	if c.grpc {
		c.res = res
	}
	if res.StatusCode == http.StatusTooManyRequests {
		c.ds.CountUpstream429()
	}
	if res.StatusCode == http.StatusSwitchingProtocols {
		return
	}
	c.body = res.Body
	res.Body = c
	if c.key != "" {
		c.tee = c.h.newTee(c.key, res.Request, res)
	}
}

// Read passes the upstream body through, noting a failure and teeing into the stale cache.
func (c *call) Read(p []byte) (int, error) {
	n, err := c.body.Read(p)
	if c.tee != nil && n > 0 && !c.tee.write(p[:n]) {
		c.tee = nil // larger than an entry may be
	}
	switch {
	case err == nil:
	case errors.Is(err, io.EOF):
		if c.tee != nil {
			c.h.storeTee(c.tee, c.h.clock.Now())
			c.tee = nil
		}
	default:
		if c.bodyErr == nil {
			c.bodyErr = err
			c.tee = nil
		}
		if c.grpc {
			err = c.grpcBodyBroke(err) // trailers with a status, not a reset stream
		}
	}
	return n, err
}

// Close closes the upstream body.
func (c *call) Close() error { return c.body.Close() }

func (h *Handler) errorHandler(w http.ResponseWriter, r *http.Request, err error) {
	c, _ := r.Context().Value(callKey{}).(*call)
	if c == nil {
		writeProblem(w, http.StatusBadGateway, CodeUpstreamUnavailable, "Upstream unavailable", err.Error(), "")
		return
	}
	c.abortBodyRead()
	if c.failApp(w, err) {
		return
	}
	c.fail(w, err)
}

// fail records a call that got no response and answers the app: 504 when RequestTimeout
// passed, 502 for any other error, nothing when the app already left.
func (c *call) fail(w http.ResponseWriter, err error) {
	c.err = err
	if !c.sent.IsZero() {
		c.took = c.h.clock.Since(c.sent)
	}
	if c.tls = upstreamtls.Classify(err); c.tls != upstreamtls.None {
		c.ds.Metrics.TLSFailures[c.tls-1].Inc()
	}
	if c.appCtx.Err() != nil {
		return // the app left: nobody to answer
	}
	if c.tls != upstreamtls.None {
		writeTLSProblem(w, c.tls, err, c.cfg.Name)
		return
	}
	// The lean client's error is the connection's deadline, the ReverseProxy's the context's.
	if errors.Is(err, os.ErrDeadlineExceeded) || errors.Is(err, context.DeadlineExceeded) || c.pastDeadline() {
		detail := "the downstream did not answer within its requestTimeout of " + c.cfg.RequestTimeout.String()
		if c.byApp {
			detail = "the downstream did not answer within the call's own deadline"
		}
		writeProblem(w, http.StatusGatewayTimeout, CodeUpstreamTimeout, "Upstream timeout", detail, c.cfg.Name)
		return
	}
	c.h.log.Debug("upstream call failed", "downstream", c.cfg.Name, "err", err)
	var bad *h1.BadResponseError
	if !errors.As(err, &bad) && strings.Contains(err.Error(), "server response headers exceeded") {
		// http.Transport's error for a head over MaxResponseHeaderBytes (it has no type).
		bad = &h1.BadResponseError{Reason: "its head is larger than " + strconv.Itoa(h1.MaxResponseHeaderBytes>>20) + " MiB", Err: err}
	}
	if bad != nil {
		writeProblem(w, http.StatusBadGateway, CodeUpstreamBadResponse, "Bad upstream response",
			"the downstream's answer is not valid HTTP/1.1: "+bad.Reason, c.cfg.Name)
		return
	}
	writeProblem(w, http.StatusBadGateway, CodeUpstreamUnavailable, "Upstream unavailable",
		"the call to the downstream failed: "+upstreamError(err), c.cfg.Name)
}

// upstreamError describes a failed call to the downstream for the app: the kind of failure,
// without the agent's socket addresses (a *net.OpError names both ends).
func upstreamError(err error) string {
	var ne *net.OpError
	if errors.As(err, &ne) {
		what := "the connection failed"
		switch ne.Op {
		case "dial":
			what = "cannot connect"
		case "read", "raw-read":
			what = "reading the answer failed"
		case "write", "raw-write":
			what = "sending the request failed"
		}
		if ne.Err != nil {
			var se *os.SyscallError
			if errors.As(ne.Err, &se) {
				return what + ": " + se.Err.Error()
			}
			if errors.Is(ne.Err, net.ErrClosed) {
				return what + ": connection closed"
			}
			return what + ": " + ne.Err.Error()
		}
		return what
	}
	if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
		return "the connection closed before the answer"
	}
	return err.Error()
}

// splitPath splits "/<name>/<rest>" into name and "/<rest>" (rest is "" for "/<name>").
func splitPath(p string) (name, rest string) {
	p = strings.TrimPrefix(p, "/")
	if i := strings.IndexByte(p, '/'); i >= 0 {
		return p[:i], p[i:]
	}
	return p, ""
}

type noRetryBody struct{}

func (noRetryBody) Read([]byte) (int, error) { return 0, io.EOF }
func (noRetryBody) Close() error             { return nil }

func quote(s string) string {
	if len(s) > 64 {
		s = s[:64] + "…"
	}
	return `"` + strings.ReplaceAll(s, `"`, `\"`) + `"`
}
