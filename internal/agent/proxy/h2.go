package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/http/httpguts"

	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/agent/grpcstatus"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/agent/upstreamtls"
	"github.com/apportion/apportion/internal/h1"
)

// HTTP/2 and gRPC (see docs/agent.md, "HTTP/2 and gRPC").
//
// The app may speak HTTP/2 with prior knowledge (h2c) to the agent's listener: h1.Server hands
// such a connection to net/http's HTTP/2 server, which serves Handler, one ServeHTTP per
// stream. Every stream is a call like any other: the same admission (admit: degrade, breaker,
// rate, lanes, permit, ticket), its own permit held until the stream ended (the upstream's body
// and trailers passed on, or the call failed), the same deadline (grpc-timeout or
// X-Apportion-Timeout, bounding the waits and the stream), the same release and breaker
// verdict. Permits count streams, never connections: fifty streams on one connection are fifty
// calls. A long stream holds its permit for as long as it lasts (at most requestTimeout, or the
// app's own deadline): apportion_agent_h2_streams_open and _h2_stream_duration_seconds show it.
//
// Forwarding follows the caller's protocol: a call that came over HTTP/2 goes out over HTTP/2
// (h2c to an http upstream, TLS with ALPN h2 to an https one), a call that came over HTTP/1.1
// goes out over HTTP/1.1 as ever. One transport per downstream (h2Upstreams), net/http's, with
// HTTP/2 only: its connections carry many streams, its flow control is the library's, trailers
// pass through. An https downstream that does not negotiate h2 fails the call (502): gRPC needs
// HTTP/2 end to end.
//
// Refusals speak the caller's protocol. A gRPC caller (HTTP/2, Content-Type application/grpc*)
// gets a trailers-only response with a grpc-status (grpcstatus.Write): RESOURCE_EXHAUSTED for no
// permit, no rate token or a full queue, UNAVAILABLE for an open breaker, a degrade switch, no
// assignment yet, a stalled agent or an upstream that failed, DEADLINE_EXCEEDED for a deadline
// (the app's, or requestTimeout), UNIMPLEMENTED for an unknown downstream, INTERNAL for a
// malformed request; grpc-retry-pushback-ms when the wait is known (the same cases as
// Retry-After). Any other HTTP/2 caller gets the problem+json an HTTP/1.1 caller gets.

// grpcCaller is the ResponseWriter of a gRPC call: the agent's own answers on it (writeProblem,
// answerFallback, an upstream body that broke) become gRPC statuses; the upstream's answer
// passes through it unchanged.
type grpcCaller struct {
	http.ResponseWriter
}

func (g *grpcCaller) Unwrap() http.ResponseWriter { return g.ResponseWriter }

func (g *grpcCaller) FlushError() error { return http.NewResponseController(g.ResponseWriter).Flush() }

func (g *grpcCaller) SetReadDeadline(t time.Time) error {
	return http.NewResponseController(g.ResponseWriter).SetReadDeadline(t)
}

func (g *grpcCaller) SetWriteDeadline(t time.Time) error {
	return http.NewResponseController(g.ResponseWriter).SetWriteDeadline(t)
}

// callerWriter returns w as the call's ResponseWriter: wrapped when the caller speaks gRPC.
func callerWriter(w http.ResponseWriter, r *http.Request) http.ResponseWriter {
	if r.ProtoMajor == 2 && grpcstatus.IsGRPC(r.Header.Get("Content-Type")) {
		return &grpcCaller{ResponseWriter: w}
	}
	return w
}

// byAuthority routes a gRPC call whose path does not start with a downstream's name by its
// :authority: a gRPC client cannot put a prefix before its method's path without an
// interceptor, but it can name the authority (grpc.WithAuthority("payments"), and the agent's
// address as the target). The authority's host (without a port) names the downstream, and the
// whole path is forwarded. The path's first segment, when it names a downstream, wins. name,
// rest and nil are returned as given when the authority names none either.
func byAuthority(w http.ResponseWriter, r *http.Request, t *enforce.Table, name, rest string) (string, string, *enforce.Downstream) {
	if _, ok := w.(*grpcCaller); !ok {
		return name, rest, nil
	}
	host := r.Host
	if hp, _, err := net.SplitHostPort(host); err == nil {
		host = hp
	}
	if ds := t.Lookup(host); ds != nil {
		return host, r.URL.EscapedPath(), ds
	}
	return name, rest, nil
}

// grpcProblem answers a gRPC caller in place of the problem+json of code; false: w is not a
// gRPC caller's.
func grpcProblem(w http.ResponseWriter, code, title, detail string) bool {
	g, ok := w.(*grpcCaller)
	if !ok {
		return false
	}
	grpcstatus.Write(g, grpcCodeOf(code), "apportion: "+title+": "+detail, 0)
	return true
}

// grpcCodeOf is the gRPC status of the agent's own answer with problem code.
func grpcCodeOf(code string) grpcstatus.Code {
	switch code {
	case CodeDeadlineExceeded, CodeUpstreamTimeout, CodeRequestTimeout:
		return grpcstatus.DeadlineExceeded
	case CodeUnknownDownstream, CodeMethodNotAllowed:
		return grpcstatus.Unimplemented
	case CodeNotConfigured, CodeStalled, CodeUpstreamUnavailable, CodeUpstreamBadResponse:
		return grpcstatus.Unavailable
	}
	return grpcstatus.Internal // the app's request is malformed (CodeBadRequest, ...)
}

// grpcFallback answers a refused gRPC call: whatever the fallback (Static and ServeStale are
// HTTP answers a gRPC client cannot read, and ServeStale only ever serves GET), a status by
// the reason, with the pushback when the wait is known; counted as a reject. False: w is not a
// gRPC caller's.
func grpcFallback(w http.ResponseWriter, ds *enforce.Downstream, reason fallback.Reason, retryAfter time.Duration) bool {
	g, ok := w.(*grpcCaller)
	if !ok {
		return false
	}
	ds.Metrics.Fallback[metrics.ActionReject].Inc()
	code := grpcstatus.Unavailable // circuit-open, degraded
	switch reason {
	case fallback.NoPermit, fallback.RateLimited, fallback.QueueFull:
		code = grpcstatus.ResourceExhausted
	}
	h := g.Header()
	h.Set(fallback.HeaderFallback, "reject")
	h.Set(fallback.HeaderReason, string(reason))
	grpcstatus.Write(g, code, "apportion: downstream "+ds.Name+" refused the call: "+string(reason), retryAfter)
	return true
}

// grpcBodyBroke ends a gRPC call whose upstream body broke after its header was passed on: the
// trailers say UNAVAILABLE (DEADLINE_EXCEEDED when the call's deadline cut it), where an
// HTTP/1.1 caller's answer is cut; the gRPC client reads a status, not a reset stream. It
// returns io.EOF for the body (forwardH2 then sends the trailers) or err when the call
// is not a gRPC caller's.
func (c *call) grpcBodyBroke(err error) error {
	if c.res == nil {
		return err
	}
	code, msg := grpcstatus.Unavailable, "apportion: the downstream's answer broke off: "+upstreamError(err)
	if isTimeout(err) || c.pastDeadline() {
		code, msg = grpcstatus.DeadlineExceeded, "apportion: the call's deadline passed while the downstream answered"
	}
	c.res.Trailer = http.Header{
		grpcstatus.HeaderStatus:  {strconv.Itoa(int(code))},
		grpcstatus.HeaderMessage: {grpcstatus.EncodeMessage(msg)},
	}
	return io.EOF
}

// grpcOutcome is the HTTP status the breaker and the metrics judge a gRPC call by: its HTTP
// status is 200 whatever the outcome, which is the grpc-status in its trailers (or header).
// A call whose body broke keeps its failure (bodyErr); a stream that ended without a status is
// judged by its HTTP status.
func (c *call) grpcOutcome() {
	if c.res == nil || c.status != http.StatusOK || c.bodyErr != nil {
		return
	}
	code, ok := grpcstatus.Of(c.res.Header, c.res.Trailer)
	if !ok {
		return
	}
	c.status = grpcstatus.HTTPStatus(code)
	if code == grpcstatus.ResourceExhausted {
		c.ds.CountUpstream429()
	}
}

// h2Upstreams are the HTTP/2 transports, one per downstream: a downstream's connections are
// its own (its TLS configuration, from Options.UpstreamTLS, is), and carry its streams. A
// downstream whose upstream changed scheme or address gets a new transport; the old one's idle
// connections are closed.
type h2Upstreams struct {
	h  *Handler
	mu sync.Mutex
	m  map[string]*h2Upstream
}

type h2Upstream struct {
	scheme, host string
	t            *http.Transport
}

func (u *h2Upstreams) transport(cfg *enforce.Config) *http.Transport {
	up := cfg.Upstream
	u.mu.Lock()
	defer u.mu.Unlock()
	if e := u.m[cfg.Name]; e != nil {
		if e.scheme == up.Scheme && e.host == up.Host {
			return e.t
		}
		e.t.CloseIdleConnections()
	}
	if u.m == nil {
		u.m = map[string]*h2Upstream{}
	}
	e := &h2Upstream{scheme: up.Scheme, host: up.Host, t: u.h.newH2Transport(cfg.Name)}
	u.m[cfg.Name] = e
	return e.t
}

func (u *h2Upstreams) CloseIdleConnections() {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, e := range u.m {
		e.t.CloseIdleConnections()
	}
}

// upstreamDialer dials the upstreams' TCP connections.
var upstreamDialer = &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}

// newH2Transport returns the HTTP/2 transport of the downstream name: h2c with prior knowledge
// to http upstreams, TLS with ALPN h2 to https ones (dialTLS), never HTTP/1.1. A request is sent
// once: net/http's HTTP/2 client retries only a request the upstream provably did not process
// (a stream it refused, or one above the last stream a GOAWAY accepted).
func (h *Handler) newH2Transport(name string) *http.Transport {
	var p http.Protocols
	p.SetHTTP2(true)
	p.SetUnencryptedHTTP2(true)
	return &http.Transport{
		Proxy:       nil,
		DialContext: upstreamDialer.DialContext,
		DialTLSContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return h.dialTLS(ctx, name, network, addr)
		},
		Protocols:              &p,
		IdleConnTimeout:        90 * time.Second,
		TLSHandshakeTimeout:    10 * time.Second,
		DisableCompression:     true,
		MaxResponseHeaderBytes: h1.MaxResponseHeaderBytes,
	}
}

// errNoH2 is the failure of an https upstream that does not speak HTTP/2.
var errNoH2 = errors.New("the downstream did not negotiate HTTP/2 (ALPN h2)")

// dialTLS opens a TLS connection to the https upstream of the downstream name, with the TLS
// configuration Options.UpstreamTLS gives for its current configuration (asked at every
// connection: a rotated certificate applies to the next one), ALPN h2 only.
func (h *Handler) dialTLS(ctx context.Context, name, network, addr string) (net.Conn, error) {
	if h.upstreamTLS == nil {
		if ds := h.enf.Table().Lookup(name); ds != nil && ds.Config().TLS != nil {
			return dialUpstreamTLS(ctx, ds.Config().TLS, network, addr)
		}
	}
	var conf *tls.Config
	if h.upstreamTLS != nil {
		if ds := h.enf.Table().Lookup(name); ds != nil {
			var err error
			if conf, err = h.upstreamTLS(ds.Config()); err != nil {
				return nil, err
			}
		}
	}
	if conf == nil {
		conf = &tls.Config{MinVersion: tls.VersionTLS12} // crypto/tls's defaults: system roots, the URL's host
	} else {
		conf = conf.Clone()
	}
	conf.NextProtos = []string{"h2"}
	nc, err := (&tls.Dialer{NetDialer: upstreamDialer, Config: conf}).DialContext(ctx, network, addr)
	if err != nil && strings.Contains(err.Error(), "no application protocol") {
		// The server's no_application_protocol alert (RFC 7301 §3.2): it speaks HTTP/1.1 only.
		// crypto/tls reports a received alert as a *net.OpError around an unexported type.
		return nil, errNoH2
	}
	if err != nil {
		return nil, err
	}
	if nc.(*tls.Conn).ConnectionState().NegotiatedProtocol != "h2" {
		_ = nc.Close()
		return nil, errNoH2
	}
	return nc, nil
}

// dialUpstreamTLS opens an HTTP/2 connection to an https upstream with the downstream's TLS
// settings (spec.upstreamTLS: its CA, server name, client certificate, rotation and session
// cache, the same verification as the lean HTTP/1.1 path), ALPN h2 only. Its failures are
// *upstreamtls.HandshakeError, classified as on the lean path.
func dialUpstreamTLS(ctx context.Context, up *upstreamtls.Upstream, network, addr string) (net.Conn, error) {
	conf := up.Config().Clone() // shares the session cache and the callbacks reading the material
	conf.NextProtos = []string{"h2"}
	raw, err := upstreamDialer.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	deadline, _ := ctx.Deadline()
	tc, err := up.HandshakeWith(raw, conf, deadline)
	if err != nil {
		if strings.Contains(err.Error(), "no application protocol") {
			return nil, errNoH2 // the server's no_application_protocol alert: HTTP/1.1 only
		}
		return nil, err
	}
	// The connection carries many streams: no call's deadline stays on it.
	if err := tc.SetDeadline(time.Time{}); err != nil {
		_ = tc.Close()
		return nil, err
	}
	if tc.ConnectionState().NegotiatedProtocol != "h2" {
		_ = tc.Close()
		return nil, errNoH2
	}
	return tc, nil
}

// forwardH2 forwards a call that came over HTTP/2 and holds its permit until the stream ended:
// it returns once the upstream's body and trailers were passed on, or the call failed.
//
// It is the ReverseProxy's work without the ReverseProxy (see docs/benchmarks.md, "A leaner
// HTTP/2 path"): the request goes out with the app's header map itself (the hop-by-hop fields
// removed, "te: trailers" kept, X-Forwarded-For set as for HTTP/1.1) rather than a clone of it,
// straight to the downstream's HTTP/2 transport (no context value to find the call, no hooks);
// the answer's header is copied once into the app's, its body written as it arrives, each
// write flushed when its length is unknown (gRPC's: a streamed message must not wait for the
// next), its trailers after it. Interim (1xx) answers other than 100 Continue, which the
// ReverseProxy relayed through an httptrace hook, are not passed on over HTTP/2.
//
// The app's side is bounded by the call's deadline (appDeadlines) without a timer of its own:
// setting a stream's deadline is a message to net/http's connection goroutine and a timer per
// stream, four messages per call to set and clear both. They are set only if the call is still
// forwarding at its deadline (deadlinesAtExpiry), which leaves the same bounds: reading the
// app's body ends at the deadline, writing its answer answerWriteGrace later.
func (h *Handler) forwardH2(w http.ResponseWriter, r *http.Request, c *call) {
	m := c.ds.Metrics
	m.StreamsOpen.Inc()
	start := h.clock.Now()
	defer func() {
		m.StreamsOpen.Dec()
		m.StreamDuration.Observe(h.clock.Since(start).Seconds())
	}()
	ctx, cancel := context.WithDeadline(context.WithoutCancel(r.Context()), c.deadline)
	defer cancel()
	c.ctx = ctx
	if c.dl != nil {
		defer c.deadlinesAtExpiry()()
	}

	out := h2Request(ctx, r, c)
	c.sent = h.clock.Now()
	res, err := h.h2up.transport(c.cfg).RoundTrip(out)
	if err != nil {
		c.abortBodyRead()
		if c.failApp(w, err) {
			return
		}
		c.fail(w, err)
		return
	}
	body := res.Body
	defer body.Close()
	c.gotResponse(res) // res.Body is now c, which notes a broken body (a gRPC status, see grpcBodyBroke)

	h1.RemoveHopByHop(res.Header)
	dst := w.Header()
	for k, v := range res.Header {
		dst[k] = v
	}
	if len(res.Trailer) > 0 {
		// The trailers the upstream announced, announced to the app as the ReverseProxy does.
		keys := make([]string, 0, len(res.Trailer))
		for k := range res.Trailer {
			keys = append(keys, k)
		}
		dst.Add("Trailer", strings.Join(keys, ", "))
	}
	w.WriteHeader(res.StatusCode)
	copyAnswer(w, c, res, dst)
}

// h2Request is the upstream request of the call c, which came as r over HTTP/2: r's header map
// (rewritten in place: r is the agent's alone, and nothing reads it after forwarding), its body
// (as the call reads it) and its trailers, to the downstream's upstream.
func h2Request(ctx context.Context, r *http.Request, c *call) *http.Request {
	u := c.cfg.Upstream
	h := r.Header
	te := httpguts.HeaderValuesContainsToken(h["Te"], "trailers")
	h1.RemoveHopByHop(h)
	if te {
		h["Te"] = []string{"trailers"} // gRPC's
	}
	if xff, ok := forwardedFor(h, r.RemoteAddr); ok {
		h["X-Forwarded-For"] = []string{xff}
	} else {
		delete(h, "X-Forwarded-For")
	}
	if _, ok := h["User-Agent"]; !ok {
		h["User-Agent"] = []string{""} // none, rather than the client's default
	}
	joined, query := c.upstreamTarget(r.URL.RawQuery)
	out := &http.Request{
		Method:     r.Method,
		URL:        &url.URL{Scheme: u.Scheme, Host: u.Host, RawQuery: query},
		Proto:      "HTTP/2.0",
		ProtoMajor: 2,
		Header:     h,
		Trailer:    r.Trailer,
	}
	if p, err := url.PathUnescape(joined); err == nil {
		out.URL.Path, out.URL.RawPath = p, joined
	} else {
		out.URL.Path = joined
	}
	if c.ab.rc != nil && r.ContentLength != 0 {
		out.Body, out.ContentLength = (*h2Body)(c), r.ContentLength
	}
	return out.WithContext(ctx)
}

// h2Body is the app's request body as the HTTP/2 transport reads it: c.ab (appDeadlines), whose
// Close, the transport's when the stream ended or was aborted (at the call's deadline: the
// context's), is the agent's doing: a read it cuts is not counted as the app's malformed body.
type h2Body call

func (b *h2Body) Read(p []byte) (int, error) { return b.ab.Read(p) }

func (b *h2Body) Close() error {
	b.ab.cut.Store(true)
	return b.ab.Close()
}

// deadlinesAtExpiry sets the app's stream deadlines (appDeadlines) if the call is still
// forwarding at its deadline, and returns what to defer: it stops that and waits for a setting
// in progress (the stream's writer is net/http's no more once the handler returned). One timer
// per call, set and stopped by this goroutine: no message to the connection's goroutine.
func (c *call) deadlinesAtExpiry() func() {
	t := time.AfterFunc(time.Until(c.deadline), func() {
		c.expiryMu.Lock()
		defer c.expiryMu.Unlock()
		if c.ended {
			return
		}
		if c.ab.rc != nil {
			_ = c.dl.SetReadDeadline(past)
		}
		_ = c.dl.SetWriteDeadline(c.deadline.Add(answerWriteGrace))
	})
	return func() {
		t.Stop()
		c.expiryMu.Lock()
		c.ended = true
		c.expiryMu.Unlock()
	}
}
