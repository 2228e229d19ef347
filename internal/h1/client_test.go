package h1

import (
	"bufio"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/h1/h1test"
)

// upstream is a raw HTTP/1.1 upstream on 127.0.0.1: it answers every request head with "ok"
// (Content-Length 2), counts its connections and keeps the heads it read.
type upstream struct {
	addr  string
	conns *atomic.Int32
	mu    sync.Mutex
	heads []string
}

// listenRaw serves every connection accepted on a loopback port with serve (in a goroutine of
// its own, the connection closed when serve returns) until the test ends; it returns the address
// and the count of connections accepted.
func listenRaw(t *testing.T, serve func(net.Conn)) (string, *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	conns := new(atomic.Int32)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			go func() {
				defer c.Close()
				serve(c)
			}()
		}
	}()
	return ln.Addr().String(), conns
}

func newUpstream(t *testing.T) *upstream {
	t.Helper()
	u := &upstream{}
	u.addr, u.conns = listenRaw(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			head, err := h1test.ReadHead(br)
			if err != nil {
				return
			}
			u.mu.Lock()
			u.heads = append(u.heads, head)
			u.mu.Unlock()
			if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"); err != nil {
				return
			}
		}
	})
	return u
}

func (u *upstream) lastHead() string {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.heads) == 0 {
		return ""
	}
	return u.heads[len(u.heads)-1]
}

func get(t *testing.T, c *Client, u *upstream, hdr http.Header, readAll bool) {
	t.Helper()
	req := &http.Request{Method: http.MethodGet, Header: hdr, Body: http.NoBody}
	res, err := c.Do(req, Target{Host: u.addr, Path: "/p", RawQuery: "q=1", ForwardedFor: "127.0.0.1"}, time.Now().Add(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if readAll {
		if b, err := io.ReadAll(res.Body); err != nil || string(b) != "ok" {
			t.Fatalf("body %q %v", b, err)
		}
	}
	res.Body.Close()
}

// The head Do writes: the target, the upstream's Host, the request's header without hop-by-hop
// fields (those named in Connection too) and without its own X-Forwarded-For, the Target's.
func TestClientHead(t *testing.T) {
	u := newUpstream(t)
	c := NewClient()
	t.Cleanup(c.CloseIdleConnections)
	get(t, c, u, http.Header{
		"Connection": {"X-Drop"}, "X-Drop": {"1"}, "Keep-Alive": {"timeout=5"}, "Te": {"trailers"},
		"X-Forwarded-For": {"10.9.9.9"}, "Host": {"app"}, "Content-Length": {"7"},
	}, true)
	want := "GET /p?q=1 HTTP/1.1\r\nHost: " + u.addr + "\r\nTe: trailers\r\nX-Forwarded-For: 127.0.0.1\r\n\r\n"
	if got := u.lastHead(); got != want {
		t.Fatalf("head %q, want %q", got, want)
	}
}

// A connection whose answer's body was read to its end is reused; one whose body was closed
// before its end is not (the rest cannot be skipped reliably).
func TestClientPoolsOnlyCleanlyEndedExchanges(t *testing.T) {
	u := newUpstream(t)
	c := NewClient()
	t.Cleanup(c.CloseIdleConnections)
	get(t, c, u, http.Header{}, true)
	get(t, c, u, http.Header{}, true)
	if n := u.conns.Load(); n != 1 {
		t.Fatalf("%d connections for two calls read to their end, want 1", n)
	}
	get(t, c, u, http.Header{}, false) // closed unread: its connection is closed
	get(t, c, u, http.Header{}, true)
	if n := u.conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2: the one whose answer was closed unread is not reused", n)
	}
}

// countPooled replaces poolBuffers for the test with one that also counts the times a
// connection gives its buffers back.
func countPooled(t *testing.T) *atomic.Int32 {
	t.Helper()
	var n atomic.Int32
	orig := poolBuffers
	poolBuffers = func(br *bufio.Reader, bw *bufio.Writer) {
		n.Add(1)
		orig(br, bw)
	}
	t.Cleanup(func() { poolBuffers = orig })
	return &n
}

// idleConns returns the idle connections Client holds for u.
func idleConns(c *Client, u *upstream) []*upConn {
	hp := c.host(poolKey{host: u.addr})
	hp.mu.Lock()
	defer hp.mu.Unlock()
	return append([]*upConn(nil), hp.idle...)
}

// An idle connection holds no buffer: it gives them back when its exchange ends, takes them
// again when it carries the next one, and works then. Closing it while idle (reaped, closed
// by CloseIdleConnections, found closed by the upstream) gives nothing back again.
func TestClientIdleConnectionHoldsNoBuffer(t *testing.T) {
	pooled := countPooled(t)
	u := newUpstream(t)
	c := NewClient()
	t.Cleanup(c.CloseIdleConnections)
	get(t, c, u, http.Header{}, true)
	idle := idleConns(c, u)
	if len(idle) != 1 {
		t.Fatalf("%d idle connections after one call, want 1", len(idle))
	}
	if idle[0].br != nil || idle[0].bw != nil {
		t.Fatalf("an idle connection holds buffers: reader %p, writer %p", idle[0].br, idle[0].bw)
	}
	if n := pooled.Load(); n != 1 {
		t.Fatalf("buffers given back %d times after one call, want 1", n)
	}
	for range 3 { // reused: the same connection, with buffers again, and works
		get(t, c, u, http.Header{"X-Call": {"again"}}, true)
	}
	if n := u.conns.Load(); n != 1 {
		t.Fatalf("%d connections for four calls, want 1 (the idle one reused)", n)
	}
	if !strings.Contains(u.lastHead(), "X-Call: again\r\n") {
		t.Fatalf("the reused connection sent %q", u.lastHead())
	}
	if again := idleConns(c, u); len(again) != 1 || again[0] != idle[0] || again[0].br != nil || again[0].bw != nil {
		t.Fatalf("idle after reuse: %v, want the first connection without buffers", again)
	}
	if n := pooled.Load(); n != 4 {
		t.Fatalf("buffers given back %d times after four calls, want 4", n)
	}

	c.CloseIdleConnections() // closed while idle: nothing more is given back
	c.reap()
	if n := pooled.Load(); n != 4 {
		t.Fatalf("buffers given back %d times after the idle connection was closed, want still 4", n)
	}
	get(t, c, u, http.Header{}, true) // a new connection, with buffers from the pool
	if n := u.conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2 (the closed one replaced)", n)
	}
	if n := pooled.Load(); n != 5 {
		t.Fatalf("buffers given back %d times, want 5", n)
	}
}

// A connection whose upstream sent bytes after the answer is not pooled: its reader holds them
// (put closes it, keeping its buffers out of the pools) or the socket does (get finds it not
// alive); either way the next call takes a new connection.
func TestClientClosesConnectionWithUnaskedBytes(t *testing.T) {
	pooled := countPooled(t)
	addr, conns := listenRaw(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			if _, err := h1test.ReadHead(br); err != nil {
				return
			}
			if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokJUNK"); err != nil {
				return
			}
		}
	})
	c := NewClient()
	t.Cleanup(c.CloseIdleConnections)
	u := &upstream{addr: addr}
	for range 2 {
		get(t, c, u, http.Header{}, true)
	}
	if n := conns.Load(); n != 2 {
		t.Fatalf("%d connections for two calls, want 2: a connection with unasked bytes is not reused", n)
	}
	for _, uc := range idleConns(c, u) {
		if uc.br != nil || uc.bw != nil {
			t.Fatalf("an idle connection holds buffers")
		}
	}
	if n := pooled.Load(); n > 2 {
		t.Fatalf("buffers given back %d times for two calls", n)
	}
}

// An answer's heads are bounded together, 1xx heads included (as http.Transport counts them):
// a head over the client's limit, or 1xx heads that reach it together, fail with a
// *BadResponseError naming the limit, and heads within it are read. Without the 1xx heads
// counted, an upstream could send them for ever, each as large as the limit.
func TestClientBoundsHeads(t *testing.T) {
	const limit = 4 << 10
	field := "X-Pad: " + strings.Repeat("p", 1000) + "\r\n" // 1,009 bytes
	for _, tc := range []struct {
		name   string
		answer string
		ok     bool
	}{
		{"small", "HTTP/1.1 200 OK\r\n" + field + "Content-Length: 2\r\n\r\nok", true},
		{"one head over", "HTTP/1.1 200 OK\r\n" + strings.Repeat(field, 5) + "Content-Length: 2\r\n\r\nok", false},
		{"1xx heads within", "HTTP/1.1 103 Early Hints\r\n" + field + "\r\n" + "HTTP/1.1 200 OK\r\n" + field + "Content-Length: 2\r\n\r\nok", true},
		{"1xx heads over together", strings.Repeat("HTTP/1.1 103 Early Hints\r\n"+field+"\r\n", 4) + "HTTP/1.1 200 OK\r\n" + field + "Content-Length: 2\r\n\r\nok", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr, _ := listenRaw(t, func(c net.Conn) {
				if _, err := h1test.ReadHead(bufio.NewReader(c)); err == nil {
					_, _ = io.WriteString(c, tc.answer)
				}
			})
			c := NewClient()
			c.SetMaxResponseHeaderBytes(limit)
			t.Cleanup(c.CloseIdleConnections)
			req := &http.Request{Method: http.MethodGet, Header: http.Header{}, Body: http.NoBody}
			res, err := c.Do(req, Target{Host: addr, Path: "/"}, time.Now().Add(10*time.Second))
			if tc.ok {
				if err != nil {
					t.Fatal(err)
				}
				if b, err := io.ReadAll(res.Body); err != nil || string(b) != "ok" {
					t.Fatalf("body %q %v", b, err)
				}
				res.Body.Close()
				return
			}
			var bad *BadResponseError
			if !errors.As(err, &bad) || !strings.Contains(err.Error(), "larger than 4 KiB") {
				t.Fatalf("Do = %v, want a *BadResponseError for a head larger than 4 KiB", err)
			}
		})
	}
}

// TestHostCache: host returns each key's own pool, the one in the map, whichever was asked
// last; never a pool reap dropped.
func TestHostCache(t *testing.T) {
	c := NewClient()
	a, b := poolKey{host: "a.test"}, poolKey{host: "b.test"}
	pa := c.host(a)
	if c.host(a) != pa {
		t.Fatal("another pool for the same key")
	}
	pb := c.host(b)
	if pb == pa || c.host(a) != pa || c.host(b) != pb {
		t.Fatal("one key's pool returned for another")
	}
	c.reap() // neither has an idle connection: both dropped
	if !pa.gone.Load() || !pb.gone.Load() {
		t.Fatal("pools without idle connections were kept")
	}
	pb2 := c.host(b) // the last one asked for, dropped: a new one
	if pb2 == pb {
		t.Fatal("host returned a dropped pool")
	}
	if v, ok := c.hosts.Load(b); !ok || v.(*hostPool) != pb2 {
		t.Fatal("the new pool is not the map's")
	}
}
