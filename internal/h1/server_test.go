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

// TestDateCache: the Date value is the time's, in http.TimeFormat, for every second asked, and
// answers within one second share it without formatting (or allocating) again.
func TestDateCache(t *testing.T) {
	var d dateCache
	t0 := time.Date(2026, 12, 2, 9, 0, 0, 100, time.FixedZone("CET", 3600))
	for _, at := range []time.Duration{0, 999 * time.Millisecond, time.Second, 1500 * time.Millisecond, time.Hour, 0} {
		now := t0.Add(at)
		if got, want := d.text(now), now.UTC().Format(http.TimeFormat); got != want {
			t.Errorf("at +%v: Date %q, want %q", at, got, want)
		}
	}
	now := t0.Add(2 * time.Hour)
	first := d.text(now)
	if n := testing.AllocsPerRun(100, func() {
		if d.text(now.Add(500*time.Millisecond)) != first {
			t.Fatal("another value within the same second")
		}
	}); n != 0 {
		t.Errorf("%v allocations per answer within one second, want 0", n)
	}
}
