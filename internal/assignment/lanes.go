package assignment

import (
	"fmt"
	"strings"
)

// Lane limits, mirroring the CRD's (api/v1alpha1 Lane).
const (
	MaxLanes            = 8
	MaxLaneHeaders      = 8
	MaxLanePathPrefixes = 16
	MaxPathPrefixLength = 1024
	// DefaultLane names the lane of calls that match no declared lane; no declared lane may use it.
	DefaultLane = "default"
)

// Lane is a priority lane of a downstream (see package lanes of the agent): calls that match it
// share ReservePercent of the pod's permits, which other lanes may borrow up to LendPercent of
// while idle and which this lane's calls get back first. Lanes are tried in order; the first that
// matches takes the call; a call matching none goes to the default lane (no reserve).
type Lane struct {
	// Name is a DNS label, unique among the downstream's lanes, not "default".
	Name string `json:"name"`
	// ReservePercent of the pod's permits (0..100; Σ over lanes ≤ 100).
	ReservePercent int32 `json:"reservePercent"`
	// LendPercent of the reserve others may borrow while it is idle (0..100).
	LendPercent int32 `json:"lendPercent"`
	// Headers must all match exactly (names case-insensitive).
	Headers []HeaderMatch `json:"headers,omitempty"`
	// Methods: the call's method must be one of them; empty means any.
	Methods []string `json:"methods,omitempty"`
	// PathPrefixes: the call's path below the downstream must start with one of them; empty
	// means any.
	PathPrefixes []string `json:"pathPrefixes,omitempty"`
}

// LaneState is one lane in an agent's DownstreamState: the declared lanes in order, then
// "default".
type LaneState struct {
	Name string `json:"name"`
	// Reserved is the lane's reserve in permits at the limit in force now.
	Reserved int32 `json:"reserved"`
	// InFlight and Waiting are the lane's calls holding a permit and queued for one.
	InFlight int32 `json:"inFlight"`
	Waiting  int32 `json:"waiting"`
	// Borrowed bounds the permits of other lanes' reserves the lane's calls hold.
	Borrowed int32 `json:"borrowed"`
	// Rejected counts the lane's calls not forwarded since the agent started, by reason.
	Rejected map[string]int64 `json:"rejected,omitempty"`
}

// lanes checks a downstream's lanes (called from downstream).
func (v *validator) lanes(p string, ls []Lane) {
	if len(ls) > MaxLanes {
		v.add(p, fmt.Sprintf("must list at most %d lanes", MaxLanes))
	}
	seen := make(map[string]int, len(ls))
	var total int64
	for i := range ls {
		l := &ls[i]
		lp := fmt.Sprintf("%s[%d]", p, i)
		switch {
		case !IsDNSLabel(l.Name):
			v.add(lp+".name", "must be a DNS label of at most 63 characters")
		case l.Name == DefaultLane:
			v.add(lp+".name", fmt.Sprintf("%q is the lane of unmatched calls", DefaultLane))
		default:
			if j, dup := seen[l.Name]; dup {
				v.add(lp+".name", fmt.Sprintf("duplicate of %s[%d].name %q", p, j, l.Name))
			}
			seen[l.Name] = i
		}
		v.intRange(lp+".reservePercent", int64(l.ReservePercent), 0, 100)
		v.intRange(lp+".lendPercent", int64(l.LendPercent), 0, 100)
		total += int64(max(l.ReservePercent, 0))
		if len(l.Headers) == 0 && len(l.Methods) == 0 && len(l.PathPrefixes) == 0 {
			v.add(lp, "must match on headers, methods or pathPrefixes")
		}
		if len(l.Headers) > MaxLaneHeaders {
			v.add(lp+".headers", fmt.Sprintf("must have at most %d entries", MaxLaneHeaders))
		}
		for j, h := range l.Headers {
			hp := fmt.Sprintf("%s.headers[%d]", lp, j)
			if !IsHeaderName(h.Name) || len(h.Name) > MaxHeaderNameLength {
				v.add(hp+".name", fmt.Sprintf("must be a valid header name of at most %d characters", MaxHeaderNameLength))
			}
			if !isHeaderValue(h.Value) || len(h.Value) > MaxHeaderValueLength {
				v.add(hp+".value", fmt.Sprintf("must be at most %d bytes without control characters", MaxHeaderValueLength))
			}
		}
		v.methods(lp+".methods", l.Methods)
		if len(l.PathPrefixes) > MaxLanePathPrefixes {
			v.add(lp+".pathPrefixes", fmt.Sprintf("must list at most %d prefixes", MaxLanePathPrefixes))
		}
		for j, pre := range l.PathPrefixes {
			if !strings.HasPrefix(pre, "/") || len(pre) > MaxPathPrefixLength || !isPrintableASCII(pre) {
				v.add(fmt.Sprintf("%s.pathPrefixes[%d]", lp, j), fmt.Sprintf("must start with / and be printable ASCII of at most %d characters", MaxPathPrefixLength))
			}
		}
	}
	if total > 100 {
		v.add(p, fmt.Sprintf("reservePercent sums to %d, more than 100", total))
	}
}
