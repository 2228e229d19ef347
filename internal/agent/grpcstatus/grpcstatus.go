// Package grpcstatus is the little of gRPC the agent speaks itself: the status codes, the
// trailers-only answer it refuses a gRPC call with, and how it reads the upstream's status to
// judge a call. The codes and headers are the gRPC over HTTP/2 specification's
// (https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md and doc/statuscodes.md);
// they are written out here rather than taken from google.golang.org/grpc so that the agent's
// binary does not link a gRPC implementation it does not use (grpc-go is used by the tests, as
// the real client and server the agent is held to).
//
// A refusal is a trailers-only response: HTTP 200, Content-Type application/grpc, grpc-status
// and grpc-message (percent-encoded as the specification says) in the one HEADERS frame that
// ends the stream, and grpc-retry-pushback-ms only when the wait is known. A gRPC client reads
// that as the call's status and never as a protocol error; grpc-go's retry policy honours the
// pushback (a retry after that many milliseconds) and retries with its own backoff without it.
package grpcstatus

import (
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Code is a gRPC status code.
type Code int

// The status codes (doc/statuscodes.md).
const (
	OK                 Code = 0
	Canceled           Code = 1
	Unknown            Code = 2
	InvalidArgument    Code = 3
	DeadlineExceeded   Code = 4
	NotFound           Code = 5
	AlreadyExists      Code = 6
	PermissionDenied   Code = 7
	ResourceExhausted  Code = 8
	FailedPrecondition Code = 9
	Aborted            Code = 10
	OutOfRange         Code = 11
	Unimplemented      Code = 12
	Internal           Code = 13
	Unavailable        Code = 14
	DataLoss           Code = 15
	Unauthenticated    Code = 16
)

// Header names (canonical form).
const (
	HeaderStatus   = "Grpc-Status"
	HeaderMessage  = "Grpc-Message"
	HeaderPushback = "Grpc-Retry-Pushback-Ms"
)

// IsGRPC reports whether a request's Content-Type is gRPC's: application/grpc, alone or with a
// subtype (application/grpc+proto) or parameters. gRPC-Web (application/grpc-web) is not: it
// carries its status in the body and is answered like any HTTP call.
func IsGRPC(contentType string) bool {
	rest, ok := strings.CutPrefix(contentType, "application/grpc")
	return ok && (rest == "" || rest[0] == '+' || rest[0] == ';')
}

// Write answers a gRPC call with a trailers-only response of code and msg, with
// grpc-retry-pushback-ms when pushback > 0 (rounded up to a whole millisecond). Fields the
// answer already has (X-Apportion-Reason, ...) stay; Content-Length and Connection go (the
// answer has no body, and over HTTP/2 "Connection: close" would end every stream of the
// connection).
func Write(w http.ResponseWriter, code Code, msg string, pushback time.Duration) {
	h := w.Header()
	delete(h, "Content-Length")
	delete(h, "Connection")
	h.Set("Content-Type", "application/grpc")
	h.Set(HeaderStatus, strconv.Itoa(int(code)))
	if msg != "" {
		h.Set(HeaderMessage, EncodeMessage(msg))
	}
	if pushback > 0 {
		ms := (pushback + time.Millisecond - 1) / time.Millisecond
		h.Set(HeaderPushback, strconv.FormatInt(int64(ms), 10))
	}
	w.WriteHeader(http.StatusOK)
}

// EncodeMessage percent-encodes a grpc-message value: every byte outside printable ASCII
// (0x20 to 0x7E) and '%' itself as %XX of its UTF-8 bytes.
func EncodeMessage(s string) string {
	n := 0
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '%' {
			n++
		}
	}
	if n == 0 {
		return s
	}
	const hex = "0123456789ABCDEF"
	b := make([]byte, 0, len(s)+2*n)
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c > 0x7e || c == '%' {
			b = append(b, '%', hex[c>>4], hex[c&15])
			continue
		}
		b = append(b, c)
	}
	return string(b)
}

// Of returns the status a gRPC response carries: grpc-status in its trailers, or in its header
// (a trailers-only response); ok false when neither has a valid one (the stream ended without
// a status, or the answer is not gRPC's).
func Of(header, trailer http.Header) (Code, bool) {
	for _, h := range []http.Header{trailer, header} {
		if vs := h[HeaderStatus]; len(vs) > 0 {
			n, err := strconv.Atoi(vs[0])
			if err != nil || n < 0 {
				return Unknown, false
			}
			return Code(n), true
		}
	}
	return Unknown, false
}

// HTTPStatus is the HTTP status that means what code means (as google.rpc.Code documents the
// mapping): the agent judges a gRPC call, whose HTTP status is 200 whatever its outcome, by it,
// with the same rules as an HTTP call (a 5xx or a 429 is a failure). Codes outside the
// specification are 500.
func HTTPStatus(c Code) int {
	switch c {
	case OK:
		return http.StatusOK
	case Canceled:
		return 499 // client closed request
	case InvalidArgument, FailedPrecondition, OutOfRange:
		return http.StatusBadRequest
	case DeadlineExceeded:
		return http.StatusGatewayTimeout
	case NotFound:
		return http.StatusNotFound
	case AlreadyExists, Aborted:
		return http.StatusConflict
	case PermissionDenied:
		return http.StatusForbidden
	case ResourceExhausted:
		return http.StatusTooManyRequests
	case Unimplemented:
		return http.StatusNotImplemented
	case Unavailable:
		return http.StatusServiceUnavailable
	case Unauthenticated:
		return http.StatusUnauthorized
	}
	return http.StatusInternalServerError // Unknown, Internal, DataLoss and the rest
}
