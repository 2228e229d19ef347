package h1

import (
	"bufio"
	"bytes"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/apportion/apportion/internal/h1/h1test"
)

// The differential test of the data plane's server against net/http's: the same bytes on a
// connection to each, and the same verdict — every request each one hands its handler, as the
// handler sees it (method, target, URL, header names and values, Host, framing, body bytes,
// trailers), in order, and the status of every answer, a refusal included. Comparing
// sequences of requests also compares what each server leaves on the connection after a
// request: the next request is read from it.
//
// Deliberate differences, each allowed by the RFC clause named; the comparison applies them:
//
//  1. A request with both Content-Length and Transfer-Encoding: both read the chunked body
//     and drop the Content-Length (RFC 9112 §6.3 item 3), but Server closes the connection after
//     the answer (RFC 9112 §6.1: "the server MUST close the connection after responding to
//     such a request"); net/http keeps it. The agent's view of that request has Close set, and
//     nothing it would have read after it is served.
//
//  2. The HTTP/2 connection preface ("PRI * HTTP/2.0", RFC 9113 §3.4): net/http hands it to
//     the handler as a request (to let it hijack the connection for h2c); Server answers 505
//     (RFC 9110 §15.6.6: the major version is not supported) and closes — or, with HTTP2 set
//     and the whole 24-byte preface received, hands the connection to net/http's HTTP/2 server
//     (h2c.go), which this test does not compare: input that starts with the whole preface is
//     HTTP/2's. Anything else, a "PRI * HTTP/2.0" request line without the rest of the
//     preface included, is held to net/http's server with HTTP2 set as without.
//
// Everything else is the same, refusals included: 400 for what http.Server refuses (a field
// name with whitespace before the colon, RFC 9112 §5.1; an invalid Host, RFC 9112 §3.2), 431
// for a head too large, 501 for a transfer coding other than chunked, 505 for a version other
// than 1.x, 417 for an Expect other than 100-continue.

// seen is a request as a handler sees it.
type seen struct {
	Method, RequestURI, URL, Proto, Host string
	Header, Trailer                      http.Header
	ContentLength                        int64
	TransferEncoding                     []string
	Close                                bool
	Body                                 string
	BodyErr                              bool
}

// outcome is what a server made of one connection's bytes.
type outcome struct {
	Seen     []seen
	Statuses []int
}

// diffRig serves the recording handler with net/http's server and with Server.
type diffRig struct {
	netHTTP, agent string // addresses
	agentH2        string // Server with HTTP2 set
	mu             sync.Mutex
	seen           []seen
}

func newDiffRig(tb testing.TB) *diffRig {
	tb.Helper()
	r := &diffRig{}
	h := http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		b, err := io.ReadAll(req.Body)
		s := seen{Method: req.Method, RequestURI: req.RequestURI, URL: req.URL.String(), Proto: req.Proto,
			Host: req.Host, Header: req.Header.Clone(), Trailer: req.Trailer.Clone(), ContentLength: req.ContentLength,
			TransferEncoding: req.TransferEncoding, Close: req.Close, Body: string(b), BodyErr: err != nil}
		r.mu.Lock()
		r.seen = append(r.seen, s)
		r.mu.Unlock()
		w.WriteHeader(http.StatusNoContent) // no body: the answers read alike whatever the method
	})
	ns := httptest.NewServer(h)
	tb.Cleanup(ns.Close)
	r.netHTTP = ns.Listener.Addr().String()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	srv := &Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute, Logger: quietLogger()}
	go func() { _ = srv.Serve(ln) }()
	tb.Cleanup(func() { _ = srv.Close() })
	r.agent = ln.Addr().String()
	ln2, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	srv2 := &Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute, Logger: quietLogger(),
		HTTP2: &http.HTTP2Config{}}
	go func() { _ = srv2.Serve(ln2) }()
	tb.Cleanup(func() { _ = srv2.Close() })
	r.agentH2 = ln2.Addr().String()
	return r
}

// run sends data on a new connection to addr, half-closes it, and reads every answer until the
// server closes.
func (r *diffRig) run(tb testing.TB, addr string, data []byte) outcome {
	tb.Helper()
	r.mu.Lock()
	r.seen = nil
	r.mu.Unlock()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		tb.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	var wg sync.WaitGroup
	wg.Go(func() {
		_, _ = c.Write(data)
		_ = c.(*net.TCPConn).CloseWrite()
	})
	var out outcome
	br := bufio.NewReader(c)
	for {
		res, err := http.ReadResponse(br, nil)
		if err != nil {
			break
		}
		_, _ = io.Copy(io.Discard, res.Body)
		res.Body.Close()
		if res.StatusCode >= 200 {
			out.Statuses = append(out.Statuses, res.StatusCode)
		}
	}
	wg.Wait()
	r.mu.Lock()
	out.Seen = r.seen
	r.mu.Unlock()
	return out
}

// checkDifferential holds Server to net/http's server on data.
func (r *diffRig) check(t *testing.T, data []byte) {
	t.Helper()
	want := r.run(t, r.netHTTP, data)
	got := r.run(t, r.agent, data)
	// Difference 1: the agent closes after a request with both framings.
	for i, s := range got.Seen {
		if i < len(want.Seen) && s.Close && !want.Seen[i].Close && len(s.TransferEncoding) > 0 &&
			bytes.Contains(bytes.ToLower(data), []byte("content-length")) {
			want.Seen = want.Seen[:i+1]
			want.Seen[i].Close = true
			want.Statuses = want.Statuses[:min(len(want.Statuses), i+1)]
			break
		}
	}
	// Difference 2: the HTTP/2 preface is refused.
	if len(want.Seen) > 0 && want.Seen[0].Method == "PRI" && want.Seen[0].Proto == "HTTP/2.0" {
		want = outcome{Statuses: []int{http.StatusHTTPVersionNotSupported}}
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Fatalf("Server differs from net/http's server (-net/http +agent):\n%s\ninput %q", d, data)
	}
	if bytes.HasPrefix(data, []byte(h2Preface)) {
		return // HTTP/2's, with HTTP2 set
	}
	if d := cmp.Diff(want, r.run(t, r.agentH2, data)); d != "" {
		t.Fatalf("Server with HTTP2 set differs from net/http's server (-net/http +agent):\n%s\ninput %q", d, data)
	}
}

// serverCorpus is the differential test's seed: the head parser's corpus and the smuggling
// corpus's requests.
func serverCorpus() []string {
	c := append(append([]string{}, requestHeads...), declinedRequests...)
	for _, v := range h1test.Smuggling {
		c = append(c, v.Raw)
	}
	return append(c,
		"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n\r\nx\r\nGET /b HTTP/1.1\r\nHost: a\r\n\r\n",
		"GET /a HTTP/1.1\r\nHost: a\r\nExpect: 100-continue x\r\nContent-Length: 1\r\n\r\nx",
		"GET /a HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx",
		"GET /a HTTP/1.1\r\nHost:\r\n\r\n",
		"GET http://h/a HTTP/1.1\r\n\r\n",
		"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
		"PRI * HTTP/2.0\r\n\r\n",
		"PRI * HTTP/2.0\r\n\r\nSM\r\n",
		"PRI * HTTP/2.0\r\n\r\nSX\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
		"PR",
		"GET /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
		"GET /a HTTP/1.1\r\nHost: a\r\nExpect: \r\nExpect: x\r\n\r\n",
	)
}

func TestServerDifferential(t *testing.T) {
	r := newDiffRig(t)
	for _, in := range serverCorpus() {
		r.check(t, []byte(in))
	}
	// A head larger than the limit is refused alike.
	r.check(t, []byte("GET /a HTTP/1.1\r\nHost: a\r\nX-Big: "+strings.Repeat("b", 2<<20)+"\r\n\r\n"))
}

func FuzzServerDifferential(f *testing.F) {
	for _, in := range serverCorpus() {
		f.Add([]byte(in))
	}
	r := newDiffRig(f)
	f.Fuzz(func(t *testing.T, data []byte) { r.check(t, data) })
}
