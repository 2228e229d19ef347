package h1

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
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
	if err != nil {
		t.Fatalf("PRI request line alone: %v", err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusHTTPVersionNotSupported {
		t.Fatalf("PRI request line alone: %s", res.Status)
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

// What the agent sets on its HTTP/2 side and holds a hostile client to (the framing, HPACK and
// flow control are net/http's): the preface within ReadHeaderTimeout, MaxConcurrentStreams
// streams served at once per connection, a header list within MaxHeaderBytes (431 without the
// handler), and a connection that breaks the protocol after the preface closed without the
// handler ever seeing a request.
func TestServerH2CHostile(t *testing.T) {
	var handled, inFlight atomic.Int32
	var mu sync.Mutex
	perConn, peak := map[string]int{}, 0 // streams in the handler by connection, and the most on one
	release := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		handled.Add(1)
		inFlight.Add(1)
		mu.Lock()
		perConn[r.RemoteAddr]++
		peak = max(peak, perConn[r.RemoteAddr])
		mu.Unlock()
		if r.URL.Path == "/hold" {
			<-release
		}
		mu.Lock()
		perConn[r.RemoteAddr]--
		mu.Unlock()
		inFlight.Add(-1)
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &Server{Handler: h, HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 3}, Logger: quietLogger(),
		ReadHeaderTimeout: 200 * time.Millisecond, MaxHeaderBytes: 4 << 10}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	addr := ln.Addr().String()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		return c
	}
	closedWithin := func(c net.Conn, d time.Duration) bool {
		start := time.Now()
		_, _ = io.Copy(io.Discard, c) // until the server closes (or the 10 s deadline)
		return time.Since(start) < d
	}

	// A preface that stops half-way is closed at ReadHeaderTimeout.
	c := dial()
	_, _ = io.WriteString(c, h2Preface[:10])
	if !closedWithin(c, 5*time.Second) {
		t.Fatal("a stalled preface was not closed")
	}

	// Garbage after the preface: the connection closes (GOAWAY), no request is handled.
	c = dial()
	_, _ = io.WriteString(c, h2Preface+"\x00\x00\x01\x99\x00\x00\x00\x00\x01xGET / HTTP/1.1\r\nHost: a\r\n\r\n")
	if !closedWithin(c, 5*time.Second) || handled.Load() != 0 {
		t.Fatalf("garbage after the preface: closed late, or %d requests handled", handled.Load())
	}

	// A header list beyond MaxHeaderBytes: 431, the handler not called; one field alone beyond
	// it: the connection closes (GOAWAY COMPRESSION_ERROR, net/http's HPACK decoder's limit).
	headers := func(fields [][2]string) (string, error) {
		c := dial()
		fr := http2.NewFramer(c, c)
		_, _ = io.WriteString(c, h2Preface)
		if err := fr.WriteSettings(); err != nil {
			t.Fatal(err)
		}
		var block bytes.Buffer
		enc := hpack.NewEncoder(&block)
		for _, f := range append([][2]string{{":method", "GET"}, {":scheme", "http"}, {":authority", "a"}, {":path", "/"}}, fields...) {
			_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
		}
		if block.Len() >= 16<<10 {
			t.Fatalf("a header block of %d bytes needs CONTINUATION frames", block.Len())
		}
		if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block.Bytes(), EndStream: true, EndHeaders: true}); err != nil {
			t.Fatal(err)
		}
		status := ""
		dec := hpack.NewDecoder(4096, func(f hpack.HeaderField) {
			if f.Name == ":status" {
				status = f.Value
			}
		})
		for status == "" {
			f, err := fr.ReadFrame()
			if err != nil {
				return "", err
			}
			if hf, ok := f.(*http2.HeadersFrame); ok && hf.StreamID == 1 {
				if _, err := dec.Write(hf.HeaderBlockFragment()); err != nil {
					t.Fatal(err)
				}
			}
			if ga, ok := f.(*http2.GoAwayFrame); ok && ga.ErrCode != http2.ErrCodeNo {
				return "GOAWAY " + ga.ErrCode.String(), nil
			}
		}
		return status, nil
	}
	var many [][2]string
	for i := range 14 {
		many = append(many, [2]string{"x-f" + strconv.Itoa(i), strings.Repeat("b", 1<<10)})
	}
	if st, err := headers(many); st != "431" || handled.Load() != 0 {
		t.Fatalf("a header list over MaxHeaderBytes: %q %v, %d requests handled", st, err, handled.Load())
	}
	if st, err := headers([][2]string{{"x-big", strings.Repeat("b", 12<<10)}}); st != "GOAWAY COMPRESSION_ERROR" || handled.Load() != 0 {
		t.Fatalf("a field over MaxHeaderBytes: %q %v, %d requests handled", st, err, handled.Load())
	}

	// 10 streams at once: at most MaxConcurrentStreams in the handler per connection (the
	// client opens more connections for the rest).
	cl := h2cClient()
	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() {
			if res, err := cl.Get("http://" + addr + "/hold"); err == nil {
				res.Body.Close()
			}
		})
	}
	deadline := time.Now().Add(5 * time.Second)
	for inFlight.Load() < 10 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	close(release)
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	t.Logf("10 streams over %d connections", len(perConn))
	if peak != 3 || handled.Load() != 10 {
		t.Fatalf("peak %d streams on one connection with MaxConcurrentStreams 3 (want 3), %d of 10 handled", peak, handled.Load())
	}
}
