// Package control is the agent's control API: the HTTP handler of the control port, which the
// manager reaches on the pod IP (default :15000) and the kubelet probes.
//
// Endpoints and every outcome:
//
//	PUT /v1/assignment   authenticated. Body: one JSON Assignment (at most MaxBodyBytes).
//	                     200 application/json State: applied atomically, or a lease renewal
//	                         (same epoch and generation). This State is the ack: the manager
//	                         reads InFlight and EffectivePermits from it.
//	                     400 problem+json, code invalid-assignment: not valid; "errors" lists
//	                         every field as "path: message". Nothing was applied.
//	                     409 problem+json, code stale-assignment: (epoch, generation) is below
//	                         the pair held (or, without authentication, the body's instance is
//	                         another agent process); "state" is the agent's State. Nothing was
//	                         applied.
//	                     401/403: see Authentication below.
//	                     503 problem+json, code agent-stalled, Retry-After 1: the process was
//	                         frozen or starved just now (Options.Stalled), so the push may be
//	                         older than the manager expects any push to land. Nothing was applied.
//	                     413 body-too-large, 415 unsupported-media-type (a Content-Type other
//	                         than application/json).
//	GET /v1/state        authenticated. 200 application/json State.
//	GET /healthz         200 "ok" while the process serves (liveness).
//	GET /readyz          200 "ready" once an assignment or the bootstrap file was applied and
//	                     until shutdown starts; 503 otherwise.
//	GET /metrics         Prometheus exposition of the agent's own registry.
//
// Authentication (package assignment: Sign/Verify): every control request must carry an
// "Authorization: Apportion-Ed25519 ..." signature by a key of the agent's trust set, made for this
// pod (Options.Pod) and, for a push, this process (Backend.Instance), within 2 minutes of the
// agent's clock. Without the header: 401 (code unauthenticated). Otherwise refused: 403 (code
// forbidden) with "reason" one of assignment's Reason* constants — unknown-key, bad-signature,
// stale-timestamp, wrong-pod, wrong-instance (with the agent's State, so that the manager learns
// of the restart), binding-mismatch (a push whose signed epoch or instance is not its body's),
// malformed. Every refusal is logged at warn with the reason and the key id, never key material,
// and counted by Options.Rejected (apportion_agent_rejected_pushes_total{reason}); nothing is
// applied. Authentication is checked before the body is parsed. An accepted push's lease ends no
// later than its signed time + LeaseTTL (Backend.Apply), so a replay cannot extend it. An unknown
// path gets 404, a wrong method 405 with Allow.
package control

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"strconv"
	"time"

	"k8s.io/utils/clock"

	"github.com/apportion/apportion/internal/assignment"
)

// Backend is what the control API drives.
type Backend interface {
	// Apply applies a validated assignment, or renews the lease when the pair is the one held,
	// with the lease ending no later than signed + a.LeaseTTL (signed is the signature's time;
	// zero without authentication). It returns the State after the call; for a stale pair an
	// error wrapping assignment.ErrStale and the State held.
	Apply(a *assignment.Assignment, signed time.Time) (assignment.State, error)
	// Instance is the agent process's id (assignment.State.Instance), which pushes are signed for.
	Instance() string
	// State is the current State.
	State() assignment.State
	// Ready reports readiness.
	Ready() bool
}

// Options configure the handler.
type Options struct {
	Backend Backend
	// Trust returns the public keys requests are verified with (it is called per request, so
	// the keys can be reloaded); nil disables authentication (--insecure-no-auth).
	Trust func() assignment.TrustSet
	// Pod is this agent's pod, "namespace/name": requests must be signed for it.
	Pod string
	// Rejected counts a request refused by authentication, by reason; nil: not counted.
	Rejected func(reason string)
	// Clock is the time for signature checks; nil means the real clock.
	Clock clock.PassiveClock
	// Metrics serves GET /metrics; nil answers 404.
	Metrics http.Handler
	// Logger; nil means slog.Default().
	Logger *slog.Logger
	// MaxBodyBytes caps an assignment; 0 means assignment.DefaultMaxBytes.
	MaxBodyBytes int64
	// Stalled reports whether the process stalled just now (package stall); nil: never.
	Stalled func() bool
}

type handler struct {
	o   Options
	log *slog.Logger
}

// New returns the control API handler.
func New(o Options) http.Handler {
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	if o.MaxBodyBytes <= 0 {
		o.MaxBodyBytes = assignment.DefaultMaxBytes
	}
	h := &handler{o: o, log: o.Logger}
	if h.log == nil {
		h.log = slog.Default()
	}
	return h
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/healthz":
		if !h.method(w, r, http.MethodGet, http.MethodHead) {
			return
		}
		text(w, http.StatusOK, "ok\n")
	case "/readyz":
		if !h.method(w, r, http.MethodGet, http.MethodHead) {
			return
		}
		if h.o.Backend.Ready() {
			text(w, http.StatusOK, "ready\n")
		} else {
			text(w, http.StatusServiceUnavailable, "not ready\n")
		}
	case "/metrics":
		if h.o.Metrics == nil {
			h.problem(w, http.StatusNotFound, assignment.Problem{Title: "Not found", Code: assignment.CodeNotFound})
			return
		}
		h.o.Metrics.ServeHTTP(w, r)
	case assignment.PathAssignment:
		if !h.method(w, r, http.MethodPut) {
			return
		}
		h.putAssignment(w, r)
	case assignment.PathState:
		if !h.method(w, r, http.MethodGet) {
			return
		}
		if _, ok := h.authenticate(w, r, nil, true); !ok {
			return
		}
		writeJSON(w, http.StatusOK, advertise(h.o.Backend.State()))
	default:
		h.problem(w, http.StatusNotFound, assignment.Problem{Title: "Not found", Code: assignment.CodeNotFound,
			Detail: "the control API serves " + assignment.PathAssignment + ", " + assignment.PathState + ", /healthz, /readyz and /metrics"})
	}
}

func (h *handler) method(w http.ResponseWriter, r *http.Request, allowed ...string) bool {
	for _, m := range allowed {
		if r.Method == m {
			return true
		}
	}
	allow := allowed[0]
	for _, m := range allowed[1:] {
		allow += ", " + m
	}
	w.Header().Set("Allow", allow)
	h.problem(w, http.StatusMethodNotAllowed, assignment.Problem{Title: "Method not allowed", Code: assignment.CodeMethodNotAllowed,
		Detail: r.URL.Path + " takes " + allow})
	return false
}

// authenticate verifies the signature over body and answers 401/403 when it fails. Without
// authentication (--insecure-no-auth) it accepts everything, with a zero Verified.
func (h *handler) authenticate(w http.ResponseWriter, r *http.Request, body []byte, instanceOptional bool) (assignment.Verified, bool) {
	if h.o.Trust == nil {
		return assignment.Verified{}, true
	}
	self := assignment.Self{Pod: h.o.Pod, Instance: h.o.Backend.Instance()}
	v, err := assignment.Verify(r, body, h.o.Trust(), self, instanceOptional, h.o.Clock.Now())
	if err == nil {
		return v, true
	}
	h.refuse(w, r, err)
	return assignment.Verified{}, false
}

// refuse answers an authentication failure (an *assignment.AuthError), logs and counts it.
func (h *handler) refuse(w http.ResponseWriter, r *http.Request, err error) {
	reason := assignment.AuthReason(err)
	h.log.Warn("control request refused", "method", r.Method, "path", r.URL.Path, "remote", r.RemoteAddr, "reason", reason, "detail", err.Error())
	if h.o.Rejected != nil {
		h.o.Rejected(reason)
	}
	if errors.Is(err, assignment.ErrMissingCredentials) {
		w.Header().Set("WWW-Authenticate", assignment.AuthScheme)
		h.problem(w, http.StatusUnauthorized, assignment.Problem{Title: "Unauthenticated", Code: assignment.CodeUnauthenticated,
			Reason: reason, Detail: "control requests must carry an " + assignment.AuthScheme + " Authorization header"})
		return
	}
	p := assignment.Problem{Title: "Forbidden", Code: assignment.CodeForbidden, Reason: reason,
		Detail: "the request signature was refused (" + reason + "); nothing was applied"}
	if reason == assignment.ReasonWrongInstance {
		// The signature verified: this is the manager (or a replay of it) addressing this pod's
		// previous process. The manager must learn of the restart from the State.
		st := advertise(h.o.Backend.State())
		p.State = &st
	}
	h.problem(w, http.StatusForbidden, p)
}

func (h *handler) putAssignment(w http.ResponseWriter, r *http.Request) {
	if ct := r.Header.Get("Content-Type"); ct != "" {
		if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
			h.problem(w, http.StatusUnsupportedMediaType, assignment.Problem{Title: "Unsupported media type",
				Code: assignment.CodeUnsupportedMedia, Detail: "an assignment is application/json"})
			return
		}
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, h.o.MaxBodyBytes))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			h.problem(w, http.StatusRequestEntityTooLarge, assignment.Problem{Title: "Assignment too large",
				Code: assignment.CodeTooLarge, Detail: "an assignment is at most " + strconv.FormatInt(h.o.MaxBodyBytes, 10) + " bytes"})
			return
		}
		h.log.Debug("reading an assignment failed", "remote", r.RemoteAddr, "err", err)
		h.problem(w, http.StatusBadRequest, assignment.Problem{Title: "Unreadable body", Code: assignment.CodeInvalidAssignment, Detail: err.Error()})
		return
	}
	v, ok := h.authenticate(w, r, body, false)
	if !ok {
		return
	}
	a, err := assignment.Decode(bytes.NewReader(body), h.o.MaxBodyBytes)
	if err != nil {
		p := assignment.Problem{Title: "Invalid assignment", Code: assignment.CodeInvalidAssignment,
			Detail: "the assignment was refused; nothing was applied"}
		for _, fe := range assignment.FieldErrors(err) {
			p.Errors = append(p.Errors, fe.Error())
		}
		if len(p.Errors) == 0 {
			p.Errors = []string{err.Error()}
		}
		h.log.Warn("invalid assignment refused", "remote", r.RemoteAddr, "errors", p.Errors)
		h.problem(w, http.StatusBadRequest, p)
		return
	}
	// The signature binds the epoch and instance it names; the body must say the same (the
	// manager always signs what it sends: a difference is a forgery attempt or a bug).
	if h.o.Trust != nil && (a.Epoch != v.Target.Epoch || a.Instance != v.Target.Instance) {
		h.refuse(w, r, &assignment.AuthError{Reason: assignment.ReasonBindingMismatch,
			Detail: fmt.Sprintf("signed for epoch %d instance %q, the assignment says epoch %d instance %q (key id %q)",
				v.Target.Epoch, v.Target.Instance, a.Epoch, a.Instance, v.KeyID)})
		return
	}
	// A manager that gave up on this request (it timed out: the agent was frozen or stalled) has
	// already counted it as possibly landed, but applying it now would start a lease it no longer
	// expects. Refuse it; the manager's next push is current.
	if err := r.Context().Err(); err != nil {
		h.log.Warn("assignment not applied: the manager gave up on the request", "remote", r.RemoteAddr,
			"epoch", a.Epoch, "generation", a.Generation)
		return
	}
	// The same after a freeze the agent noticed itself: the request may have waited in the
	// kernel's buffers for longer than the manager allows a push to land.
	if h.o.Stalled != nil && h.o.Stalled() {
		h.log.Warn("assignment not applied: the agent stalled just now", "remote", r.RemoteAddr,
			"epoch", a.Epoch, "generation", a.Generation)
		w.Header().Set("Retry-After", "1")
		h.problem(w, http.StatusServiceUnavailable, assignment.Problem{Title: "Agent stalled", Code: assignment.CodeAgentStalled,
			Detail: "the agent process did not run for a while just now; the push may be late and was not applied"})
		return
	}
	st, err := h.o.Backend.Apply(a, v.Signed)
	if err != nil {
		if errors.Is(err, assignment.ErrStale) {
			h.log.Info("stale assignment refused", "remote", r.RemoteAddr,
				"pushedEpoch", a.Epoch, "pushedGeneration", a.Generation, "heldEpoch", st.Epoch, "heldGeneration", st.Generation)
			h.problem(w, http.StatusConflict, assignment.Problem{Title: "Stale assignment", Code: assignment.CodeStaleAssignment,
				Detail: "the agent holds a newer (epoch, generation)", State: new(advertise(st))})
			return
		}
		h.log.Error("applying an assignment failed", "err", err)
		h.problem(w, http.StatusInternalServerError, assignment.Problem{Title: "Internal error", Detail: err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, advertise(st))
}

// capabilities are what this control API has beyond the first release's (State.Capabilities):
// it verifies batch signatures (assignment.Verify), and knows Observe and dry-run switches and
// reports what they would have refused and the per-second counts (assignment.CapabilityObserve),
// and ramps a raise flagged as following an incident (assignment.CapabilityRampRaise).
var capabilities = []string{assignment.CapabilityBatchSignatures, assignment.CapabilityObserve,
	assignment.CapabilityRampRaise}

// advertise adds the control API's capabilities to a State it answers with.
func advertise(st assignment.State) assignment.State {
	st.Capabilities = capabilities
	return st
}

func (h *handler) problem(w http.ResponseWriter, status int, p assignment.Problem) {
	p.Status = status
	b, _ := json.Marshal(p)
	w.Header().Set("Content-Type", "application/problem+json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

func text(w http.ResponseWriter, status int, s string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(status)
	_, _ = io.WriteString(w, s)
}
