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

// maxStateBytes caps a State answer the client reads.
const maxStateBytes = 8 << 20

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
	// Now is the clock used for signatures; nil means time.Now.
	Now func() time.Time
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
	return c.do(ctx, http.MethodPut, to.URL, PathAssignment, body, Target{Pod: to.Pod, Instance: a.Instance, Epoch: a.Epoch})
}

// PushEncoded is Push for an assignment already validated and encoded: body must be
// json.Marshal(a) of an a that passed Validate. It signs and sends body as it is, so that a
// sender re-sending the same assignment (a lease renewal) encodes and validates it once.
func (c *Client) PushEncoded(ctx context.Context, to Endpoint, a *Assignment, body []byte) (*State, error) {
	return c.do(ctx, http.MethodPut, to.URL, PathAssignment, body, Target{Pod: to.Pod, Instance: a.Instance, Epoch: a.Epoch})
}

// State GETs the agent's State at to, signed for to.Pod and epoch (no instance: it may be the
// first contact), with the same errors as Push.
func (c *Client) State(ctx context.Context, to Endpoint, epoch int64) (*State, error) {
	return c.do(ctx, http.MethodGet, to.URL, PathState, nil, Target{Pod: to.Pod, Epoch: epoch})
}

func (c *Client) do(ctx context.Context, method, baseURL, path string, body []byte, to Target) (*State, error) {
	var rd io.Reader = http.NoBody
	if body != nil {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimRight(baseURL, "/")+path, rd)
	if err != nil {
		return nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json, application/problem+json")
	now := time.Now
	if c.Now != nil {
		now = c.Now
	}
	Sign(req, body, c.Key, to, now())
	var hc Doer = http.DefaultClient
	if c.HTTP != nil {
		hc = c.HTTP
	}
	resp, err := hc.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxStateBytes+1))
	if err != nil {
		return nil, fmt.Errorf("reading the agent's answer: %w", err)
	}
	if len(data) > maxStateBytes {
		return nil, fmt.Errorf("the agent's answer exceeds %d bytes", maxStateBytes)
	}
	if resp.StatusCode == http.StatusOK {
		// encoding/json, not encoding/json/v2: in Go 1.27 v1 runs on v2's decoder, and decoding
		// a State costs the same with either (BenchmarkStateDecode), so nothing is gained by
		// v2's stricter defaults (duplicate names, invalid UTF-8 refused) or its different
		// errors. Unknown fields are ignored: a newer agent may add some.
		var st State
		if err := json.Unmarshal(data, &st); err != nil {
			return nil, fmt.Errorf("decoding the agent's state: %w", err)
		}
		return &st, nil
	}
	var p Problem
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt == "application/problem+json" || mt == "application/json" {
		_ = json.Unmarshal(data, &p)
	}
	if p.State != nil && (resp.StatusCode == http.StatusConflict ||
		(resp.StatusCode == http.StatusForbidden && p.Reason == ReasonWrongInstance)) {
		return nil, &StaleError{State: *p.State, Detail: p.Detail}
	}
	if p.Title == "" && p.Detail == "" {
		p.Detail = strings.TrimSpace(string(truncateBytes(data, 512)))
	}
	return nil, &StatusError{StatusCode: resp.StatusCode, Problem: p}
}

func truncateBytes(b []byte, n int) []byte {
	if len(b) > n {
		return b[:n]
	}
	return b
}

// IsStale reports whether err is (or wraps) a *StaleError, and returns it.
func IsStale(err error) (*StaleError, bool) {
	var se *StaleError
	ok := errors.As(err, &se)
	return se, ok
}
