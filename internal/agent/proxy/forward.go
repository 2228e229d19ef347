package proxy

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"

	"github.com/apportion/apportion/internal/agent/upstreamtls"
	"github.com/apportion/apportion/internal/h1"
)

// forwardLean sends the call to a plain http upstream with the engine's client (package h1) and
// passes its answer to the app, as httputil.ReverseProxy would: hop-by-hop fields removed, a
// body of unknown length or an event stream flushed as it arrives, trailers after the body.
func (h *Handler) forwardLean(w http.ResponseWriter, r *http.Request, c *call) {
	u := c.cfg.Upstream
	path, query := c.upstreamTarget(r.URL.RawQuery)
	t := h1.Target{Host: u.Host, Path: path, RawQuery: query}
	if c.cfg.TLS != nil {
		t.TLS = c.cfg.TLS // never a nil *Upstream in the interface
	}
	if xff, ok := forwardedFor(r.Header, r.RemoteAddr); ok {
		t.ForwardedFor = xff
	}
	if c.ab.rc != nil {
		// The client closes the body only to end a read of it stuck past the answer: then the
		// app's read is cut (see abortBodyRead).
		r.Body = (*leanBody)(c)
	}
	c.sent = h.clock.Now()
	res, err := h.up.Do(r, t, c.deadline) // the deadline is the connection's
	if err != nil {
		if c.failApp(w, err) {
			return
		}
		c.fail(w, err)
		return
	}
	body := res.Body
	// On every way out, a panic included: the exchange ends (its connection pooled or closed)
	// and the request body's writer does not outlive the call.
	defer body.Close()
	c.gotResponse(res) // res.Body is now c, which notes a broken body and tees

	h1.RemoveHopByHop(res.Header)
	dst := w.Header()
	for k, v := range res.Header {
		dst[k] = v
	}
	w.WriteHeader(res.StatusCode)
	copyAnswer(w, c, res, dst)
}

// copyAnswer writes the body of c's answer res to w, then its trailers into dst (w's header), for
// HTTP/1.1 and HTTP/2 alike. Like httputil.ReverseProxy, a body of unknown length (chunked, up to
// the close, or an HTTP/2 stream without content-length) or an event stream is flushed as it
// arrives; any other is written through the server's buffer. When the app has left (a write
// fails) it returns: over HTTP/1.1 the rest of the body is unread and the connection closed, over
// HTTP/2 the app's stream is reset and the upstream's by the call's Close. When the upstream
// breaks after the header was passed on it cuts the answer (ErrAbortHandler: the server aborts
// the connection or resets the stream), the only honest signal left to a caller that is not gRPC;
// a gRPC body that broke ends at EOF, with its status in res.Trailer.
func copyAnswer(w http.ResponseWriter, c *call, res *http.Response, dst http.Header) {
	var rc *http.ResponseController
	if res.ContentLength == -1 || isEventStream(res.Header) {
		rc = http.NewResponseController(w)
	}
	buf := bufferPool.Get()
	defer bufferPool.Put(buf)
	for {
		n, rerr := c.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return
			}
			if rc != nil && rc.Flush() != nil {
				return
			}
		}
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr != nil {
			panic(http.ErrAbortHandler)
		}
	}
	// Trailers, known only now that the body ended, under the TrailerPrefix convention.
	for k, v := range res.Trailer {
		dst[http.TrailerPrefix+k] = v
	}
}

// leanBody is the app's request body as the engine's client reads it: c.ab, whose Close cuts a
// read in progress (the client's only use of Close).
type leanBody call

func (b *leanBody) Read(p []byte) (int, error) { return b.ab.Read(p) }

func (b *leanBody) Close() error {
	(*call)(b).abortBodyRead()
	return nil
}

func isEventStream(h http.Header) bool {
	ct, _, _ := strings.Cut(h.Get("Content-Type"), ";")
	return strings.EqualFold(strings.TrimSpace(ct), "text/event-stream")
}

// upstreamTransport is the ReverseProxy's transport when Options gave none: plain for http
// upstreams, and for an https upstream an http.Transport of its own that dials through its
// upstreamtls.Upstream (the same verification, material and rotation as the lean client's;
// pooled apart, as the lean client pools apart, so that a connection made with one downstream's
// client certificate never carries another's calls).
type upstreamTransport struct {
	h     *Handler
	plain *http.Transport
}

func (t *upstreamTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if c, _ := r.Context().Value(callKey{}).(*call); c != nil && c.cfg.TLS != nil && r.URL.Scheme == "https" {
		return t.h.tlsTransport(c.cfg.TLS).RoundTrip(r)
	}
	return t.plain.RoundTrip(r)
}

func (t *upstreamTransport) CloseIdleConnections() { t.plain.CloseIdleConnections() }

// tlsTransport returns up's http.Transport (NewTransport, dialling TLS through up).
func (h *Handler) tlsTransport(up *upstreamtls.Upstream) *http.Transport {
	if v, ok := h.tlsTransports.Load(up); ok {
		return v.(*http.Transport)
	}
	t := NewTransport()
	dial := t.DialContext
	t.DialTLSContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		raw, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		deadline, _ := ctx.Deadline()
		return up.Handshake(raw, deadline)
	}
	t.ForceAttemptHTTP2 = false // HTTP/1.1: no ALPN is offered
	v, _ := h.tlsTransports.LoadOrStore(up, t)
	return v.(*http.Transport)
}

// neverSent reports whether err says that nothing of the call reached the downstream: no
// connection could be made, or its TLS handshake did not complete.
func neverSent(err error) bool {
	var ce *h1.ConnectError
	var he *upstreamtls.HandshakeError
	var ne *net.OpError
	return errors.As(err, &ce) || errors.As(err, &he) || (errors.As(err, &ne) && ne.Op == "dial")
}
