package fallback

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/apportion/apportion/internal/h1"
)

// Header names the agent sets on every fallback answer.
const (
	HeaderFallback = "X-Apportion-Fallback" // "reject", "static" or "serve-stale"
	HeaderReason   = "X-Apportion-Reason"   // the Reason
)

// ProblemTypePrefix starts the "type" URI of every problem the agent sends;
// the Reason follows it.
const ProblemTypePrefix = "https://apportion.io/problems/"

// Problem is the RFC 9457 body of a Reject. Type, Code and Reason are stable
// and meant for machines; Title and Detail are for people.
type Problem struct {
	Type       string `json:"type"`   // ProblemTypePrefix + Reason
	Title      string `json:"title"`  // fixed per Reason
	Status     int    `json:"status"` // 503
	Detail     string `json:"detail"`
	Code       string `json:"code"` // "APPORTION_" + Reason in upper snake case
	Downstream string `json:"downstream"`
	Reason     Reason `json:"reason"`
}

// Code is the machine code for r: APPORTION_NO_PERMIT, APPORTION_RATE_LIMITED,
// APPORTION_CIRCUIT_OPEN, APPORTION_DEGRADED, APPORTION_QUEUE_FULL.
func Code(r Reason) string {
	return "APPORTION_" + strings.ToUpper(strings.ReplaceAll(string(r), "-", "_"))
}

func title(r Reason) string {
	switch r {
	case NoPermit:
		return "Downstream concurrency limit reached"
	case RateLimited:
		return "Downstream rate limit reached"
	case CircuitOpen:
		return "Downstream circuit breaker open"
	case Degraded:
		return "Downstream degraded"
	case QueueFull:
		return "Too many calls waiting for the downstream"
	}
	return "Downstream not called"
}

// Render turns d into the response to send. It is pure; the returned
// Header is a fresh map, the Body may share d's bytes.
func Render(d Decision) Response {
	switch d.Action {
	case Static:
		h := endToEnd(d.Static.Header)
		h.Set(HeaderFallback, "static")
		h.Set(HeaderReason, string(d.Reason))
		h.Set("Content-Length", strconv.Itoa(len(d.Static.Body)))
		return Response{Status: statusOr200(d.Static.Status), Header: h, Body: d.Static.Body}

	case ServeStale:
		e := d.Stale
		h := endToEnd(e.Header)
		h.Set("Age", strconv.FormatInt(int64(d.Age/time.Second), 10))
		h.Set(HeaderFallback, "serve-stale")
		h.Set(HeaderReason, string(d.Reason))
		h.Set("Content-Length", strconv.Itoa(len(e.Body)))
		return Response{Status: statusOr200(e.Status), Header: h, Body: e.Body}
	}
	// Reject, and anything Decide would never produce.
	p := Problem{
		Type:       ProblemTypePrefix + string(d.Reason),
		Title:      title(d.Reason),
		Status:     http.StatusServiceUnavailable,
		Detail:     fmt.Sprintf("Apportion did not call downstream %q (%s).", d.Downstream, d.Reason),
		Code:       Code(d.Reason),
		Downstream: d.Downstream,
		Reason:     d.Reason,
	}
	body, err := json.Marshal(p)
	if err != nil {
		panic(err) // strings and ints only: cannot fail
	}
	h := http.Header{}
	h.Set("Content-Type", "application/problem+json")
	// The answer describes this moment only; no cache may keep it.
	h.Set("Cache-Control", "no-store")
	h.Set(HeaderFallback, "reject")
	h.Set(HeaderReason, string(d.Reason))
	if d.RetryAfter > 0 {
		secs := (d.RetryAfter + time.Second - 1) / time.Second // round up: never invite a retry too early
		h.Set("Retry-After", strconv.FormatInt(int64(secs), 10))
	}
	h.Set("Content-Length", strconv.Itoa(len(body)))
	return Response{Status: http.StatusServiceUnavailable, Header: h, Body: body}
}

// Write sends d on w: the rendered headers replace any of the same name
// already set on w. It returns the error of writing the body.
func Write(w http.ResponseWriter, d Decision) error {
	r := Render(d)
	dst := w.Header()
	for k, v := range r.Header {
		dst[k] = v
	}
	w.WriteHeader(r.Status)
	_, err := w.Write(r.Body)
	return err
}

// endToEnd returns a copy of h without hop-by-hop headers (h1.RemoveHopByHop: the agent's one
// list, and any listed in its Connection header) and without Content-Length, which Render
// computes. Replaying a stored Transfer-Encoding or Content-Length would corrupt the framing of
// the new response.
func endToEnd(h http.Header) http.Header {
	out := h.Clone()
	if out == nil {
		out = http.Header{}
	}
	h1.RemoveHopByHop(out)
	delete(out, "Content-Length")
	return out
}
