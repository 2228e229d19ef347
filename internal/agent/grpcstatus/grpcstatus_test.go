package grpcstatus

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
)

func TestIsGRPC(t *testing.T) {
	for ct, want := range map[string]bool{
		"application/grpc": true, "application/grpc+proto": true, "application/grpc;charset=utf-8": true,
		"application/grpc-web": false, "application/grpc-web+proto": false, "application/json": false, "": false,
		"application/grpcx": false,
	} {
		if IsGRPC(ct) != want {
			t.Errorf("IsGRPC(%q) = %v", ct, !want)
		}
	}
}

// EncodeMessage is the specification's percent-encoding: what url.PathUnescape (which reads
// %XX the same way) turns back into the message, with nothing outside 0x20..0x7E left.
func TestEncodeMessage(t *testing.T) {
	for _, m := range []string{"plain", "50% off", "naïve\nline", "\x00\x7f\xff", ""} {
		e := EncodeMessage(m)
		for i := 0; i < len(e); i++ {
			if e[i] < 0x20 || e[i] > 0x7e {
				t.Fatalf("%q encodes to %q", m, e)
			}
		}
		if d, err := url.PathUnescape(e); err != nil || d != m {
			t.Fatalf("%q -> %q -> %q %v", m, e, d, err)
		}
	}
}

// The codes are grpc-go's (the specification's), and HTTPStatus makes a failure of what an
// HTTP call's rule (5xx or 429) would.
func TestCodes(t *testing.T) {
	ours := []Code{OK, Canceled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists, PermissionDenied,
		ResourceExhausted, FailedPrecondition, Aborted, OutOfRange, Unimplemented, Internal, Unavailable, DataLoss, Unauthenticated}
	for i, c := range ours {
		if int(c) != i || codes.Code(c).String() == "" || int(codes.Code(i)) != int(c) {
			t.Fatalf("code %d is %d", i, c)
		}
	}
	failures := map[Code]bool{Unknown: true, DeadlineExceeded: true, ResourceExhausted: true, Unimplemented: true,
		Internal: true, Unavailable: true, DataLoss: true}
	for _, c := range ours {
		s := HTTPStatus(c)
		if failed := s >= 500 || s == http.StatusTooManyRequests; failed != failures[c] {
			t.Errorf("%v: HTTP %d", codes.Code(c), s)
		}
	}
}

func TestWriteTrailersOnly(t *testing.T) {
	w := httptest.NewRecorder()
	w.Header().Set("Content-Length", "12")
	w.Header().Set("Connection", "close")
	Write(w, ResourceExhausted, "no permit 100%", 1500*time.Microsecond)
	h := w.Result().Header
	if w.Code != http.StatusOK || h.Get("Grpc-Status") != "8" || h.Get("Grpc-Message") != "no permit 100%25" ||
		h.Get("Grpc-Retry-Pushback-Ms") != "2" || h.Get("Content-Type") != "application/grpc" ||
		h.Get("Content-Length") != "" || h.Get("Connection") != "" || w.Body.Len() != 0 {
		t.Fatalf("%d %v %q", w.Code, h, w.Body.String())
	}
	w = httptest.NewRecorder()
	Write(w, Unavailable, "x", 0)
	if _, ok := w.Result().Header["Grpc-Retry-Pushback-Ms"]; ok {
		t.Fatal("pushback without a known wait")
	}
	if c, ok := Of(w.Result().Header, nil); !ok || c != Unavailable {
		t.Fatalf("Of: %v %v", c, ok)
	}
	if c, ok := Of(http.Header{"Grpc-Status": {"0"}}, http.Header{"Grpc-Status": {"13"}}); !ok || c != Internal {
		t.Fatalf("Of prefers the trailer: %v %v", c, ok)
	}
	if _, ok := Of(http.Header{}, http.Header{"Grpc-Status": {"x"}}); ok {
		t.Fatal("Of read a malformed status")
	}
}
