package h1

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// readAll reads r to its end and returns what it read and how it ended.
func readAll(r io.Reader) (string, string) {
	b, err := io.ReadAll(r)
	if err != nil {
		return string(b), err.Error()
	}
	return string(b), ""
}

// filled returns a reader over data whose buffer holds what one read of it gives (the start of
// data, as a segment arrives on a connection).
func filled(data []byte) *bufio.Reader {
	br := bufio.NewReaderSize(bytes.NewReader(data), 4<<10)
	_, _ = br.Peek(1)
	return br
}

// checkRequestHead is the contract of readRequestHead on data: when it takes the head, net/http
// takes it too and reads the same request, body and rest of the stream; when it declines, it
// consumed nothing.
func checkRequestHead(t *testing.T, data []byte) (taken bool) {
	t.Helper()
	br := filled(data)
	before := br.Buffered()
	got, ok := readRequestHead(br, context.Background())
	if !ok {
		if br.Buffered() != before {
			t.Fatalf("declined but consumed %d bytes", before-br.Buffered())
		}
		return false
	}
	wr := bufio.NewReader(bytes.NewReader(data))
	want, err := http.ReadRequest(wr)
	if err != nil {
		t.Fatalf("took a head net/http refuses (%v):\n%q", err, data)
	}
	type view struct {
		Method, RequestURI, Proto, Host, URL string
		ProtoMajor, ProtoMinor               int
		Header, Trailer                      http.Header
		ContentLength                        int64
		Close                                bool
		TransferEncoding                     []string
		NoBody                               bool
	}
	see := func(r *http.Request) view {
		return view{r.Method, r.RequestURI, r.Proto, r.Host, r.URL.String(), r.ProtoMajor, r.ProtoMinor,
			r.Header, r.Trailer, r.ContentLength, r.Close, r.TransferEncoding, r.Body == http.NoBody}
	}
	if d := cmp.Diff(see(want), see(got)); d != "" {
		t.Fatalf("request differs from net/http's (-net/http +fast):\n%s\ninput %q", d, data)
	}
	if d := cmp.Diff(want.URL, got.URL); d != "" {
		t.Fatalf("URL differs (-net/http +fast):\n%s", d)
	}
	sameRest(t, want.Body, got.Body, wr, br)
	return true
}

// sameRest checks that both bodies read alike and leave the same rest of the stream (the next
// message on a kept-alive connection).
func sameRest(t *testing.T, wantBody, gotBody io.Reader, want, got *bufio.Reader) {
	t.Helper()
	wb, we := readAll(wantBody)
	gb, ge := readAll(gotBody)
	if wb != gb || we != ge {
		t.Fatalf("body differs: net/http %q (%s), fast %q (%s)", wb, we, gb, ge)
	}
	wrest, _ := io.ReadAll(want)
	grest, _ := io.ReadAll(got)
	if !bytes.Equal(wrest, grest) {
		t.Fatalf("rest of stream differs: net/http %q, fast %q", wrest, grest)
	}
}

func checkResponseHead(t *testing.T, data []byte, method string) (taken bool) {
	t.Helper()
	req := &http.Request{Method: method}
	br := filled(data)
	before := br.Buffered()
	got, ok := readResponseHead(br, req) //nolint:bodyclose // read to its end below; Close is a no-op
	if !ok {
		if br.Buffered() != before {
			t.Fatalf("declined but consumed %d bytes", before-br.Buffered())
		}
		return false
	}
	wr := bufio.NewReader(bytes.NewReader(data))
	want, err := http.ReadResponse(wr, req) //nolint:bodyclose // read to its end below
	if err != nil {
		t.Fatalf("took a head net/http refuses (%v):\n%q", err, data)
	}
	type view struct {
		Status, Proto                string
		StatusCode                   int
		ProtoMajor, ProtoMinor       int
		Header, Trailer              http.Header
		ContentLength                int64
		Close, Uncompressed, SameReq bool
		TransferEncoding             []string
		NoBody                       bool
	}
	see := func(r *http.Response) view {
		return view{r.Status, r.Proto, r.StatusCode, r.ProtoMajor, r.ProtoMinor, r.Header, r.Trailer,
			r.ContentLength, r.Close, r.Uncompressed, r.Request == req, r.TransferEncoding, r.Body == http.NoBody}
	}
	if d := cmp.Diff(see(want), see(got)); d != "" {
		t.Fatalf("response differs from net/http's (-net/http +fast):\n%s\ninput %q", d, data)
	}
	sameRest(t, want.Body, got.Body, wr, br)
	return true
}

var requestHeads = []string{
	"GET /up/x HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nUser-Agent: bench\r\nAccept: */*\r\n\r\n",
	"POST /up/orders?id=1&x=%20y HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\ncontent-type: application/json\r\n\r\nhello",
	"PUT /a HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nshort",
	"GET /a HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, Close\r\nX-A: 1\r\nx-a:  2 \r\nX-Empty:\r\n\r\nGET /b HTTP/1.1\r\n\r\n",
	"DELETE /a HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n",
	"GET /a HTTP/1.1\r\nHost: a\r\nX-Obs: caf\xc3\xa9\t!\r\n\r\n",
	"GET /a HTTP/1.1\r\nX-No-Host: 1\r\n\r\n", // the server refuses it, as net/http's would
}

// declinedRequests are heads in which net/http reads something the fast path does not do
// itself, or refuses: each must go to net/http.
var declinedRequests = []string{
	"GET /a HTTP/1.1\r\nHost: a\r\n",                                             // incomplete
	"GET /a HTTP/1.1\nHost: a\n\n",                                               // bare LF
	"GET /a HTTP/1.0\r\nHost: a\r\n\r\n",                                         // HTTP/1.0: other keep-alive rules
	"GET http://x/a HTTP/1.1\r\nHost: a\r\n\r\n",                                 // absolute form
	"GET HTTP/1.1\r\n\r\n",                                                       // no target
	"BREW /pot HTTP/1.1\r\nHost: a\r\n\r\n",                                      // other method
	"POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", // chunked
	"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
	"POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: +1\r\n\r\nx",
	"GET /a HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
	"GET /a HTTP/1.1\r\nHost: a\r\nPragma: no-cache\r\n\r\n",
	"GET /a HTTP/1.1\r\nHost: a\r\n folded\r\n\r\n",
	"GET /a HTTP/1.1\r\nHost: a\r\nBad Name: x\r\n\r\n",
	"GET /a HTTP/1.1\r\nHost: a\r\nX: a\x00b\r\n\r\n",
	"GET /a HTTP/1.1\r\nHost: a\r\nX: a\rb\r\n\r\n",
	"GET /a\rb HTTP/1.1\r\nHost: a\r\n\r\n",
}

// checkSubset runs check on heads that must be taken and on heads that must be declined.
func checkSubset(t *testing.T, taken, declined []string, check func([]byte) bool) {
	t.Helper()
	for _, h := range taken {
		if !check([]byte(h)) {
			t.Errorf("declined a head in the subset: %q", h)
		}
	}
	for _, h := range declined {
		if check([]byte(h)) {
			t.Errorf("took a head outside the subset: %q", h)
		}
	}
}

func TestRequestHead(t *testing.T) {
	checkSubset(t, requestHeads, declinedRequests, func(b []byte) bool { return checkRequestHead(t, b) })
}

// targets are request targets for parseTarget: those it reads itself (a plain path, a query of
// visible ASCII) and those it leaves to url.ParseRequestURI, each read as net/http reads it.
var targets = []string{
	"/", "/up/x", "/a?", "/a??", "/a?b?", "/a?x=1&y=2", "/a?#frag", "/a?q=caf\xc3\xa9", "/a?%zz",
	"/$&+,/:;=@-_.~", "//x/y", "///x", "/a%2Fb", "/a%20b", "/caf\xc3\xa9", "/a#b", "/a!b", "/a*b", "/a'b",
	"/a(b)", "/%zz", "/a[b]", "/a|b", "/a\"b", "/a<b>", "/a\\b", "/a^b", "/a`b", "/a{b}",
}

// TestRequestTargets: every target is read as net/http reads it (checkRequestHead compares the
// URL field by field), by parseTarget's own path or url.ParseRequestURI's, and a target net/http
// refuses is refused.
func TestRequestTargets(t *testing.T) {
	plain := 0
	for _, target := range targets {
		head := "GET " + target + " HTTP/1.1\r\nHost: a\r\n\r\n"
		_, err := http.ReadRequest(bufio.NewReader(strings.NewReader(head)))
		if taken := checkRequestHead(t, []byte(head)); taken != (err == nil) {
			t.Errorf("%q: taken %v, net/http's error %v", target, taken, err)
		}
		path, query, _ := strings.Cut(target, "?")
		if plainPath(path) && visibleASCII(query) {
			plain++
		}
	}
	if plain < 8 || plain == len(targets) {
		t.Errorf("%d of %d targets on parseTarget's own path: both paths must be tried", plain, len(targets))
	}
}

var responseHeads = []string{
	"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nDate: Mon, 30 Nov 2026 01:00:00 GMT\r\n\r\nok",
	"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\nContent-Length: 0\r\n\r\nHTTP/1.1 200 OK\r\n",
	"HTTP/1.1 503\r\nconnection: close\r\nContent-Length: 4\r\n\r\nbusy",
	"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
	"HTTP/1.1 201 \r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nContent-Length: 1\r\n\r\nxtrailing",
}

var declinedResponses = []string{
	"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
	"HTTP/1.1 200 OK\r\n\r\nto the close",
	"HTTP/1.1 204 No Content\r\n\r\n",
	"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n",
	"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.1 +20 OK\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.1  200 OK\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.1 200OK\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.1 200 O\x01K\r\nContent-Length: 0\r\n\r\n",
	"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nTrailer: X\r\n\r\nx",
}

func TestResponseHead(t *testing.T) {
	checkSubset(t, responseHeads, declinedResponses, func(b []byte) bool { return checkResponseHead(t, b, http.MethodGet) })
	if checkResponseHead(t, []byte(responseHeads[0]), http.MethodHead) {
		t.Error("took the answer to a HEAD request (net/http gives it no body)")
	}
}

// A head larger than what the first read buffered goes to net/http, which reads the rest.
func TestHeadNotWholeInBuffer(t *testing.T) {
	big := "GET /a HTTP/1.1\r\nHost: a\r\nX-Big: " + strings.Repeat("b", 5000) + "\r\n\r\n"
	if checkRequestHead(t, []byte(big)) {
		t.Error("took a head larger than the buffer")
	}
}

func FuzzRequestHead(f *testing.F) {
	for _, h := range append(append([]string{}, requestHeads...), declinedRequests...) {
		f.Add([]byte(h))
	}
	for _, target := range targets {
		f.Add([]byte("GET " + target + " HTTP/1.1\r\nHost: a\r\n\r\n"))
	}
	f.Fuzz(func(t *testing.T, data []byte) { checkRequestHead(t, data) })
}

func FuzzResponseHead(f *testing.F) {
	for _, h := range append(append([]string{}, responseHeads...), declinedResponses...) {
		f.Add([]byte(h), false)
	}
	f.Fuzz(func(t *testing.T, data []byte, head bool) {
		method := http.MethodGet
		if head {
			method = http.MethodHead
		}
		checkResponseHead(t, data, method)
	})
}

// readResponse: the answer's first bytes decide between the fast path and net/http; an upstream that
// closes without answering, switches protocols unasked or answers garbage fails the call.
func TestReadResponse(t *testing.T) {
	for _, tc := range []struct {
		in, wantErr string
		wantStatus  int
	}{
		{in: "", wantErr: io.ErrUnexpectedEOF.Error()},
		{in: "HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", wantErr: "bad response from the upstream: the upstream switched protocols unasked"},
		{in: "HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", wantStatus: 200},
		{in: "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", wantStatus: 200},
		{in: "garbage\r\n\r\n", wantErr: "bad response from the upstream: malformed head"},
	} {
		res, err := readResponse(bufio.NewReader(strings.NewReader(tc.in)), nil, &http.Request{Method: http.MethodGet})
		gotErr, gotStatus := "", 0
		if err != nil {
			gotErr = err.Error()
		} else {
			gotStatus = res.StatusCode
			_ = res.Body.Close()
		}
		if gotErr != tc.wantErr || gotStatus != tc.wantStatus {
			t.Errorf("%q: got %d %q, want %d %q", tc.in, gotStatus, gotErr, tc.wantStatus, tc.wantErr)
		}
	}
}
