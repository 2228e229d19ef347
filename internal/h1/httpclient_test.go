package h1

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testing/wait"
)

// echoServer answers every request with its method, path and body, and counts its connections.
func echoServer(t *testing.T) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var conns atomic.Int32
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("X-Length", r.Header.Get("Content-Length"))
		_, _ = io.WriteString(w, r.Method+" "+r.URL.RequestURI()+" "+string(b))
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, &conns
}

// call sends a request and returns the answer's body and header.
func call(t *testing.T, hc HTTPClient, ctx context.Context, method, url string, body io.Reader) (string, http.Header) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, url, body)
	if err != nil {
		t.Fatal(err)
	}
	res, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b), res.Header
}

// HTTPClient sends what http.Client would: the URL's path and query, the body (inline when
// small, from the writer goroutine when not), Content-Length; and it reuses one connection.
func TestHTTPClientSendsAndPools(t *testing.T) {
	srv, conns := echoServer(t)
	c := NewClient()
	c.SetMaxIdlePerHost(1)
	t.Cleanup(c.CloseIdleConnections)
	hc := HTTPClient{C: c}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	small := strings.Repeat("a", 1500)
	large := strings.Repeat("b", MaxInlineBody+1)
	for i, tc := range []struct{ method, body string }{
		{http.MethodPut, small}, {http.MethodGet, ""}, {http.MethodPut, large}, {http.MethodPut, small},
		{http.MethodPut, strings.Repeat("c", MaxInlineBody)},
	} {
		var body io.Reader
		if tc.body != "" {
			body = strings.NewReader(tc.body)
		}
		got, hdr := call(t, hc, ctx, tc.method, srv.URL+"/v1/x?q="+strconv.Itoa(i), body)
		if want := tc.method + " /v1/x?q=" + strconv.Itoa(i) + " " + tc.body; got != want {
			t.Fatalf("call %d: answer %.80q…, want %.80q…", i, got, want)
		}
		if want := strconv.Itoa(len(tc.body)); tc.body != "" && hdr.Get("X-Length") != want {
			t.Fatalf("call %d: Content-Length %q, want %s", i, hdr.Get("X-Length"), want)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("%d connections for sequential calls, want 1", n)
	}
}

// doFails sends req and returns the error; an answer is closed (nil error).
func doFails(hc HTTPClient, req *http.Request) error {
	res, err := hc.Do(req)
	if err == nil {
		res.Body.Close()
	}
	return err
}

// The context's deadline bounds the exchange: an upstream that never answers fails the call
// with os.ErrDeadlineExceeded at the deadline, and its connection is not pooled. A context
// already done sends nothing.
func TestHTTPClientDeadline(t *testing.T) {
	addr, accepted := listenRaw(t, func(c net.Conn) { _, _ = io.Copy(io.Discard, c) }) // reads, never answers
	c := NewClient()
	t.Cleanup(c.CloseIdleConnections)
	hc := HTTPClient{C: c}

	done, cancel := context.WithCancel(context.Background())
	cancel()
	req, _ := http.NewRequestWithContext(done, http.MethodPut, "http://"+addr+"/", strings.NewReader("x"))
	if err := doFails(hc, req); !errors.Is(err, context.Canceled) {
		t.Fatalf("a cancelled context: %v, want context.Canceled", err)
	}

	ctx, cancel2 := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel2()
	req, _ = http.NewRequestWithContext(ctx, http.MethodPut, "http://"+addr+"/", strings.NewReader("x"))
	start := time.Now()
	if err := doFails(hc, req); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("no answer: %v, want os.ErrDeadlineExceeded", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the call took %s past a 100 ms deadline", d)
	}
	if n := accepted.Load(); n != 1 {
		t.Fatalf("%d connections, want 1: the cancelled context sends nothing", n)
	}
	if hp := c.host(poolKey{host: addr}); len(hp.idle) != 0 {
		t.Fatal("the timed-out connection was pooled")
	}
}

// A body shorter than its ContentLength fails the call before anything is sent; a non-http
// URL is refused.
func TestHTTPClientRefuses(t *testing.T) {
	srv, conns := echoServer(t)
	hc := HTTPClient{C: NewClient()}
	req, _ := http.NewRequest(http.MethodPut, srv.URL+"/", strings.NewReader("abc"))
	req.ContentLength = 10
	if err := doFails(hc, req); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("short body: %v, want io.ErrUnexpectedEOF", err)
	}
	req, _ = http.NewRequest(http.MethodGet, "https://example.invalid/", nil)
	if err := doFails(hc, req); err == nil {
		t.Fatal("an https URL was accepted")
	}
	if n := conns.Load(); n != 0 {
		t.Fatalf("%d connections, want none", n)
	}
}

// An idle connection the upstream closed (an agent that died) is not reused: the next call
// goes over a new connection and succeeds; nothing is sent twice.
func TestHTTPClientSkipsClosedIdleConnection(t *testing.T) {
	var requests atomic.Int32
	addr, conns := listenRaw(t, func(c net.Conn) { // one exchange per connection, then close without saying so
		req, err := http.ReadRequest(bufio.NewReader(c))
		if err != nil {
			return
		}
		_, _ = io.Copy(io.Discard, req.Body)
		requests.Add(1)
		_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
	})
	c := NewClient()
	t.Cleanup(c.CloseIdleConnections)
	hc := HTTPClient{C: c}
	url := "http://" + addr + "/"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	call(t, hc, ctx, http.MethodPut, url, strings.NewReader("first"))
	hp := c.host(poolKey{host: addr})
	wait.For(t, "the upstream's close to reach the pooled connection", func() bool {
		hp.mu.Lock()
		defer hp.mu.Unlock()
		return len(hp.idle) == 1 && !hp.idle[0].peek.idle()
	})
	if got, _ := call(t, hc, ctx, http.MethodPut, url, strings.NewReader("second")); got != "ok" {
		t.Fatalf("answer %q", got)
	}
	if r, n := requests.Load(), conns.Load(); r != 2 || n != 2 {
		t.Fatalf("%d requests over %d connections, want 2 over 2", r, n)
	}
}

// SetMaxIdlePerHost(1) keeps one idle connection per host; a host left without idle
// connections is dropped by reap, and a connection coming back to it afterwards is pooled in
// the map, not in the dropped pool.
func TestClientIdleLimitAndReap(t *testing.T) {
	srv, conns := echoServer(t)
	c := NewClient()
	c.SetMaxIdlePerHost(1)
	c.SetIdleTimeout(time.Hour)
	t.Cleanup(c.CloseIdleConnections)
	hc := HTTPClient{C: c}
	host := strings.TrimPrefix(srv.URL, "http://")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	// Two calls in flight at once: two connections, one kept.
	open := func() *http.Response {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/", nil)
		res, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	finish := func(res *http.Response) {
		_, _ = io.Copy(io.Discard, res.Body)
		res.Body.Close()
	}
	a, b := open(), open() //nolint:bodyclose // finish closes them
	finish(a)
	finish(b)
	if n := conns.Load(); n != 2 {
		t.Fatalf("%d connections for two concurrent calls, want 2", n)
	}
	if n := len(c.host(poolKey{host: host}).idle); n != 1 {
		t.Fatalf("%d idle connections, want 1", n)
	}

	// Idle too long: reaped, and the host dropped.
	hp := c.host(poolKey{host: host})
	hp.mu.Lock()
	hp.idle[0].idleSince = time.Now().Add(-2 * time.Hour)
	hp.mu.Unlock()
	c.reap()
	if _, ok := c.hosts.Load(poolKey{host: host}); ok {
		t.Fatal("a host without idle connections was kept")
	}

	// A call in flight while its host is dropped comes back to a new pool.
	res := open() //nolint:bodyclose // finish closes it
	c.reap()      // its pool has no idle connection: dropped
	finish(res)
	v, ok := c.hosts.Load(poolKey{host: host})
	if !ok || len(v.(*hostPool).idle) != 1 || v.(*hostPool).gone.Load() {
		t.Fatal("the connection that came back after its pool was dropped is not in the map")
	}
	call(t, hc, ctx, http.MethodPut, srv.URL+"/", bytes.NewReader([]byte("z")))
	if n := conns.Load(); n != 3 {
		t.Fatalf("%d connections, want 3 (the reaped one replaced once, then reused)", n)
	}
}

// pastDeadline is a context past its deadline that no timer ended (its Err is nil), as the push
// engine's timerless request context can be.
type pastDeadline struct{ context.Context }

func (pastDeadline) Deadline() (time.Time, bool) { return time.Now().Add(-time.Millisecond), true }

// A request whose context is past its deadline is not sent, even when no timer ended the
// context: the deadline alone bounds a call (BoundsByDeadline).
func TestHTTPClientPastDeadlineNotSent(t *testing.T) {
	u := newUpstream(t)
	c := HTTPClient{C: NewClient()}
	t.Cleanup(c.C.CloseIdleConnections)
	req, err := http.NewRequestWithContext(pastDeadline{context.Background()}, http.MethodGet, "http://"+u.addr+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	if res, err := c.Do(req); !errors.Is(err, context.DeadlineExceeded) {
		if res != nil {
			res.Body.Close()
		}
		t.Fatalf("Do past the deadline: %v, want context.DeadlineExceeded", err)
	}
	if n := u.conns.Load(); n != 0 {
		t.Fatalf("%d connections made for a call past its deadline", n)
	}
}
