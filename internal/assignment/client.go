package assignment

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"time"

	"k8s.io/utils/clock"
)

// Control API paths on the agent's control port.
const (
	// PathAssignment takes PUT with an Assignment; it answers 200 with the State (the ack).
	PathAssignment = "/v1/assignment"
	// PathState takes GET; it answers 200 with the State.
	PathState = "/v1/state"
)

// Problem codes of the control API (Problem.Code).
const (
	CodeUnauthenticated   = "unauthenticated"        // 401
	CodeForbidden         = "forbidden"              // 403; Problem.Reason says why (the Reason* constants)
	CodeInvalidAssignment = "invalid-assignment"     // 400, Errors lists "path: message"
	CodeStaleAssignment   = "stale-assignment"       // 409, State is the agent's
	CodeTooLarge          = "body-too-large"         // 413
	CodeUnsupportedMedia  = "unsupported-media-type" // 415
	CodeMethodNotAllowed  = "method-not-allowed"     // 405
	CodeNotFound          = "not-found"              // 404
	CodeAgentStalled      = "agent-stalled"          // 503, the agent just resumed from a stall
)

// Problem is an RFC 9457 application/problem+json body as the control API writes it.
type Problem struct {
	Type   string `json:"type,omitempty"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	// Code is a stable machine-readable code (the Code* constants).
	Code string `json:"code,omitempty"`
	// Reason is why a request was refused (CodeUnauthenticated, CodeForbidden): one of the
	// Reason* constants.
	Reason string `json:"reason,omitempty"`
	// Errors lists every invalid field as "path: message" (CodeInvalidAssignment).
	Errors []string `json:"errors,omitempty"`
	// State is the agent's current State (CodeStaleAssignment, and CodeForbidden with
	// ReasonWrongInstance: a push the manager addressed to the agent's previous process).
	State *State `json:"state,omitempty"`
}

// Endpoint addresses one agent's control API.
type Endpoint struct {
	// URL is the control API's base URL ("http://10.1.2.3:15000").
	URL string
	// Pod is the agent's pod, "namespace/name": signatures are bound to it.
	Pod string
}

// Doer sends one HTTP request and returns the answer, as http.Client.Do: *http.Client, or the
// manager's lean client h1.HTTPClient (internal/h1), which bounds a request by its
// context's deadline only.
type Doer interface {
	Do(*http.Request) (*http.Response, error)
}

// Client is the manager's side of the control API.
type Client struct {
	// HTTP sends the requests; nil means http.DefaultClient. Give it a Timeout or pass contexts
	// with deadlines.
	HTTP Doer
	// Key signs every request.
	Key SigningKey
	// Clock dates signatures; nil means the real clock.
	Clock clock.PassiveClock
}

// StaleError is the agent's 409: it holds a newer (Epoch, Generation) than the one pushed.
// State is what the agent holds.
type StaleError struct {
	State  State
	Detail string
}

func (e *StaleError) Error() string {
	return fmt.Sprintf("agent refused a stale assignment: it holds epoch %d generation %d", e.State.Epoch, e.State.Generation)
}

// StatusError is any other non-200 answer of the agent.
type StatusError struct {
	StatusCode int
	// Problem is the agent's problem+json, when it sent one (Title, Detail, Code, Errors).
	Problem Problem
}

func (e *StatusError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "agent answered %d", e.StatusCode)
	if e.Problem.Code != "" {
		fmt.Fprintf(&b, " (%s)", e.Problem.Code)
	}
	if e.Problem.Detail != "" {
		b.WriteString(": " + e.Problem.Detail)
	} else if e.Problem.Title != "" {
		b.WriteString(": " + e.Problem.Title)
	}
	if len(e.Problem.Errors) > 0 {
		b.WriteString(": " + strings.Join(e.Problem.Errors, "; "))
	}
	return b.String()
}

// Push validates a and PUTs it to the agent at to, signed for to.Pod, a.Instance and a.Epoch. It
// returns the agent's State on 200, a *StaleError on 409 and on a 403 wrong-instance that carries
// the agent's State (it restarted: the push was addressed to its previous process), a
// *StatusError on other answers, or the validation or transport error. Push never retries.
func (c *Client) Push(ctx context.Context, to Endpoint, a *Assignment) (*State, error) {
	if err := a.Validate(); err != nil {
		return nil, fmt.Errorf("refusing to push an invalid assignment: %w", err)
	}
	body, err := json.Marshal(a)
	if err != nil {
		return nil, err
	}
	return c.PushEncoded(ctx, to, a, body)
}

// PushEncoded is Push for an assignment already validated and encoded: body must be
// json.Marshal(a) of an a that passed Validate. It signs and sends body as it is, so that a
// sender re-sending the same assignment (a lease renewal) encodes and validates it once.
func (c *Client) PushEncoded(ctx context.Context, to Endpoint, a *Assignment, body []byte) (*State, error) {
	o, err := NewOutgoing(to, a, body)
	if err != nil {
		return nil, err
	}
	return c.Send(ctx, o)
}

// Outgoing is a push made before it is sent, so that it can be signed with others
// (SignTogether) by the sender that then sends it (Client.Send).
type Outgoing struct {
	req    *http.Request
	ep     Endpoint
	body   []byte
	target Target
}

// NewOutgoing makes the push of a, encoded as body (json.Marshal(a) of an a that passed
// Validate), to the agent at to, unsigned.
func NewOutgoing(to Endpoint, a *Assignment, body []byte) (*Outgoing, error) {
	req, err := newRequest(http.MethodPut, to, PathAssignment, body)
	if err != nil {
		return nil, err
	}
	return &Outgoing{req: req, ep: to, body: body, target: Target{Pod: to.Pod, Instance: a.Instance, Epoch: a.Epoch}}, nil
}

// Signed reports whether the push carries a signature.
func (o *Outgoing) Signed() bool { return o.req.Header.Get("Authorization") != "" }

// KeyID is the id of the key the push was signed with ("" when unsigned).
func (o *Outgoing) KeyID() string {
	_, params, _ := strings.Cut(o.req.Header.Get("Authorization"), " ")
	for part := range strings.SplitSeq(params, ",") {
		if v, ok := strings.CutPrefix(part, "keyid="); ok {
			return v
		}
	}
	return ""
}

// Unsigned is the same push without a signature (to sign it anew, with another key).
func (o *Outgoing) Unsigned() *Outgoing {
	req, err := newRequest(o.req.Method, o.ep, PathAssignment, o.body)
	if err != nil {
		panic("assignment: remaking a request that was made: " + err.Error()) // the same inputs
	}
	return &Outgoing{req: req, ep: o.ep, body: o.body, target: o.target}
}

// SignTogether signs the pushes with one signature of key at now (one per MaxBatch): in a batch
// (batchsign.go) when there are several, so each must go to an agent that verifies batch
// signatures (CapabilityBatchSignatures); a lone one as Sign signs it.
func SignTogether(outs []*Outgoing, key SigningKey, now time.Time) {
	for len(outs) > MaxBatch {
		SignTogether(outs[:MaxBatch], key, now)
		outs = outs[MaxBatch:]
	}
	if len(outs) == 0 {
		return
	}
	batch := make([]*pendingSig, len(outs))
	for i, o := range outs {
		batch[i] = newPending(o.req, o.body, key, o.target, now)
	}
	signBatch(batch)
	for i, o := range outs {
		o.req.Header.Set("Authorization", batch[i].header())
	}
}

// Send sends a push made by NewOutgoing: as it is when it was signed (SignTogether), else signed
// with the Client's key. The answers are Push's.
// An Outgoing is sent at most once (its body is read).
func (c *Client) Send(ctx context.Context, o *Outgoing) (*State, error) {
	if !o.Signed() {
		Sign(o.req, o.body, c.Key, o.target, c.now())
	}
	return c.send(o.req.WithContext(ctx))
}

// State GETs the agent's State at to, signed for to.Pod and epoch (no instance: it may be the
// first contact), with the same errors as Push.
func (c *Client) State(ctx context.Context, to Endpoint, epoch int64) (*State, error) {
	req, err := newRequest(http.MethodGet, to, PathState, nil)
	if err != nil {
		return nil, err
	}
	Sign(req, nil, c.Key, Target{Pod: to.Pod, Epoch: epoch}, c.now())
	return c.send(req.WithContext(ctx))
}

// newRequest makes an unsigned control request without a context.
func newRequest(method string, ep Endpoint, path string, body []byte) (*http.Request, error) {
	var rd io.Reader = http.NoBody
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequest(method, strings.TrimRight(ep.URL, "/")+path, rd)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json, application/problem+json")
	return req, nil
}

func (c *Client) now() time.Time {
	if c.Clock != nil {
		return c.Clock.Now()
	}
	return time.Now()
}

// send sends a signed request and reads the answer, at a bounded cost (answer.go).
func (c *Client) send(req *http.Request) (*State, error) {
	var hc Doer = http.DefaultClient
	if c.HTTP != nil {
		hc = c.HTTP
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusOK {
		// Decoded as it is read, within the bounds of answer.go; a valid State decodes as
		// json.Unmarshal decodes it. Unknown fields are ignored: a newer agent may add some.
		st, err := decodeState(resp.Body)
		if err != nil {
			return nil, refusedAnswer("decoding the agent's state", err)
		}
		return st, nil
	}
	return nil, readProblem(resp)
}

// readProblem reads an answer other than 200: a *StaleError when it is a 409, or a 403
// wrong-instance, with the agent's State; a *StatusError otherwise, or an error wrapping
// ErrTooLarge when a problem+json body is larger than a real agent's.
func readProblem(resp *http.Response) error {
	var head [512]byte // the first bytes, the detail of an answer that is not a problem
	var kept []byte
	var p Problem
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt == "application/problem+json" || mt == "application/json" {
		limit := MaxProblemBytes
		if resp.StatusCode == http.StatusConflict || resp.StatusCode == http.StatusForbidden {
			limit += MaxStateBytes
		}
		dp, k, err := decodeProblem(resp.Body, limit, head[:])
		switch {
		case errors.Is(err, ErrTooLarge):
			return refusedAnswer(fmt.Sprintf("reading the agent's %d answer", resp.StatusCode), err)
		case err != nil:
			kept = fmt.Appendf(nil, "%s (the problem could not be decoded: %s)", bytes.TrimSpace(k), truncate(err.Error(), maxErrorText))
		default:
			p, kept = *dp, k
		}
	} else {
		// Read what an agent would send, so that the connection can be reused; the rest, if
		// any, is left to Close, which closes the connection.
		n, _ := io.ReadFull(resp.Body, head[:])
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, MaxProblemBytes))
		kept = head[:n]
	}
	if p.State != nil && (resp.StatusCode == http.StatusConflict ||
		(resp.StatusCode == http.StatusForbidden && p.Reason == ReasonWrongInstance)) {
		return &StaleError{State: *p.State, Detail: p.Detail}
	}
	if p.Title == "" && p.Detail == "" {
		p.Detail = string(bytes.TrimSpace(kept))
	}
	return &StatusError{StatusCode: resp.StatusCode, Problem: p}
}

// maxErrorText bounds the text of an error that may quote an answer.
const maxErrorText = 512

// answerError is an answer the client refused. Its text is cut at maxErrorText bytes: it may
// quote the answer (a JSON pointer into it), whose author is not trusted, and it ends in log
// lines.
type answerError struct {
	msg string
	err error
}

func (e *answerError) Error() string { return e.msg }
func (e *answerError) Unwrap() error { return e.err }

func refusedAnswer(what string, err error) error {
	return &answerError{msg: truncate(what+": "+err.Error(), maxErrorText), err: err}
}

// IsStale reports whether err is (or wraps) a *StaleError, and returns it.
func IsStale(err error) (*StaleError, bool) {
	var se *StaleError
	ok := errors.As(err, &se)
	return se, ok
}
