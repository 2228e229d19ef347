package push

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// SigningClient is an AgentClient that signs every request with the schedule's signing key (see
// KeyRing.Schedule) and, when an agent answers 403 unknown-key (it has not picked up that key,
// e.g. its kubelet refreshed the trust volume late), tries the other published keys, newest
// first. Such an answer means the request was not accepted, so trying again is safe. The
// schedule can be swapped at run time with SetSchedule.
type SigningClient struct {
	// HTTP sends the requests (*http.Client, or the lean h1.HTTPClient the manager uses); nil
	// means http.DefaultClient. The engine bounds each request with Options.PushTimeout
	// through its context's deadline.
	HTTP assignment.Doer
	// Now is the clock for signatures; nil means time.Now.
	Now func() time.Time

	sched atomic.Pointer[Schedule]
}

// NewSigningClient returns a SigningClient with schedule s.
func NewSigningClient(hc assignment.Doer, s Schedule) *SigningClient {
	c := &SigningClient{HTTP: hc}
	c.SetSchedule(s)
	return c
}

// BoundsByDeadline implements DeadlineBounded: it ends a request at its context's deadline by
// itself when its HTTP client does (h1.HTTPClient: the deadline is its connection's). Trying
// the other keys after an unknown-key answer stays within the same deadline.
func (c *SigningClient) BoundsByDeadline() bool {
	d, ok := c.HTTP.(DeadlineBounded)
	return ok && d.BoundsByDeadline()
}

// SetSchedule replaces the keys.
func (c *SigningClient) SetSchedule(s Schedule) { c.sched.Store(&s) }

// SigningKeyID is the id of the key that signs now ("" when none).
func (c *SigningClient) SigningKeyID() string {
	if s := c.sched.Load(); s != nil {
		return s.Signing.ID
	}
	return ""
}

// Push implements AgentClient.
func (c *SigningClient) Push(ctx context.Context, to assignment.Endpoint, a *assignment.Assignment) (*assignment.State, error) {
	return c.try(func(cl *assignment.Client) (*assignment.State, error) { return cl.Push(ctx, to, a) })
}

// PushEncoded implements EncodedPusher.
func (c *SigningClient) PushEncoded(ctx context.Context, to assignment.Endpoint, a *assignment.Assignment, body []byte) (*assignment.State, error) {
	return c.try(func(cl *assignment.Client) (*assignment.State, error) { return cl.PushEncoded(ctx, to, a, body) })
}

// State implements AgentClient.
func (c *SigningClient) State(ctx context.Context, to assignment.Endpoint, epoch int64) (*assignment.State, error) {
	return c.try(func(cl *assignment.Client) (*assignment.State, error) { return cl.State(ctx, to, epoch) })
}

func (c *SigningClient) try(call func(*assignment.Client) (*assignment.State, error)) (*assignment.State, error) {
	s := c.sched.Load()
	if s == nil || s.Signing.Private == nil {
		return nil, errors.New("push: no signing key")
	}
	keys := []assignment.SigningKey{s.Signing}
	for i := len(s.Published) - 1; i >= 0; i-- {
		if s.Published[i].ID != s.Signing.ID {
			keys = append(keys, s.Published[i])
		}
	}
	var err error
	for _, k := range keys {
		var st *assignment.State
		st, err = call(&assignment.Client{HTTP: c.HTTP, Key: k, Now: c.Now})
		var se *assignment.StatusError
		if !errors.As(err, &se) || se.StatusCode != http.StatusForbidden || se.Problem.Reason != assignment.ReasonUnknownKey {
			return st, err
		}
	}
	return nil, err
}
