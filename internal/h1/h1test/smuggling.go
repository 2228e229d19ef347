// Package h1test holds corpora of HTTP/1.1 messages shared by the tests of the agent's HTTP
// engine (package h1: its server held to net/http's on each message) and of its data plane
// (package proxy: what reaches the upstream), and what their raw upstreams share (ReadHead).
// It is imported by tests only.
package h1test

import "strings"

// SmuggleVector is one of the known request-smuggling families, sent by an app on its own
// connection to downstream "up" of an agent whose upstream logs every byte it receives: the
// first answer's status, whether the app's connection closes after it, and the upstream's
// bytes, exactly ("{H}" is the upstream's host:port; "" means nothing reached it). The proxy's
// TestSmugglingCorpus then sends a following request on the same connection (when it stays
// open) and on another connection, each of which gets its own answer, and the upstream
// receives exactly those two requests more: nothing the vector carried is left on the app's
// connection or in a pooled upstream connection. The engine's differential test holds its
// server to net/http's on each Raw.
type SmuggleVector struct {
	Name   string
	Raw    string // what the app sends on its connection
	Status int    // the first answer's status
	Closes bool   // the app's connection closes after it
	Up     string // what the upstream receives
}

// UpGet is the agent's own head for a GET of /x to the upstream.
const (
	UpGet = "GET /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\n\r\n"
)

// Smuggling is the corpus of SmuggleVector.
var Smuggling = []SmuggleVector{
	// CL.TE and TE.CL: both framings; chunked wins, the Content-Length is dropped, the
	// connection closes after the answer (RFC 9112 §6.1), so what a CL reader would take for
	// a second request is never read.
	{Name: "CL.TE", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGPOST / HTTP/1.1\r\n\r\n",
		Status: 200, Closes: true, Up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"},
	{Name: "TE.CL", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n",
		Status: 200, Closes: true, Up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n8\r\nSMUGGLED\r\n0\r\n\r\n"},
	// TE.TE: obfuscated Transfer-Encodings are refused (501 for a coding that is not exactly
	// chunked, 400 for a malformed field), or read as the one chunked they are.
	{Name: "TE space before colon", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n", Status: 400, Closes: true},
	{Name: "TE tab before colon", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding\t: chunked\r\n\r\n0\r\n\r\n", Status: 400, Closes: true},
	{Name: "TE xchunked", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n", Status: 501, Closes: true},
	{Name: "TE list", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n", Status: 501, Closes: true},
	{Name: "TE list chunked last", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", Status: 501, Closes: true},
	{Name: "TE duplicated", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", Status: 501, Closes: true},
	{Name: "TE duplicated other", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: x\r\n\r\n0\r\n\r\n", Status: 501, Closes: true},
	{Name: "TE vertical tab", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\vchunked\r\n\r\n0\r\n\r\n", Status: 400, Closes: true},
	// obs-fold is replaced by a space (RFC 9112 §5.2 allows that or a 400): a folded
	// Transfer-Encoding is the field it folds into, and one folded into another field is part
	// of that field's value, sent upstream on one line.
	{Name: "TE obs-fold", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n",
		Status: 200, Up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"},
	{Name: "TE folded into another field", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nX-A: 1\r\n Transfer-Encoding: chunked\r\n\r\n",
		Status: 200, Up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-A: 1 Transfer-Encoding: chunked\r\nX-Forwarded-For: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"},
	{Name: "TE case and tab", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\ntransfer-encoding:\tCHUNKED\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
		Status: 200, Up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"},
	// Content-Length: duplicates and malformed values.
	{Name: "CL differing duplicates", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", Status: 400, Closes: true},
	{Name: "CL equal duplicates", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
		Status: 200, Up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nContent-Length: 3\r\n\r\nabc"},
	{Name: "CL list", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 3, 3\r\n\r\nabc", Status: 400, Closes: true},
	{Name: "CL plus sign", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: +3\r\n\r\nabc", Status: 400, Closes: true},
	{Name: "CL negative", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\nabc", Status: 400, Closes: true},
	{Name: "CL hex", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 0x3\r\n\r\nabc", Status: 400, Closes: true},
	{Name: "CL overflow", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\nabc", Status: 400, Closes: true},
	{Name: "CL space before colon", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nContent-Length : 0\r\nContent-Length: 5\r\n\r\nabcde", Status: 400, Closes: true},
	// Field-name whitespace and bare CR/LF.
	{Name: "leading whitespace first field", Raw: "GET /up/x HTTP/1.1\r\n Host: a\r\n\r\n", Status: 400, Closes: true},
	{Name: "Host space before colon", Raw: "GET /up/x HTTP/1.1\r\nHost: a\r\nHost : evil.example\r\n\r\n", Status: 400, Closes: true},
	{Name: "Connection space before colon", Raw: "GET /up/x HTTP/1.1\r\nHost: a\r\nConnection : close\r\n\r\n", Status: 400, Closes: true},
	{Name: "bare LF line ends", Raw: "GET /up/x HTTP/1.1\nHost: a\n\n", Status: 200, Up: UpGet},
	{Name: "bare CR in a value", Raw: "GET /up/x HTTP/1.1\r\nHost: a\r\nX-A: 1\rX-B: 2\r\n\r\n", Status: 400, Closes: true},
	{Name: "bare CR in the request line", Raw: "GET /up/x\rHTTP/1.1 HTTP/1.1\r\nHost: a\r\n\r\n", Status: 400, Closes: true},
	{Name: "NUL in a value", Raw: "GET /up/x HTTP/1.1\r\nHost: a\r\nX-A: 1\x002\r\n\r\n", Status: 400, Closes: true},
	// Chunk sizes and extensions: a malformed chunk is the app's error (400, never the
	// downstream's), and the upstream gets nothing when it is the first chunk (the head is
	// sent with the first chunk), or else the agent's own chunked framing of the chunks before
	// it, cut (no last chunk: the upstream cannot take it for a whole body).
	{Name: "chunk extension", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=\"1\"\r\nabc\r\n0;x=y\r\n\r\n",
		Status: 200, Up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"},
	{Name: "chunk size hex prefix", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n", Status: 400, Closes: true},
	{Name: "chunk size negative", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n-3\r\nabc\r\n0\r\n\r\n", Status: 400, Closes: true},
	{Name: "chunk size overflow", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffff\r\nabc\r\n0\r\n\r\n", Status: 400, Closes: true},
	{Name: "chunk data longer than its size", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcdef\r\n0\r\n\r\n", Status: 400, Closes: true,
		Up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n"},
	// Trailers carrying framing fields: the agent sends the upstream no trailers of the app's.
	{Name: "trailer with framing fields", Raw: "POST /up/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nContent-Length: 50\r\nTransfer-Encoding: chunked\r\n\r\n",
		Status: 200, Up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"},
	// Absolute-form and CONNECT targets: the authority of an absolute target is not where
	// the call goes (the downstream's upstream is), and CONNECT is refused.
	{Name: "absolute form", Raw: "GET http://evil.example/up/x HTTP/1.1\r\nHost: a\r\n\r\n", Status: 200, Up: UpGet},
	{Name: "absolute form without Host", Raw: "GET http://evil.example/up/x HTTP/1.1\r\n\r\n", Status: 400, Closes: true},
	{Name: "CONNECT authority", Raw: "CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n", Status: 405, Closes: true},
	{Name: "CONNECT path", Raw: "CONNECT /up/x HTTP/1.1\r\nHost: a\r\n\r\n", Status: 405, Closes: true},
	// HTTP/1.0 with Transfer-Encoding: ignored (RFC 9112 §6.1), the body is what
	// Content-Length says (none: empty), and the connection closes after the answer.
	{Name: "HTTP/1.0 TE and CL", Raw: "POST /up/x HTTP/1.0\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\nabc",
		Status: 200, Closes: true, Up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nContent-Length: 3\r\n\r\nabc"},
	{Name: "HTTP/1.0 TE alone", Raw: "POST /up/x HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\nGET /up/smuggled HTTP/1.0\r\n\r\n",
		Status: 200, Closes: true, Up: "POST /x HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"},
	// Pipelined follow-ups are answered in order, each its own.
	{Name: "pipelined", Raw: "GET /up/x HTTP/1.1\r\nHost: a\r\n\r\nGET /up/y HTTP/1.1\r\nHost: a\r\n\r\n",
		Status: 200, Up: UpGet + strings.ReplaceAll(UpGet, "/x", "/y")},
}
