package h1

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// h2cClient speaks HTTP/2 with prior knowledge only (net/http's transport, no HTTP/1.1).
func h2cClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p}, Timeout: 10 * time.Second}
}

// With HTTP2 set, a connection that starts with the preface is served HTTP/2 (many streams on
// one connection, request and response bodies, trailers), and HTTP/1.1 on the same listener is
// unchanged; a request line "PRI * HTTP/2.0" without the rest of the preface is still refused
// with 505.
func TestServerH2C(t *testing.T) {
	var conns sync.Map // remote addresses seen over HTTP/2
	var inFlight, peak atomic.Int32
	release := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ProtoMajor == 2 {
			conns.Store(r.RemoteAddr, true)
		}
		if r.URL.Path == "/hold" {
			n := inFlight.Add(1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			<-release
			inFlight.Add(-1)
		}
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("Trailer", "X-Sum")
		_, _ = io.WriteString(w, r.Proto+" "+string(b))
		w.Header().Set("X-Sum", "done")
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &Server{Handler: h, HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 100}, Logger: quietLogger(),
		ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	base := "http://" + ln.Addr().String()

	c := h2cClient()
	res, err := c.Post(base+"/echo", "text/plain", strings.NewReader("hello"))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.ProtoMajor != 2 || string(b) != "HTTP/2.0 hello" || res.Trailer.Get("X-Sum") != "done" {
		t.Fatalf("h2c: proto %s body %q trailer %v", res.Proto, b, res.Trailer)
	}

	// 20 streams at once on one connection.
	const streams = 20
	var wg sync.WaitGroup
	errs := make(chan error, streams)
	for range streams {
		wg.Go(func() {
			res, err := c.Get(base + "/hold")
			if err != nil {
				errs <- err
				return
			}
			_, _ = io.Copy(io.Discard, res.Body)
			res.Body.Close()
		})
	}
	deadline := time.Now().Add(10 * time.Second)
	for inFlight.Load() < streams && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	n := 0
	conns.Range(func(any, any) bool { n++; return true })
	if peak.Load() != streams || n != 1 {
		t.Fatalf("%d streams at once over %d connections, want %d over 1", peak.Load(), n, streams)
	}

	// HTTP/1.1 on the same listener.
	res, err = http.Post(base+"/echo", "text/plain", strings.NewReader("one"))
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(res.Body)
	res.Body.Close()
	if string(b) != "HTTP/1.1 one" {
		t.Fatalf("HTTP/1.1: %q", b)
	}

	// The request line alone, the app closing its side: HTTP/1.1's 505.
	nc, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	_, _ = io.WriteString(nc, "PRI * HTTP/2.0\r\n\r\n")
	_ = nc.(*net.TCPConn).CloseWrite()
	_ = nc.SetReadDeadline(time.Now().Add(10 * time.Second))
	res, err = http.ReadResponse(bufio.NewReader(nc), nil)
	if err != nil || res.StatusCode != http.StatusHTTPVersionNotSupported {
		t.Fatalf("PRI request line alone: %v %v", res, err)
	}
}

// Shutdown lets an HTTP/2 stream in flight finish (GOAWAY, then it waits) and refuses new
// connections.
func TestServerH2CShutdown(t *testing.T) {
	started, release := make(chan struct{}), make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-release
		_, _ = io.WriteString(w, "late")
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &Server{Handler: h, HTTP2: &http.HTTP2Config{}, Logger: quietLogger()}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	type result struct {
		body string
		err  error
	}
	got := make(chan result, 1)
	go func() {
		res, err := h2cClient().Get("http://" + ln.Addr().String() + "/")
		if err != nil {
			got <- result{err: err}
			return
		}
		b, err := io.ReadAll(res.Body)
		res.Body.Close()
		got <- result{string(b), err}
	}()
	<-started
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		done <- srv.Shutdown(ctx)
	}()
	select {
	case err := <-done:
		t.Fatalf("Shutdown returned (%v) with a stream in flight", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if r := <-got; r.err != nil || r.body != "late" {
		t.Fatalf("the stream in flight: %q %v", r.body, r.err)
	}
}
