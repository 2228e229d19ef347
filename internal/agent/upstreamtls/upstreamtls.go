// Package upstreamtls is the agent's TLS to its downstreams: one Upstream per downstream's TLS
// settings (a server name, a CA bundle file, a client certificate and key files, a minimum
// version), whose *tls.Config every client of the agent dials with — the lean HTTP/1.1 client
// (package h1, through Handshake), http.Transport (DialTLSContext or TLSClientConfig) and an
// HTTP/2 transport (a Clone of Config with NextProtos set by the caller).
//
// What is guaranteed:
//
//   - Verification is always on: the server's chain is verified against the CA bundle (the
//     system roots when none is given) and its name against ServerName, at the wall clock's
//     time (certificates are dated in real time, whatever clock paces the rest), on every
//     handshake, resumed ones included. The one exception is
//     Settings.InsecureSkipVerify, the API's loudly named opt-out.
//   - TLS 1.2 at least (MinVersion may raise it to 1.3); library TLS only (crypto/tls,
//     crypto/x509).
//   - Rotation without dropping calls: the files are read when the Upstream is made and read
//     again when they change (the kubelet swaps a mounted ConfigMap's or Secret's files
//     atomically, through a symbolic link: a change of the file's identity, size or time is
//     seen). The check runs when a connection is made, at most once per ReloadEvery, never on
//     a call over a kept-alive connection. The *tls.Config never changes: its callbacks
//     (VerifyConnection, GetClientCertificate) read the material in force through an atomic
//     pointer, so connections made after a rotation use the new files, and connections and
//     calls already under way are left alone. Material that fails to load after a good one
//     leaves the good one in force (the next change is tried again); material that never
//     loaded fails every handshake with a *ConfigError, before anything is sent.
//   - Session resumption: the Config holds a client session cache (one per Upstream: a
//     ticket is never offered to a server of another downstream's settings). New material
//     drops the cached session, and so does a resumed session that fails verification: a
//     resumed session carries the chain verified when it began, and the client certificate
//     the server saw then.
//
// Classify tells what failed in a connection's TLS (unknown CA, wrong name, expired, client
// certificate refused, handshake timeout, ...), for the agent's answers and metrics.
package upstreamtls

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"k8s.io/utils/clock"
)

// Settings are one downstream's TLS settings, as the manager's assignment gives them (paths of
// files the injection webhook mounted into the agent's container). Comparable: equal settings
// share one Upstream (Set).
type Settings struct {
	// ServerName is sent in SNI (unless it is an IP address) and verified against the server's
	// certificate. Required: the agent fills it with the upstream URL's host when the API left
	// it empty.
	ServerName string
	// CAFile is a PEM bundle of the CAs the server's chain must lead to; "" means the system
	// roots.
	CAFile string
	// CertFile and KeyFile are the client certificate (PEM, chain allowed) and its key, for a
	// downstream that requires mTLS; both or neither.
	CertFile, KeyFile string
	// MinVersion is tls.VersionTLS12 (also what 0 means) or tls.VersionTLS13.
	MinVersion uint16
	// InsecureSkipVerify accepts any certificate from the server: the API's
	// insecureSkipVerifyDangerous. Never a default.
	InsecureSkipVerify bool
}

// Validate says what is wrong with s.
func (s Settings) Validate() error {
	var errs []error
	if s.ServerName == "" {
		errs = append(errs, errors.New("serverName is required"))
	}
	if (s.CertFile == "") != (s.KeyFile == "") {
		errs = append(errs, errors.New("certFile and keyFile go together"))
	}
	for _, f := range []string{s.CAFile, s.CertFile, s.KeyFile} {
		if f != "" && (!filepath.IsAbs(f) || filepath.Clean(f) != f) {
			errs = append(errs, fmt.Errorf("%q is not a clean absolute path", f))
		}
	}
	switch s.MinVersion {
	case 0, tls.VersionTLS12, tls.VersionTLS13:
	default:
		errs = append(errs, fmt.Errorf("minVersion %#x is neither TLS 1.2 nor TLS 1.3", s.MinVersion))
	}
	return errors.Join(errs...)
}

// Options tune an Upstream; the zero value is the agent's.
type Options struct {
	// Clock paces the reload checks (verification is on the wall clock); nil: the real clock.
	Clock clock.PassiveClock
	// ReloadEvery is how often, at most, the files are checked for a change (when a connection
	// is made); 0: DefaultReloadEvery.
	ReloadEvery time.Duration
	// HandshakeTimeout bounds a handshake (Handshake: besides the caller's deadline); 0:
	// DefaultHandshakeTimeout.
	HandshakeTimeout time.Duration
	// SessionCacheSize is the client session cache's size; 0: DefaultSessionCacheSize.
	SessionCacheSize int
}

const (
	// DefaultReloadEvery: the kubelet updates mounted ConfigMaps and Secrets about once a
	// minute; a second's delay on top is nothing, and the check is a few stat calls.
	DefaultReloadEvery = time.Second
	// DefaultHandshakeTimeout is http.Transport's TLSHandshakeTimeout.
	DefaultHandshakeTimeout = 10 * time.Second
	// DefaultSessionCacheSize: the cache is keyed by server name, one Upstream has one; a few
	// entries cover a change of settings' server name while old connections live.
	DefaultSessionCacheSize = 8
)

// Upstream is one downstream's TLS: a *tls.Config that stays the same pointer while the files
// behind it rotate. Safe for concurrent use.
type Upstream struct {
	s      Settings
	clock  clock.PassiveClock
	every  time.Duration
	hsMax  time.Duration
	cfg    *tls.Config
	mat    atomic.Pointer[material]
	mu     sync.Mutex   // one reload at a time
	next   atomic.Int64 // unix nanoseconds after which the files are checked again
	reload atomic.Int64 // loads of changed material (tests, metrics)
}

// material is what the files said at one time.
type material struct {
	roots *x509.CertPool   // nil: the system roots
	cert  *tls.Certificate // nil: no client certificate
	err   error            // the files could not be loaded (no good material before)
	stamp [3]fileStamp     // CAFile, CertFile, KeyFile
}

// fileStamp identifies a file's content cheaply: the kubelet's atomic swap gives the path a new
// inode (through the ..data link), an editor a new time or size.
type fileStamp struct {
	ino   uint64
	size  int64
	mtime int64
	ok    bool
}

func stampOf(path string) fileStamp {
	if path == "" {
		return fileStamp{}
	}
	fi, err := os.Stat(path) // follows the links
	if err != nil {
		return fileStamp{}
	}
	st := fileStamp{size: fi.Size(), mtime: fi.ModTime().UnixNano(), ok: true}
	if sys, ok := fi.Sys().(*syscall.Stat_t); ok {
		st.ino = sys.Ino
	}
	return st
}

// New returns the Upstream of s, its files read once (a failure is kept: see Err).
func New(s Settings, o Options) (*Upstream, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	u := &Upstream{s: s, clock: o.Clock, every: o.ReloadEvery, hsMax: o.HandshakeTimeout}
	if u.every <= 0 {
		u.every = DefaultReloadEvery
	}
	if u.hsMax <= 0 {
		u.hsMax = DefaultHandshakeTimeout
	}
	size := o.SessionCacheSize
	if size <= 0 {
		size = DefaultSessionCacheSize
	}
	minV := s.MinVersion
	if minV == 0 {
		minV = tls.VersionTLS12
	}
	u.cfg = &tls.Config{
		ServerName: s.ServerName,
		MinVersion: minV,
		// crypto/tls's own verification reads RootCAs, fixed in the Config; VerifyConnection
		// does the same verification with the roots in force (and runs on resumed sessions
		// too), so that a rotated CA applies without a new Config.
		InsecureSkipVerify:   true, //nolint:gosec // verified in VerifyConnection
		VerifyConnection:     u.verify,
		GetClientCertificate: u.clientCert,
		ClientSessionCache:   tls.NewLRUClientSessionCache(size),
	}
	u.mat.Store(load(s, nil))
	u.next.Store(u.clock.Now().Add(u.every).UnixNano())
	return u, nil
}

// Settings returns the settings the Upstream was made with.
func (u *Upstream) Settings() Settings { return u.s }

// Config is the Upstream's *tls.Config, the same pointer for the Upstream's life. A caller
// that needs ALPN (HTTP/2) sets NextProtos on a Clone; the clone shares the callbacks, hence
// the rotation. Do not change the Config itself.
func (u *Upstream) Config() *tls.Config { return u.cfg }

// Err is the error of material that never loaded (a missing or malformed file: a *ConfigError),
// or nil. It checks the files for a change first (at most once per ReloadEvery).
func (u *Upstream) Err() error { return u.current().err }

// Reloads counts the changes of material loaded since New.
func (u *Upstream) Reloads() int64 { return u.reload.Load() }

// current returns the material in force, after checking the files when ReloadEvery passed.
func (u *Upstream) current() *material {
	m := u.mat.Load()
	now := u.clock.Now().UnixNano()
	if now < u.next.Load() || !u.mu.TryLock() {
		return m // checked lately, or another connection is checking right now
	}
	defer u.mu.Unlock()
	u.next.Store(now + int64(u.every))
	m = u.mat.Load()
	stamp := [3]fileStamp{stampOf(u.s.CAFile), stampOf(u.s.CertFile), stampOf(u.s.KeyFile)}
	if stamp == m.stamp && m.err == nil {
		return m
	}
	n := load(u.s, &stamp)
	switch {
	case n.err == nil:
		u.mat.Store(n)
		u.reload.Add(1)
		// A session resumed after a rotation would carry the old server chain (refused now,
		// again and again: the failed handshake does not drop the ticket) and, to the server,
		// the old client certificate: new material starts new sessions.
		u.forgetSession()
		return n
	case m.err != nil:
		u.mat.Store(n) // still nothing good: the newest error says what is wrong now
		return n
	}
	// A half-written or bad rotation: keep what works, look again at the next check (the
	// stamps were not stored).
	return m
}

// load reads the settings' files; stamp, when given, is the files' stamps before reading (a
// change while reading is then seen at the next check).
func load(s Settings, stamp *[3]fileStamp) *material {
	m := &material{}
	if stamp != nil {
		m.stamp = *stamp
	} else {
		m.stamp = [3]fileStamp{stampOf(s.CAFile), stampOf(s.CertFile), stampOf(s.KeyFile)}
	}
	if s.CAFile != "" {
		pem, err := os.ReadFile(s.CAFile)
		if err != nil {
			m.err = &ConfigError{File: s.CAFile, Err: err}
			return m
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			m.err = &ConfigError{File: s.CAFile, Err: errors.New("no PEM certificate in the CA bundle")}
			return m
		}
		m.roots = pool
	}
	if s.CertFile != "" {
		cert, err := tls.LoadX509KeyPair(s.CertFile, s.KeyFile)
		if err != nil {
			m.err = &ConfigError{File: s.CertFile, Err: err}
			return m
		}
		m.cert = &cert
	}
	return m
}

// verify is the Config's VerifyConnection: the server's chain against the roots in force and
// its name against ServerName, as crypto/tls would with RootCAs.
func (u *Upstream) verify(cs tls.ConnectionState) error {
	m := u.current()
	if m.err != nil {
		return m.err
	}
	if u.s.InsecureSkipVerify {
		return nil
	}
	if len(cs.PeerCertificates) == 0 {
		return &tls.CertificateVerificationError{Err: errors.New("the server sent no certificate")}
	}
	opts := x509.VerifyOptions{
		Roots:         m.roots,
		DNSName:       u.s.ServerName,
		Intermediates: x509.NewCertPool(),
	}
	for _, c := range cs.PeerCertificates[1:] {
		opts.Intermediates.AddCert(c)
	}
	if _, err := cs.PeerCertificates[0].Verify(opts); err != nil {
		if cs.DidResume {
			u.forgetSession() // the next connection makes a full handshake
		}
		return &tls.CertificateVerificationError{UnverifiedCertificates: cs.PeerCertificates, Err: err}
	}
	return nil
}

// forgetSession drops the cached session: crypto/tls keys its client session cache by the
// server name (Config.ServerName is always set here), and a nil session deletes the entry.
func (u *Upstream) forgetSession() { u.cfg.ClientSessionCache.Put(u.s.ServerName, nil) }

// clientCert is the Config's GetClientCertificate: the certificate in force, or none (the
// server then decides whether it needs one).
func (u *Upstream) clientCert(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
	m := u.current()
	if m.err != nil {
		return nil, m.err
	}
	if m.cert == nil {
		return &tls.Certificate{}, nil
	}
	return m.cert, nil
}

// Handshake makes raw, a connection to the downstream, a TLS client connection with Config
// (HandshakeWith). It is the lean client's h1.Handshaker.
func (u *Upstream) Handshake(raw net.Conn, deadline time.Time) (*tls.Conn, error) {
	return u.HandshakeWith(raw, nil, deadline)
}

// HandshakeWith makes raw, a connection to the downstream, a TLS client connection and completes
// the handshake within deadline and HandshakeTimeout, whichever comes first. Every error is a
// *HandshakeError (raw is then closed); on success the connection's deadline is left at
// deadline. cfg is Config or a Clone of it (with NextProtos for HTTP/2); nil means Config.
func (u *Upstream) HandshakeWith(raw net.Conn, cfg *tls.Config, deadline time.Time) (*tls.Conn, error) {
	if cfg == nil {
		cfg = u.cfg
	}
	if m := u.current(); m.err != nil {
		_ = raw.Close()
		return nil, &HandshakeError{Err: m.err}
	}
	hsDeadline := time.Now().Add(u.hsMax) // the socket's deadline is on the wall clock
	if !deadline.IsZero() && deadline.Before(hsDeadline) {
		hsDeadline = deadline
	}
	if err := raw.SetDeadline(hsDeadline); err != nil {
		_ = raw.Close()
		return nil, &HandshakeError{Err: err}
	}
	// A clone per connection (the session cache is shared) notes whether the server asked for
	// a client certificate: a TLS 1.2 server that refuses one may say only handshake_failure.
	asked := false
	cc := cfg.Clone()
	getCert := cfg.GetClientCertificate
	cc.GetClientCertificate = func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
		asked = true
		if getCert == nil {
			return &tls.Certificate{}, nil
		}
		return getCert(cri)
	}
	tc := tls.Client(raw, cc)
	if err := tc.Handshake(); err != nil {
		_ = raw.Close() // not tc.Close: no close_notify on a connection that may not take it
		return nil, &HandshakeError{Err: err, ClientCertAsked: asked}
	}
	if err := raw.SetDeadline(deadline); err != nil {
		_ = raw.Close()
		return nil, &HandshakeError{Err: err}
	}
	return tc, nil
}

// ConfigError is the agent's own TLS material that cannot be used: a file missing, unreadable
// or malformed. Nothing is sent to the downstream.
type ConfigError struct {
	File string
	Err  error
}

func (e *ConfigError) Error() string {
	return "the TLS material " + e.File + " cannot be used: " + e.Err.Error()
}
func (e *ConfigError) Unwrap() error { return e.Err }

// HandshakeError is a failure before the connection carried any request: the handshake (or
// the material it needs). Err is crypto/tls's, crypto/x509's or the connection's error.
type HandshakeError struct {
	Err error
	// ClientCertAsked: the server asked for a client certificate before the handshake failed.
	ClientCertAsked bool
}

func (e *HandshakeError) Error() string { return "TLS handshake with the downstream: " + e.Err.Error() }
func (e *HandshakeError) Unwrap() error { return e.Err }
