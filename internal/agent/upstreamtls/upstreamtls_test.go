package upstreamtls

import (
	"bufio"
	"crypto/tls"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/testing/tlstest"
)

// server is a TLS server on loopback that answers each line with "ok\n".
type server struct {
	ln  net.Listener
	cfg *tls.Config
}

func startServer(t *testing.T, cfg *tls.Config) *server {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &server{ln: ln, cfg: cfg}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = c.Close() }()
				tc := tls.Server(c, s.cfg)
				_ = tc.SetDeadline(time.Now().Add(10 * time.Second))
				if tc.Handshake() != nil {
					return
				}
				br := bufio.NewReader(tc)
				for {
					if _, err := br.ReadString('\n'); err != nil {
						return
					}
					if _, err := tc.Write([]byte("ok\n")); err != nil {
						return
					}
				}
			}()
		}
	}()
	return s
}

func (s *server) addr() string { return s.ln.Addr().String() }

// exchange dials s, handshakes with u and sends one line; the error is the handshake's or the
// first read's (where a TLS 1.3 server's refusal of the client certificate shows).
func exchange(t *testing.T, u *Upstream, addr string) (*tls.Conn, error) {
	t.Helper()
	raw, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	tc, err := u.Handshake(raw, time.Now().Add(5*time.Second))
	if err != nil {
		return nil, err
	}
	t.Cleanup(func() { _ = tc.Close() })
	if _, err := tc.Write([]byte("hi\n")); err != nil {
		return tc, err
	}
	line, err := bufio.NewReader(tc).ReadString('\n')
	if err == nil && line != "ok\n" {
		t.Fatalf("answer %q", line)
	}
	return tc, err
}

type pki struct {
	ca, other *tlstest.CA
	dir       string
	caFile    string
}

func newPKI(t *testing.T) *pki {
	t.Helper()
	ca, err := tlstest.NewCA("partner CA")
	if err != nil {
		t.Fatal(err)
	}
	other, err := tlstest.NewCA("another CA")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	paths, err := tlstest.Mount(filepath.Join(dir, "ca"), map[string][]byte{"ca.crt": ca.PEM})
	if err != nil {
		t.Fatal(err)
	}
	return &pki{ca: ca, other: other, dir: dir, caFile: paths["ca.crt"]}
}

func issue(t *testing.T, ca *tlstest.CA, o tlstest.LeafOptions) *tlstest.Leaf {
	t.Helper()
	l, err := ca.Issue(o)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

func newUpstream(t *testing.T, s Settings, o Options) *Upstream {
	t.Helper()
	u, err := New(s, o)
	if err != nil {
		t.Fatal(err)
	}
	return u
}

// TestClassifiedFailures: each way a handshake fails is told apart, against real crypto/tls
// servers; the good chain and the private CA pass.
func TestClassifiedFailures(t *testing.T) {
	p := newPKI(t)
	good := issue(t, p.ca, tlstest.LeafOptions{Names: []string{"partner.test", "127.0.0.1"}})
	wrongName := issue(t, p.ca, tlstest.LeafOptions{Names: []string{"elsewhere.test"}})
	expired := issue(t, p.ca, tlstest.LeafOptions{Names: []string{"partner.test"},
		NotBefore: time.Now().Add(-48 * time.Hour), NotAfter: time.Now().Add(-time.Hour)})
	foreign := issue(t, p.other, tlstest.LeafOptions{Names: []string{"partner.test"}})
	client := issue(t, p.ca, tlstest.LeafOptions{Client: true})
	strangerClient := issue(t, p.other, tlstest.LeafOptions{Client: true})
	cdir := filepath.Join(p.dir, "client")
	cpaths, err := tlstest.Mount(cdir, map[string][]byte{"tls.crt": client.CertPEM, "tls.key": client.KeyPEM})
	if err != nil {
		t.Fatal(err)
	}
	sdir := filepath.Join(p.dir, "stranger")
	spaths, err := tlstest.Mount(sdir, map[string][]byte{"tls.crt": strangerClient.CertPEM, "tls.key": strangerClient.KeyPEM})
	if err != nil {
		t.Fatal(err)
	}
	serve := func(leaf *tlstest.Leaf, mtls bool, maxV uint16) string {
		cfg := &tls.Config{Certificates: []tls.Certificate{leaf.Cert}, MaxVersion: maxV}
		if mtls {
			cfg.ClientAuth = tls.RequireAndVerifyClientCert
			cfg.ClientCAs = tlstest.Pool(p.ca)
		}
		return startServer(t, cfg).addr()
	}
	base := Settings{ServerName: "partner.test", CAFile: p.caFile}
	withCert := base
	withCert.CertFile, withCert.KeyFile = cpaths["tls.crt"], cpaths["tls.key"]
	withStranger := base
	withStranger.CertFile, withStranger.KeyFile = spaths["tls.crt"], spaths["tls.key"]
	byIP := base
	byIP.ServerName = "127.0.0.1"
	system := base
	system.CAFile = ""
	tls13 := base
	tls13.MinVersion = tls.VersionTLS13
	skip := base
	skip.InsecureSkipVerify = true
	for _, tc := range []struct {
		name string
		s    Settings
		addr string
		want Reason
		ok   bool
	}{
		{"private CA, good chain", base, serve(good, false, 0), None, true},
		{"by IP address", byIP, serve(good, false, 0), None, true},
		{"unknown CA", base, serve(foreign, false, 0), UnknownCA, false},
		{"system roots do not know a private CA", system, serve(good, false, 0), UnknownCA, false},
		{"wrong name", base, serve(wrongName, false, 0), WrongName, false},
		{"expired", base, serve(expired, false, 0), Expired, false},
		{"mTLS with the client certificate", withCert, serve(good, true, 0), None, true},
		{"mTLS without a client certificate, TLS 1.3", base, serve(good, true, 0), ClientCertRefused, false},
		{"mTLS without a client certificate, TLS 1.2", base, serve(good, true, tls.VersionTLS12), ClientCertRefused, false},
		{"mTLS with a refused client certificate", withStranger, serve(good, true, 0), ClientCertRefused, false},
		{"TLS 1.3 required, server 1.2", tls13, serve(good, false, tls.VersionTLS12), HandshakeFailed, false},
		{"insecureSkipVerify accepts a stranger", skip, serve(foreign, false, 0), None, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u := newUpstream(t, tc.s, Options{})
			_, err := exchange(t, u, tc.addr)
			if tc.ok {
				if err != nil {
					t.Fatalf("failed: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("succeeded")
			}
			if got := Classify(err); got != tc.want {
				t.Fatalf("Classify(%v) = %q, want %q", err, got, tc.want)
			}
			t.Logf("%s: %v", Classify(err), err)
		})
	}
}

// TestHandshakeTimeout: a server that accepts and never answers is a handshake timeout at the
// caller's deadline.
func TestHandshakeTimeout(t *testing.T) {
	p := newPKI(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = ln.Close() }()
	held := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			held <- c
		}
	}()
	u := newUpstream(t, Settings{ServerName: "partner.test", CAFile: p.caFile}, Options{})
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err = u.Handshake(raw, time.Now().Add(150*time.Millisecond))
	t.Logf("after %v: %v", time.Since(start), err)
	if got := Classify(err); got != HandshakeTimeout {
		t.Fatalf("Classify(%v) = %q", err, got)
	}
	if HandshakeTimeout.Misconfigured() || !UnknownCA.Misconfigured() || None.Misconfigured() {
		t.Fatal("Misconfigured")
	}
	if c := <-held; c != nil {
		_ = c.Close()
	}
}

// TestMissingMaterial: files that do not exist fail every handshake as Config, before anything
// is sent; once they appear (the next check), the Upstream works.
func TestMissingMaterial(t *testing.T) {
	p := newPKI(t)
	good := issue(t, p.ca, tlstest.LeafOptions{Names: []string{"partner.test"}})
	srv := startServer(t, &tls.Config{Certificates: []tls.Certificate{good.Cert}})
	clk := clocktesting.NewFakeClock(time.Now())
	caFile := filepath.Join(p.dir, "late", "ca.crt")
	u := newUpstream(t, Settings{ServerName: "partner.test", CAFile: caFile}, Options{Clock: clk})
	var ce *ConfigError
	if err := u.Err(); !errors.As(err, &ce) {
		t.Fatalf("Err() = %v", err)
	}
	if _, err := exchange(t, u, srv.addr()); Classify(err) != Config {
		t.Fatalf("exchange: %v (%q)", err, Classify(err))
	}
	if _, err := tlstest.Mount(filepath.Join(p.dir, "late"), map[string][]byte{"ca.crt": p.ca.PEM}); err != nil {
		t.Fatal(err)
	}
	if _, err := exchange(t, u, srv.addr()); Classify(err) != Config {
		t.Fatalf("before the next check: %v", err) // at most once per ReloadEvery
	}
	clk.Step(DefaultReloadEvery)
	if _, err := exchange(t, u, srv.addr()); err != nil {
		t.Fatalf("after the files appeared: %v", err)
	}
	if u.Err() != nil {
		t.Fatal(u.Err())
	}
	// Bad material after good leaves the good in force.
	if _, err := tlstest.Mount(filepath.Join(p.dir, "late"), map[string][]byte{"ca.crt": []byte("not PEM")}); err != nil {
		t.Fatal(err)
	}
	clk.Step(DefaultReloadEvery)
	if _, err := exchange(t, u, srv.addr()); err != nil {
		t.Fatalf("after a bad rotation: %v", err)
	}
}

// TestRotation: the CA and the client certificate rotate (the kubelet's ..data swap) while a
// connection made before stays in use; new connections use the new files.
func TestRotation(t *testing.T) {
	p := newPKI(t)
	next, err := tlstest.NewCA("partner CA 2")
	if err != nil {
		t.Fatal(err)
	}
	oldLeaf := issue(t, p.ca, tlstest.LeafOptions{Names: []string{"partner.test"}})
	newLeaf := issue(t, next, tlstest.LeafOptions{Names: []string{"partner.test"}})
	clientOld := issue(t, p.ca, tlstest.LeafOptions{Client: true})
	clientNew := issue(t, next, tlstest.LeafOptions{Client: true})
	cdir := filepath.Join(p.dir, "client")
	cpaths, err := tlstest.Mount(cdir, map[string][]byte{"tls.crt": clientOld.CertPEM, "tls.key": clientOld.KeyPEM})
	if err != nil {
		t.Fatal(err)
	}
	// The server accepts client certificates of either CA, and serves the old chain first.
	scfg := &tls.Config{Certificates: []tls.Certificate{oldLeaf.Cert}, ClientAuth: tls.RequireAndVerifyClientCert,
		ClientCAs: tlstest.Pool(p.ca, next)}
	srv := startServer(t, scfg)
	clk := clocktesting.NewFakeClock(time.Now())
	u := newUpstream(t, Settings{ServerName: "partner.test", CAFile: p.caFile,
		CertFile: cpaths["tls.crt"], KeyFile: cpaths["tls.key"]}, Options{Clock: clk})
	before, err := exchange(t, u, srv.addr())
	if err != nil {
		t.Fatal(err)
	}

	// The partner moves to the new CA: the server's certificate and the CA bundle change
	// together, and the client certificate is renewed by the new CA.
	newSrv := startServer(t, &tls.Config{Certificates: []tls.Certificate{newLeaf.Cert}, ClientAuth: tls.RequireAndVerifyClientCert,
		ClientCAs: tlstest.Pool(next)})
	if _, err := exchange(t, u, newSrv.addr()); Classify(err) != UnknownCA {
		t.Fatalf("new server before the rotation: %v", err)
	}
	if _, err := tlstest.Mount(filepath.Join(p.dir, "ca"), map[string][]byte{"ca.crt": next.PEM}); err != nil {
		t.Fatal(err)
	}
	if _, err := tlstest.Mount(cdir, map[string][]byte{"tls.crt": clientNew.CertPEM, "tls.key": clientNew.KeyPEM}); err != nil {
		t.Fatal(err)
	}
	clk.Step(DefaultReloadEvery)
	after, err := exchange(t, u, newSrv.addr())
	if err != nil {
		t.Fatalf("new server after the rotation: %v", err)
	}
	if got := after.ConnectionState().PeerCertificates[0].Issuer.CommonName; got != "partner CA 2" {
		t.Fatalf("issuer %q", got)
	}
	if u.Reloads() != 1 {
		t.Fatalf("reloads %d", u.Reloads())
	}
	// The connection made before the rotation carries on.
	if _, err := before.Write([]byte("again\n")); err != nil {
		t.Fatal(err)
	}
	if line, err := bufio.NewReader(before).ReadString('\n'); err != nil || line != "ok\n" {
		t.Fatalf("old connection: %q %v", line, err)
	}
	// And the old server, which the old CA signed, is no longer trusted for new connections.
	if _, err := exchange(t, u, srv.addr()); Classify(err) != UnknownCA {
		t.Fatalf("old server after the rotation: %v", err)
	}
}

// TestResumption: a second connection resumes the first one's session, and is verified again
// (a rotated CA applies to resumed sessions too).
func TestResumption(t *testing.T) {
	for _, v := range []uint16{tls.VersionTLS12, tls.VersionTLS13} {
		t.Run(tls.VersionName(v), func(t *testing.T) {
			p := newPKI(t)
			good := issue(t, p.ca, tlstest.LeafOptions{Names: []string{"partner.test"}})
			srv := startServer(t, &tls.Config{Certificates: []tls.Certificate{good.Cert}, MaxVersion: v})
			clk := clocktesting.NewFakeClock(time.Now())
			u := newUpstream(t, Settings{ServerName: "partner.test", CAFile: p.caFile}, Options{Clock: clk})
			first, err := exchange(t, u, srv.addr())
			if err != nil {
				t.Fatal(err)
			}
			if first.ConnectionState().DidResume {
				t.Fatal("the first connection resumed")
			}
			second, err := exchange(t, u, srv.addr())
			if err != nil {
				t.Fatal(err)
			}
			if !second.ConnectionState().DidResume {
				t.Fatal("the second connection did not resume")
			}
			// A CA bundle that no longer holds the server's CA refuses even a resumed session.
			if _, err := tlstest.Mount(filepath.Join(p.dir, "ca"), map[string][]byte{"ca.crt": p.other.PEM}); err != nil {
				t.Fatal(err)
			}
			clk.Step(DefaultReloadEvery)
			_, err = exchange(t, u, srv.addr())
			if Classify(err) != UnknownCA {
				t.Fatalf("after the CA changed: %v", err)
			}
		})
	}
}

func TestSettingsValidate(t *testing.T) {
	for _, tc := range []struct {
		s    Settings
		want string
	}{
		{Settings{}, "serverName is required"},
		{Settings{ServerName: "a", CertFile: "/x"}, "go together"},
		{Settings{ServerName: "a", CAFile: "rel/ca.crt"}, "clean absolute"},
		{Settings{ServerName: "a", CAFile: "/a/../b"}, "clean absolute"},
		{Settings{ServerName: "a", MinVersion: tls.VersionTLS11}, "neither"},
	} {
		err := tc.s.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want %q", tc.s, err, tc.want)
		}
	}
	if err := (Settings{ServerName: "a", CAFile: "/ca", CertFile: "/c", KeyFile: "/k", MinVersion: tls.VersionTLS13}).Validate(); err != nil {
		t.Error(err)
	}
}
