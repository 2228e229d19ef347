package h1

import (
	"io"
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"
)

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// Server: an idle kept-alive connection is closed after IdleTimeout, a slow header after
// ReadHeaderTimeout.
func TestServerTimeouts(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }),
		IdleTimeout: 100 * time.Millisecond, ReadHeaderTimeout: 100 * time.Millisecond}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	for _, first := range []string{"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "GET / HTTP/1.1\r\nHost:"} {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		io.WriteString(c, first)
		start := time.Now()
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, _ = io.Copy(io.Discard, c) // until the server closes
		if took := time.Since(start); took > 2*time.Second {
			t.Fatalf("%q: closed after %v", first, took)
		}
	}
}
