package proxy

import (
	"bufio"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// Regression tests for the defects a hostile-input probe of the data plane found (issue 11).

// byteLog is a raw upstream that records every byte it receives, on all its connections in the
// order they arrive (the tests' calls are sequential), and answers each request it can parse
// with 200 and the request's target as the body.
type byteLog struct {
	*rawUpstream
	mu  sync.Mutex
	log strings.Builder
}

func newByteLog(t *testing.T) *byteLog {
	t.Helper()
	l := &byteLog{}
	l.rawUpstream = newRawUpstream(t, func(c net.Conn, br *bufio.Reader) {
		rbr := bufio.NewReader(&recorder{r: br, l: l})
		for {
			req, err := http.ReadRequest(rbr)
			if err != nil {
				return
			}
			if _, err := io.Copy(io.Discard, req.Body); err != nil {
				return
			}
			body := req.URL.RequestURI()
			if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: "+strconv.Itoa(len(body))+"\r\n\r\n"+body); err != nil {
				return
			}
		}
	})
	return l
}

// all returns what the upstream received since the last reset.
func (l *byteLog) all() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.log.String()
}

func (l *byteLog) reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.log.Reset()
}

type recorder struct {
	r io.Reader
	l *byteLog
}

func (r *recorder) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	r.l.mu.Lock()
	r.l.log.Write(p[:n])
	r.l.mu.Unlock()
	return n, err
}

// answer is an answer read from a raw app connection.
type answer struct {
	status int
	header http.Header
	close  bool
	body   string
}

// readAnswer reads one answer from br.
func readAnswer(t *testing.T, br *bufio.Reader) answer {
	t.Helper()
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("no answer: %v", err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	return answer{res.StatusCode, res.Header, res.Close, string(b)}
}

// exchange writes raw to a new app connection and reads one answer.
func exchange(t *testing.T, a *testAgent, raw string) answer {
	t.Helper()
	c, br := rawConn(t, a)
	go io.WriteString(c, raw)
	return readAnswer(t, br)
}

// Defect 1: a field name with whitespace before the colon (which textproto accepts and the lean
// client would write as received), or a Host that is not a valid host, is answered 400 and
// nothing reaches the upstream (RFC 9112 §5.1: a server MUST reject it).
func TestHeaderNameWhitespaceRefused(t *testing.T) {
	up := newByteLog(t)
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("up", up.URL, 4))
	for _, raw := range []string{
		"POST /up/a HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nX-Ignore: X",
		"POST /up/a HTTP/1.1\r\nHost: x\r\nContent-Length : 0\r\nContent-Length: 38\r\n\r\nGET /smuggled HTTP/1.1\r\nX-Ignore: X",
		"GET /up/a HTTP/1.1\r\nHost: x\r\nConnection : close\r\n\r\n",
		"GET /up/a HTTP/1.1\r\nHost: x\r\nProxy-Authorization : Basic c2VjcmV0\r\n\r\n",
		"GET /up/a HTTP/1.1\r\nHost: x\r\nHost : evil.example\r\n\r\n",
		"GET /up/a HTTP/1.1\r\nHost: x\r\nX-A\t: 1\r\n\r\n",
		"GET /up/a HTTP/1.1\r\nHost: a b\r\n\r\n",
		"GET /up/a HTTP/1.1\r\nHost: a\x01\r\n\r\n",
	} {
		res := exchange(t, a, raw)
		if res.status != http.StatusBadRequest || !res.close {
			t.Errorf("%q = %d close=%v, want 400 and a close", raw, res.status, res.close)
		}
		if res.header.Get("Content-Type") != "application/problem+json" || !strings.Contains(res.body, CodeBadRequest) {
			t.Errorf("%q: answer %s %q, want problem+json with %s", raw, res.header.Get("Content-Type"), res.body, CodeBadRequest)
		}
	}
	if got := up.all(); got != "" {
		t.Fatalf("the upstream received:\n%q", got)
	}
}

// Defect 1 end to end: the smuggling payload of the report, then another app's call with its
// credentials on another connection: the victim's call is answered as its own.
func TestSmugglingPayloadDoesNotReachAnotherApp(t *testing.T) {
	up := newByteLog(t)
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("up", up.URL, 4))
	if res := exchange(t, a, "POST /up/a HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nX-Ignore: X"); res.status != http.StatusBadRequest {
		t.Fatalf("smuggling payload = %d", res.status)
	}
	r := a.do(t, http.MethodGet, "/up/victim", "Authorization", "Bearer secret", "Cookie", "s=1")
	if r.status != 200 || r.body != "/victim" {
		t.Fatalf("victim's call = %d %q, want its own answer", r.status, r.body)
	}
	if strings.Contains(up.all(), "smuggled") {
		t.Fatalf("the upstream received the smuggled request:\n%q", up.all())
	}
}

// stallDownstream is a downstream with one permit and a short requestTimeout whose upstream
// reads the whole request body before it answers.
func stallDownstream(t *testing.T, a *testAgent) {
	t.Helper()
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		io.WriteString(w, "read")
	})
	d := withBreaker(downstream("st", up.URL, 1), 3, 1, time.Minute)
	d.RequestTimeout = assignment.Duration(300 * time.Millisecond)
	a.apply(t, nil, d)
}

// Defect 2: a request body the app stops sending does not hold its permit: at requestTimeout
// the app gets 408 (its own body was late, not the downstream), the permit is free and the
// breaker counts nothing. Same for a dribbled body, a chunked body stalled after its first
// chunk and the Expect: 100-continue path.
func TestStalledRequestBodyReleasesThePermit(t *testing.T) {
	a := newAgent(t, nil)
	stallDownstream(t, a)
	for _, tc := range []struct {
		name, head, first string
		dribble           bool
	}{
		{"stalled", "POST /st/x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n", "0123456789", false},
		{"dribbled", "POST /st/x HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n", "0", true},
		{"chunked", "POST /st/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", "5\r\nhello\r\n", false},
		{"expect-continue", "POST /st/x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\nExpect: 100-continue\r\n\r\n", "", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, br := rawConn(t, a)
			io.WriteString(c, tc.head+tc.first)
			stop := make(chan struct{})
			var wg sync.WaitGroup
			defer func() { close(stop); wg.Wait() }()
			if tc.dribble {
				wg.Go(func() {
					for {
						select {
						case <-stop:
							return
						case <-time.After(20 * time.Millisecond):
						}
						if _, err := io.WriteString(c, "1"); err != nil {
							return
						}
					}
				})
			}
			var res *http.Response
			for {
				var err error
				if res, err = http.ReadResponse(br, nil); err != nil {
					t.Fatalf("no answer: %v", err)
				}
				if res.StatusCode != http.StatusContinue {
					break
				}
				if tc.first == "" {
					io.WriteString(c, "0123456789") // then stall after the 100
				}
			}
			b, _ := io.ReadAll(res.Body)
			res.Body.Close()
			if res.StatusCode != http.StatusRequestTimeout || !strings.Contains(string(b), CodeRequestTimeout) {
				t.Fatalf("answer %d %s, want 408 %s", res.StatusCode, b, CodeRequestTimeout)
			}
			waitFor(t, func() bool { return a.enf.State().Downstreams[0].InFlight == 0 })
		})
	}
	if st := a.enf.State().Downstreams[0]; st.Breaker != "closed" {
		t.Fatalf("the app's stalled bodies opened the breaker: %+v", st)
	}
	if r := a.do(t, http.MethodPost, "/st/after"); r.status != 200 || r.body != "read" {
		t.Fatalf("call after = %d %q", r.status, r.body)
	}
}

// Defect 2, the write side: an app that stops reading a large answer does not hold its permit
// past requestTimeout.
func TestAppNotReadingTheAnswerReleasesThePermit(t *testing.T) {
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		chunk := make([]byte, 64<<10)
		for range 1024 { // 64 MiB: more than any socket buffers
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	})
	a := newAgent(t, nil)
	d := downstream("big", up.URL, 1)
	d.RequestTimeout = assignment.Duration(300 * time.Millisecond)
	a.apply(t, nil, d)
	c, _ := rawConn(t, a)
	io.WriteString(c, "GET /big/ HTTP/1.1\r\nHost: x\r\n\r\n") // and never read
	waitFor(t, func() bool { return a.enf.State().Downstreams[0].InFlight == 1 })
	waitFor(t, func() bool { return a.enf.State().Downstreams[0].InFlight == 0 })
}

// Defect 3: an upstream answering with a head larger than the limit gets 502
// APPORTION_UPSTREAM_BAD_RESPONSE, read no further than the limit.
func TestUpstreamHeadTooLarge(t *testing.T) {
	up := newRawUpstream(t, func(c net.Conn, br *bufio.Reader) {
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nX-Huge: ")
		line := []byte(strings.Repeat("h", 64<<10))
		for range 1024 { // 64 MiB, unless the agent stops reading
			if _, err := c.Write(line); err != nil {
				return
			}
		}
	})
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("huge", up.URL, 4))
	r := a.do(t, http.MethodGet, "/huge/")
	if r.status != http.StatusBadGateway || problemCode(r) != CodeUpstreamBadResponse {
		t.Fatalf("answer %d %.200s, want 502 %s", r.status, r.body, CodeUpstreamBadResponse)
	}
	// The same through http.Transport (an Expect: 100-continue request takes that way).
	res := exchange(t, a, "POST /huge/ HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nExpect: 100-continue\r\n\r\nx")
	if res.status != http.StatusBadGateway || !strings.Contains(res.body, CodeUpstreamBadResponse) {
		t.Fatalf("through http.Transport: answer %d %.200s, want 502 %s", res.status, res.body, CodeUpstreamBadResponse)
	}
}

// Defect 4: the app's own malformed body is answered 400 with a code of its own, names no
// address of the agent, and never counts against the downstream: more bad bodies than open the
// breaker leave it closed.
func TestMalformedAppBodyIsTheAppsError(t *testing.T) {
	_, up := upstream(t, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		io.WriteString(w, "ok")
	})
	a := newAgent(t, nil)
	a.apply(t, nil, withBreaker(downstream("mb", up.URL, 4), 5, 1, time.Minute))
	for i := range 10 {
		res := exchange(t, a, "POST /mb/x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n")
		body := res.body
		if res.status != http.StatusBadRequest || res.header.Get("Content-Type") != "application/problem+json" {
			t.Fatalf("bad chunk %d = %d %s %q", i, res.status, res.header.Get("Content-Type"), body)
		}
		var p problem
		if err := json.Unmarshal([]byte(body), &p); err != nil || p.Code != CodeBadRequest {
			t.Fatalf("bad chunk %d: %q (%v), want code %s", i, body, err, CodeBadRequest)
		}
		if strings.Contains(body, "127.0.0.1") {
			t.Fatalf("the answer names an internal address: %q", body)
		}
	}
	if r := a.do(t, http.MethodGet, "/mb/x"); r.status != 200 {
		t.Fatalf("a healthy downstream was cut off: %d %q", r.status, r.body)
	}
	if st := a.enf.State().Downstreams[0]; st.Breaker != "closed" {
		t.Fatalf("the app's bad bodies opened the breaker: %+v", st)
	}
}

// Defect 5: CONNECT is refused (the agent is not a forward proxy) and never reaches the
// upstream, so no upstream connection can turn into a tunnel in the pool.
func TestConnectRefused(t *testing.T) {
	up := newByteLog(t)
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("up", up.URL, 4))
	if res := exchange(t, a, "CONNECT /up/x HTTP/1.1\r\nHost: x\r\n\r\n"); res.status != http.StatusMethodNotAllowed ||
		!strings.Contains(res.body, CodeMethodNotAllowed) {
		t.Fatalf("CONNECT = %d %q, want 405 %s", res.status, res.body, CodeMethodNotAllowed)
	}
	if got := up.all(); got != "" {
		t.Fatalf("the upstream received:\n%q", got)
	}
	if r := a.do(t, http.MethodGet, "/up/next"); r.status != 200 || r.body != "/next" {
		t.Fatalf("next call = %d %q", r.status, r.body)
	}
}

// Defect 7: idle upstream connections are closed on a timer, not only when the same host is
// called again.
func TestIdleUpstreamConnectionsReaped(t *testing.T) {
	closed := make(chan struct{}, 1)
	up := newRawUpstream(t, func(c net.Conn, br *bufio.Reader) {
		for answerOK(c, br) {
		}
		closed <- struct{}{} // the agent closed it
	})
	a := newAgent(t, nil)
	a.h.up.SetIdleTimeout(200 * time.Millisecond)
	a.apply(t, nil, downstream("idle", up.URL, 4))
	if r := a.do(t, http.MethodGet, "/idle/"); r.status != 200 {
		t.Fatalf("call = %d", r.status)
	}
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the idle upstream connection was not closed")
	}
}

// Also: a Connection header naming X-Forwarded-For (or Forwarded) drops the app's value on the
// lean path, as net/http's ReverseProxy does; the agent's own X-Forwarded-For is still added.
func TestConnectionNamedForwardingHeadersDropped(t *testing.T) {
	up := newByteLog(t)
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("up", up.URL, 4))
	r := a.do(t, http.MethodGet, "/up/x", "Connection", "X-Forwarded-For, Forwarded", "X-Forwarded-For", "10.9.9.9",
		"Forwarded", "for=10.9.9.9")
	if r.status != 200 {
		t.Fatalf("call = %d", r.status)
	}
	got := up.all()
	if strings.Contains(got, "10.9.9.9") || !strings.Contains(got, "X-Forwarded-For: 127.0.0.1\r\n") {
		t.Fatalf("upstream head:\n%s", got)
	}
}

// Also: a request with both Content-Length and Transfer-Encoding is served (chunked wins, the
// Content-Length is dropped), and its connection closes after the answer (RFC 9112 §6.1).
func TestContentLengthAndTransferEncodingCloses(t *testing.T) {
	up := newByteLog(t)
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("up", up.URL, 4))
	c, br := rawConn(t, a)
	io.WriteString(c, "POST /up/a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 || string(b) != "/a" || !res.Close {
		t.Fatalf("answer %d %q close=%v, want 200 /a and a close", res.StatusCode, b, res.Close)
	}
	if got := up.all(); strings.Contains(got, "Content-Length: 3") || !strings.Contains(got, "3\r\nabc\r\n0\r\n\r\n") {
		t.Fatalf("upstream received:\n%q", got)
	}
}

// Defect 2, an early answer: the upstream answers (chunked, of unknown length) without reading
// the app's body, which stalls. The app's read is ended once the answer is passed on; the app
// gets the whole answer, its last chunk included, and the permit is free.
func TestEarlyAnswerToAStalledBody(t *testing.T) {
	up := newRawUpstream(t, func(c net.Conn, br *bufio.Reader) {
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		io.WriteString(c, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nearly\r\n0\r\n\r\n")
		_, _ = io.Copy(io.Discard, br) // until the agent closes
	})
	a := newAgent(t, nil)
	d := downstream("early", up.URL, 1)
	d.RequestTimeout = assignment.Duration(5 * time.Second)
	a.apply(t, nil, d)
	c, br := rawConn(t, a)
	// Chunked: each chunk goes upstream as it comes (a Content-Length body goes with its head
	// once whole), so the upstream sees the request and answers while the body stalls.
	io.WriteString(c, "POST /early/ HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
	res, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != 200 || string(b) != "early" || err != nil {
		t.Fatalf("answer %d %q %v, want 200 \"early\" whole", res.StatusCode, b, err)
	}
	waitFor(t, func() bool { return a.enf.State().Downstreams[0].InFlight == 0 })
}
