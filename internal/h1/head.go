package h1

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net/http"
	"net/textproto"
	"net/url"
	"strings"

	"golang.org/x/net/http/httpguts"
)

// Reading message heads on the hot path.
//
// http.ReadRequest and http.ReadResponse read a head line by line through textproto, allocate
// a string per value and wrap a body in two readers: on the agent's small calls that was about
// a seventh of its CPU. readRequestHead and readResponseHead parse a head that is already
// whole in the bufio.Reader's buffer (a small call's head arrives in one segment) in one pass,
// with one string allocation for all of it: method, target, names and values are substrings.
//
// They take only heads in a strict, common subset: HTTP/1.1, CRLF line ends, field names of
// token characters, values of visible characters, spaces and tabs, framing by one
// Content-Length or (requests) none, and no field net/http rewrites (Transfer-Encoding,
// Trailer, Pragma). Anything else they decline without consuming a byte, and the caller reads
// the head with net/http, which decides. So they accept nothing net/http would refuse and read
// nothing differently from it: FuzzRequestHead and FuzzResponseHead check exactly that against
// net/http on arbitrary input.

// scanHead finds a whole head at the start of b: its length through the blank line that ends
// it, and how many field lines it has. ok false: b holds no whole head, the start line is
// empty, or a line ends otherwise than CRLF.
func scanHead(b []byte) (length, fields int, ok bool) {
	i := 0
	for line := 0; ; line++ {
		j := bytes.IndexByte(b[i:], '\n')
		if j < 1 || b[i+j-1] != '\r' {
			return 0, 0, false // incomplete, or a bare LF (net/http's reading of those differs)
		}
		if j == 1 {
			if line == 0 {
				return 0, 0, false
			}
			return i + 2, line - 1, true
		}
		i += j + 1
	}
}

// parseFields reads field lines (each ending CRLF, the blank line excluded) into h, with
// vals as the backing of each name's first value. ok false: a line outside the subset.
func parseFields(s string, h http.Header, vals []string) bool {
	for len(s) > 0 {
		nl := strings.IndexByte(s, '\n') // present, after '\r': scanHead checked
		line := s[:nl-1]
		s = s[nl+1:]
		colon := strings.IndexByte(line, ':')
		if colon <= 0 {
			return false // no name; a leading space (a continuation line) fails below too
		}
		name, canonical, upper := line[:colon], true, true
		for i := range len(name) {
			c := name[i]
			if !tokenByte(c) {
				return false
			}
			if upper && 'a' <= c && c <= 'z' || !upper && 'A' <= c && c <= 'Z' {
				canonical = false
			}
			upper = c == '-'
		}
		if !canonical {
			name = textproto.CanonicalMIMEHeaderKey(name)
		}
		v := line[colon+1:]
		for i := range len(v) {
			if !valueByte(v[i]) {
				return false
			}
		}
		v = strings.Trim(v, " \t")
		if vv := h[name]; vv != nil {
			h[name] = append(vv, v)
		} else {
			vv, vals = vals[:1:1], vals[1:]
			vv[0] = v
			h[name] = vv
		}
	}
	return true
}

// tokenByte reports whether c may be in a field name (RFC 9110 tchar).
func tokenByte(c byte) bool {
	switch {
	case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// valueByte reports whether c may be in a field value: visible, space, tab or obs-text.
func valueByte(c byte) bool { return c == '\t' || (c >= 0x20 && c != 0x7f) }

// contentLength parses one Content-Length value: 1 to 18 digits (net/http takes up to 2^63-1;
// longer ones go to it).
func contentLength(v string) (int64, bool) {
	if len(v) == 0 || len(v) > 18 {
		return 0, false
	}
	var n int64
	for i := range len(v) {
		c := v[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

// framing reads the fields net/http treats specially in h. ok false: a field the subset leaves
// to net/http (Transfer-Encoding, Trailer, Pragma, several or invalid Content-Length).
// length is -1 without Content-Length.
func framing(h http.Header) (length int64, closing, ok bool) {
	if _, te := h["Transfer-Encoding"]; te {
		return 0, false, false
	}
	if _, tr := h["Trailer"]; tr {
		return 0, false, false
	}
	if _, pr := h["Pragma"]; pr {
		return 0, false, false
	}
	length = -1
	if cl, present := h["Content-Length"]; present {
		if len(cl) != 1 {
			return 0, false, false
		}
		if length, ok = contentLength(cl[0]); !ok {
			return 0, false, false
		}
	}
	return length, httpguts.HeaderValuesContainsToken(h["Connection"], "close"), true
}

// methods are the request methods the fast path takes, as constants: the request keeps no
// substring of the head for them.
var methods = [...]string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodDelete,
	http.MethodPatch, http.MethodHead, http.MethodOptions}

// readRequestHead reads the request whose head is at the front of br's buffer, with ctx as its
// context, when the head is whole there and in the subset (see the top of this file). ok
// false: nothing was consumed, and http.ReadRequest must read it.
func readRequestHead(br *bufio.Reader, ctx context.Context) (req *http.Request, ok bool) {
	b, _ := br.Peek(br.Buffered())
	n, fields, ok := scanHead(b)
	if !ok {
		return nil, false
	}
	line := b[:bytes.IndexByte(b, '\n')-1] // a '\r' inside it is refused below
	sp := bytes.IndexByte(line, ' ')
	if sp < 0 || sp+1 > len(line)-len(" HTTP/1.1") {
		return nil, false
	}
	method := ""
	for _, m := range methods {
		if string(line[:sp]) == m {
			method = m
			break
		}
	}
	if method == "" || !bytes.HasSuffix(line, []byte(" HTTP/1.1")) {
		return nil, false
	}
	block := string(b[:n])
	target := block[sp+1 : len(line)-len(" HTTP/1.1")]
	if len(target) == 0 || target[0] != '/' || strings.IndexByte(target, ' ') >= 0 {
		return nil, false
	}
	parts := new(requestParts)
	if !parseTarget(target, &parts.url) {
		return nil, false
	}
	vals := parts.vals[:]
	if fields > len(vals) {
		vals = make([]string, fields)
	}
	h := make(http.Header, fields)
	if !parseFields(block[len(line)+2:n-2], h, vals) {
		return nil, false
	}
	length, closing, ok := framing(h)
	hosts := h["Host"]
	if !ok || len(hosts) > 1 || len(hosts) == 1 && (hosts[0] == "" || !httpguts.ValidHostHeader(hosts[0])) {
		return nil, false // an empty Host is valid but must stay apart from none (see checkRequest)
	}
	r := http.Request{Method: method, URL: &parts.url, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, Header: h,
		Body: http.NoBody, RequestURI: target, Close: closing, ContentLength: max(length, 0)}
	if len(hosts) == 1 {
		r.Host = hosts[0]
		delete(h, "Host") // as http.ReadRequest: it is in r.Host
	}
	if length > 0 {
		r.Body = &fixedBody{r: br, remain: length}
	}
	_, _ = br.Discard(n)
	return r.WithContext(ctx), true
}

// requestParts holds a request's URL and the first values of its fields (parseFields' vals) in
// one allocation.
type requestParts struct {
	url  url.URL
	vals [inlineValues]string
}

// inlineValues is how many fields' first values a head's own allocation holds (requestParts,
// leanResponse): a head with more allocates their backing apart. Small calls and their answers
// often have no more (BenchmarkServeLean's call has 3 fields, its upstream's answer 1); 4 keeps
// requestParts at 208 bytes and leanResponse at 224, 16 to 48 bytes more than the two
// allocations each replaces.
const inlineValues = 4

// parseTarget parses an origin-form request target (it starts with '/') into u as
// url.ParseRequestURI does. A path of characters that need no escaping (url.URL.EscapedPath
// gives it back as it is), with a query of visible ASCII or none, is the common case and is
// read here without it: Path is the path, RawPath empty, RawQuery the query, ForceQuery set for
// a '?' with nothing after it. Anything else goes to url.ParseRequestURI. ok false: it refused
// the target.
func parseTarget(target string, u *url.URL) bool {
	path, query, hasQuery := strings.Cut(target, "?")
	if plainPath(path) && visibleASCII(query) {
		*u = url.URL{Path: path, RawQuery: query, ForceQuery: hasQuery && query == ""}
		return true
	}
	p, err := url.ParseRequestURI(target)
	if err != nil {
		return false
	}
	*u = *p
	return true
}

// plainPath reports whether every byte of p is one url.URL keeps as it is in a path: letters,
// digits, "-_.~" and the reserved characters a path may hold unescaped ("$&+,/:;=@").
func plainPath(p string) bool {
	for i := range len(p) {
		c := p[i]
		if 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' {
			continue
		}
		if strings.IndexByte("-_.~$&+,/:;=@", c) < 0 {
			return false
		}
	}
	return true
}

// visibleASCII reports whether every byte of s is visible ASCII (no space, control or
// non-ASCII byte).
func visibleASCII(s string) bool {
	for i := range len(s) {
		if s[i] <= ' ' || s[i] >= 0x7f {
			return false
		}
	}
	return true
}

// readResponseHead reads the answer to req whose head is at the front of br's buffer, when the
// head is whole there and in the subset: a final status with a body (200-599 but 204 and 304)
// framed by Content-Length, to a request other than HEAD. ok false: nothing was consumed, and
// http.ReadResponse must read it.
func readResponseHead(br *bufio.Reader, req *http.Request) (res *http.Response, ok bool) {
	if req.Method == http.MethodHead {
		return nil, false
	}
	b, _ := br.Peek(br.Buffered())
	n, fields, ok := scanHead(b)
	if !ok {
		return nil, false
	}
	line := b[:bytes.IndexByte(b, '\n')-1] // a '\r' inside it is refused below
	const proto = "HTTP/1.1 "
	if len(line) < len(proto)+3 || string(line[:len(proto)]) != proto || (len(line) > len(proto)+3 && line[len(proto)+3] != ' ') {
		return nil, false
	}
	code := 0
	for _, c := range line[len(proto) : len(proto)+3] {
		if c < '0' || c > '9' {
			return nil, false
		}
		code = code*10 + int(c-'0')
	}
	if code < 200 || code > 599 || code == http.StatusNoContent || code == http.StatusNotModified {
		return nil, false
	}
	for _, c := range line[len(proto)+3:] {
		if !valueByte(c) {
			return nil, false
		}
	}
	block := string(b[:n])
	lr := new(leanResponse)
	vals := lr.vals[:]
	if fields > len(vals) {
		vals = make([]string, fields)
	}
	h := make(http.Header, fields)
	if !parseFields(block[len(line)+2:n-2], h, vals) {
		return nil, false
	}
	length, closing, ok := framing(h)
	if !ok || length < 0 {
		return nil, false // no Content-Length: the body ends with the connection
	}
	if closing {
		delete(h, "Connection") // as http.ReadResponse
	}
	lr.Response = http.Response{Status: block[len(proto):len(line)], StatusCode: code,
		Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, Header: h, Body: http.NoBody, ContentLength: length,
		Close: closing, Request: req}
	if length > 0 {
		lr.body = fixedBody{r: br, remain: length}
		lr.Body = &lr.body
	}
	res = &lr.Response
	_, _ = br.Discard(n)
	return res, true
}

// leanResponse holds an answer, its body and the first values of its fields in one allocation.
type leanResponse struct {
	http.Response
	body fixedBody
	vals [inlineValues]string
}

// fixedBody is a body of a known length read from r, as net/http's: io.EOF with its last
// bytes (so that the connection can be reused as soon as the body is read), and
// io.ErrUnexpectedEOF when r ends before it. Close does not drain it: the server and the
// upstream client close a connection whose body was not read to its end, and stop reading a
// body they closed.
type fixedBody struct {
	r      *bufio.Reader
	remain int64
}

func (b *fixedBody) Read(p []byte) (int, error) {
	if b.remain <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > b.remain {
		p = p[:b.remain]
	}
	n, err := b.r.Read(p)
	b.remain -= int64(n)
	switch {
	case b.remain == 0:
		return n, io.EOF
	case err == io.EOF:
		return n, io.ErrUnexpectedEOF
	}
	return n, err
}

func (b *fixedBody) Close() error { return nil }
