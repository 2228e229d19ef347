package h1

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/net/http/httpguts"
)

// Server is the HTTP/1.1 server: one goroutine per connection that reads a request (in one pass,
// or with http.ReadRequest), runs Handler and writes the answer, then waits for the next.
//
// Why not http.Server: it starts a background read on the connection for every request (to
// notice the client leaving) and parks and wakes it again when the handler is done; with the
// rest of its per-request machinery that was half of the agent's CPU on small calls. The app is
// a local process on loopback; the agent needs HTTP/1.1 with keep-alive, pipelining (served in
// order), streamed bodies both ways, Expect: 100-continue, hijacking for upgrades, trailers and
// a graceful shutdown, which is what this implements. Not done here: HTTP/2 (handed to net/http's
// HTTP/2 server when HTTP2 is set, see h2c.go), TLS, and Content-Type sniffing (a proxy passes the upstream's header
// as it is). A request's context is cancelled when the app is found gone: only watched while
// the handler waits (see watchCtx), and otherwise noticed when the answer cannot be written.
type Server struct {
	Handler http.Handler
	// ReadHeaderTimeout bounds reading a request's header once its first byte arrived; 0: none.
	ReadHeaderTimeout time.Duration
	// IdleTimeout closes a kept-alive connection with no request for that long; 0: never.
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds a request's line and header; 0 means http.DefaultMaxHeaderBytes.
	MaxHeaderBytes int
	// Logger gets handler panics (but ErrAbortHandler) at error level; nil: slog.Default().
	Logger *slog.Logger
	// Refusal gives the body of the answer to a request the server refuses before any handler
	// sees it (400 malformed, 417 an Expect other than 100-continue, 431 a head too large, 501 a
	// transfer coding other than chunked, 505 a version other than HTTP/1.x), and its
	// Content-Type; reason names the check that failed. nil: the status text and reason as
	// text/plain.
	Refusal func(status int, reason string) (contentType string, body []byte)
	// HTTP2, when set, serves HTTP/2 with prior knowledge (h2c, RFC 9113 §3.3) on the same
	// listeners: a connection whose first bytes are the HTTP/2 connection preface is handed to
	// net/http's HTTP/2 server (see h2Server), which serves Handler over it with this
	// configuration (its MaxConcurrentStreams, buffers, ...), with ReadHeaderTimeout,
	// IdleTimeout and MaxHeaderBytes (its header list size) as above. Any other connection is
	// HTTP/1.1 as ever. nil: the preface is refused with 505, as any version but HTTP/1.x.
	HTTP2 *http.HTTP2Config

	date      dateCache // the Date field of the second
	mu        sync.Mutex
	h2srv     *h2Server // started by the first HTTP/2 connection (under mu)
	listeners map[net.Listener]struct{}
	conns     map[*srvConn]struct{}
	closing   atomic.Bool
	sweeping  bool          // the sweeper runs (under mu)
	stop      chan struct{} // closed by Shutdown and Close: the sweeper ends
}

// A connection's phase, for the sweeper and Shutdown.
const (
	phaseIdle   = iota // waiting for a request (or a new connection)
	phaseHeader        // reading a request's header
	phaseActive        // serving a request
)

// Serve accepts connections on ln until Shutdown or Close (then it returns
// http.ErrServerClosed) or a permanent accept error.
func (s *Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.closing.Load() {
		s.mu.Unlock()
		return http.ErrServerClosed
	}
	s.init()
	s.listeners[ln] = struct{}{}
	if !s.sweeping {
		s.sweeping = true
		go s.sweep()
	}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
	}()
	var backoff time.Duration
	for {
		nc, err := ln.Accept()
		if err != nil {
			if s.closing.Load() {
				return http.ErrServerClosed
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			// Out of file descriptors and the like: wait, as http.Server does.
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		c := s.newConn(nc)
		if c == nil {
			_ = nc.Close()
			continue
		}
		go c.serve()
	}
}

// init allocates the maps; under mu.
func (s *Server) init() {
	if s.listeners == nil {
		s.listeners = map[net.Listener]struct{}{}
		s.conns = map[*srvConn]struct{}{}
		s.stop = make(chan struct{})
	}
}

// sweepTick is the sweeper's longest period: the granularity of the handlers' read and write
// deadlines (see response.SetReadDeadline).
const sweepTick = 250 * time.Millisecond

// sweep enforces IdleTimeout, ReadHeaderTimeout and the handlers' read and write deadlines, to
// the granularity of its tick: the connections note when they entered their phase and the
// deadlines their handler set, and the sweeper closes those that stayed idle or in their header
// too long, and cuts the reads and writes of those past their handler's deadline. Timers set
// and cleared on every request (read deadlines, as http.Server does) cost the agent more than
// a sweep of its few connections a few times a second.
func (s *Server) sweep() {
	tick := sweepTick
	for _, d := range []time.Duration{s.IdleTimeout, s.ReadHeaderTimeout} {
		if d > 0 {
			tick = min(tick, max(d/4, 10*time.Millisecond))
		}
	}
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case <-t.C:
		}
		now := time.Now().UnixNano()
		s.mu.Lock()
		for c := range s.conns {
			var limit time.Duration
			switch c.phase.Load() {
			case phaseIdle:
				limit = s.IdleTimeout
			case phaseHeader:
				limit = s.ReadHeaderTimeout
			}
			if limit > 0 && now-c.since.Load() > int64(limit) {
				_ = c.conn.Close()
			}
			if by := c.readBy.Load(); by != 0 && now > by && c.readBy.CompareAndSwap(by, 0) {
				c.cut.Store(true)
				_ = c.conn.SetReadDeadline(past)
			}
			if by := c.writeBy.Load(); by != 0 && now > by && c.writeBy.CompareAndSwap(by, 0) {
				c.cut.Store(true)
				_ = c.conn.SetWriteDeadline(past)
			}
		}
		s.mu.Unlock()
	}
}

// beginClosing marks the server closing and stops the sweeper; under mu.
func (s *Server) beginClosing() {
	if !s.closing.Swap(true) {
		s.init()
		close(s.stop)
	}
}

// Shutdown stops accepting, closes idle connections and waits until every request in flight
// was answered (connections close after their answer) or ctx ends (its error is returned).
// HTTP/2 connections get a GOAWAY and close once their streams in flight ended.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.beginClosing()
	s.mu.Unlock()
	s.closeListeners()
	h2done := make(chan error, 1)
	go func() { h2done <- s.shutdownH2(ctx) }()
	if err := s.shutdownH1(ctx); err != nil {
		return err
	}
	return <-h2done
}

// shutdownH1 closes the idle HTTP/1.1 connections until none is left or ctx ends.
func (s *Server) shutdownH1(ctx context.Context) error {
	t := time.NewTicker(5 * time.Millisecond)
	defer t.Stop()
	for {
		s.mu.Lock()
		for c := range s.conns {
			if c.phase.Load() == phaseIdle {
				_ = c.conn.Close()
			}
		}
		n := len(s.conns)
		s.mu.Unlock()
		if n == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Close stops accepting and closes every connection, requests in flight included.
func (s *Server) Close() error {
	s.mu.Lock()
	s.beginClosing()
	s.mu.Unlock()
	s.closeListeners()
	s.mu.Lock()
	for c := range s.conns {
		_ = c.conn.Close()
	}
	s.mu.Unlock()
	return s.closeH2()
}

func (s *Server) closeListeners() {
	s.mu.Lock()
	for ln := range s.listeners {
		_ = ln.Close()
	}
	s.mu.Unlock()
}

func (s *Server) newConn(nc net.Conn) *srvConn {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing.Load() {
		return nil
	}
	c := &srvConn{s: s, conn: fastConn(nc), remote: nc.RemoteAddr().String()}
	c.ctx, c.cancel = context.WithCancel(context.Background())
	c.reqCtx = watchCtx{Context: c.ctx, c: c}
	c.enter(phaseIdle)
	s.conns[c] = struct{}{}
	return c
}

func (s *Server) forget(c *srvConn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
}

func (s *Server) logger() *slog.Logger {
	if s.Logger != nil {
		return s.Logger
	}
	return slog.Default()
}

// Buffers of a connection, recycled when it closes: an idle keep-alive connection costs its
// goroutine and these 8 KiB. The client's connections to upstreams share them, and hold them
// only while carrying an exchange (upConn). Bodies larger than connBufSize bypass them (bufio
// reads and writes large slices directly).
var (
	readers = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, connBufSize) }}
	writers = sync.Pool{New: func() any { return bufio.NewWriterSize(nil, connBufSize) }}
)

// connBufSize is the size of each connection's read and write buffers.
const connBufSize = 4 << 10

type srvConn struct {
	s      *Server
	conn   net.Conn
	remote string
	ctx    context.Context
	cancel context.CancelFunc
	lr     limitedConn
	// The watch of the app's connection during a request (see watchCtx), under watchMu.
	watchMu            sync.Mutex
	watching, watchOff bool
	watchDone          chan struct{}
	reqCtx             context.Context
	br                 *bufio.Reader
	bw                 *bufio.Writer
	res                response
	phase              atomic.Int32 // phaseIdle, ...
	since              atomic.Int64 // when phase began, Unix nanoseconds
	// The handler's deadlines for reading the request body and writing the answer (Unix
	// nanoseconds, 0: none), enforced by the sweeper (see SetReadDeadline); cut: one was
	// applied to the connection, which then closes after the answer.
	readBy, writeBy atomic.Int64
	cut             atomic.Bool
	// wmu orders the 100 Continue, written from whichever goroutine first reads the body,
	// with the answer's header, written by the handler.
	wmu sync.Mutex
}

func (c *srvConn) enter(phase int32) {
	c.since.Store(time.Now().UnixNano())
	c.phase.Store(phase)
}

// limitedConn reads from the connection at most remain bytes (it bounds a request's header),
// the byte a watch read first if any. While teeing, it keeps a copy of what it read (the head
// http.ReadRequest reads, see readRequestSlow).
type limitedConn struct {
	c       net.Conn
	remain  int64
	held    byte
	holding bool
	teeing  bool
	tee     []byte
}

// readRequestSlow reads a head outside readRequestHead's subset with http.ReadRequest, and the
// facts about it that http.ReadRequest does not keep, from a copy of its bytes: those buffered
// before, and those read from the connection while it read; the head is what it consumed of
// them. Only heads outside the subset pay for the copy.
func (c *srvConn) readRequestSlow() (*http.Request, headFacts, error) {
	pre, _ := c.br.Peek(c.br.Buffered())
	c.lr.tee = append(c.lr.tee[:0], pre...)
	c.lr.teeing = true
	req, err := http.ReadRequest(c.br)
	c.lr.teeing = false
	var f headFacts
	if err == nil {
		f = scanHeadFacts(c.lr.tee[:len(c.lr.tee)-c.br.Buffered()])
	}
	if cap(c.lr.tee) > 64<<10 {
		c.lr.tee = nil // a large head: do not keep its copy with the connection
	}
	return req, f, err
}

var errHeaderTooLarge = errors.New("request header too large")

func (l *limitedConn) Read(p []byte) (int, error) {
	if l.remain <= 0 {
		return 0, errHeaderTooLarge
	}
	if len(p) == 0 {
		return 0, nil
	}
	if l.holding {
		p[0], l.holding = l.held, false
		l.remain--
		if l.teeing {
			l.tee = append(l.tee, p[0])
		}
		return 1, nil
	}
	if int64(len(p)) > l.remain {
		p = p[:l.remain]
	}
	n, err := l.c.Read(p)
	l.remain -= int64(n)
	if l.teeing {
		l.tee = append(l.tee, p[:n]...)
	}
	return n, err
}

// watchCtx is a request's context. The app leaving (its connection closed) can only be seen by
// reading the connection, which http.Server does from a goroutine for every request; here the
// read starts only when something asks for Done: the handler waiting for a rate token or a
// permit. The forwarding path never does, and pays nothing.
type watchCtx struct {
	context.Context // the connection's: cancelled when the app is found gone
	c               *srvConn
}

func (w watchCtx) Done() <-chan struct{} {
	w.c.startWatch()
	return w.Context.Done()
}

// startWatch reads the app's connection in the background until stopWatch: an error but the
// stop's deadline means the app left; a byte (the next pipelined request) is kept for the next
// read. Not when the request's body is still to be read (the read would take it) or more of
// the app's bytes are buffered (the app is there, and nothing more can be seen).
//
// Done may be called from another goroutine than the handler's, and late: a timer context
// derived from the request's calls it when its timer fires, to detach itself, which may be after
// the handler moved on. watchMu orders that with stopWatch, and the body is looked at before
// the buffer, which a body's reader may be using.
func (c *srvConn) startWatch() {
	c.watchMu.Lock()
	defer c.watchMu.Unlock()
	if c.watching || c.watchOff || (c.res.body != nil && !c.res.body.eof.Load()) || c.br.Buffered() > 0 {
		return
	}
	c.watching = true
	c.watchDone = make(chan struct{})
	go func() {
		defer close(c.watchDone)
		var b [1]byte
		n, err := c.conn.Read(b[:])
		if n == 1 {
			c.lr.held, c.lr.holding = b[0], true
			return
		}
		if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			c.cancel()
		}
	}()
}

// stopWatch ends a watch read, before the connection is read again or given away.
func (c *srvConn) stopWatch() {
	c.watchMu.Lock()
	defer c.watchMu.Unlock()
	c.watchOff = true
	if !c.watching {
		return
	}
	_ = c.conn.SetReadDeadline(past)
	<-c.watchDone
	_ = c.conn.SetReadDeadline(time.Time{})
	c.watching = false
}

func (c *srvConn) serve() {
	// How the connection ends: by default gently (see close) with its buffers recycled.
	hijacked, aborted, recycle := false, false, true
	defer func() {
		if p := recover(); p != nil {
			aborted = true
			if p != http.ErrAbortHandler { //nolint:errorlint // the sentinel is panicked as is
				c.s.logger().Error("panic serving a request", "remote", c.remote, "panic", p)
			}
		}
		if hijacked {
			c.s.forget(c) // hijacked, or handed to the HTTP/2 server (serveH2)
			return
		}
		// An aborted answer is cut: what is buffered goes out, then the connection closes
		// without the end of the body.
		_ = c.bw.Flush()
		c.close(!aborted, recycle && !aborted)
	}()
	c.lr.c = c.conn
	c.br = readers.Get().(*bufio.Reader)
	c.br.Reset(&c.lr)
	c.bw = writers.Get().(*bufio.Writer)
	c.bw.Reset(c.conn)
	maxHeader := int64(c.s.MaxHeaderBytes)
	if maxHeader <= 0 {
		maxHeader = http.DefaultMaxHeaderBytes
	}
	lastPOST, peekNext, first := false, 1, true
	for {
		// Wait for the next request (IdleTimeout), then read its header (ReadHeaderTimeout):
		// both enforced by the sweeper.
		c.lr.remain = math.MaxInt64
		// The first request is read as soon as a byte comes; a later one, as net/http's server
		// does, once 4 bytes came: a shorter rest before the app closes is not a request, and
		// the connection closes without an answer.
		if _, err := c.br.Peek(peekNext); err != nil {
			return
		}
		peekNext = 4
		c.enter(phaseHeader)
		if first && c.s.HTTP2 != nil && sawH2Preface(c.br) {
			// HTTP/2 with prior knowledge: the connection is the HTTP/2 server's.
			hijacked = true
			c.serveH2()
			return
		}
		first = false
		if lastPOST {
			// As net/http's server (RFC 7230 §3 tolerance for old clients that end a POST body
			// with an extra CRLF): up to 4 CR or LF before the next request line are skipped.
			peek, _ := c.br.Peek(4)
			_, _ = c.br.Discard(leadingCRorLF(peek))
		}
		// The bufio.Reader may read ahead of the header: allow for its buffer, as http.Server.
		c.lr.remain = maxHeader + int64(c.br.Size()) - int64(c.br.Buffered())
		// A head whole in the buffer and in the common subset is read without net/http (see
		// head.go); any other by it.
		req, fast := readRequestHead(c.br, c.reqCtx)
		facts := headFacts{checked: true, host: fast && req.Host != ""}
		if !fast {
			var err error
			if req, facts, err = c.readRequestSlow(); err != nil {
				c.badRequest(err)
				return
			}
			if facts.contentLength && len(req.TransferEncoding) > 0 {
				// Both framings: net/http reads the chunked body and drops the Content-Length,
				// and so does the agent, but the connection closes after the answer (RFC 9112
				// §6.1: the message may be an attempt at smuggling).
				req.Close = true
			}
		}
		c.lr.remain = math.MaxInt64
		c.phase.Store(phaseActive)
		lastPOST = req.Method == http.MethodPost
		if code, msg := checkRequest(req, facts); code != 0 {
			c.reject(code, msg)
			return
		}
		req.RemoteAddr = c.remote
		if !fast {
			// In place, not a copy: the body http.ReadRequest made writes the trailers it
			// reads into this Request (a copy would see only declared ones).
			*req = *req.WithContext(c.reqCtx)
		}
		var body *requestBody
		if req.Body != nil && req.Body != http.NoBody {
			body = &requestBody{rc: req.Body, c: c}
			body.expect.Store(expectsContinue(req))
			req.Body = body
		}
		w := &c.res
		w.reset(c, req)
		w.body = body
		c.watchMu.Lock()
		c.watchOff = false
		c.watchMu.Unlock()
		c.s.Handler.ServeHTTP(w, req)
		c.stopWatch()
		if w.hijacked {
			hijacked = true
			return
		}
		c.readBy.Store(0)
		c.writeBy.Store(0)
		err := w.finish()
		if c.cut.Load() {
			// A deadline cut the connection's reads or writes: the answer is ended (if it can
			// still be written), and the connection is not used again.
			recycle = false
			return
		}
		if err != nil {
			return
		}
		if body != nil && !body.eof.Load() {
			// The body was not read to its end: it cannot be skipped reliably, and a
			// transport's goroutine may still be reading it, so the buffers are not recycled.
			recycle = false
			return
		}
		if !w.keepAlive {
			return
		}
		c.enter(phaseIdle)
	}
}

func leadingCRorLF(b []byte) int {
	n := 0
	for _, c := range b {
		if c != '\r' && c != '\n' {
			break
		}
		n++
	}
	return n
}

// close ends the connection. gently: half-close, let the app read the answer and close its side
// (reading what it still sends, for at most 500 ms), so that unread request bytes do not turn
// into a reset that could destroy the answer before the app read it. recycle: the buffers go
// back to their pools (only when nothing can still use them).
func (c *srvConn) close(gently, recycle bool) {
	if gently {
		if tc, ok := c.conn.(interface{ CloseWrite() error }); ok && tc.CloseWrite() == nil {
			_ = c.conn.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
			_, _ = io.Copy(io.Discard, io.LimitReader(c.conn, 256<<10))
		}
	}
	_ = c.conn.Close()
	c.cancel()
	c.s.forget(c)
	if recycle {
		c.br.Reset(nil)
		readers.Put(c.br)
		c.bw.Reset(nil)
		writers.Put(c.bw)
	}
}

// checkRequest applies the checks http.Server makes after reading a request (server.go's
// readRequest) that http.ReadRequest leaves to the server: the protocol version, a Host field
// present (HTTP/1.1) and valid, field names of token characters and values without control
// characters, and Expect. textproto accepts "Name :" on purpose (go.dev/issue/34540); a server
// must refuse it (RFC 9112 §5.1), or a proxy forwards a field its upstream may read as another
// ("Transfer-Encoding : chunked" smuggles a request past an upstream that trims the space).
// f describes the head as received; for a head readRequestHead took, whose subset has valid
// names and values and a valid Host, only the version and Expect checks are left.
func checkRequest(req *http.Request, f headFacts) (int, string) {
	if req.ProtoMajor != 1 {
		return http.StatusHTTPVersionNotSupported, "unsupported protocol version"
	}
	if req.ProtoAtLeast(1, 1) && !f.host && req.Method != http.MethodConnect {
		return http.StatusBadRequest, "missing required Host header"
	}
	if !f.checked {
		if f.host && req.URL.Host == "" {
			f.hostValue = req.Host // the field's value as textproto read it
		}
		if f.host && !httpguts.ValidHostHeader(f.hostValue) {
			return http.StatusBadRequest, "malformed Host header"
		}
		for k, vv := range req.Header {
			if !httpguts.ValidHeaderFieldName(k) {
				return http.StatusBadRequest, "invalid header name"
			}
			for _, v := range vv {
				if !httpguts.ValidHeaderFieldValue(v) {
					return http.StatusBadRequest, "invalid header value"
				}
			}
		}
	}
	if e := firstValue(req.Header["Expect"]); e != "" && !hasToken(e, "100-continue") {
		return http.StatusExpectationFailed, "unsupported Expect"
	}
	return 0, ""
}

func firstValue(vv []string) string {
	if len(vv) == 0 {
		return ""
	}
	return vv[0]
}

// headFacts are what http.ReadRequest does not tell about a head: whether it had a Host field
// (it moves the value to req.Host, or drops it for an absolute-form target), that value, and
// whether it had a Content-Length beside a Transfer-Encoding (it drops the Content-Length).
type headFacts struct {
	checked       bool // read by readRequestHead: names, values and Host are valid
	host          bool
	hostValue     string
	contentLength bool
}

// scanHead reads the facts from a head's bytes as received (request line, fields, blank line).
// A field line starts with its name (textproto refuses a first line that starts with
// whitespace and folds later ones into the line before), so a line that starts with "host:" or
// "content-length:", in any case, is that field; names with whitespace before the colon are
// refused by checkRequest.
func scanHeadFacts(head []byte) headFacts {
	var f headFacts
	inHost := false // the last field line was Host's
	nl := bytes.IndexByte(head, '\n')
	for nl >= 0 {
		line := head[nl+1:]
		end := bytes.IndexByte(line, '\n')
		if end < 0 {
			break
		}
		l := bytes.TrimSuffix(line[:end], []byte("\r"))
		if len(l) == 0 {
			break // the blank line that ends the head
		}
		if l[0] == ' ' || l[0] == '\t' {
			// obs-fold: textproto joins the line to the field before with a space.
			if inHost {
				f.hostValue = strings.TrimRight(f.hostValue, " \t") + " " + string(bytes.Trim(l, " \t"))
			}
		} else if name, value, ok := bytes.Cut(l, []byte(":")); ok {
			inHost = bytes.EqualFold(name, []byte("Host"))
			switch {
			case inHost:
				f.host = true
				f.hostValue = string(bytes.Trim(value, " \t"))
			case bytes.EqualFold(name, []byte("Content-Length")):
				f.contentLength = true
			}
		} else {
			inHost = false
		}
		nl += 1 + end
	}
	f.hostValue = strings.Trim(f.hostValue, " \t")
	return f
}

// expectsContinue reports whether the app waits for 100 Continue before it sends the body: as
// net/http's server decides, from the first Expect value only, for HTTP/1.1 with a body.
func expectsContinue(req *http.Request) bool {
	return req.ProtoAtLeast(1, 1) && req.ContentLength != 0 && hasToken(firstValue(req.Header["Expect"]), "100-continue")
}

// hasToken is net/http's own token match for Expect (server.go's hasToken): token, in ASCII
// case-insensitively, bounded by the value's ends, spaces, tabs or commas. httpguts'
// HeaderValuesContainsToken splits on commas only ("100-continue x" is no match there), and the
// verdict on a request must be net/http's server's (see the differential test).
func hasToken(v, token string) bool {
	if len(token) > len(v) || token == "" {
		return false
	}
	boundary := func(b byte) bool { return b == ' ' || b == ',' || b == '\t' }
	for sp := 0; sp <= len(v)-len(token); sp++ {
		if sp > 0 && !boundary(v[sp-1]) {
			continue
		}
		if end := sp + len(token); end != len(v) && !boundary(v[end]) {
			continue
		}
		if asciiEqualFold(v[sp:sp+len(token)], token) {
			return true
		}
	}
	return false
}

// asciiEqualFold is strings.EqualFold in ASCII only (net/http's internal/ascii.EqualFold):
// unlike strings.EqualFold it does not take "K" (U+212A) for "k".
func asciiEqualFold(s, t string) bool {
	if len(s) != len(t) {
		return false
	}
	lower := func(b byte) byte {
		if 'A' <= b && b <= 'Z' {
			return b + 'a' - 'A'
		}
		return b
	}
	for i := 0; i < len(s); i++ {
		if lower(s[i]) != lower(t[i]) {
			return false
		}
	}
	return true
}

func (c *srvConn) badRequest(err error) {
	var ne net.Error
	switch {
	case errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed):
		return // the app closed the connection
	case errors.As(err, new(*net.OpError)):
		return // a reset and the like: nobody to answer
	case errors.As(err, &ne) && ne.Timeout():
		return // idle or slow header: just close, as http.Server
	case errors.Is(err, errHeaderTooLarge):
		c.reject(http.StatusRequestHeaderFieldsTooLarge, "request header too large")
	case strings.Contains(err.Error(), "transfer encoding"):
		// net/http's unsupportedTEError ("unsupported transfer encoding", "too many transfer
		// encodings"), which its server answers 501 (RFC 9112 §6.1); it has no exported type.
		c.reject(http.StatusNotImplemented, "unsupported transfer encoding")
	default:
		c.reject(http.StatusBadRequest, "malformed request")
	}
}

// reject answers a request that cannot be served and lets the connection close: the body
// Server.Refusal gives, or the status text and msg as plain text (msg names the check that
// failed, never an address or the request's bytes).
func (c *srvConn) reject(code int, msg string) {
	contentType, b := "text/plain; charset=utf-8", []byte(http.StatusText(code)+": "+msg)
	if c.s.Refusal != nil {
		contentType, b = c.s.Refusal(code, msg)
	}
	_, _ = c.bw.WriteString("HTTP/1.1 " + strconv.Itoa(code) + " " + http.StatusText(code) +
		"\r\nContent-Type: " + contentType + "\r\nCache-Control: no-store\r\nConnection: close\r\nContent-Length: " +
		strconv.Itoa(len(b)) + "\r\n\r\n")
	_, _ = c.bw.Write(b)
}

// requestBody notes whether the handler read the request body to its end (the connection is
// kept only then) and sends 100 Continue when the body is first read. It is read by one
// goroutine at a time, not necessarily the handler's.
type requestBody struct {
	rc        io.ReadCloser
	c         *srvConn
	expect    atomic.Bool // 100 Continue not sent yet
	continued bool        // it was sent (under c.wmu)
	eof       atomic.Bool
	closed    atomic.Bool
}

func (b *requestBody) Read(p []byte) (int, error) {
	if b.closed.Load() {
		return 0, http.ErrBodyReadAfterClose
	}
	if b.eof.Load() {
		return 0, io.EOF
	}
	if b.expect.Load() && !b.c.writeContinue(b) {
		return 0, errors.New("the answer was written before the body was read")
	}
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.eof.Store(true)
	}
	return n, err
}

// Close does not drain the body (http.ReadRequest's body would read it to its end): the
// connection is closed instead when the body was not read whole.
func (b *requestBody) Close() error {
	b.closed.Store(true)
	return nil
}

// writeContinue sends 100 Continue for b unless it was sent or the answer's header went first.
func (c *srvConn) writeContinue(b *requestBody) bool {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if !b.expect.Swap(false) {
		return true // sent already, or replaced by the handler's own 100
	}
	if c.res.wroteHeader {
		return false
	}
	_, _ = c.bw.WriteString("HTTP/1.1 100 Continue\r\n\r\n")
	b.continued = true
	return c.bw.Flush() == nil
}

// response is the http.ResponseWriter of one request; a connection reuses its own.
type response struct {
	c      *srvConn
	req    *http.Request
	header http.Header

	wroteHeader bool // under c.wmu while a 100 Continue may be written
	hijacked    bool
	keepAlive   bool
	noBody      bool  // HEAD, 1xx, 204, 304: no body is sent
	chunked     bool  // Transfer-Encoding: chunked
	length      int64 // declared Content-Length, -1 when none
	written     int64
	trailers    []string // declared in the Trailer header
	err         error    // the connection failed
	body        *requestBody
}

func (w *response) reset(c *srvConn, req *http.Request) {
	h := w.header
	if h == nil {
		h = http.Header{}
	} else {
		clear(h)
	}
	*w = response{c: c, req: req, header: h, length: -1}
	w.keepAlive = !c.s.closing.Load() && keepsAlive(req)
}

// keepsAlive reports whether the app's request lets the connection stay open after the
// answer, as net/http's server decides (its wantsClose and wantsHttp10KeepAlive), which looks at
// the first Connection value with its own token match: HTTP/1.1 unless it says close (or
// http.ReadRequest found it must close), HTTP/1.0 only when it says keep-alive. (The answer may
// close it still: a body of unknown length to HTTP/1.0, see WriteHeader.)
func keepsAlive(req *http.Request) bool {
	conn := firstValue(req.Header["Connection"])
	if req.ProtoAtLeast(1, 1) {
		return !req.Close && !hasToken(conn, "close")
	}
	return hasToken(conn, "keep-alive")
}

func (w *response) Header() http.Header { return w.header }

func (w *response) WriteHeader(code int) {
	if w.hijacked || w.wroteHeader {
		return
	}
	if code < 100 || code > 999 {
		panic("invalid WriteHeader code " + strconv.Itoa(code))
	}
	bw := w.c.bw
	if code >= 100 && code < 200 && code != http.StatusSwitchingProtocols {
		// Informational: its header goes out at once; the final answer follows. A 100 from
		// the handler (the ReverseProxy passing on the upstream's) replaces the automatic one,
		// or is dropped when that went first: one 100 per request.
		w.c.wmu.Lock()
		if code == http.StatusContinue && w.body != nil {
			w.body.expect.Store(false)
			if w.body.continued {
				w.c.wmu.Unlock()
				return
			}
		}
		writeStatusLine(bw, code)
		writeHeaderFields(bw, w.header)
		_, _ = bw.WriteString("\r\n")
		w.err = bw.Flush()
		w.c.wmu.Unlock()
		return
	}
	w.c.wmu.Lock()
	defer w.c.wmu.Unlock()
	w.wroteHeader = true
	h := w.header
	w.noBody = w.req.Method == http.MethodHead || code < 200 || code == http.StatusNoContent || code == http.StatusNotModified
	if v := h["Content-Length"]; len(v) > 0 {
		if n, err := strconv.ParseInt(strings.TrimSpace(v[0]), 10, 64); err == nil && n >= 0 && len(v) == 1 {
			w.length = n
		} else {
			delete(h, "Content-Length") // invalid: the body is framed otherwise
		}
	}
	delete(h, "Transfer-Encoding") // the framing is this server's
	if httpguts.HeaderValuesContainsToken(h["Connection"], "close") {
		w.keepAlive = false
	}
	delete(h, "Connection")
	if w.c.s.closing.Load() {
		w.keepAlive = false
	}
	if !w.noBody && w.length < 0 {
		if w.req.ProtoAtLeast(1, 1) {
			w.chunked = true
			w.trailers = declaredTrailers(h["Trailer"])
		} else {
			w.keepAlive = false // HTTP/1.0: the body ends with the connection
		}
	}
	writeStatusLine(bw, code)
	writeHeaderFields(bw, h)
	if _, ok := h["Date"]; !ok {
		_, _ = bw.WriteString("Date: ")
		_, _ = bw.WriteString(w.c.s.date.text(time.Now()))
		_, _ = bw.WriteString("\r\n")
	}
	switch {
	case w.chunked:
		_, _ = bw.WriteString("Transfer-Encoding: chunked\r\n")
	}
	switch {
	case !w.keepAlive:
		_, _ = bw.WriteString("Connection: close\r\n")
	case !w.req.ProtoAtLeast(1, 1):
		_, _ = bw.WriteString("Connection: keep-alive\r\n")
	}
	_, _ = bw.WriteString("\r\n")
}

// dateCache keeps the Date field's value (http.TimeFormat, one-second resolution) of the
// second it was last asked for: formatting the time for every answer cost more than the rest
// of the status line and header together. Answers written in the same second share one value;
// the first answer of a new second formats it again.
type dateCache struct{ v atomic.Pointer[dateText] }

type dateText struct {
	sec  int64 // Unix seconds
	text string
}

// text returns the Date value for now.
func (d *dateCache) text(now time.Time) string {
	sec := now.Unix()
	if v := d.v.Load(); v != nil && v.sec == sec {
		return v.text
	}
	v := &dateText{sec: sec, text: now.UTC().Format(http.TimeFormat)}
	d.v.Store(v)
	return v.text
}

// writeInt writes n in base through bw's free buffer: a local array would escape to the heap
// through bufio.Writer.Write.
func writeInt(bw *bufio.Writer, n int64, base int) {
	_, _ = bw.Write(strconv.AppendInt(bw.AvailableBuffer(), n, base))
}

func writeStatusLine(bw *bufio.Writer, code int) {
	_, _ = bw.WriteString("HTTP/1.1 ")
	writeInt(bw, int64(code), 10)
	_ = bw.WriteByte(' ')
	text := http.StatusText(code)
	if text == "" {
		text = "status code " + strconv.Itoa(code)
	}
	_, _ = bw.WriteString(text)
	_, _ = bw.WriteString("\r\n")
}

// writeHeaderFields writes h but trailers (TrailerPrefix) and fields whose name or value could
// break the message.
func writeHeaderFields(bw *bufio.Writer, h http.Header) {
	for k, vv := range h {
		if strings.HasPrefix(k, http.TrailerPrefix) || !validFieldName(k) {
			continue
		}
		for _, v := range vv {
			if !validFieldValue(v) {
				continue
			}
			_, _ = bw.WriteString(k)
			_, _ = bw.WriteString(": ")
			_, _ = bw.WriteString(v)
			_, _ = bw.WriteString("\r\n")
		}
	}
}

func validFieldName(k string) bool {
	if k == "" {
		return false
	}
	for i := 0; i < len(k); i++ {
		if c := k[i]; c <= ' ' || c >= 0x7f || c == ':' {
			return false
		}
	}
	return true
}

func validFieldValue(v string) bool {
	return !strings.ContainsAny(v, "\r\n\x00")
}

func declaredTrailers(vv []string) []string {
	var out []string
	for _, v := range vv {
		for tok := range strings.SplitSeq(v, ",") {
			if tok = strings.TrimSpace(tok); tok != "" {
				out = append(out, http.CanonicalHeaderKey(tok))
			}
		}
	}
	return out
}

func (w *response) Write(p []byte) (int, error) {
	if w.hijacked {
		return 0, http.ErrHijacked
	}
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return 0, w.err
	}
	if len(p) == 0 {
		return 0, nil
	}
	if w.noBody {
		if w.req.Method == http.MethodHead {
			return len(p), nil
		}
		return 0, http.ErrBodyNotAllowed
	}
	if w.length >= 0 && w.written+int64(len(p)) > w.length {
		return 0, http.ErrContentLength
	}
	w.written += int64(len(p))
	bw := w.c.bw
	if w.chunked {
		writeInt(bw, int64(len(p)), 16)
		_, _ = bw.WriteString("\r\n")
	}
	n, err := bw.Write(p)
	if w.chunked && err == nil {
		_, err = bw.WriteString("\r\n")
	}
	if err != nil {
		w.err = err
	}
	return n, err
}

// FlushError sends what is buffered (http.ResponseController uses it).
func (w *response) FlushError() error {
	if w.hijacked {
		return http.ErrHijacked
	}
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if w.err != nil {
		return w.err
	}
	w.err = w.c.bw.Flush()
	return w.err
}

// Flush is http.Flusher's.
func (w *response) Flush() { _ = w.FlushError() }

// past is a deadline already passed: set on a connection, it ends a read or write in progress.
var past = time.Unix(1, 0)

// SetReadDeadline bounds reading the request body (http.ResponseController uses it); the zero
// time removes the bound. A deadline in the future is enforced by the sweeper, to its tick (at
// most sweepTick late), which costs a handler nothing per call where a timer would; one already
// passed applies at once (ending a read in progress). Once applied, the connection closes after
// the answer.
func (w *response) SetReadDeadline(t time.Time) error {
	return w.c.setDeadline(&w.c.readBy, t, w.c.conn.SetReadDeadline)
}

// SetWriteDeadline bounds writing the answer, as SetReadDeadline bounds reading: a write that
// cannot finish by then fails, and the connection closes.
func (w *response) SetWriteDeadline(t time.Time) error {
	return w.c.setDeadline(&w.c.writeBy, t, w.c.conn.SetWriteDeadline)
}

func (c *srvConn) setDeadline(by *atomic.Int64, t time.Time, apply func(time.Time) error) error {
	switch {
	case t.IsZero():
		by.Store(0)
	case !t.After(time.Now()):
		by.Store(0)
		c.cut.Store(true)
		return apply(past)
	default:
		by.Store(t.UnixNano())
	}
	return nil
}

// Hijack hands the connection over (protocol upgrades); the server forgets it.
func (w *response) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	if w.hijacked {
		return nil, nil, http.ErrHijacked
	}
	if w.wroteHeader {
		if err := w.c.bw.Flush(); err != nil {
			return nil, nil, err
		}
	}
	c := w.c
	c.stopWatch()
	w.hijacked = true
	c.readBy.Store(0)
	c.writeBy.Store(0)
	_ = c.conn.SetDeadline(time.Time{})
	// The buffers go with the connection: they may hold the app's next bytes.
	return c.conn, bufio.NewReadWriter(c.br, c.bw), nil
}

// finish ends the answer once the handler returned: an empty one if nothing was written, the
// last chunk and trailers, the flush. An answer shorter than its Content-Length closes the
// connection (the app then sees it cut).
func (w *response) finish() error {
	if !w.wroteHeader {
		if _, ok := w.header["Content-Length"]; !ok && w.req.Method != http.MethodHead {
			w.header["Content-Length"] = []string{"0"}
		}
		w.WriteHeader(http.StatusOK)
	}
	bw := w.c.bw
	if w.chunked {
		_, _ = bw.WriteString("0\r\n")
		for k, vv := range w.header {
			name, ok := strings.CutPrefix(k, http.TrailerPrefix)
			if !ok {
				continue
			}
			writeTrailer(bw, http.CanonicalHeaderKey(name), vv)
		}
		for _, k := range w.trailers {
			writeTrailer(bw, k, w.header[k])
		}
		_, _ = bw.WriteString("\r\n")
	}
	if !w.noBody && w.length >= 0 && w.written < w.length {
		w.keepAlive = false
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	return w.err
}

func writeTrailer(bw *bufio.Writer, k string, vv []string) {
	if !validFieldName(k) {
		return
	}
	for _, v := range vv {
		if validFieldValue(v) {
			_, _ = bw.WriteString(k + ": " + v + "\r\n")
		}
	}
}
