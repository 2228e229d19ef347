package proxy

import (
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/agent/upstreamtls"
	"github.com/apportion/apportion/internal/h1"
)

// Problem codes of the answers the data plane gives itself (fallback answers carry the
// fallback package's codes: APPORTION_NO_PERMIT, ...).
const (
	CodeUnknownDownstream   = "APPORTION_UNKNOWN_DOWNSTREAM"   // 404
	CodeUpstreamTimeout     = "APPORTION_UPSTREAM_TIMEOUT"     // 504
	CodeUpstreamUnavailable = "APPORTION_UPSTREAM_UNAVAILABLE" // 502
	CodeNotConfigured       = "APPORTION_NOT_CONFIGURED"       // 503: no assignment yet
	CodeStalled             = "APPORTION_STALLED"              // 503: the agent stalled after admitting the call
	// The upstream's answer could not be read as HTTP (a head over h1.MaxResponseHeaderBytes, a
	// malformed head, a protocol switch nobody asked for).
	CodeUpstreamBadResponse = "APPORTION_UPSTREAM_BAD_RESPONSE" // 502
	// The app's own request was malformed: its head (answered by h1.Server, see Refusal) or its body. Never
	// counted against the downstream.
	CodeBadRequest = "APPORTION_BAD_REQUEST" // 400
	// h1.Server's other refusals of a request head (see Refusal).
	CodeHeaderTooLarge                 = "APPORTION_HEADER_TOO_LARGE"                  // 431
	CodeExpectationFailed              = "APPORTION_EXPECTATION_FAILED"                // 417
	CodeHTTPVersionNotSupported        = "APPORTION_HTTP_VERSION_NOT_SUPPORTED"        // 505
	CodeTransferEncodingNotImplemented = "APPORTION_TRANSFER_ENCODING_NOT_IMPLEMENTED" // 501
	// The app did not send its request body within the downstream's requestTimeout.
	CodeRequestTimeout = "APPORTION_REQUEST_TIMEOUT" // 408
	// CONNECT: the agent is not a forward proxy.
	CodeMethodNotAllowed = "APPORTION_METHOD_NOT_ALLOWED" // 405
	// The app's own deadline (X-Apportion-Timeout, grpc-timeout) passed before the call could be
	// forwarded.
	CodeDeadlineExceeded = "APPORTION_DEADLINE_EXCEEDED" // 504
)

// answerFallback answers a call that is not forwarded, with fc (the downstream's fallback or a
// switch's action).
func (h *Handler) answerFallback(w http.ResponseWriter, r *http.Request, ds *enforce.Downstream, fc *fallback.Config,
	reason fallback.Reason, retryAfter time.Duration, now time.Time) {
	if grpcFallback(w, ds, reason, retryAfter) {
		return // a gRPC caller gets a gRPC status (h2.go)
	}
	in := fallback.Input{Downstream: ds.Name, Reason: reason, Method: r.Method, RetryAfter: retryAfter, Now: now}
	if fc.Action == fallback.ServeStale && r.Method == http.MethodGet && h.stale != nil {
		if e, ok := h.stale.Get(fallback.Key(ds.Name, r.URL.RequestURI())); ok {
			in.Stale = e
		}
	}
	d := fallback.Decide(*fc, in)
	switch d.Action {
	case fallback.Static:
		ds.Metrics.Fallback[metrics.ActionStatic].Inc()
	case fallback.ServeStale:
		ds.Metrics.Fallback[metrics.ActionServeStale].Inc()
	default:
		ds.Metrics.Fallback[metrics.ActionReject].Inc()
	}
	_ = fallback.Write(w, d)
}

// problem is the application/problem+json of the data plane's own answers, shaped like the
// fallback package's.
type problem struct {
	Type       string `json:"type"`
	Title      string `json:"title"`
	Status     int    `json:"status"`
	Detail     string `json:"detail"`
	Code       string `json:"code"`
	Downstream string `json:"downstream,omitempty"`
}

// writeRefusal answers a call the agent refuses before any fallback applies (no assignment
// yet, unknown downstream) like every other refusal: the problem, with X-Apportion-Fallback:
// reject and X-Apportion-Reason (the code's slug, e.g. unknown-downstream), so that clients and
// logs tell it from a downstream's answer.
func writeRefusal(w http.ResponseWriter, status int, code, title, detail, downstream string) {
	hd := w.Header()
	hd.Set(fallback.HeaderFallback, "reject")
	hd.Set(fallback.HeaderReason, codeSlug(code))
	writeProblem(w, status, code, title, detail, downstream)
}

func problemJSON(status int, code, title, detail, downstream string) []byte {
	b, _ := json.Marshal(problem{
		Type: fallback.ProblemTypePrefix + codeSlug(code), Title: title, Status: status,
		Detail: detail, Code: code, Downstream: downstream,
	})
	return b
}

func writeProblem(w http.ResponseWriter, status int, code, title, detail, downstream string) {
	if grpcProblem(w, code, title, detail) {
		return // a gRPC caller gets a gRPC status (h2.go)
	}
	b := problemJSON(status, code, title, detail, downstream)
	hd := w.Header()
	hd.Set("Content-Type", "application/problem+json")
	hd.Set("Cache-Control", "no-store")
	hd.Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// codeSlug turns APPORTION_UPSTREAM_TIMEOUT into upstream-timeout.
func codeSlug(code string) string {
	b := []byte(code[len("APPORTION_"):])
	for i, c := range b {
		switch {
		case c == '_':
			b[i] = '-'
		case c >= 'A' && c <= 'Z':
			b[i] = c + 'a' - 'A'
		}
	}
	return string(b)
}

// staleTee copies a GET 2xx response body, up to a bound, for the stale cache.
type staleTee struct {
	key    string
	status int
	header http.Header
	buf    []byte
	max    int
}

// newTee starts copying a response for the cache, or returns nil when it cannot be stored
// (not storable, or announced larger than one entry may be).
func (h *Handler) newTee(key string, req *http.Request, res *http.Response) *staleTee {
	if h.stale == nil || !fallback.Storable(req.Header, res.StatusCode, res.Header) {
		return nil
	}
	if res.ContentLength > h.maxEntry {
		return nil
	}
	t := &staleTee{key: key, status: res.StatusCode, header: res.Header.Clone(), max: int(h.maxEntry)}
	if res.ContentLength > 0 {
		t.buf = make([]byte, 0, res.ContentLength)
	}
	return t
}

// write copies p; it reports false once the body exceeds the bound (the tee is then dropped).
func (t *staleTee) write(p []byte) bool {
	if len(t.buf)+len(p) > t.max {
		return false
	}
	t.buf = append(t.buf, p...)
	return true
}

func (h *Handler) storeTee(t *staleTee, now time.Time) {
	h.stale.Put(t.key, fallback.Entry{
		Response: fallback.Response{Status: t.status, Header: t.header, Body: t.buf},
		StoredAt: now,
	})
}

// bufferPool recycles the 32 KiB copy buffers of the ReverseProxy, of forwardLean and of the
// engine's client: one pool.
var bufferPool h1.BufferPool

// Refusal is h1.Server's Refusal for the agent: a request the server refuses before the Handler
// sees it gets the agent's problem+json, whose code names the app's error
// (APPORTION_BAD_REQUEST, APPORTION_HEADER_TOO_LARGE, ...).
func Refusal(status int, reason string) (contentType string, body []byte) {
	code := CodeBadRequest
	switch status {
	case http.StatusRequestHeaderFieldsTooLarge:
		code = CodeHeaderTooLarge
	case http.StatusExpectationFailed:
		code = CodeExpectationFailed
	case http.StatusHTTPVersionNotSupported:
		code = CodeHTTPVersionNotSupported
	case http.StatusNotImplemented:
		code = CodeTransferEncodingNotImplemented
	}
	return "application/problem+json", problemJSON(status, code, http.StatusText(status), reason, "")
}

// Problem codes of a call whose TLS to the downstream failed (upstreamtls.Classify), one per
// reason, the metric upstream_tls_failures_total's reason their slug's tail. All but the
// handshake timeout are misconfigurations, which the breaker does not count (see finish).
const (
	CodeTLSUnknownCA         = "APPORTION_UPSTREAM_TLS_UNKNOWN_CA"          // 502
	CodeTLSWrongName         = "APPORTION_UPSTREAM_TLS_WRONG_NAME"          // 502
	CodeTLSExpired           = "APPORTION_UPSTREAM_TLS_EXPIRED"             // 502
	CodeTLSBadCertificate    = "APPORTION_UPSTREAM_TLS_BAD_CERTIFICATE"     // 502
	CodeTLSClientCertRefused = "APPORTION_UPSTREAM_TLS_CLIENT_CERT_REFUSED" // 502
	CodeTLSHandshakeFailed   = "APPORTION_UPSTREAM_TLS_HANDSHAKE_FAILED"    // 502
	CodeTLSHandshakeTimeout  = "APPORTION_UPSTREAM_TLS_HANDSHAKE_TIMEOUT"   // 504
	CodeTLSConfig            = "APPORTION_UPSTREAM_TLS_CONFIG"              // 502
)

// tlsProblems are the answers by upstreamtls.Reason (index Reason-1).
var tlsProblems = [...]struct {
	status       int
	code, title  string
	detailPrefix string
}{
	{http.StatusBadGateway, CodeTLSUnknownCA, "Upstream certificate not trusted",
		"the downstream's certificate chain leads to no CA the agent trusts (spec.upstreamTLS.caBundle, or the system roots)"},
	{http.StatusBadGateway, CodeTLSWrongName, "Upstream certificate for another name",
		"the downstream's certificate does not name the server name the agent verifies (spec.upstreamTLS.serverName, or the upstream's host)"},
	{http.StatusBadGateway, CodeTLSExpired, "Upstream certificate expired",
		"a certificate of the downstream's chain has expired or is not valid yet"},
	{http.StatusBadGateway, CodeTLSBadCertificate, "Upstream certificate invalid",
		"the downstream's certificate cannot be verified"},
	{http.StatusBadGateway, CodeTLSClientCertRefused, "Client certificate refused",
		"the downstream refused the agent's client certificate, or its absence (spec.upstreamTLS.clientCertificate)"},
	{http.StatusBadGateway, CodeTLSHandshakeFailed, "TLS handshake failed",
		"the downstream refused the TLS handshake (version, cipher suites)"},
	{http.StatusGatewayTimeout, CodeTLSHandshakeTimeout, "TLS handshake timeout",
		"the downstream did not complete the TLS handshake in time"},
	{http.StatusBadGateway, CodeTLSConfig, "TLS material unusable",
		"the agent's TLS material for this downstream cannot be used (a file the webhook mounts is missing or malformed); nothing was sent"},
}

// writeTLSProblem answers a call whose TLS failed for reason r (not None).
func writeTLSProblem(w http.ResponseWriter, r upstreamtls.Reason, err error, downstream string) {
	p := tlsProblems[r-1]
	writeProblem(w, p.status, p.code, p.title, p.detailPrefix+": "+tlsDetail(err), downstream)
}

// tlsDetail describes a TLS failure for the app: crypto/tls's or crypto/x509's words, the
// downstream's alert, or the connection's failure without the agent's socket addresses.
func tlsDetail(err error) string {
	var ne *net.OpError
	if errors.As(err, &ne) {
		if ne.Op == "remote error" && ne.Err != nil {
			return "the downstream sent the alert " + quote(ne.Err.Error())
		}
		return upstreamError(err)
	}
	var he *upstreamtls.HandshakeError
	if errors.As(err, &he) {
		return he.Err.Error()
	}
	return err.Error()
}
