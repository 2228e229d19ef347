package h1

import (
	"bufio"
	"bytes"
	"context"
	"log/slog"
	"net"
	"net/http"
	"sync"
)

// h2Preface is the HTTP/2 client connection preface (RFC 9113 §3.4). A client with prior
// knowledge (h2c, §3.3) sends it as the first bytes of the connection.
const h2Preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

// sawH2Preface reports whether the connection's first bytes, read through br, are the HTTP/2
// preface. It reads no further than it must: as soon as the bytes differ from the preface (the
// second byte of every HTTP/1.1 method but PRI does) it answers false, with the bytes left
// buffered for the HTTP/1.1 reader. While they match, it waits for the next byte (a short
// "PRI * HTTP/2.0\r\n\r\n" then waits for more, as net/http's server does); an error (the
// app closed, a timeout) is false, and the HTTP/1.1 reader then answers what was read.
func sawH2Preface(br *bufio.Reader) bool {
	n := max(br.Buffered(), 1)
	for {
		b, err := br.Peek(min(n, len(h2Preface)))
		if string(b) != h2Preface[:len(b)] {
			return false
		}
		if len(b) == len(h2Preface) {
			return true
		}
		if err != nil {
			return false
		}
		n = len(b) + 1
	}
}

// h2Server serves the connections that started with the preface: net/http's HTTP/2 server,
// unencrypted HTTP/2 only, fed by a listener the HTTP/1.1 server hands them to.
//
// Why net/http's and not x/net/http2's Server.ServeConn: since Go 1.27 x/net/http2 is a
// deprecated wrapper around net/http's own HTTP/2, and net/http serves h2c with prior knowledge
// itself (Protocols.SetUnencryptedHTTP2), with Shutdown's graceful GOAWAY. Nothing of HTTP/2 is
// written here: the framing, HPACK, flow control, stream limits and the header list size are
// net/http's.
type h2Server struct {
	srv *http.Server
	ln  *handoff
}

// h2 returns the server's HTTP/2 server, started on first use; nil once the server is closing.
func (s *Server) h2() *h2Server {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closing.Load() {
		return nil
	}
	if s.h2srv != nil {
		return s.h2srv
	}
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	cfg := *s.HTTP2
	h := &h2Server{
		srv: &http.Server{
			Handler:           s.Handler,
			Protocols:         &p,
			HTTP2:             &cfg,
			ReadHeaderTimeout: s.ReadHeaderTimeout,
			IdleTimeout:       s.IdleTimeout,
			// net/http's HTTP/2 server advertises MaxHeaderBytes (plus a margin) as
			// SETTINGS_MAX_HEADER_LIST_SIZE and refuses larger header blocks.
			MaxHeaderBytes: s.MaxHeaderBytes,
			ErrorLog:       slog.NewLogLogger(s.logger().Handler(), slog.LevelDebug),
		},
		ln: &handoff{conns: make(chan net.Conn), done: make(chan struct{})},
	}
	go func() { _ = h.srv.Serve(h.ln) }()
	s.h2srv = h
	return h
}

// serveH2 hands the connection, whose buffered bytes (the preface, maybe more) are in c.br, to
// the HTTP/2 server; the HTTP/1.1 server forgets it. The buffers go back to their pools: the
// bytes read ahead are copied in front of the connection.
func (c *srvConn) serveH2() {
	h := c.s.h2()
	pre, _ := c.br.Peek(c.br.Buffered())
	nc := &prefixConn{Conn: c.conn, pre: bytes.Clone(pre)}
	c.br.Reset(nil)
	readers.Put(c.br)
	c.bw.Reset(nil)
	writers.Put(c.bw)
	c.cancel()
	c.s.forget(c)
	if h == nil || !h.ln.hand(nc) {
		_ = nc.Close()
	}
}

// shutdownH2 shuts the HTTP/2 server down gracefully: GOAWAY, then it waits until the streams
// in flight ended or ctx ends.
func (s *Server) shutdownH2(ctx context.Context) error {
	if h := s.h2Started(); h != nil {
		return h.srv.Shutdown(ctx)
	}
	return nil
}

// closeH2 closes the HTTP/2 server and every connection it serves.
func (s *Server) closeH2() error {
	if h := s.h2Started(); h != nil {
		return h.srv.Close()
	}
	return nil
}

func (s *Server) h2Started() *h2Server {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.h2srv
}

// prefixConn is a connection whose first bytes were already read: Read returns them first.
// Only the HTTP/2 server's reader reads it, one Read at a time.
type prefixConn struct {
	net.Conn
	pre []byte
}

func (p *prefixConn) Read(b []byte) (int, error) {
	if len(p.pre) > 0 {
		n := copy(b, p.pre)
		p.pre = p.pre[n:]
		return n, nil
	}
	return p.Conn.Read(b)
}

// handoff is the HTTP/2 server's listener: it accepts the connections the HTTP/1.1 server
// hands it, until closed.
type handoff struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

// hand passes c to Accept; false: the listener is closed (c is not taken).
func (l *handoff) hand(c net.Conn) bool {
	select {
	case l.conns <- c:
		return true
	case <-l.done:
		return false
	}
}

func (l *handoff) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *handoff) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *handoff) Addr() net.Addr { return handoffAddr{} }

type handoffAddr struct{}

func (handoffAddr) Network() string { return "h2c" }
func (handoffAddr) String() string  { return "h1-handoff" }
