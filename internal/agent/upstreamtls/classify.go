package upstreamtls

import (
	"crypto/x509"
	"errors"
	"net"
	"os"
	"strings"
)

// Reason is what failed in a connection's TLS, as Classify tells it.
type Reason int

// The reasons. Every one but None and HandshakeTimeout is a misconfiguration (Misconfigured):
// of the agent's settings or files, or of the downstream's certificates. The downstream may
// well be healthy: such a call says nothing about its load.
const (
	None              Reason = iota // not a TLS failure
	UnknownCA                       // the server's chain leads to no CA of the bundle
	WrongName                       // the server's certificate does not name ServerName
	Expired                         // a certificate of the server's chain expired (or is not yet valid)
	BadCertificate                  // the server's certificate is unusable otherwise
	ClientCertRefused               // the server refused the client certificate (or its absence)
	HandshakeFailed                 // the server refused the handshake otherwise (version, ciphers, ...)
	HandshakeTimeout                // the handshake did not end in time
	Config                          // the agent's own material cannot be used (ConfigError)
	// NumReasons is the number of reasons, None included.
	NumReasons
)

// reasonNames are the reasons as metric label values (and problem slugs' tails).
var reasonNames = [NumReasons]string{"", "unknown-ca", "wrong-name", "expired", "bad-certificate",
	"client-cert-refused", "handshake-failed", "handshake-timeout", "config"}

// String is the reason's label value ("" for None).
func (r Reason) String() string {
	if r < 0 || r >= NumReasons {
		return ""
	}
	return reasonNames[r]
}

// Misconfigured reports whether r says nothing about the downstream's health: a TLS failure
// other than a handshake timeout.
func (r Reason) Misconfigured() bool { return r != None && r != HandshakeTimeout }

// certAlerts are the alerts a server sends when it refuses the client's certificate (RFC 8446
// §6.2), as crypto/tls words them: bad_certificate, unsupported_certificate,
// certificate_revoked, certificate_expired, certificate_unknown, unknown_ca, access_denied,
// certificate_required. In TLS 1.3 the client's handshake ends before the server has judged its
// certificate, so the refusal comes as the first read's error.
var certAlerts = []string{"tls: bad certificate", "tls: unsupported certificate", "tls: revoked certificate",
	"tls: expired certificate", "tls: unknown certificate", "tls: unknown certificate authority",
	"tls: access denied", "tls: certificate required"}

// Classify tells what failed in a connection's TLS from the error of a handshake (Handshake's,
// or http.Transport's) or of the first read after it; None for any other error (a refused
// connection, a reset, an answer that is not HTTP: the downstream's usual failures).
func Classify(err error) Reason {
	if err == nil {
		return None
	}
	var ce *ConfigError
	if errors.As(err, &ce) {
		return Config
	}
	var ua x509.UnknownAuthorityError
	var sr x509.SystemRootsError
	if errors.As(err, &ua) || errors.As(err, &sr) {
		return UnknownCA
	}
	var hn x509.HostnameError
	if errors.As(err, &hn) {
		return WrongName
	}
	var ci x509.CertificateInvalidError
	if errors.As(err, &ci) {
		if ci.Reason == x509.Expired {
			return Expired
		}
		return BadCertificate
	}
	var he *HandshakeError
	isHS := errors.As(err, &he)
	var ne *net.OpError
	if errors.As(err, &ne) && ne.Op == "remote error" && ne.Err != nil {
		msg := ne.Err.Error()
		for _, a := range certAlerts {
			if msg == a {
				return ClientCertRefused
			}
		}
		if isHS && he.ClientCertAsked && msg == "tls: handshake failure" {
			return ClientCertRefused // TLS 1.2's generic refusal, after the server asked for one
		}
		return HandshakeFailed
	}
	if isHS {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return HandshakeTimeout
		}
		if strings.HasPrefix(he.Err.Error(), "tls: ") {
			// crypto/tls's own refusals: no common version or cipher suite, a malformed
			// handshake message, a server certificate it cannot parse.
			return HandshakeFailed
		}
		return None // the connection failed during the handshake: reset, closed
	}
	if strings.Contains(err.Error(), "TLS handshake timeout") {
		return HandshakeTimeout // http.Transport's TLSHandshakeTimeout (its error has no type)
	}
	return None
}
