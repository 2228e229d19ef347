// Package degrade matches requests against expiring degrade switches.
//
// # Model
//
// A Switch tells the agent to answer some calls to one downstream with a
// fallback instead of calling it (see package fallback), until ExpiresAt.
// A switch applies to a request when all of these hold:
//
//   - now is before ExpiresAt. The switch turns itself off at expiry; nobody
//     needs to tell the agent. A zero ExpiresAt is already expired, so a
//     switch without an expiry never applies.
//   - the downstream name is equal to Switch.Downstream.
//   - the method is in Methods (exact, case-sensitive), or Methods is empty.
//   - every HeaderMatch matches: the request has that header (name
//     case-insensitive) with one value exactly equal to Value.
//   - the request falls in the Percent share (below).
//
// # The share
//
// Percent <= 0 selects nothing, >= 100 everything. In between:
//
//   - With a KeyHeader, the share is picked per value of that header, so one
//     user (say, X-User-Id) sees the same behaviour on every request: the
//     request is selected when FNV-1a-32(value) mod 100 < Percent (see
//     Bucket). Raising Percent only adds users. Switches with the same
//     KeyHeader pick the same users first (the hash is not salted per
//     switch), which keeps the degraded experience on one small cohort
//     rather than spreading it. A request without the header, or with an
//     empty value, is not selected: it cannot be placed consistently.
//   - Without a KeyHeader, each request is sampled on its own: it is
//     selected when RequestView.Rand() mod 100 < Percent. Rand is consulted
//     only when everything else matched. A nil Rand selects nothing.
//
// Everything here is a pure function of its arguments (Rand included);
// there is no state. Matching allocates nothing when header names in the
// switch are in canonical form (http.CanonicalHeaderKey); other names work
// but cost an allocation per lookup, so canonicalise them when loading.
package degrade

import (
	"net/http"
	"slices"
	"time"

	"github.com/apportion/apportion/internal/agent/fallback"
)

// HeaderMatch requires a request header with exactly this value.
type HeaderMatch struct {
	Name, Value string
}

// Switch is one degrade switch. See the package documentation for how it
// matches.
type Switch struct {
	Name          string
	Downstream    string
	ExpiresAt     time.Time
	Percent       int    // 1..100
	KeyHeader     string // header whose value picks the share; "" samples per request
	HeaderMatches []HeaderMatch
	Methods       []string        // empty means all
	Action        fallback.Config // what to answer instead
}

// RequestView is what matching needs from a request.
type RequestView struct {
	Method string
	Header http.Header
	// Path is the escaped path below the downstream ("/<rest>" or ""); switches ignore it,
	// priority lanes match on it.
	Path string
	// Rand returns uniformly random values; it is used only by switches
	// without KeyHeader and with Percent below 100. The agent passes
	// math/rand/v2.Uint32; tests pass a fixed sequence.
	Rand func() uint32
}

// Applies reports whether sw applies to a request r to downstream at now.
func Applies(sw Switch, downstream string, r RequestView, now time.Time) bool {
	return applies(&sw, downstream, &r, now)
}

// Select returns the applicable switch with the smallest Name (among equal
// names, the first in the slice), or nil. The result points into switches.
// The order does not depend on the order of the slice, so every agent
// resolves overlapping switches the same way.
func Select(switches []Switch, downstream string, r RequestView, now time.Time) *Switch {
	var best *Switch
	for i := range switches {
		sw := &switches[i]
		if best != nil && sw.Name >= best.Name {
			continue // cannot win; skip before spending a random draw on it
		}
		if applies(sw, downstream, &r, now) {
			best = sw
		}
	}
	return best
}

func applies(sw *Switch, downstream string, r *RequestView, now time.Time) bool {
	if !now.Before(sw.ExpiresAt) || sw.Downstream != downstream || sw.Percent <= 0 {
		return false
	}
	if len(sw.Methods) > 0 && !slices.Contains(sw.Methods, r.Method) {
		return false
	}
	for _, m := range sw.HeaderMatches {
		if !slices.Contains(r.Header.Values(m.Name), m.Value) {
			return false
		}
	}
	if sw.Percent >= 100 {
		return true
	}
	if sw.KeyHeader != "" {
		v := r.Header.Get(sw.KeyHeader)
		return v != "" && Bucket(v) < sw.Percent
	}
	return r.Rand != nil && int(r.Rand()%100) < sw.Percent
}

// Bucket is the share bucket (0..99) of a KeyHeader value:
// FNV-1a-32(value) mod 100. A value is selected by a switch with Percent p
// when Bucket(value) < p.
func Bucket(value string) int {
	// FNV-1a, inline rather than hash/fnv to stay allocation-free.
	const (
		offset32 = 2166136261
		prime32  = 16777619
	)
	h := uint32(offset32)
	for i := 0; i < len(value); i++ {
		h ^= uint32(value[i])
		h *= prime32
	}
	return int(h % 100)
}
