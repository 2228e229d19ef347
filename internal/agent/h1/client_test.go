package h1

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// upstream is a raw HTTP/1.1 upstream on 127.0.0.1: it answers every request head with "ok"
// (Content-Length 2), counts its connections and keeps the heads it read.
type upstream struct {
	addr  string
	conns atomic.Int32
	mu    sync.Mutex
	heads []string
}

func newUpstream(t *testing.T) *upstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	u := &upstream{addr: ln.Addr().String()}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u.conns.Add(1)
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					var head strings.Builder
					for {
						line, err := br.ReadString('\n')
						if err != nil {
							return
						}
						head.WriteString(line)
						if line == "\r\n" {
							break
						}
					}
					u.mu.Lock()
					u.heads = append(u.heads, head.String())
					u.mu.Unlock()
					if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"); err != nil {
						return
					}
				}
			}()
		}
	}()
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
