package proxy

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/h1/h1test"
)

// TestSuiteUnderNetHTTP runs the data plane's tests with net/http's server in front of the
// Handler: it stays an http.Handler that works under any server.
func TestSuiteUnderNetHTTP(t *testing.T) {
	underNetHTTP = true
	t.Cleanup(func() { underNetHTTP = false })
	for _, tc := range []struct {
		name string
		f    func(*testing.T)
	}{
		{"Forwarding", TestForwarding},
		{"UnknownDownstream", TestUnknownDownstream},
		{"InFlightNeverExceedsPermits", TestInFlightNeverExceedsPermits},
		{"BreakerOpensAndHalfOpenProbes", TestBreakerOpensAndHalfOpenProbes},
		{"Upstream429PassedThroughNeverRetried", TestUpstream429PassedThroughNeverRetried},
		{"HangingUpstreamTimesOut", TestHangingUpstreamTimesOut},
		{"ConnectionResetIs502AndNotRetried", TestConnectionResetIs502AndNotRetried},
		{"Streaming", TestStreaming},
		{"ServeStaleAfterBreakerOpens", TestServeStaleAfterBreakerOpens},
		{"StaticNeverAnswersPOSTWithSuccess", TestStaticNeverAnswersPOSTWithSuccess},
		{"DegradeSwitchAppliesAndExpires", TestDegradeSwitchAppliesAndExpires},
		{"RateLimited", TestRateLimited},
		{"ReconfigureWhileInFlight", TestReconfigureWhileInFlight},
		{"GracefulDrain", TestGracefulDrain},
		{"UpgradePassesThrough", TestUpgradePassesThrough},
		{"AppCancelKeepsThePermitUntilTheDownstreamAnswers", TestAppCancelKeepsThePermitUntilTheDownstreamAnswers},
		{"LeanFraming", TestLeanFraming},
		{"LeanHopByHopHeaders", TestLeanHopByHopHeaders},
		{"LeanIdleConnectionClosedByUpstream", TestLeanIdleConnectionClosedByUpstream},
		{"LeanUpstreamResetMidBody", TestLeanUpstreamResetMidBody},
		{"LeanPoolReuse", TestLeanPoolReuse},
		{"Trailers", TestTrailers},
		{"AppLeavesWhileWaitingForAPermit", TestAppLeavesWhileWaitingForAPermit},
		{"AppNotReadingTheAnswerReleasesThePermit", TestAppNotReadingTheAnswerReleasesThePermit},
		{"UpstreamHeadTooLarge", TestUpstreamHeadTooLarge},
		{"MalformedAppBodyIsTheAppsError", TestMalformedAppBodyIsTheAppsError},
		{"ConnectRefused", TestConnectRefused},
		{"ConnectionNamedForwardingHeadersDropped", TestConnectionNamedForwardingHeadersDropped},
	} {
		t.Run(tc.name, tc.f)
	}
}

// rawUpstream is a TCP upstream whose connections are served by a test's function: the raw
// bytes on the wire are the test's.
type rawUpstream struct {
	URL   string
	conns atomic.Int64
}

func newRawUpstream(t *testing.T, serve func(c net.Conn, br *bufio.Reader)) *rawUpstream {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := &rawUpstream{URL: "http://" + ln.Addr().String()}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var open []net.Conn
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range open {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u.conns.Add(1)
			mu.Lock()
			open = append(open, c)
			mu.Unlock()
			wg.Go(func() {
				defer c.Close()
				serve(c, bufio.NewReader(c))
			})
		}
	})
	return u
}

// rawConn dials the agent: the test writes requests and reads answers byte for byte.
func rawConn(t *testing.T, a *testAgent) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(a.srv.URL, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return c, bufio.NewReader(c)
}

// Bodies stream both ways at once: the app sends its chunked body a line at a time and reads
// the upstream's echo of each line before it sends the next.
func TestLeanStreamsBodiesBothWays(t *testing.T) {
	var te []string
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		te = r.TransferEncoding
		rc := http.NewResponseController(w)
		_ = rc.EnableFullDuplex()
		w.WriteHeader(200)
		_ = rc.Flush()
		br := bufio.NewReader(r.Body)
		for {
			line, err := br.ReadString('\n')
			if line != "" {
				io.WriteString(w, "echo:"+line)
				_ = rc.Flush()
			}
			if err != nil {
				return
			}
		}
	})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("echo", up.URL, 1))
	c, br := rawConn(t, a)
	io.WriteString(c, "POST /echo/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nline1\n\r\n")
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if res.StatusCode != 200 || res.ContentLength != -1 {
		t.Fatalf("answer %d, length %d", res.StatusCode, res.ContentLength)
	}
	body := bufio.NewReader(res.Body)
	if line, err := body.ReadString('\n'); line != "echo:line1\n" {
		t.Fatalf("first echo %q %v", line, err)
	}
	if st := a.enf.State().Downstreams[0]; st.InFlight != 1 {
		t.Fatalf("in flight while streaming = %d", st.InFlight)
	}
	io.WriteString(c, "6\r\nline2\n\r\n0\r\n\r\n")
	if line, err := body.ReadString('\n'); line != "echo:line2\n" {
		t.Fatalf("second echo %q %v", line, err)
	}
	if rest, err := io.ReadAll(body); err != nil || len(rest) != 0 {
		t.Fatalf("after the last echo: %q %v", rest, err)
	}
	if len(te) != 1 || te[0] != "chunked" {
		t.Fatalf("upstream got Transfer-Encoding %v, want chunked", te)
	}
	waitFor(t, func() bool { return a.enf.State().Downstreams[0].InFlight == 0 })
}

// Answers without a body (HEAD, 204, 304) and with a Content-Length keep one app connection in
// step; an HTTP/1.0 app gets a body of unknown length up to the connection's close.
func TestLeanFraming(t *testing.T) {
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/head":
			w.Header().Set("Content-Length", "10")
		case "/204":
			w.WriteHeader(204)
		case "/304":
			w.Header().Set("ETag", `"v1"`)
			w.WriteHeader(304)
		case "/cl":
			w.Header().Set("Content-Length", "5")
			io.WriteString(w, "hello")
		case "/stream":
			io.WriteString(w, "part1,")
			http.NewResponseController(w).Flush()
			io.WriteString(w, "part2")
		}
	})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("f", up.URL, 4))
	c, br := rawConn(t, a)
	for _, tc := range []struct {
		method, path string
		status       int
		body, header string
	}{
		{"HEAD", "/f/head", 200, "", "10"},
		{"GET", "/f/204", 204, "", ""},
		{"GET", "/f/304", 304, "", ""},
		{"GET", "/f/cl", 200, "hello", "5"},
		{"GET", "/f/stream", 200, "part1,part2", ""},
		{"HEAD", "/f/head", 200, "", "10"},
	} {
		io.WriteString(c, tc.method+" "+tc.path+" HTTP/1.1\r\nHost: x\r\n\r\n")
		req, _ := http.NewRequest(tc.method, "http://x"+tc.path, nil)
		res, err := http.ReadResponse(br, req)
		if err != nil {
			t.Fatalf("%s %s: %v", tc.method, tc.path, err)
		}
		b, err := io.ReadAll(res.Body)
		res.Body.Close()
		if err != nil || res.StatusCode != tc.status || string(b) != tc.body || res.Header.Get("Content-Length") != tc.header {
			t.Fatalf("%s %s = %d %v %q %v", tc.method, tc.path, res.StatusCode, res.Header, b, err)
		}
		if res.Close {
			t.Fatalf("%s %s closed the app's connection", tc.method, tc.path)
		}
	}
	// HTTP/1.0: no chunking; the body ends with the connection.
	c2, br2 := rawConn(t, a)
	io.WriteString(c2, "GET /f/stream HTTP/1.0\r\n\r\n")
	res, err := http.ReadResponse(br2, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(res.Body)
	res.Body.Close()
	if err != nil || string(b) != "part1,part2" || !res.Close {
		t.Fatalf("HTTP/1.0 answer %q %v close=%v", b, err, res.Close)
	}
}

// The lean client removes hop-by-hop headers both ways and frames the request itself.
func TestLeanHopByHopHeaders(t *testing.T) {
	heads := make(chan string, 1)
	up := newRawUpstream(t, func(c net.Conn, br *bufio.Reader) {
		head, err := h1test.ReadHead(br)
		if err != nil {
			return
		}
		heads <- head
		io.WriteString(c, "HTTP/1.1 200 OK\r\nConnection: X-Resp-Hop\r\nX-Resp-Hop: 1\r\nKeep-Alive: timeout=5\r\n"+
			"Proxy-Connection: keep-alive\r\nX-Up: 1\r\nContent-Length: 2\r\n\r\nok")
	})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("h", up.URL+"/base", 4))
	r := a.do(t, http.MethodGet, "/h/p?q=1", "Connection", "X-Custom", "X-Custom", "1", "Keep-Alive", "timeout=1",
		"Proxy-Authorization", "secret", "Te", "trailers, deflate", "Trailer", "X-T", "Proxy-Connection", "keep-alive",
		"X-Keep", "yes")
	if r.status != 200 || r.body != "ok" || r.header.Get("X-Up") != "1" {
		t.Fatalf("answer %d %v %q", r.status, r.header, r.body)
	}
	for _, k := range []string{"X-Resp-Hop", "Keep-Alive", "Proxy-Connection"} {
		if r.header.Get(k) != "" {
			t.Errorf("response header %s passed on", k)
		}
	}
	head := <-heads
	host := strings.TrimPrefix(up.URL, "http://")
	if !strings.HasPrefix(head, "GET /base/p?q=1 HTTP/1.1\r\nHost: "+host+"\r\n") {
		t.Fatalf("request head:\n%s", head)
	}
	for _, want := range []string{"X-Keep: yes\r\n", "Te: trailers\r\n", "X-Forwarded-For: 127.0.0.1\r\n"} {
		if !strings.Contains(head, want) {
			t.Errorf("request head lacks %q:\n%s", want, head)
		}
	}
	for _, bad := range []string{"X-Custom", "Keep-Alive", "Proxy-Authorization", "Trailer", "Proxy-Connection", "Connection", "deflate"} {
		if strings.Contains(head, bad) {
			t.Errorf("request head has %q:\n%s", bad, head)
		}
	}
}

// answerOK reads one request head and answers 200 "ok", keeping the connection.
func answerOK(c net.Conn, br *bufio.Reader) bool {
	req, err := http.ReadRequest(br)
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, req.Body)
	_, err = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
	return err == nil
}

// A connection the upstream closed while it was idle in the pool is never used: the call goes
// on a new connection, and reaches the upstream once.
func TestLeanIdleConnectionClosedByUpstream(t *testing.T) {
	var requests atomic.Int64
	up := newRawUpstream(t, func(c net.Conn, br *bufio.Reader) {
		if answerOK(c, br) {
			requests.Add(1)
		}
		// Then close, as an upstream's keep-alive timeout does.
	})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("idle", up.URL, 4))
	for i := range 3 {
		if r := a.do(t, http.MethodGet, "/idle/"); r.status != 200 || r.body != "ok" {
			t.Fatalf("call %d = %d %q", i, r.status, r.body)
		}
		time.Sleep(50 * time.Millisecond) // the upstream's close reaches the agent
	}
	if n, c := requests.Load(), up.conns.Load(); n != 3 || c != 3 {
		t.Fatalf("upstream saw %d requests on %d connections, want 3 on 3", n, c)
	}
}

// The upstream breaking its answer's body cuts the answer to the app; the connection is not
// reused and the permit is released.
func TestLeanUpstreamResetMidBody(t *testing.T) {
	up := newRawUpstream(t, func(c net.Conn, br *bufio.Reader) {
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly ten b")
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0) // a reset, not a clean close
		}
	})
	a := newAgent(t, nil)
	a.apply(t, nil, withBreaker(downstream("cut", up.URL, 4), 100, 1, time.Minute))
	for range 2 {
		resp, err := a.client.Get(a.srv.URL + "/cut/")
		if err != nil {
			continue // cut before the header went out (net/http's server buffers it): cut too
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || err == nil {
			t.Fatalf("a broken body reached the app whole: %d %q %v", resp.StatusCode, b, err)
		}
	}
	if c := up.conns.Load(); c != 2 {
		t.Fatalf("upstream connections = %d, want 2 (a broken one is not reused)", c)
	}
	waitFor(t, func() bool { return a.enf.State().Downstreams[0].InFlight == 0 })
}

// Sequential calls share one upstream connection, bodies or not.
func TestLeanPoolReuse(t *testing.T) {
	var conns atomic.Int64
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Write(b)
		io.WriteString(w, "ok")
	}))
	up.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	up.Start()
	t.Cleanup(up.Close)
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("p", up.URL, 8))
	for i := range 40 {
		if r := a.do(t, http.MethodGet, "/p/x"); r.body != "ok" {
			t.Fatalf("GET %d = %d %q", i, r.status, r.body)
		}
	}
	for i := range 10 {
		resp, err := a.client.Post(a.srv.URL+"/p/x", "text/plain", io.MultiReader(strings.NewReader("chunked-"))) // length unknown
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(b) != "chunked-ok" {
			t.Fatalf("POST %d = %q", i, b)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("upstream connections for 50 sequential calls = %d, want 1", n)
	}
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 10 {
				a.do(t, http.MethodGet, "/p/x")
			}
		})
	}
	wg.Wait()
	if n := conns.Load(); n > 4 {
		t.Fatalf("upstream connections after 4 concurrent clients = %d, want at most 4", n)
	}
}

// Trailers of a chunked answer reach the app.
func TestTrailers(t *testing.T) {
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Sum")
		io.WriteString(w, "body")
		w.Header().Set("X-Sum", "42")
	})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("tr", up.URL, 4))
	resp, err := a.client.Get(a.srv.URL + "/tr/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "body" || resp.Trailer.Get("X-Sum") != "42" {
		t.Fatalf("answer %q trailer %v", b, resp.Trailer)
	}
}

// Calls of every kind (bodies, streaming, timeouts, refused, broken) leave no goroutine behind
// once the servers are closed.
func TestLeanNoGoroutineLeak(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("calls", func(t *testing.T) {
		_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/slow":
				time.Sleep(200 * time.Millisecond)
			case "/early":
				w.WriteHeader(413) // answers before the body is read
				return
			}
			_, _ = io.Copy(w, r.Body)
		})
		a := newAgent(t, nil)
		d := downstream("g", up.URL, 8)
		d.RequestTimeout = assignment.Duration(50 * time.Millisecond)
		refused := downstream("refused", "http://127.0.0.1:1", 4)
		a.apply(t, nil, d, refused)
		for range 5 {
			a.do(t, http.MethodGet, "/g/x")
			a.do(t, http.MethodGet, "/g/slow")
			a.do(t, http.MethodGet, "/refused/x")
			resp, err := a.client.Post(a.srv.URL+"/g/x", "text/plain", io.MultiReader(strings.NewReader(strings.Repeat("x", 100<<10))))
			if err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			pr, pw := io.Pipe()
			go func() {
				pw.Write([]byte("never finished"))
				time.Sleep(300 * time.Millisecond)
				pw.Close()
			}()
			resp, err = a.client.Post(a.srv.URL+"/g/early", "text/plain", pr)
			if err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}
		a.client.CloseIdleConnections()
		a.h.CloseIdleConnections()
	})
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines before, %d after:\n%s", before, runtime.NumGoroutine(), buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Server: pipelined requests are answered in order; malformed ones get 400 or 431 and a close.
func TestServerPipeliningAndBadRequests(t *testing.T) {
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, r.URL.Path) })
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("s", up.URL, 4))
	c, br := rawConn(t, a)
	io.WriteString(c, "GET /s/one HTTP/1.1\r\nHost: x\r\n\r\nGET /s/two HTTP/1.1\r\nHost: x\r\n\r\n")
	for _, want := range []string{"/one", "/two"} {
		res, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(res.Body)
		res.Body.Close()
		if string(b) != want {
			t.Fatalf("pipelined answer %q, want %q", b, want)
		}
	}
	for _, tc := range []struct {
		req    string
		status int
	}{
		{"NONSENSE\r\n\r\n", 400},
		{"GET /s/x HTTP/1.1\r\n\r\n", 400}, // no Host
		{"GET /s/x HTTP/1.1\r\nHost: x\r\nX-Big: " + strings.Repeat("b", 2<<20) + "\r\n\r\n", 431},
		{"GET /s/x HTTP/1.1\r\nHost: x\r\nExpect: magic\r\n\r\n", 417},
	} {
		c, br := rawConn(t, a)
		go io.WriteString(c, tc.req)
		res, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("%.30q: %v", tc.req, err)
		}
		res.Body.Close()
		if res.StatusCode != tc.status || !res.Close {
			t.Fatalf("%.30q = %d close=%v, want %d and a close", tc.req, res.StatusCode, res.Close, tc.status)
		}
	}
}

// Server: Expect: 100-continue gets its 100 when the body is wanted, then the answer.
func TestServerExpectContinue(t *testing.T) {
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.Copy(w, r.Body) })
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("e", up.URL, 4))
	c, br := rawConn(t, a)
	io.WriteString(c, "POST /e/ HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
	line, err := br.ReadString('\n')
	if err != nil || line != "HTTP/1.1 100 Continue\r\n" {
		t.Fatalf("first line %q %v", line, err)
	}
	if blank, _ := br.ReadString('\n'); blank != "\r\n" {
		t.Fatalf("after 100: %q", blank)
	}
	io.WriteString(c, "hello")
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 || string(b) != "hello" {
		t.Fatalf("answer %d %q", res.StatusCode, b)
	}
}

// An app that gives up while its call waits for a permit is noticed: the call is not forwarded
// when the permit frees up.
func TestAppLeavesWhileWaitingForAPermit(t *testing.T) {
	release := make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	c, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hold" {
			<-release
		}
		io.WriteString(w, "ok")
	})
	t.Cleanup(unblock)
	a := newAgent(t, nil)
	d := downstream("one", up.URL, 1)
	d.AcquireTimeout = assignment.Duration(5 * time.Second)
	a.apply(t, nil, d)
	held := make(chan result)
	go func() { held <- a.do(t, http.MethodGet, "/one/hold") }()
	ds := a.enf.Table().Lookup("one")
	waitFor(t, func() bool { return ds.Sem.Stats().InFlight == 1 })
	conn, _ := rawConn(t, a)
	io.WriteString(conn, "GET /one/waiting HTTP/1.1\r\nHost: x\r\n\r\n")
	waitFor(t, func() bool { return ds.Sem.Stats().Waiting == 1 })
	conn.Close() // the app gives up
	waitFor(t, func() bool { return ds.Sem.Stats().Waiting == 0 })
	unblock()
	if r := <-held; r.status != 200 {
		t.Fatalf("held call = %d", r.status)
	}
	if r := a.do(t, http.MethodGet, "/one/after"); r.status != 200 {
		t.Fatalf("call after = %d", r.status)
	}
	if n := c.calls.Load(); n != 2 {
		t.Fatalf("upstream calls = %d, want 2: the abandoned call must not be forwarded", n)
	}
}
