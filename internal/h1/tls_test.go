package h1

import (
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/agent/upstreamtls"
	"github.com/apportion/apportion/internal/testing/tlstest"
)

// TestClientTLS: the lean client over crypto/tls against a real TLS server: kept-alive
// connections reused (one connection for sequential calls), a new connection resumes the
// session, pools of two TLS identities kept apart, and a handshake failure is a ConnectError.
func TestClientTLS(t *testing.T) {
	ca, err := tlstest.NewCA("partner CA")
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := ca.Issue(tlstest.LeafOptions{Names: []string{"partner.test"}})
	if err != nil {
		t.Fatal(err)
	}
	paths, err := tlstest.Mount(filepath.Join(t.TempDir(), "ca"), map[string][]byte{"ca.crt": ca.PEM})
	if err != nil {
		t.Fatal(err)
	}
	var conns atomic.Int32
	var mu sync.Mutex
	var resumed []bool
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		resumed = append(resumed, r.TLS.DidResume)
		mu.Unlock()
		_, _ = io.WriteString(w, "ok "+r.Host)
	}))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{leaf.Cert}}
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.StartTLS()
	defer srv.Close()
	host := srv.Listener.Addr().String()

	u, err := upstreamtls.New(upstreamtls.Settings{ServerName: "partner.test", CAFile: paths["ca.crt"]}, upstreamtls.Options{})
	if err != nil {
		t.Fatal(err)
	}
	c := NewClient()
	get := func(tt Handshaker) (string, error) {
		req, _ := http.NewRequest(http.MethodGet, "https://"+host+"/x", nil)
		res, err := c.Do(req, Target{Host: host, Path: "/x", TLS: tt}, time.Now().Add(5*time.Second))
		if err != nil {
			return "", err
		}
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		return string(b), err
	}
	for i := range 3 {
		b, err := get(u)
		if err != nil || b != "ok "+host {
			t.Fatalf("call %d: %q %v", i, b, err)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("%d connections for 3 sequential calls, want 1", n)
	}
	c.CloseIdleConnections()
	if _, err := get(u); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	if n := conns.Load(); n != 2 || !resumed[len(resumed)-1] || resumed[0] {
		t.Fatalf("connections %d, resumed %v: want 2, the second resumed", n, resumed)
	}
	mu.Unlock()

	// Another identity (here: the system roots) gets its own pool, and fails verification
	// before anything is sent.
	sys, err := upstreamtls.New(upstreamtls.Settings{ServerName: "partner.test"}, upstreamtls.Options{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = get(sys)
	var ce *ConnectError
	if !errors.As(err, &ce) || upstreamtls.Classify(err) != upstreamtls.UnknownCA {
		t.Fatalf("system roots: %v", err)
	}
	if _, err := get(u); err != nil {
		t.Fatal(err)
	}
	if n := conns.Load(); n != 3 { // 2, and the refused one
		t.Fatalf("%d connections, want 3", n)
	}
}
