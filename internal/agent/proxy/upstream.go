package proxy

import (
	"bufio"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"net/textproto"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"
)

// The lean upstream client: plain HTTP/1.1 over a pool of kept-alive connections per upstream
// host, driven synchronously by the handler's goroutine. http.Transport spends two goroutines
// per connection (readLoop, writeLoop) and channel handoffs between them and the caller on
// every call; on the agent's small calls that machinery cost more CPU than the proxying. Here a
// call without a request body is: write the head, flush, read the answer on the same goroutine.
// A call with a body writes it from a second goroutine while the answer is read, so that an
// upstream answering before it read the whole body (or streaming both ways) works as with
// http.Transport.
//
// Nothing is ever re-sent: a connection is taken from the pool only after a check that the
// upstream has not closed it while idle (see alive), and once the request was written, any
// failure is the call's failure (502, or 504 past RequestTimeout). A connection goes back to
// the pool only when the answer's body ended cleanly, the answer allows keep-alive and the
// request was written whole; anything else closes it.

const (
	// maxIdlePerHost bounds the idle connections kept per upstream host (http.Transport's
	// MaxIdleConnsPerHost of NewTransport).
	maxIdlePerHost = 1024
	// idleConnTimeout closes a connection idle for longer (NewTransport's IdleConnTimeout).
	idleConnTimeout = 90 * time.Second
	// upBufSize is the size of each connection's read and write buffers. Bodies larger than
	// that bypass them (bufio reads and writes large slices directly).
	upBufSize = 4 << 10
	// bodyWriteGrace is how long a complete answer waits for the request body's writer to
	// report before the connection is given up (http.Transport waits as long).
	bodyWriteGrace = 50 * time.Millisecond
	// maxResponseHeaderBytes bounds an answer's head (status line and fields, 1xx heads
	// included): a downstream answering with an endless head must not take the agent's memory.
	// 1 MiB, as http.DefaultMaxHeaderBytes for requests; http.Transport's default is 10 MiB,
	// which 1,024 pooled connections could not afford.
	maxResponseHeaderBytes = 1 << 20
)

// badResponseError is an answer the upstream client cannot read as HTTP/1.1: a head over
// maxResponseHeaderBytes, a malformed head, a protocol switch nobody asked for. The app gets
// 502 APPORTION_UPSTREAM_BAD_RESPONSE; the breaker counts it (the downstream misbehaves).
type badResponseError struct {
	reason string
	err    error
}

func (e *badResponseError) Error() string { return "bad response from the upstream: " + e.reason }
func (e *badResponseError) Unwrap() error { return e.err }

var errResponseHeadTooLarge = errors.New("response head too large")

// leanEligible reports whether the lean client can send r to u: plain http, no protocol
// upgrade (the ReverseProxy hijacks the app's connection for it), no Expect: 100-continue
// (http.Transport waits for the upstream's 100 before sending the body).
func leanEligible(r *http.Request, u *url.URL) bool {
	if u.Scheme != "http" {
		return false
	}
	if _, ok := r.Header["Upgrade"]; ok {
		return false
	}
	if _, ok := r.Header["Expect"]; ok {
		return false
	}
	return true
}

// upstreamPool holds the idle connections of every upstream host.
type upstreamPool struct {
	hosts  sync.Map // host (URL.Host) -> *hostPool
	dialer net.Dialer
	// idleTimeout closes a connection idle for longer (idleConnTimeout; tests shorten it).
	idleTimeout time.Duration
	// reaping: a timer is set to close the connections that will have been idle too long (see
	// reap).
	reaping atomic.Bool
}

func newUpstreamPool() *upstreamPool {
	return &upstreamPool{dialer: net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}, idleTimeout: idleConnTimeout}
}

type hostPool struct {
	addr string // host:port to dial
	mu   sync.Mutex
	idle []*upConn // the most recently used last: reuse keeps few connections warm
}

type upConn struct {
	conn      net.Conn
	lr        headLimit // between conn and br: bounds a head while it is read
	br        *bufio.Reader
	bw        *bufio.Writer
	idleSince time.Time
	peek      peeker
}

// headLimit reads from c at most remain bytes, then fails with errResponseHeadTooLarge.
type headLimit struct {
	c      net.Conn
	remain int64
}

func (l *headLimit) Read(p []byte) (int, error) {
	if l.remain <= 0 {
		return 0, errResponseHeadTooLarge
	}
	if int64(len(p)) > l.remain {
		p = p[:l.remain]
	}
	n, err := l.c.Read(p)
	l.remain -= int64(n)
	return n, err
}

func (p *upstreamPool) host(host string) *hostPool {
	if hp, ok := p.hosts.Load(host); ok {
		return hp.(*hostPool)
	}
	addr := host
	if _, port, err := net.SplitHostPort(host); err != nil || port == "" {
		addr = net.JoinHostPort(strings.Trim(host, "[]"), "80")
	}
	hp, _ := p.hosts.LoadOrStore(host, &hostPool{addr: addr})
	return hp.(*hostPool)
}

// get returns a connection to host with deadline set: an idle one the upstream has not closed,
// or a new one.
func (p *upstreamPool) get(host string, deadline time.Time) (*upConn, error) {
	hp := p.host(host)
	now := time.Now()
	for {
		hp.mu.Lock()
		n := len(hp.idle)
		if n == 0 {
			hp.mu.Unlock()
			break
		}
		uc := hp.idle[n-1]
		hp.idle[n-1] = nil
		hp.idle = hp.idle[:n-1]
		hp.mu.Unlock()
		if now.Sub(uc.idleSince) > p.idleTimeout {
			uc.close()
			continue
		}
		if err := uc.conn.SetDeadline(deadline); err != nil || !uc.alive() {
			uc.close()
			continue
		}
		return uc, nil
	}
	d := p.dialer
	d.Deadline = deadline
	conn, err := d.Dial("tcp", hp.addr)
	if err != nil {
		return nil, err
	}
	conn = fastConn(conn)
	uc := &upConn{conn: conn, lr: headLimit{c: conn, remain: math.MaxInt64}, bw: bufio.NewWriterSize(conn, upBufSize)}
	uc.br = bufio.NewReaderSize(&uc.lr, upBufSize)
	uc.peek.init(conn)
	if err := conn.SetDeadline(deadline); err != nil {
		uc.close()
		return nil, err
	}
	return uc, nil
}

// put returns a connection whose last exchange ended cleanly to the idle pool of host.
func (p *upstreamPool) put(host string, uc *upConn) {
	hp := p.host(host)
	uc.idleSince = time.Now()
	hp.mu.Lock()
	// Close the oldest when full or expired; the pool is a stack, so they are at the bottom.
	var stale *upConn
	if len(hp.idle) > 0 && (len(hp.idle) >= maxIdlePerHost || uc.idleSince.Sub(hp.idle[0].idleSince) > p.idleTimeout) {
		stale = hp.idle[0]
		hp.idle = append(hp.idle[:0], hp.idle[1:]...)
	}
	hp.idle = append(hp.idle, uc)
	hp.mu.Unlock()
	if stale != nil {
		stale.close()
	}
	if p.reaping.CompareAndSwap(false, true) {
		time.AfterFunc(p.idleTimeout, p.reap)
	}
}

// reap closes the connections idle for idleTimeout or longer, of every host, and sets its timer
// again for when the oldest of the rest will be, while any is left. Without it, the connections
// (and their descriptors) of an upstream no longer called would stay open forever, since get
// and put only look at the host they serve. A connection is closed at most idleTimeout late.
func (p *upstreamPool) reap() {
	now := time.Now()
	var stale []*upConn
	next := time.Duration(-1)
	p.hosts.Range(func(_, v any) bool {
		hp := v.(*hostPool)
		hp.mu.Lock()
		i := 0 // the stack holds the oldest at the bottom
		for i < len(hp.idle) && now.Sub(hp.idle[i].idleSince) >= p.idleTimeout {
			i++
		}
		stale = append(stale, hp.idle[:i]...)
		n := copy(hp.idle, hp.idle[i:])
		clear(hp.idle[n:])
		hp.idle = hp.idle[:n]
		if n > 0 {
			if d := p.idleTimeout - now.Sub(hp.idle[0].idleSince); next < 0 || d < next {
				next = d
			}
		}
		hp.mu.Unlock()
		return true
	})
	for _, uc := range stale {
		uc.close()
	}
	p.reaping.Store(false)
	if next >= 0 && p.reaping.CompareAndSwap(false, true) {
		time.AfterFunc(max(next, time.Millisecond), p.reap)
	}
}

// closeIdle closes every idle connection.
func (p *upstreamPool) closeIdle() {
	p.hosts.Range(func(_, v any) bool {
		hp := v.(*hostPool)
		hp.mu.Lock()
		idle := hp.idle
		hp.idle = nil
		hp.mu.Unlock()
		for _, uc := range idle {
			uc.close()
		}
		return true
	})
}

func (uc *upConn) close() { _ = uc.conn.Close() }

// alive reports whether an idle connection can carry a request: the upstream has neither
// closed it nor sent anything unasked (both would be read as the next call's answer).
func (uc *upConn) alive() bool {
	return uc.br.Buffered() == 0 && uc.peek.idle()
}

// forwardLean sends the call to a plain http upstream and passes its answer to the app; see the
// comment at the top of this file.
func (h *Handler) forwardLean(w http.ResponseWriter, r *http.Request, c *call) {
	u := c.cfg.Upstream
	c.sent = time.Now()
	uc, err := h.up.get(u.Host, c.deadline)
	if err != nil {
		c.fail(w, err)
		return
	}
	reusable := false
	defer func() {
		if reusable {
			h.up.put(u.Host, uc)
		} else {
			uc.close()
		}
	}()

	writeRequestHead(uc.bw, r, c, u.Host)
	var bodyDone chan error // nil: no request body
	if r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0 {
		bodyDone = make(chan error, 1)
		go func() { bodyDone <- uc.writeBody(r.Body, r.ContentLength) }()
	} else if err := uc.bw.Flush(); err != nil {
		c.fail(w, err)
		return
	}
	// waitBody waits for the request body's writer and reports whether the whole request was
	// sent. When the answer is complete (or failed) and the writer has not finished within
	// bodyWriteGrace (it may just be returning), the upstream did not want the rest: the
	// connection is closed to end the writer, and cannot be reused.
	waitBody := func() bool {
		if bodyDone == nil {
			return true
		}
		select {
		case err := <-bodyDone:
			bodyDone = nil
			return err == nil
		default:
		}
		t := time.NewTimer(bodyWriteGrace)
		defer t.Stop()
		select {
		case err := <-bodyDone:
			bodyDone = nil
			return err == nil
		case <-t.C:
		}
		// The writer is blocked writing upstream (closing the connection ends that) or reading
		// the app's body (ending that read ends it).
		uc.close()
		c.abortBodyRead()
		<-bodyDone //nolint:errcheck // it fails: its connection was just closed
		bodyDone = nil
		return false
	}
	defer waitBody() // on every way out, a panic included: the writer must not outlive the call

	// The body is read to its end or its connection closed; Close would drain it.
	res, err := readResponse(uc.br, &uc.lr, r) //nolint:bodyclose // see above
	if err != nil {
		waitBody()
		if c.failApp(w, err) {
			return
		}
		c.fail(w, err)
		return
	}
	c.gotResponse(res) // res.Body is now c, which notes a broken body and tees

	removeHopByHop(res.Header)
	dst := w.Header()
	for k, v := range res.Header {
		dst[k] = v
	}
	w.WriteHeader(res.StatusCode)

	// Like httputil.ReverseProxy: a body of unknown length (chunked, or up to the close) or an
	// event stream is flushed as it arrives; any other is written through the server's buffer.
	var rc *http.ResponseController
	if res.ContentLength == -1 || isEventStream(res.Header) {
		rc = http.NewResponseController(w)
	}
	buf := copyBuffers.Get().(*[copyBufferSize]byte)
	defer copyBuffers.Put(buf)
	for {
		n, rerr := c.Read(buf[:])
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return // the app left; the rest of the body is unread: the connection is closed
			}
			if rc != nil {
				if rc.Flush() != nil {
					return
				}
			}
		}
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr != nil {
			// The upstream broke after its header was passed on: cut the answer, the only
			// honest signal left (the server aborts the connection on ErrAbortHandler).
			uc.close()
			waitBody()
			panic(http.ErrAbortHandler)
		}
	}
	// Trailers, known only now that the body ended, under the TrailerPrefix convention.
	for k, v := range res.Trailer {
		dst[http.TrailerPrefix+k] = v
	}
	reusable = waitBody() && !res.Close
}

// readResponse reads the upstream's final answer; informational answers other than 101 are
// dropped (the lean path never sends Expect, and 103 hints are optional). A 101 to a request
// that asked for no upgrade is an error. lim (nil: none) is the reader under br: each head may
// take at most maxResponseHeaderBytes from the connection (plus what br buffered before), the
// body any amount. Errors of the answer itself (too large, malformed, a 101) are
// *badResponseError; those of the connection are returned as they are.
func readResponse(br *bufio.Reader, lim *headLimit, r *http.Request) (*http.Response, error) {
	for {
		// Wait for the answer's first bytes; a head whole in them and in the common subset is
		// read without net/http (see head.go).
		if lim != nil {
			lim.remain = maxResponseHeaderBytes
		}
		_, err := br.Peek(1)
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF // as http.ReadResponse: the answer is missing
			}
			return nil, headError(err)
		}
		res, ok := readResponseHead(br, r)
		if !ok {
			if res, err = http.ReadResponse(br, r); err != nil {
				return nil, headError(err)
			}
		}
		if lim != nil {
			lim.remain = math.MaxInt64
		}
		switch {
		case res.StatusCode == http.StatusSwitchingProtocols:
			return nil, &badResponseError{reason: "the upstream switched protocols unasked"}
		case res.StatusCode >= 100 && res.StatusCode < 200:
			continue
		}
		return res, nil
	}
}

// headError sorts an error reading an answer's head: the connection's (a timeout, a reset, the
// upstream closing) as is, the answer's own (over the limit, not HTTP) as *badResponseError.
func headError(err error) error {
	var ne net.Error
	switch {
	case errors.Is(err, errResponseHeadTooLarge):
		return &badResponseError{reason: "its head is larger than " + strconv.Itoa(maxResponseHeaderBytes>>20) + " MiB", err: err}
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF), errors.As(err, &ne), errors.Is(err, net.ErrClosed):
		return err
	}
	return &badResponseError{reason: "malformed head", err: err}
}

// writeRequestHead writes the upstream request's line and header into bw (not flushed): the
// app's header without hop-by-hop fields, Host the upstream's, X-Forwarded-For extended,
// framing of our own.
func writeRequestHead(bw *bufio.Writer, r *http.Request, c *call, host string) {
	path, query := c.upstreamTarget(r.URL.RawQuery)
	if path == "" {
		path = "/"
	}
	_, _ = bw.WriteString(r.Method)
	_ = bw.WriteByte(' ')
	_, _ = bw.WriteString(path)
	if query != "" {
		_ = bw.WriteByte('?')
		_, _ = bw.WriteString(query)
	}
	_, _ = bw.WriteString(" HTTP/1.1\r\nHost: ")
	_, _ = bw.WriteString(host)
	_, _ = bw.WriteString("\r\n")
	named := connectionTokens(r.Header)
	for k, vv := range r.Header {
		if isHopByHop(k) || k == "X-Forwarded-For" || k == "Content-Length" || k == "Host" ||
			(named != nil && named[k]) {
			if k == "Te" && httpguts.HeaderValuesContainsToken(vv, "trailers") {
				_, _ = bw.WriteString("Te: trailers\r\n") // as the ReverseProxy: the app can take trailers
			}
			continue
		}
		for _, v := range vv {
			_, _ = bw.WriteString(k)
			_, _ = bw.WriteString(": ")
			_, _ = bw.WriteString(v)
			_, _ = bw.WriteString("\r\n")
		}
	}
	if xff, ok := forwardedFor(r.Header, r.RemoteAddr); ok {
		_, _ = bw.WriteString("X-Forwarded-For: ")
		_, _ = bw.WriteString(xff)
		_, _ = bw.WriteString("\r\n")
	}
	switch {
	case r.ContentLength > 0:
		_, _ = bw.WriteString("Content-Length: ")
		writeInt(bw, r.ContentLength, 10)
		_, _ = bw.WriteString("\r\n")
	case r.ContentLength < 0 && r.Body != nil && r.Body != http.NoBody:
		_, _ = bw.WriteString("Transfer-Encoding: chunked\r\n")
	case r.Method == http.MethodPost || r.Method == http.MethodPut || r.Method == http.MethodPatch:
		_, _ = bw.WriteString("Content-Length: 0\r\n") // as http.Transport: these methods announce an empty body
	}
	_, _ = bw.WriteString("\r\n")
}

// errAppBody marks a failure to read the app's request body (as opposed to writing upstream).
var errAppBody = errors.New("reading the request body")

// writeBody sends the request body (chunked when its length is unknown, so each piece is
// flushed as the app sends it) and flushes. A body the app fails to deliver closes the
// connection: the upstream must not take a truncated body for a whole one, and the answer
// reader then fails at once instead of waiting for the deadline.
func (uc *upConn) writeBody(body io.Reader, length int64) error {
	buf := copyBuffers.Get().(*[copyBufferSize]byte)
	defer copyBuffers.Put(buf)
	chunked := length < 0
	var sent int64
	for {
		n, rerr := body.Read(buf[:])
		if n > 0 {
			if !chunked && sent+int64(n) > length {
				n = int(length - sent) // the server's body reader would not give more anyway
			}
			sent += int64(n)
			if chunked {
				writeInt(uc.bw, int64(n), 16)
				_, _ = uc.bw.WriteString("\r\n")
			}
			_, _ = uc.bw.Write(buf[:n])
			if chunked {
				_, _ = uc.bw.WriteString("\r\n")
				if err := uc.bw.Flush(); err != nil {
					return err
				}
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			uc.close()
			return errors.Join(errAppBody, rerr)
		}
	}
	if !chunked && sent != length {
		uc.close()
		return errors.Join(errAppBody, io.ErrUnexpectedEOF)
	}
	if chunked {
		_, _ = uc.bw.WriteString("0\r\n\r\n")
	}
	return uc.bw.Flush()
}

// hop-by-hop header fields (RFC 9110 §7.6.1 and the older Keep-Alive, Proxy-Connection), in
// canonical form.
func isHopByHop(k string) bool {
	switch k {
	case "Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate", "Proxy-Authorization",
		"Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return true
	}
	return false
}

// connectionTokens returns the header names listed in Connection, canonical; nil when none (no
// allocation in the usual case).
func connectionTokens(h http.Header) map[string]bool {
	vv := h["Connection"]
	if len(vv) == 0 {
		return nil
	}
	var m map[string]bool
	for _, v := range vv {
		for tok := range strings.SplitSeq(v, ",") {
			if tok = strings.TrimSpace(tok); tok != "" {
				if m == nil {
					m = map[string]bool{}
				}
				m[textproto.CanonicalMIMEHeaderKey(tok)] = true
			}
		}
	}
	return m
}

// removeHopByHop deletes the hop-by-hop fields of a response header, those named in its
// Connection field included.
func removeHopByHop(h http.Header) {
	for k := range connectionTokens(h) {
		delete(h, k)
	}
	for k := range h { // one pass over the few fields, rather than a delete per hop-by-hop name
		if isHopByHop(k) {
			delete(h, k)
		}
	}
}

func isEventStream(h http.Header) bool {
	ct, _, _ := strings.Cut(h.Get("Content-Type"), ";")
	return strings.EqualFold(strings.TrimSpace(ct), "text/event-stream")
}
