package h1

import (
	"net/http"
	"net/textproto"
	"strings"

	"golang.org/x/net/http/httpguts"
)

// The hop-by-hop fields: they describe one connection, not the message, and a proxy must not
// pass them on (RFC 9110 §7.6.1). The one list of the agent: the server, the client, the proxy
// and the fallback answers all use it.

// IsHopByHop reports whether k, in canonical form, is a hop-by-hop field: those of RFC 9110
// §7.6.1 (Connection, TE, Transfer-Encoding, Upgrade, Trailer, Proxy-Authenticate,
// Proxy-Authorization) and the older Keep-Alive and Proxy-Connection. Fields named in a
// message's Connection field are hop-by-hop too (see NamedInConnection).
func IsHopByHop(k string) bool {
	switch k {
	case "Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate", "Proxy-Authorization",
		"Te", "Trailer", "Transfer-Encoding", "Upgrade":
		return true
	}
	return false
}

// NamedInConnection reports whether h's Connection field names k (a hop-by-hop field then).
func NamedInConnection(h http.Header, k string) bool {
	vv := h["Connection"]
	return len(vv) > 0 && httpguts.HeaderValuesContainsToken(vv, k)
}

// RemoveHopByHop deletes h's hop-by-hop fields, those named in its Connection field included.
func RemoveHopByHop(h http.Header) {
	for k := range connectionTokens(h) {
		delete(h, k)
	}
	for k := range h { // one pass over the few fields, rather than a delete per hop-by-hop name
		if IsHopByHop(k) {
			delete(h, k)
		}
	}
}

// connectionTokens returns the header names listed in Connection, canonical; nil when none (no
// allocation in the usual case).
func connectionTokens(h http.Header) map[string]bool {
	vv := h["Connection"]
	if len(vv) == 0 {
		return nil
	}
	var m map[string]bool
	for _, v := range vv {
		for tok := range strings.SplitSeq(v, ",") {
			if tok = strings.TrimSpace(tok); tok != "" {
				if m == nil {
					m = map[string]bool{}
				}
				m[textproto.CanonicalMIMEHeaderKey(tok)] = true
			}
		}
	}
	return m
}
