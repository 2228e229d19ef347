package proxy

import (
	"io"
	"strings"
	"testing"
	"time"
)

// The smuggling corpus: the known request-smuggling families, each sent by an app on its own
// connection to a downstream whose upstream logs every byte it receives. For each: the first
// answer's status, whether the app's connection closes after it, and the upstream's bytes,
// exactly ("{H}" is the upstream's host:port; "" means nothing reached it). Then a following
// request on the same connection (when it stays open) and on another connection each get
// their own answer, and the upstream receives exactly those two requests more: nothing the
// vector carried is left on the app's connection or in a pooled upstream connection.
type smuggleVector struct {
	name   string
	raw    string
	status int
	closes bool
	up     string
}

// The agent's own head for a GET to the upstream, and for a body.
const (
	upGet = "GET /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\n\r\n"
)

var smuggling = []smuggleVector{
	// CL.TE and TE.CL: both framings; chunked wins, the Content-Length is dropped, the
	// connection closes after the answer (RFC 9112 §6.1), so what a CL reader would take for
	// a second request is never read.
	{name: "CL.TE", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGPOST / HTTP/1.1\r\n\r\n",
		status: 200, closes: true, up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"},
	{name: "TE.CL", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n",
		status: 200, closes: true, up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n"},
	// TE.TE: obfuscated Transfer-Encodings are refused (501 for a coding that is not exactly
	// chunked, 400 for a malformed field), or read as the one chunked they are.
	{name: "TE space before colon", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n", status: 400, closes: true},
	{name: "TE tab before colon", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding\t: chunked\r\n\r\n0\r\n\r\n", status: 400, closes: true},
	{name: "TE xchunked", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", status: 501, closes: true},
	{name: "TE list", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", status: 501, closes: true},
	{name: "TE list chunked last", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", status: 501, closes: true},
	{name: "TE duplicated", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", status: 501, closes: true},
	{name: "TE duplicated other", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n\r\n0\r\n\r\n", status: 501, closes: true},
	{name: "TE vertical tab", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\vchunked\r\n\r\n0\r\n\r\n", status: 400, closes: true},
	// obs-fold is replaced by a space (RFC 9112 §5.2 allows that or a 400): a folded
	// Transfer-Encoding is the field it folds into, and one folded into another field is part
	// of that field's value, sent upstream on one line.
	{name: "TE obs-fold", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n",
		status: 200, up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"},
	{name: "TE folded into another field", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nX-A: 1\r\n Transfer-Encoding: chunked\r\n\r\n",
		status: 200, up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-A: 1 Transfer-Encoding: chunked\r\nX-Forwarded-For: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"},
	{name: "TE case and tab", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\ntransfer-encoding:\tCHUNKED\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
		status: 200, up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"},
	// Content-Length: duplicates and malformed values.
	{name: "CL differing duplicates", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", status: 400, closes: true},
	{name: "CL equal duplicates", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
		status: 200, up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nContent-Length: 3\r\n\r\nabc"},
	{name: "CL list", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 3, 3\r\n\r\nabc", status: 400, closes: true},
	{name: "CL plus sign", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: +3\r\n\r\nabc", status: 400, closes: true},
	{name: "CL negative", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\nabc", status: 400, closes: true},
	{name: "CL hex", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 0x3\r\n\r\nabc", status: 400, closes: true},
	{name: "CL overflow", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\nabc", status: 400, closes: true},
	{name: "CL space before colon", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length : 0\r\nContent-Length: 5\r\n\r\nabcde", status: 400, closes: true},
	// Field-name whitespace and bare CR/LF.
	{name: "leading whitespace first field", raw: "GET /up/x HTTP/1.1\r\n Host: a\r\n\r\n", status: 400, closes: true},
	{name: "Host space before colon", raw: "GET /up/x HTTP/1.1\r\nHost: a\r\nHost : evil.example\r\n\r\n", status: 400, closes: true},
	{name: "Connection space before colon", raw: "GET /up/x HTTP/1.1\r\nHost: a\r\nConnection : close\r\n\r\n", status: 400, closes: true},
	{name: "bare LF line ends", raw: "GET /up/x HTTP/1.1\nHost: a\n\n", status: 200, up: upGet},
	{name: "bare CR in a value", raw: "GET /up/x HTTP/1.1\r\nHost: a\r\nX-A: 1\rX-B: 2\r\n\r\n", status: 400, closes: true},
	{name: "bare CR in the request line", raw: "GET /up/x\rHTTP/1.1 HTTP/1.1\r\nHost: a\r\n\r\n", status: 400, closes: true},
	{name: "NUL in a value", raw: "GET /up/x HTTP/1.1\r\nHost: a\r\nX-A: 1\x002\r\n\r\n", status: 400, closes: true},
	// Chunk sizes and extensions: a malformed chunk is the app's error (400, never the
	// downstream's), and the upstream gets nothing when it is the first chunk (the head is
	// sent with the first chunk), or else the agent's own chunked framing of the chunks before
	// it, cut (no last chunk: the upstream cannot take it for a whole body).
	{name: "chunk extension", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=\"1\"\r\nabc\r\n0;x=y\r\n\r\n",
		status: 200, up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"},
	{name: "chunk size hex prefix", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n", status: 400, closes: true},
	{name: "chunk size negative", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n-3\r\nabc\r\n0\r\n\r\n", status: 400, closes: true},
	{name: "chunk size overflow", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffff\r\nabc\r\n0\r\n\r\n", status: 400, closes: true},
	{name: "chunk data longer than its size", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n", status: 400, closes: true,
		up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"},
	// Trailers carrying framing fields: the agent sends the upstream no trailers of the app's.
	{name: "trailer with framing fields", raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nContent-Length: 50\r\nTransfer-Encoding: chunked\r\n\r\n",
		status: 200, up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"},
	// Absolute-form and CONNECT targets: the authority of an absolute target is not where
	// the call goes (the downstream's upstream is), and CONNECT is refused.
	{name: "absolute form", raw: "GET http://evil.example/up/x HTTP/1.1\r\nHost: a\r\n\r\n", status: 200, up: upGet},
	{name: "absolute form without Host", raw: "GET http://evil.example/up/x HTTP/1.1\r\n\r\n", status: 400, closes: true},
	{name: "CONNECT authority", raw: "CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n", status: 405, closes: true},
	{name: "CONNECT path", raw: "CONNECT /up/x HTTP/1.1\r\nHost: a\r\n\r\n", status: 405, closes: true},
	// HTTP/1.0 with Transfer-Encoding: ignored (RFC 9112 §6.1), the body is what
	// Content-Length says (none: empty), and the connection closes after the answer.
	{name: "HTTP/1.0 TE and CL", raw: "POST /up/x HTTP/1.0\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\nabc",
		status: 200, closes: true, up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nContent-Length: 3\r\n\r\nabc"},
	{name: "HTTP/1.0 TE alone", raw: "POST /up/x HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\nGET /up/smuggled HTTP/1.0\r\n\r\n",
		status: 200, closes: true, up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"},
	// Pipelined follow-ups are answered in order, each its own.
	{name: "pipelined", raw: "GET /up/x HTTP/1.1\r\nHost: a\r\n\r\nGET /up/y HTTP/1.1\r\nHost: a\r\n\r\n",
		status: 200, up: upGet + strings.ReplaceAll(upGet, "/x", "/y")},
}

func TestSmugglingCorpus(t *testing.T) {
	up := newByteLog(t)
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("up", up.URL, 4))
	host := strings.TrimPrefix(up.URL, "http://")
	follow := func(path string) string {
		return "GET " + path + " HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\n\r\n"
	}
	for _, v := range smuggling {
		t.Run(v.name, func(t *testing.T) {
			up.reset()
			c, br := rawConn(t, a)
			go io.WriteString(c, v.raw)
			first := readAnswer(t, br)
			if first.status != v.status || first.close != v.closes {
				t.Fatalf("first answer %d close=%v %q, want %d close=%v", first.status, first.close, first.body, v.status, v.closes)
			}
			want := v.up
			if v.name == "pipelined" {
				if second := readAnswer(t, br); second.status != 200 || second.body != "/y" {
					t.Fatalf("pipelined second answer %d %q", second.status, second.body)
				}
			}
			if !first.close {
				io.WriteString(c, "GET /up/same HTTP/1.1\r\nHost: a\r\n\r\n")
				if r := readAnswer(t, br); r.status != 200 || r.body != "/same" {
					t.Fatalf("next request on the same connection = %d %q, want its own answer", r.status, r.body)
				}
				want += follow("/same")
			} else if n, err := br.Read(make([]byte, 1)); n != 0 || err == nil {
				t.Fatalf("the connection stayed open after an answer that said close")
			}
			if r := exchange(t, a, "GET /up/other HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer victim\r\n\r\n"); r.status != 200 || r.body != "/other" {
				t.Fatalf("next request on another connection = %d %q, want its own answer", r.status, r.body)
			}
			want += strings.Replace(follow("/other"), "\r\nX-Forwarded-For", "\r\nAuthorization: Bearer victim\r\nX-Forwarded-For", 1)
			// The upstream reads on its own goroutines: wait for its log to be complete.
			received := func() string { return strings.ReplaceAll(up.all(), host, "{H}") }
			deadline := time.Now().Add(5 * time.Second)
			for received() != want && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			if got := received(); got != want {
				t.Fatalf("the upstream received:\n%q\nwant:\n%q", got, want)
			}
		})
	}
}
