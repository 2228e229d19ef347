package h1

import (
	"bufio"
	"crypto/tls"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"
)

// Client: plain HTTP/1.1 over a pool of kept-alive connections per upstream host, driven
// synchronously by the caller's goroutine. http.Transport spends two goroutines
// per connection (readLoop, writeLoop) and channel handoffs between them and the caller on
// every call; on the agent's small calls that machinery cost more CPU than the proxying. Here a
// call without a request body is: write the head, flush, read the answer on the same goroutine.
// A call with a body writes it from a second goroutine while the answer is read, so that an
// upstream answering before it read the whole body (or streaming both ways) works as with
// http.Transport — except a body already in memory and small (HTTPClient): it goes out with the
// head in one write, which the socket's empty send buffer takes whole without the upstream
// reading it, so nothing can wait on the upstream before the answer is read.
//
// Nothing is ever re-sent: a connection is taken from the pool only after a check that the
// upstream has not closed it while idle (see alive), and once the request was written, any
// failure is the call's failure, returned to the caller. A connection goes back to the pool
// only when the answer's body ended cleanly, the answer allows keep-alive and the request was
// written whole; anything else closes it.

const (
	// DefaultMaxIdlePerHost bounds the idle connections kept per upstream host (as the
	// MaxIdleConnsPerHost of the agent's http.Transport); SetMaxIdlePerHost changes it.
	DefaultMaxIdlePerHost = 1024
	// DefaultIdleTimeout closes a connection idle for longer (as the agent's http.Transport's
	// IdleConnTimeout).
	DefaultIdleTimeout = 90 * time.Second
	// MaxInlineBody is the longest request body HTTPClient sends with the head in one write (see
	// Client): together they fit the connection's write buffer, and any socket's send buffer.
	MaxInlineBody = 3 << 10
	// bodyWriteGrace is how long a complete answer waits for the request body's writer to
	// report before the connection is given up (http.Transport waits as long).
	bodyWriteGrace = 50 * time.Millisecond
	// MaxResponseHeaderBytes bounds an answer's heads together (status lines and fields, the
	// 1xx heads before the final one included, as http.Transport counts them): an upstream
	// answering with an endless head, or endless 1xx heads, must not take the caller's memory.
	// 1 MiB, as http.DefaultMaxHeaderBytes for requests; http.Transport's default is 10 MiB,
	// which 1,024 pooled connections could not afford. SetMaxResponseHeaderBytes lowers it
	// for a caller whose peers send small heads (the manager: an agent's are under 300 bytes,
	// and parsing a head of many small fields allocates about 14 times its size).
	MaxResponseHeaderBytes = 1 << 20
)

// BadResponseError is an answer Client cannot read as HTTP/1.1: heads over the client's limit
// (MaxResponseHeaderBytes), a malformed head, a protocol switch nobody asked for. The upstream
// misbehaves; its connection is closed.
type BadResponseError struct {
	Reason string // what is wrong with the answer, for people
	Err    error  // the parser's error, if any
}

func (e *BadResponseError) Error() string { return "bad response from the upstream: " + e.Reason }
func (e *BadResponseError) Unwrap() error { return e.Err }

var errResponseHeadTooLarge = errors.New("response head too large")

// ConnectError is a failure to make a new connection to the upstream — the dial, or the TLS
// handshake of a Target with TLS: nothing of the request was sent. Err is the dialer's or the
// Handshaker's error (errors.Is and errors.As see through).
type ConnectError struct{ Err error }

func (e *ConnectError) Error() string { return e.Err.Error() }
func (e *ConnectError) Unwrap() error { return e.Err }

// Handshaker makes a new connection to an upstream a TLS client connection (package
// upstreamtls's Upstream): the handshake done, the connection's deadline left at deadline. On
// error it has closed raw.
type Handshaker interface {
	Handshake(raw net.Conn, deadline time.Time) (*tls.Conn, error)
}

// CanSend reports whether Client can send r to u: http, or https (the caller then gives the
// Target its TLS), no protocol upgrade (which needs the caller's connection hijacked and
// tunnelled), no Expect: 100-continue (Client does not wait for an upstream's 100 before it
// sends the body). http.Transport sends the rest.
func CanSend(r *http.Request, u *url.URL) bool {
	if u.Scheme != "http" && u.Scheme != "https" {
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

// Client is the HTTP/1.1 client: it holds the idle connections of every upstream host. Its
// zero value is not usable; use NewClient.
type Client struct {
	hosts sync.Map // poolKey -> *hostPool
	// last is the pool host returned last: an agent's calls mostly go to one upstream, and
	// comparing its key costs less than hashing it into hosts (an interface in the key).
	last   atomic.Pointer[hostPool]
	dialer net.Dialer
	// idleTimeout closes a connection idle for longer (DefaultIdleTimeout; tests shorten it
	// with SetIdleTimeout).
	idleTimeout time.Duration
	// maxIdle bounds the idle connections kept per host (DefaultMaxIdlePerHost).
	maxIdle int
	// maxHead bounds an answer's heads together (MaxResponseHeaderBytes).
	maxHead int64
	// reaping: a timer is set to close the connections that will have been idle too long (see
	// reap).
	reaping atomic.Bool
}

// NewClient returns a Client that dials with a 10 s timeout and TCP keep-alive every 30 s and
// closes connections idle for DefaultIdleTimeout.
func NewClient() *Client {
	return &Client{dialer: net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second},
		idleTimeout: DefaultIdleTimeout, maxIdle: DefaultMaxIdlePerHost, maxHead: MaxResponseHeaderBytes}
}

// SetIdleTimeout changes how long a connection may stay idle; call it before the first Do.
func (p *Client) SetIdleTimeout(d time.Duration) { p.idleTimeout = d }

// SetMaxIdlePerHost changes how many idle connections are kept per upstream host (at least
// one); call it before the first Do. A caller that sends one request at a time to each of many
// hosts (the manager to its agents) keeps one.
func (p *Client) SetMaxIdlePerHost(n int) { p.maxIdle = max(n, 1) }

// SetMaxResponseHeaderBytes changes how many bytes an answer's heads may take together (at
// least 1 KiB; MaxResponseHeaderBytes by default); call it before the first Do. An answer over
// it fails with a *BadResponseError and its connection is closed.
func (p *Client) SetMaxResponseHeaderBytes(n int) { p.maxHead = int64(max(n, 1<<10)) }

// poolKey names a pool: the upstream's host and, for TLS, the Handshaker (connections made
// with one TLS identity are never lent to a call of another).
type poolKey struct {
	host string
	tls  Handshaker
}

type hostPool struct {
	key  poolKey
	addr string // host:port to dial
	mu   sync.Mutex
	idle []*upConn // the most recently used last: reuse keeps few connections warm
	// gone: reap dropped this pool from the map (it had no idle connection); put must not
	// add to it, or the connection would be kept where neither get nor reap looks, and host
	// must not return it (last). Set under mu.
	gone atomic.Bool
}

// upConn is one connection to an upstream. Its buffers are held only while it carries an
// exchange: an idle connection gives them back to the readers and writers pools (put) and
// takes them again when it is used (get), so that many idle connections (the manager's, one
// per agent: 8 KiB each, 80 MB at 10,000 agents) hold none. An idle connection's reader held
// nothing buffered (put closes one that did), so nothing is lost with it.
type upConn struct {
	conn      net.Conn      // the TLS connection over raw, or raw
	raw       net.Conn      // the TCP connection: closed without a TLS close_notify, which could block
	lr        headLimit     // between conn and br: bounds a head while it is read
	br        *bufio.Reader // nil while idle
	bw        *bufio.Writer // nil while idle
	idleSince time.Time
	peek      peeker
	ex        exchange // the exchange in progress, if any
}

// headLimit reads from c at most remain bytes, then fails with errResponseHeadTooLarge. While
// an answer's heads are read remain starts at limit; while its body is read it is unbounded.
type headLimit struct {
	c      net.Conn
	remain int64
	limit  int64
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

func (p *Client) host(k poolKey) *hostPool {
	if hp := p.last.Load(); hp != nil && hp.key == k && !hp.gone.Load() {
		return hp
	}
	if v, ok := p.hosts.Load(k); ok {
		hp := v.(*hostPool)
		p.last.Store(hp)
		return hp
	}
	addr := k.host
	if _, port, err := net.SplitHostPort(k.host); err != nil || port == "" {
		port = "80"
		if k.tls != nil {
			port = "443"
		}
		addr = net.JoinHostPort(strings.Trim(k.host, "[]"), port)
	}
	v, _ := p.hosts.LoadOrStore(k, &hostPool{key: k, addr: addr})
	hp := v.(*hostPool)
	p.last.Store(hp)
	return hp
}

// get returns a connection to k's host with deadline set: an idle one the upstream has not
// closed, or a new one (its errors: *ConnectError).
func (p *Client) get(k poolKey, deadline time.Time) (*upConn, error) {
	hp := p.host(k)
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
		uc.takeBuffers()
		return uc, nil
	}
	d := p.dialer
	d.Deadline = deadline
	raw, err := d.Dial("tcp", hp.addr)
	if err != nil {
		return nil, &ConnectError{Err: err}
	}
	raw = fastConn(raw)
	conn := raw
	if k.tls != nil {
		// TLS over the raw connection: crypto/tls reads and writes through rawIO. The idle
		// check peeks at the TCP socket: TLS records the upstream sent unasked (an alert, a
		// close_notify) make the connection unusable as much as plain bytes would.
		tc, err := k.tls.Handshake(raw, deadline)
		if err != nil {
			return nil, &ConnectError{Err: err}
		}
		conn = tc
	}
	uc := &upConn{conn: conn, raw: raw, lr: headLimit{c: conn, remain: math.MaxInt64, limit: p.maxHead}}
	uc.takeBuffers()
	uc.peek.init(raw)
	if err := conn.SetDeadline(deadline); err != nil {
		uc.close()
		return nil, &ConnectError{Err: err}
	}
	return uc, nil
}

// put returns a connection whose last exchange ended cleanly to the idle pool of host, without
// its buffers (see upConn). One whose reader holds bytes the upstream sent unasked is closed
// instead: get would refuse it (alive), and its buffer cannot be given back with them.
func (p *Client) put(k poolKey, uc *upConn) {
	if uc.br.Buffered() != 0 {
		uc.close()
		return
	}
	uc.releaseBuffers()
	uc.idleSince = time.Now()
	hp := p.host(k)
	hp.mu.Lock()
	for hp.gone.Load() {
		hp.mu.Unlock()
		hp = p.host(k)
		hp.mu.Lock()
	}
	// Close the oldest when full or expired; the pool is a stack, so they are at the bottom.
	var stale *upConn
	if len(hp.idle) > 0 && (len(hp.idle) >= p.maxIdle || uc.idleSince.Sub(hp.idle[0].idleSince) > p.idleTimeout) {
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
// A host left without idle connections is dropped from the map: a caller of many short-lived
// upstreams (the manager's agents, each pod its own address) would otherwise keep one entry
// per address it ever called.
func (p *Client) reap() {
	now := time.Now()
	var stale []*upConn
	next := time.Duration(-1)
	p.hosts.Range(func(k, v any) bool {
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
		} else {
			hp.gone.Store(true)
			p.hosts.CompareAndDelete(k, hp)
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

// CloseIdleConnections closes every idle connection.
func (p *Client) CloseIdleConnections() {
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

// close closes the connection. Its buffers, if it holds them (it was not idle), are left to the
// collector rather than pooled: a body writer or a reader of the answer may still be using
// them, and an idle connection gave its own back already (put) — nothing is pooled twice.
func (uc *upConn) close() { _ = uc.raw.Close() }

// takeBuffers gives an idle (or new) connection its read and write buffers, from the pools.
func (uc *upConn) takeBuffers() {
	uc.br = readers.Get().(*bufio.Reader)
	uc.br.Reset(&uc.lr)
	uc.bw = writers.Get().(*bufio.Writer)
	uc.bw.Reset(uc.conn)
}

// releaseBuffers gives the buffers of a connection going idle back to the pools: its exchange
// ended (the answer's body was read to its end and closed, the request body's writer
// finished), so nothing uses them any more. They keep no reference to the connection.
func (uc *upConn) releaseBuffers() {
	br, bw := uc.br, uc.bw
	uc.br, uc.bw = nil, nil
	poolBuffers(br, bw)
}

// poolBuffers puts a connection's buffers back in the pools, detached from it; a variable so
// that a test can count what is given back.
var poolBuffers = func(br *bufio.Reader, bw *bufio.Writer) {
	br.Reset(nil)
	readers.Put(br)
	bw.Reset(nil)
	writers.Put(bw)
}

// alive reports whether an idle connection can carry a request: the upstream has neither
// closed it nor sent anything unasked (both would be read as the next call's answer). An idle
// connection's reader holds nothing (put).
func (uc *upConn) alive() bool {
	return uc.peek.idle()
}

// Target is where Do sends a request, and the fields of its head that are the caller's rather
// than the request's.
type Target struct {
	// Host is the upstream's host[:port], as in a URL: dialled (port 80 when none is given) and
	// sent as the Host field.
	Host string
	// Path is the escaped request path ("" is sent as "/"); RawQuery the query, without '?'.
	Path, RawQuery string
	// ForwardedFor, when not empty, is sent as the X-Forwarded-For field. The request's own
	// X-Forwarded-For is never sent: a proxy computes the chain (see the proxy package).
	ForwardedFor string
	// TLS, when not nil, makes new connections TLS connections (port 443 when Host has none),
	// pooled apart from those of other Handshakers; nil: plain TCP.
	TLS Handshaker
}

// Do sends req to t and returns the upstream's final answer (informational ones other than 101
// are dropped; a 101 is a *BadResponseError, as Do sends no upgrade); deadline bounds the
// whole exchange, body included (it is the connection's deadline: no timer per call).
//
// The head is req's method, t's target and Host, req's header without its hop-by-hop fields
// (IsHopByHop, and those named in its Connection field; "TE: trailers" is kept), without Host,
// Content-Length and X-Forwarded-For, and with framing of Do's own: Content-Length when
// req.ContentLength > 0, chunked when it is unknown (-1) with a body, Content-Length: 0 for a
// POST, PUT or PATCH without one.
//
// Nothing is ever re-sent. A failure to make a new connection (the dial, t.TLS's handshake) is a
// *ConnectError: nothing was sent. Other errors are the connection's (write, read: a *net.OpError,
// os.ErrDeadlineExceeded, io.ErrUnexpectedEOF, ...) or a *BadResponseError; a failure to read
// req.Body is joined with the error of the exchange it cut short.
//
// The answer's body must be closed, and not used after: Close ends the exchange, waits for the
// request body's writer, and returns the connection to the pool when the body was read to its
// end (io.EOF), the answer allows keep-alive and the request was written whole; otherwise it
// closes the connection. (The body is the connection's, reused by its next exchange: that is
// why it must not be used after Close.) A body whose reading fails closes its connection at
// once. Do never closes req.Body, except to end a read of it
// that blocks the writer when the answer ended and the writer has not finished within
// bodyWriteGrace (the upstream did not want the rest): req.Body's Close must then end that
// read.
func (p *Client) Do(req *http.Request, t Target, deadline time.Time) (*http.Response, error) {
	return p.do(req, t, deadline, nil)
}

// do is Do; inline, when not nil, is the request's body, already read from req.Body (whose
// ContentLength is its length, at most MaxInlineBody): it is written with the head, in one
// write, on the caller's goroutine (see HTTPClient).
func (p *Client) do(req *http.Request, t Target, deadline time.Time, inline []byte) (*http.Response, error) {
	key := poolKey{host: t.Host, tls: t.TLS}
	uc, err := p.get(key, deadline)
	if err != nil {
		return nil, err
	}
	ex := &uc.ex // the connection's: no allocation per call
	*ex = exchange{p: p, uc: uc, key: key, reqBody: req.Body}
	writeRequestHead(uc.bw, req, t)
	switch {
	case inline != nil:
		// As the body writer: a failed write is the exchange's only if no answer can be read
		// (the upstream may have answered and closed before reading it all).
		// The last write waits until the answer can be read (awaitAnswer): nothing is left to send.
		_, _ = uc.bw.Write(inline)
		if ex.writeErr = awaitAnswer(uc.conn, uc.bw); ex.writeErr != nil {
			ex.unsent = true
		}
	case req.Body != nil && req.Body != http.NoBody && req.ContentLength != 0:
		ex.bodyDone = make(chan error, 1)
		go func() { ex.bodyDone <- uc.writeBody(req.Body, req.ContentLength) }()
	default:
		if err := awaitAnswer(uc.conn, uc.bw); err != nil {
			uc.close()
			return nil, err
		}
	}
	// The body is read to its end or its connection closed; Close would drain it.
	res, err := readResponse(uc.br, &uc.lr, req) //nolint:bodyclose // see above
	if err != nil {
		ex.waitBody()
		uc.close()
		if ex.writeErr != nil {
			return nil, ex.writeErr // the cause: the answer's read failed because of it
		}
		return nil, err
	}
	ex.body, ex.close = res.Body, res.Close
	res.Body = ex
	return res, nil
}

// exchange is one request on a connection, from the head written to the answer's body closed:
// the answer's body as Do returns it. Each connection has one, reused.
type exchange struct {
	p       *Client
	uc      *upConn
	key     poolKey
	reqBody io.ReadCloser
	// bodyDone reports the request body's writer's end; nil: no request body, or it reported.
	bodyDone chan error
	// unsent: the request was not written whole (an inline body's write failed, writeErr).
	unsent   bool
	writeErr error
	body     io.ReadCloser // the answer's body as read from the connection
	close    bool          // the answer does not allow keep-alive
	eof      bool          // the body's end was read
	ended    bool          // the body failed or was closed
}

// waitBody waits for the request body's writer and reports whether the whole request was
// sent. When the answer is complete (or failed) and the writer has not finished within
// bodyWriteGrace (it may just be returning), the upstream did not want the rest: the
// connection is closed to end the writer, and cannot be reused.
func (ex *exchange) waitBody() bool {
	if ex.bodyDone == nil {
		return !ex.unsent
	}
	select {
	case err := <-ex.bodyDone:
		ex.bodyDone = nil
		return err == nil
	default:
	}
	t := time.NewTimer(bodyWriteGrace)
	defer t.Stop()
	select {
	case err := <-ex.bodyDone:
		ex.bodyDone = nil
		return err == nil
	case <-t.C:
	}
	// The writer is blocked writing upstream (closing the connection ends that) or reading the
	// request body (closing it ends that: see Do).
	ex.uc.close()
	_ = ex.reqBody.Close()
	<-ex.bodyDone //nolint:errcheck // it fails: its connection was just closed
	ex.bodyDone = nil
	return false
}

// Read reads the answer's body; a failure closes the connection.
func (ex *exchange) Read(b []byte) (int, error) {
	if ex.ended {
		return 0, errReadAfterEnd
	}
	if ex.eof {
		return 0, io.EOF
	}
	n, err := ex.body.Read(b)
	switch {
	case err == nil:
	case errors.Is(err, io.EOF):
		ex.eof = true
	default:
		// Broken after the head: the connection cannot be used again.
		ex.ended = true
		ex.uc.close()
		ex.waitBody()
	}
	return n, err
}

var errReadAfterEnd = errors.New("h1: read of an answer body that failed or was closed")

// Close ends the exchange (see Do).
func (ex *exchange) Close() error {
	if ex.ended {
		return nil
	}
	ex.ended = true
	reuse := ex.eof && ex.waitBody() && !ex.close
	if !reuse {
		ex.waitBody()
	}
	ex.reqBody, ex.body = nil, nil // an idle connection keeps nothing of the call
	if reuse {
		ex.p.put(ex.key, ex.uc)
	} else {
		ex.uc.close()
	}
	return nil
}

// readResponse reads the upstream's final answer; informational answers other than 101 are
// dropped (the lean path never sends Expect, and 103 hints are optional). A 101 to a request
// that asked for no upgrade is an error. lim (nil: none) is the reader under br: the heads
// together may take at most lim.limit bytes from the connection (plus what br buffered
// before), as http.Transport counts them (a 1xx head does not renew the allowance, or endless
// 1xx heads would be read for ever), the body any amount. Errors of the answer itself (too
// large, malformed, a 101) are *badResponseError; those of the connection are returned as
// they are.
func readResponse(br *bufio.Reader, lim *headLimit, r *http.Request) (*http.Response, error) {
	var limit int64
	if lim != nil {
		limit = lim.limit
		lim.remain = limit
	}
	for {
		// Wait for the answer's first bytes; a head whole in them and in the common subset is
		// read without net/http (see head.go).
		_, err := br.Peek(1)
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF // as http.ReadResponse: the answer is missing
			}
			return nil, headError(err, limit)
		}
		res, ok := readResponseHead(br, r)
		if !ok {
			if res, err = http.ReadResponse(br, r); err != nil {
				return nil, headError(err, limit)
			}
		}
		switch {
		case res.StatusCode == http.StatusSwitchingProtocols:
			return nil, &BadResponseError{Reason: "the upstream switched protocols unasked"}
		case res.StatusCode >= 100 && res.StatusCode < 200:
			continue
		}
		if lim != nil {
			lim.remain = math.MaxInt64 // the body
		}
		return res, nil
	}
}

// headError sorts an error reading an answer's head: the connection's (a timeout, a reset, the
// upstream closing) as is, the answer's own (over the limit, not HTTP) as *badResponseError.
func headError(err error, limit int64) error {
	var ne net.Error
	switch {
	case errors.Is(err, errResponseHeadTooLarge):
		return &BadResponseError{Reason: "its head is larger than " + sizeText(limit), Err: err}
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF), errors.As(err, &ne), errors.Is(err, net.ErrClosed):
		return err
	}
	return &BadResponseError{Reason: "malformed head", Err: err}
}

// sizeText writes n bytes for people: "1 MiB", "4 KiB", "1500 bytes".
func sizeText(n int64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return strconv.FormatInt(n>>20, 10) + " MiB"
	case n >= 1<<10 && n%(1<<10) == 0:
		return strconv.FormatInt(n>>10, 10) + " KiB"
	}
	return strconv.FormatInt(n, 10) + " bytes"
}

// writeRequestHead writes the request line and header into bw (not flushed): see Do.
func writeRequestHead(bw *bufio.Writer, r *http.Request, t Target) {
	path, query := t.Path, t.RawQuery
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
	_, _ = bw.WriteString(t.Host)
	_, _ = bw.WriteString("\r\n")
	named := connectionTokens(r.Header)
	for k, vv := range r.Header {
		if IsHopByHop(k) || k == "X-Forwarded-For" || k == "Content-Length" || k == "Host" ||
			(named != nil && named[k]) {
			if k == "Te" && httpguts.HeaderValuesContainsToken(vv, "trailers") {
				_, _ = bw.WriteString("Te: trailers\r\n") // as the ReverseProxy: the caller can take trailers
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
	if t.ForwardedFor != "" {
		_, _ = bw.WriteString("X-Forwarded-For: ")
		_, _ = bw.WriteString(t.ForwardedFor)
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

// errBodyRead marks a failure to read the request body (as opposed to writing upstream).
var errBodyRead = errors.New("reading the request body")

// writeBody sends the request body (chunked when its length is unknown, so each piece is
// flushed as it is read) and flushes. A body that fails to be read whole closes the
// connection: the upstream must not take a truncated body for a whole one, and the answer
// reader then fails at once instead of waiting for the deadline.
func (uc *upConn) writeBody(body io.Reader, length int64) error {
	buf := copyBuffers.Get().(*[BufferSize]byte)
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
			return errors.Join(errBodyRead, rerr)
		}
	}
	if !chunked && sent != length {
		uc.close()
		return errors.Join(errBodyRead, io.ErrUnexpectedEOF)
	}
	if chunked {
		_, _ = uc.bw.WriteString("0\r\n\r\n")
	}
	return uc.bw.Flush()
}
