// Package deadline reads the deadline an app states for one call, and writes what is left of
// it for the upstream.
//
// # Model
//
// An app may bound a call through the agent with either header:
//
//   - X-Apportion-Timeout: a Go duration ("300ms", "2s", "1m30s"), > 0 and at most MaxTimeout;
//   - grpc-timeout: gRPC's form (https://github.com/grpc/grpc/blob/master/doc/PROTOCOL-HTTP2.md):
//     at most 8 digits and a unit, H, M, S, m (milli), u (micro) or n (nano).
//
// With both, the shorter counts. The call's budget runs from the moment the agent read the
// request's head: the agent never waits for a rate token or a permit beyond it, and the upstream
// call's deadline is the earlier of the budget's end and the downstream's requestTimeout. A
// header that is present but malformed is the app's error (Parse returns it; the proxy answers
// 400): a deadline silently ignored would be a wait the app did not agree to.
//
// What is left of the budget when the call is forwarded may be passed on in a header (Format:
// in grpc-timeout's form for that header, a Go duration in whole milliseconds, rounded down,
// for any other). grpc-timeout itself, when the app sent one, is always rewritten to what is
// left: passing the app's original on would promise the upstream more time than there is.
package deadline

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// Header names.
const (
	Header     = "X-Apportion-Timeout"
	GRPCHeader = "Grpc-Timeout"
)

// MaxTimeout bounds X-Apportion-Timeout: a call longer than this is no deadline at all.
const MaxTimeout = time.Hour

// Parse returns the app's timeout from h (ok false: none stated), or an error naming the header
// that is malformed.
func Parse(h http.Header) (d time.Duration, ok bool, err error) {
	if vs, present := h[Header]; present {
		if len(vs) != 1 {
			return 0, false, fmt.Errorf("%s must appear once", Header)
		}
		v, err := time.ParseDuration(vs[0])
		if err != nil || v <= 0 || v > MaxTimeout {
			return 0, false, fmt.Errorf("%s %q is not a duration above 0 and at most %s (like 300ms)", Header, vs[0], MaxTimeout)
		}
		d, ok = v, true
	}
	if vs, present := h[GRPCHeader]; present {
		if len(vs) != 1 {
			return 0, false, fmt.Errorf("grpc-timeout must appear once")
		}
		v, err := ParseGRPC(vs[0])
		if err != nil {
			return 0, false, err
		}
		if !ok || v < d {
			d = v
		}
		ok = true
	}
	return d, ok, nil
}

var errGRPC = errors.New("grpc-timeout must be 1 to 8 digits and a unit of H, M, S, m, u or n")

// ParseGRPC parses a grpc-timeout value. A value too large for a time.Duration is the largest.
func ParseGRPC(s string) (time.Duration, error) {
	if len(s) < 2 || len(s) > 9 {
		return 0, errGRPC
	}
	n, err := strconv.ParseUint(s[:len(s)-1], 10, 64)
	if err != nil || s[0] == '+' {
		return 0, errGRPC
	}
	var unit time.Duration
	switch s[len(s)-1] {
	case 'H':
		unit = time.Hour
	case 'M':
		unit = time.Minute
	case 'S':
		unit = time.Second
	case 'm':
		unit = time.Millisecond
	case 'u':
		unit = time.Microsecond
	case 'n':
		unit = time.Nanosecond
	default:
		return 0, errGRPC
	}
	if n > uint64(1<<63-1)/uint64(unit) {
		return 1<<63 - 1, nil
	}
	return time.Duration(n) * unit, nil
}

// FormatGRPC writes d in grpc-timeout's form, in the finest unit that fits 8 digits, rounded
// down (a deadline passed on may only shrink). d <= 0 is "0n".
func FormatGRPC(d time.Duration) string {
	if d <= 0 {
		return "0n"
	}
	const max8 = 99_999_999
	for _, u := range []struct {
		unit time.Duration
		c    byte
	}{{time.Nanosecond, 'n'}, {time.Microsecond, 'u'}, {time.Millisecond, 'm'}, {time.Second, 'S'}, {time.Minute, 'M'}, {time.Hour, 'H'}} {
		if v := d / u.unit; v <= max8 {
			return strconv.FormatInt(int64(v), 10) + string(u.c)
		}
	}
	return strconv.Itoa(max8) + "H"
}

// Format writes what is left, d, for header name: FormatGRPC for grpc-timeout, else a Go duration
// in whole milliseconds rounded down ("250ms"; "0s" when under a millisecond).
func Format(name string, d time.Duration) string {
	if http.CanonicalHeaderKey(name) == GRPCHeader {
		return FormatGRPC(d)
	}
	return max(d.Truncate(time.Millisecond), 0).String()
}

// Budget is one call's time. The zero Budget has no end: only the downstream's own timeouts
// apply.
type Budget struct {
	End time.Time // zero: the app stated none
}

// New is the budget of a call read at start with the app's timeout d (ok false: none).
func New(start time.Time, d time.Duration, ok bool) Budget {
	if !ok {
		return Budget{}
	}
	return Budget{End: start.Add(d)}
}

// Set reports whether the app stated a deadline.
func (b Budget) Set() bool { return !b.End.IsZero() }

// Left is d, or what remains of the budget at now when that is less (negative once it passed).
func (b Budget) Left(now time.Time, d time.Duration) time.Duration {
	if b.End.IsZero() {
		return d
	}
	return min(d, b.End.Sub(now))
}

// Upstream is the upstream call's deadline when forwarded at now: the earlier of now +
// requestTimeout and the budget's end. bound is true when the budget's end is the earlier.
func (b Budget) Upstream(now time.Time, requestTimeout time.Duration) (deadline time.Time, bound bool) {
	d := now.Add(requestTimeout)
	if !b.End.IsZero() && b.End.Before(d) {
		return b.End, true
	}
	return d, false
}
