package assignment

import (
	"errors"
	"fmt"
	"math"
	"net/url"
	"slices"
	"strings"
	"time"
)

// Ranges enforced by Validate. They mirror the CRD's (api/v1alpha1) so that whatever the API
// server admits, the manager can push.
const (
	MinLeaseTTL       = 100 * time.Millisecond
	MaxLeaseTTL       = 10 * time.Minute
	MinAcquireTimeout = time.Millisecond
	MaxAcquireTimeout = 5 * time.Second
	MinRequestTimeout = 10 * time.Millisecond
	MaxRequestTimeout = 10 * time.Minute
	MaxPermits        = 1_000_000

	MinBreakerWindow        = time.Second
	MaxBreakerWindow        = 10 * time.Minute
	MinSlowCallThreshold    = time.Millisecond
	MaxSlowCallThreshold    = 10 * time.Minute
	MinOpenDuration         = 100 * time.Millisecond
	MaxOpenDuration         = time.Hour
	MaxHalfOpenProbes       = 100
	MinMaxStaleness         = time.Second
	MaxMaxStaleness         = 24 * time.Hour
	MinRecoveryWindow       = 100 * time.Millisecond
	MaxRecoveryWindow       = time.Minute
	MinLatencyTarget        = time.Millisecond
	MaxLatencyTarget        = 10 * time.Minute
	MaxHealthyWindows       = 100
	MinTolerancePercent     = 101
	MaxTolerancePercent     = 1000
	MinBaselineWindows      = 2
	MaxBaselineWindows      = 10000
	MaxAbandonedHold        = 10 * time.Minute
	MaxUpstreamLength       = 2048
	MaxStaticHeaders        = 32
	MaxStaticBody           = 65536
	MaxMethods              = 8
	MaxSwitchHeaders        = 16
	MaxHeaderNameLength     = 256
	MaxHeaderValueLength    = 4096
	MaxSwitchNameLength     = 317 // "<namespace (63)>/<name (253)>"
	MaxDownstreamNameLength = 63
	MaxInstanceLength       = 64
	// MaxDownstreams and MaxSwitches bound one pod's assignment, hence its agent's State and
	// what the manager reads per answer (MaxStateBytes, answer.go). The manager does not push
	// a pod in more than MaxDownstreams quotas a new assignment (it logs why), and pushes one
	// with more than MaxSwitches switches without its switches (package push, rebuild).
	MaxDownstreams = 32
	MaxSwitches    = 64
	// MaxFence bounds Epoch and Generation: an agent refuses every push below the pair it
	// holds, so one accepted near MaxInt64 would leave no room to count up and fence it out
	// of all later pushes until it restarted. 2^53-1, the largest integer a JSON number holds
	// exactly, is more than a manager counting a generation a millisecond reaches in 285,000
	// years.
	MaxFence = 1<<53 - 1
)

// Fallback actions and rate modes as they travel.
const (
	ActionReject     = "Reject"
	ActionStatic     = "Static"
	ActionServeStale = "ServeStale"

	ModeTokenBucket = "TokenBucket"
	ModePacing      = "Pacing"
)

// Methods are the HTTP methods that fallbacks and switches may name.
var Methods = []string{"GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE", "TRACE"}

// Validate checks every field of a decoded Assignment and returns all problems joined
// (errors.Join), each a *FieldError naming its path, or nil.
//
// Besides the per-field ranges and list lengths (see the constants), it requires downstream
// names to be unique DNS labels, switch names to be unique, every switch to name a listed
// downstream, the Static action to carry a static answer, and a switch below 100 percent to name
// its keyHeader.
// SafeDefaultPermits may exceed Permits: the agent always uses min(Permits, SafeDefaultPermits).
func (a *Assignment) Validate() error { return a.validate(false) }

func (a *Assignment) validate(bootstrap bool) error {
	v := &validator{}
	if bootstrap {
		if a.Epoch < 0 {
			v.add("epoch", "must be 0 or omitted in a bootstrap file")
		}
		if a.Generation < 0 {
			v.add("generation", "must be 0 or omitted in a bootstrap file")
		}
		if a.Epoch > MaxFence {
			v.intRange("epoch", a.Epoch, 0, MaxFence)
		}
		if a.Generation > MaxFence {
			v.intRange("generation", a.Generation, 0, MaxFence)
		}
		if a.LeaseTTL != 0 {
			v.durRange("leaseTTL", a.LeaseTTL.D(), MinLeaseTTL, MaxLeaseTTL)
		}
	} else {
		if a.Epoch < 1 {
			v.add("epoch", "must be at least 1")
		}
		if a.Generation < 1 {
			v.add("generation", "must be at least 1")
		}
		if a.Epoch > MaxFence {
			v.intRange("epoch", a.Epoch, 1, MaxFence)
		}
		if a.Generation > MaxFence {
			v.intRange("generation", a.Generation, 1, MaxFence)
		}
		v.durRange("leaseTTL", a.LeaseTTL.D(), MinLeaseTTL, MaxLeaseTTL)
	}
	if len(a.Instance) > MaxInstanceLength {
		v.add("instance", fmt.Sprintf("must be at most %d characters", MaxInstanceLength))
	}
	// The first one too many is named, so that the manager can tell switches it may drop
	// (paths under "switches[") from downstreams it may not.
	if len(a.Downstreams) > MaxDownstreams {
		v.add(fmt.Sprintf("downstreams[%d]", MaxDownstreams), fmt.Sprintf("beyond the %d downstreams an assignment may list", MaxDownstreams))
	}
	if len(a.Switches) > MaxSwitches {
		v.add(fmt.Sprintf("switches[%d]", MaxSwitches), fmt.Sprintf("beyond the %d switches an assignment may list", MaxSwitches))
	}
	names := make(map[string]int, len(a.Downstreams))
	for i := range a.Downstreams {
		p := fmt.Sprintf("downstreams[%d]", i)
		d := &a.Downstreams[i]
		if j, dup := names[d.Name]; dup && d.Name != "" {
			v.add(p+".name", fmt.Sprintf("duplicate of downstreams[%d].name %q", j, d.Name))
		} else {
			names[d.Name] = i
		}
		v.downstream(p, d)
	}
	swNames := make(map[string]int, len(a.Switches))
	for i := range a.Switches {
		p := fmt.Sprintf("switches[%d]", i)
		s := &a.Switches[i]
		if j, dup := swNames[s.Name]; dup && s.Name != "" {
			v.add(p+".name", fmt.Sprintf("duplicate of switches[%d].name %q", j, s.Name))
		} else {
			swNames[s.Name] = i
		}
		if _, ok := names[s.Downstream]; !ok && s.Downstream != "" {
			v.add(p+".downstream", fmt.Sprintf("%q is not a listed downstream", s.Downstream))
		}
		v.switch_(p, s)
	}
	return errors.Join(v.errs...)
}

type validator struct{ errs []error }

func (v *validator) add(path, msg string) {
	v.errs = append(v.errs, &FieldError{Path: path, Message: msg})
}

func (v *validator) durRange(path string, d, lo, hi time.Duration) {
	if d < lo || d > hi {
		v.add(path, fmt.Sprintf("must be between %s and %s", fmtDur(lo), fmtDur(hi)))
	}
}

func (v *validator) intRange(path string, n, lo, hi int64) {
	if n < lo || n > hi {
		v.add(path, fmt.Sprintf("must be between %d and %d", lo, hi))
	}
}

// fmtDur prints round durations the way people write them: 5s, 10m, 1h, 24h.
func fmtDur(d time.Duration) string {
	switch {
	case d >= time.Hour && d%time.Hour == 0:
		return fmt.Sprintf("%dh", d/time.Hour)
	case d >= time.Minute && d%time.Minute == 0:
		return fmt.Sprintf("%dm", d/time.Minute)
	}
	return d.String()
}

// IsDNSLabel reports whether s is [a-z0-9]([-a-z0-9]*[a-z0-9])? of at most 63 characters.
func IsDNSLabel(s string) bool {
	if len(s) == 0 || len(s) > MaxDownstreamNameLength {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case c == '-' && i > 0 && i < len(s)-1:
		default:
			return false
		}
	}
	return true
}

func (v *validator) downstream(p string, d *Downstream) {
	if !IsDNSLabel(d.Name) {
		v.add(p+".name", "must be a DNS label: lower-case letters, digits and '-', starting and ending with a letter or digit, at most 63 characters")
	}
	v.upstream(p+".upstream", d.Upstream)
	v.intRange(p+".permits", int64(d.Permits), 0, MaxPermits)
	v.intRange(p+".safeDefaultPermits", int64(d.SafeDefaultPermits), 0, MaxPermits)
	v.durRange(p+".acquireTimeout", d.AcquireTimeout.D(), MinAcquireTimeout, MaxAcquireTimeout)
	v.durRange(p+".requestTimeout", d.RequestTimeout.D(), MinRequestTimeout, MaxRequestTimeout)
	if r := d.Rate; r != nil {
		rp := p + ".rate"
		if math.IsNaN(r.PerSecond) || math.IsInf(r.PerSecond, 0) || r.PerSecond <= 0 {
			v.add(rp+".perSecond", "must be a finite number greater than 0")
		} else if r.PerSecond > 1e9 {
			v.add(rp+".perSecond", "must be at most 1e9")
		}
		if r.Burst < 0 {
			v.add(rp+".burst", "must be 0 or more")
		}
		if r.Mode != ModeTokenBucket && r.Mode != ModePacing {
			v.add(rp+".mode", fmt.Sprintf("must be %q or %q", ModeTokenBucket, ModePacing))
		}
	}
	if b := d.Breaker; b != nil {
		bp := p + ".breaker"
		v.durRange(bp+".window", b.Window.D(), MinBreakerWindow, MaxBreakerWindow)
		v.intRange(bp+".failureRatePercent", int64(b.FailureRatePercent), 1, 100)
		v.durRange(bp+".slowCallThreshold", b.SlowCallThreshold.D(), MinSlowCallThreshold, MaxSlowCallThreshold)
		v.intRange(bp+".slowCallRatePercent", int64(b.SlowCallRatePercent), 1, 100)
		v.intRange(bp+".minimumCalls", int64(b.MinimumCalls), 1, MaxPermits)
		v.durRange(bp+".openDuration", b.OpenDuration.D(), MinOpenDuration, MaxOpenDuration)
		v.intRange(bp+".halfOpenProbes", int64(b.HalfOpenProbes), 1, MaxHalfOpenProbes)
	}
	v.fallback(p+".fallback", &d.Fallback)
	if r := d.Recovery; r != nil {
		rp := p + ".recovery"
		v.durRange(rp+".window", r.Window.D(), MinRecoveryWindow, MaxRecoveryWindow)
		if rr := r.Ramp; rr != nil {
			if rr.Shape != ShapeLinear && rr.Shape != ShapeExponential {
				v.add(rp+".ramp.shape", fmt.Sprintf("must be %q or %q", ShapeLinear, ShapeExponential))
			}
			v.intRange(rp+".ramp.initialPercent", int64(rr.InitialPercent), 1, 100)
			v.intRange(rp+".ramp.stepPercent", int64(rr.StepPercent), 1, 100)
			v.intRange(rp+".ramp.healthyWindows", int64(rr.HealthyWindows), 1, MaxHealthyWindows)
			if rr.LatencyTarget != 0 {
				v.durRange(rp+".ramp.latencyTarget", rr.LatencyTarget.D(), MinLatencyTarget, MaxLatencyTarget)
			}
		}
		if a := r.Adaptive; a != nil {
			v.intRange(rp+".adaptive.tolerancePercent", int64(a.TolerancePercent), MinTolerancePercent, MaxTolerancePercent)
			v.intRange(rp+".adaptive.baselineWindows", int64(a.BaselineWindows), MinBaselineWindows, MaxBaselineWindows)
			v.intRange(rp+".adaptive.minLimit", int64(a.MinLimit), 1, MaxPermits)
		}
	}
	if d.MaxWaiting != nil {
		v.intRange(p+".maxWaiting", int64(*d.MaxWaiting), 0, MaxPermits)
	}
	if d.DeadlineHeader != "" {
		if !IsHeaderName(d.DeadlineHeader) || len(d.DeadlineHeader) > MaxHeaderNameLength {
			v.add(p+".deadlineHeader", "must be an HTTP field name (a token) of at most 256 characters")
		} else if reservedHeader(d.DeadlineHeader) {
			v.add(p+".deadlineHeader", fmt.Sprintf("%q is a field the agent or HTTP itself sets; name another", d.DeadlineHeader))
		}
	}
	if d.AbandonedHold != nil {
		v.durRange(p+".abandonedHold", d.AbandonedHold.D(), 0, MaxAbandonedHold)
	}
	v.lanes(p+".lanes", d.Lanes)
	if d.TLS != nil {
		v.upstreamTLS(p+".tls", d.TLS, d.Upstream)
	}
}

func (v *validator) upstream(p, s string) {
	if s == "" {
		v.add(p, "is required")
		return
	}
	if len(s) > MaxUpstreamLength {
		v.add(p, fmt.Sprintf("must be at most %d characters", MaxUpstreamLength))
		return
	}
	u, err := url.Parse(s)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.Opaque != "" {
		v.add(p, "must be an absolute http or https URL")
		return
	}
	if u.User != nil {
		v.add(p, "must not carry user information")
	}
	if u.Fragment != "" || strings.Contains(s, "#") {
		v.add(p, "must not have a fragment")
	}
}

func (v *validator) methods(p string, ms []string) {
	if len(ms) > MaxMethods {
		v.add(p, fmt.Sprintf("must list at most %d methods", MaxMethods))
	}
	seen := make(map[string]bool, len(ms))
	for i, m := range ms {
		mp := fmt.Sprintf("%s[%d]", p, i)
		if !isMethod(m) {
			v.add(mp, fmt.Sprintf("must be one of %s", strings.Join(Methods, ", ")))
		} else if seen[m] {
			v.add(mp, fmt.Sprintf("duplicate method %q", m))
		}
		seen[m] = true
	}
}

func isMethod(m string) bool {
	for _, x := range Methods {
		if m == x {
			return true
		}
	}
	return false
}

func (v *validator) fallback(p string, f *Fallback) {
	switch f.Action {
	case ActionReject, ActionServeStale:
	case ActionStatic:
		if f.Static == nil {
			v.add(p+".static", "is required when action is Static")
		}
	default:
		v.add(p+".action", fmt.Sprintf("must be %q, %q or %q", ActionReject, ActionStatic, ActionServeStale))
	}
	if f.Action == ActionServeStale && f.MaxStaleness == 0 {
		v.add(p+".maxStaleness", fmt.Sprintf("is required when action is ServeStale, between %s and %s", fmtDur(MinMaxStaleness), fmtDur(MaxMaxStaleness)))
	} else if f.MaxStaleness != 0 {
		v.durRange(p+".maxStaleness", f.MaxStaleness.D(), MinMaxStaleness, MaxMaxStaleness)
	}
	v.methods(p+".allowedMethods", f.AllowedMethods)
	if s := f.Static; s != nil {
		sp := p + ".static"
		// A final status: 1xx (and 101) are interim answers that a fallback cannot end a call
		// with, and 204 and 304 have no body (RFC 9110 §8.6, §15.3.5, §15.4.5).
		v.intRange(sp+".status", int64(s.Status), 200, 599)
		if (s.Status == 204 || s.Status == 304) && s.Body != "" {
			v.add(sp+".body", "must be empty with status 204 or 304")
		}
		if len(s.Headers) > MaxStaticHeaders {
			v.add(sp+".headers", fmt.Sprintf("must have at most %d entries", MaxStaticHeaders))
		}
		for _, k := range sortedKeys(s.Headers) {
			hp := fmt.Sprintf("%s.headers[%q]", sp, k)
			if !IsHeaderName(k) {
				v.add(hp, "is not a valid header name")
			} else if len(k) > MaxHeaderNameLength {
				v.add(hp, fmt.Sprintf("name must be at most %d characters", MaxHeaderNameLength))
			}
			if !isHeaderValue(s.Headers[k]) {
				v.add(hp, "value must not contain control characters")
			} else if len(s.Headers[k]) > MaxHeaderValueLength {
				v.add(hp, fmt.Sprintf("value must be at most %d bytes", MaxHeaderValueLength))
			}
		}
		if len(s.Body) > MaxStaticBody {
			v.add(sp+".body", fmt.Sprintf("must be at most %d bytes", MaxStaticBody))
		}
	}
}

func (v *validator) switch_(p string, s *Switch) {
	if s.Name == "" {
		v.add(p+".name", "is required")
	} else if len(s.Name) > MaxSwitchNameLength || !isPrintableASCII(s.Name) {
		v.add(p+".name", fmt.Sprintf("must be printable ASCII of at most %d characters", MaxSwitchNameLength))
	}
	if s.Downstream == "" {
		v.add(p+".downstream", "is required")
	}
	if s.ExpiresAt.IsZero() {
		v.add(p+".expiresAt", "is required")
	}
	v.intRange(p+".percent", int64(s.Percent), 1, 100)
	if s.KeyHeader != "" && (!IsHeaderName(s.KeyHeader) || len(s.KeyHeader) > MaxHeaderNameLength) {
		v.add(p+".keyHeader", fmt.Sprintf("must be a valid header name of at most %d characters", MaxHeaderNameLength))
	}
	if s.Percent >= 1 && s.Percent < 100 && s.KeyHeader == "" {
		v.add(p+".keyHeader", "is required when percent is below 100")
	}
	if len(s.Headers) > MaxSwitchHeaders {
		v.add(p+".headers", fmt.Sprintf("must have at most %d entries", MaxSwitchHeaders))
	}
	for i, h := range s.Headers {
		hp := fmt.Sprintf("%s.headers[%d]", p, i)
		if !IsHeaderName(h.Name) || len(h.Name) > MaxHeaderNameLength {
			v.add(hp+".name", fmt.Sprintf("must be a valid header name of at most %d characters", MaxHeaderNameLength))
		}
		if !isHeaderValue(h.Value) || len(h.Value) > MaxHeaderValueLength {
			v.add(hp+".value", fmt.Sprintf("must be at most %d bytes without control characters", MaxHeaderValueLength))
		}
	}
	v.methods(p+".methods", s.Methods)
	v.fallback(p+".action", &s.Action)
}

// IsHeaderName reports whether s is an RFC 9110 token, as header names must be.
// reservedHeader reports whether the deadline may not be written into field name: framing,
// hop-by-hop and forwarding fields, and the app's own X-Apportion-Timeout (read by the agent).
func reservedHeader(name string) bool {
	switch strings.ToLower(name) {
	case "host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer",
		"upgrade", "expect", "x-forwarded-for", "forwarded", "x-apportion-timeout":
		return true
	}
	return strings.HasPrefix(strings.ToLower(name), "proxy-")
}

func IsHeaderName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

func isHeaderValue(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < 0x20 && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

func isPrintableASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] > 0x7e {
			return false
		}
	}
	return true
}

func sortedKeys(m map[string]string) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
