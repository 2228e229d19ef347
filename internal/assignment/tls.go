package assignment

import (
	"net"
	"path"
	"strings"
)

// UpstreamTLS is how the agent speaks TLS to an https upstream. The files are in the agent's
// container, where the injection webhook mounted the quota's ConfigMap and Secret (package
// inject: UpstreamTLSFiles says where); the agent has no Kubernetes client and reads nothing
// else. An older agent refuses the field (strict decoding): the manager sends it only for a
// quota with spec.upstreamTLS, so an upgrade that adds none changes no assignment.
type UpstreamTLS struct {
	// ServerName is sent in SNI and verified; "" means the upstream URL's host.
	ServerName string `json:"serverName,omitempty"`
	// CAFile is a PEM bundle of the CAs the server's chain must lead to; "" means the system
	// roots.
	CAFile string `json:"caFile,omitempty"`
	// CertFile and KeyFile are the client certificate and key (mutual TLS); both or neither.
	CertFile string `json:"certFile,omitempty"`
	KeyFile  string `json:"keyFile,omitempty"`
	// MinVersion is "1.2" (also what "" means) or "1.3".
	MinVersion string `json:"minVersion,omitempty"`
	// InsecureSkipVerify accepts any server certificate (the API's insecureSkipVerifyDangerous).
	InsecureSkipVerify bool `json:"insecureSkipVerify,omitempty"`
}

// TLS versions as they travel.
const (
	TLSVersion12 = "1.2"
	TLSVersion13 = "1.3"
)

// Bounds of UpstreamTLS: a DNS name's length, and a path under the webhook's mount root (its
// quota's name at most 63 characters) with room to spare.
const (
	MaxServerNameLength = 253
	MaxTLSPathLength    = 512
)

func (v *validator) upstreamTLS(p string, t *UpstreamTLS, upstream string) {
	if !strings.HasPrefix(strings.ToLower(upstream), "https://") {
		v.add(p, "applies to an https upstream only")
	}
	if t.ServerName != "" && (len(t.ServerName) > MaxServerNameLength || (!isDNSName(t.ServerName) && net.ParseIP(t.ServerName) == nil)) {
		v.add(p+".serverName", "must be a lower-case DNS name or an IP address of at most 253 characters")
	}
	for _, f := range []struct{ name, value string }{{"caFile", t.CAFile}, {"certFile", t.CertFile}, {"keyFile", t.KeyFile}} {
		if f.value == "" {
			continue
		}
		if len(f.value) > MaxTLSPathLength || !path.IsAbs(f.value) || path.Clean(f.value) != f.value {
			v.add(p+"."+f.name, "must be a clean absolute path of at most 512 characters")
		}
	}
	if (t.CertFile == "") != (t.KeyFile == "") {
		v.add(p+".keyFile", "certFile and keyFile go together")
	}
	if t.MinVersion != "" && t.MinVersion != TLSVersion12 && t.MinVersion != TLSVersion13 {
		v.add(p+".minVersion", `must be "1.2" or "1.3"`)
	}
	if t.InsecureSkipVerify && t.CAFile != "" {
		v.add(p+".caFile", "has no use with insecureSkipVerify")
	}
}

// isDNSName reports whether s is dot-separated DNS labels (IsDNSLabel).
func isDNSName(s string) bool {
	for l := range strings.SplitSeq(s, ".") {
		if !IsDNSLabel(l) {
			return false
		}
	}
	return true
}
