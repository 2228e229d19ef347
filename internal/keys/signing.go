package keys

import (
	"context"
	"errors"
	"net/http"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"

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
	// Clock dates signatures; nil means the real clock.
	Clock clock.PassiveClock

	sched atomic.Pointer[Schedule]
	// requests signed, and the signatures that took (fewer: SignTogether)
	signed, signatures atomic.Int64
}

// NewSigningClient returns a SigningClient with schedule s.
func NewSigningClient(hc assignment.Doer, s Schedule) *SigningClient {
	c := &SigningClient{HTTP: hc}
	c.SetSchedule(s)
	return c
}

// BoundsByDeadline implements push.DeadlineBounded: it ends a request at its context's deadline by
// itself when its HTTP client does (h1.HTTPClient: the deadline is its connection's). Trying
// the other keys after an unknown-key answer stays within the same deadline.
func (c *SigningClient) BoundsByDeadline() bool {
	d, ok := c.HTTP.(interface{ BoundsByDeadline() bool }) // push.DeadlineBounded, not imported: push uses keys
	return ok && d.BoundsByDeadline()
}

// SignStats returns how many requests were signed and with how many Ed25519 signatures (fewer
// when pushes are signed together).
func (c *SigningClient) SignStats() (requests, signatures int64) {
	return c.signed.Load(), c.signatures.Load()
}

// now is the time signatures carry.
func (c *SigningClient) now() time.Time {
	if c.Clock != nil {
		return c.Clock.Now()
	}
	return time.Now()
}

// SignTogether implements BatchSigner: it signs the pushes with the schedule's signing key, one
// signature for up to assignment.MaxBatch of them. Without a signing key it signs nothing (Send
// then fails as every request does).
func (c *SigningClient) SignTogether(outs []*assignment.Outgoing) {
	s := c.sched.Load()
	if s == nil || s.Signing.Private == nil || len(outs) == 0 {
		return
	}
	assignment.SignTogether(outs, s.Signing, c.now())
	c.signed.Add(int64(len(outs)))
	c.signatures.Add(int64((len(outs) + assignment.MaxBatch - 1) / assignment.MaxBatch))
}

// Send implements BatchSigner: it sends a push signed by SignTogether and, when the agent does
// not know the key (403 unknown-key), the same push signed alone with each other published key,
// as for every request.
func (c *SigningClient) Send(ctx context.Context, o *assignment.Outgoing) (*assignment.State, error) {
	resend := func(cl *assignment.Client) (*assignment.State, error) { return cl.Send(ctx, o.Unsigned()) }
	if !o.Signed() {
		return c.try(resend, "")
	}
	st, err := (&assignment.Client{HTTP: c.HTTP}).Send(ctx, o)
	if !unknownKey(err) {
		return st, err
	}
	if st, err2 := c.try(resend, o.KeyID()); err2 != nil || st != nil {
		return st, err2
	}
	return nil, err
}

func unknownKey(err error) bool {
	var se *assignment.StatusError
	return errors.As(err, &se) && se.StatusCode == http.StatusForbidden && se.Problem.Reason == assignment.ReasonUnknownKey
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
	return c.try(func(cl *assignment.Client) (*assignment.State, error) { return cl.Push(ctx, to, a) }, "")
}

// PushEncoded implements EncodedPusher.
func (c *SigningClient) PushEncoded(ctx context.Context, to assignment.Endpoint, a *assignment.Assignment, body []byte) (*assignment.State, error) {
	return c.try(func(cl *assignment.Client) (*assignment.State, error) { return cl.PushEncoded(ctx, to, a, body) }, "")
}

// State implements AgentClient.
func (c *SigningClient) State(ctx context.Context, to assignment.Endpoint, epoch int64) (*assignment.State, error) {
	return c.try(func(cl *assignment.Client) (*assignment.State, error) { return cl.State(ctx, to, epoch) }, "")
}

// try makes the call signed with the signing key, then, while the agent answers unknown-key, with
// each other published key, newest first, skipping the key id skip (one tried already). With no
// key left to try it returns (nil, nil).
func (c *SigningClient) try(call func(*assignment.Client) (*assignment.State, error), skip string) (*assignment.State, error) {
	s := c.sched.Load()
	if s == nil || s.Signing.Private == nil {
		return nil, errors.New("push: no signing key")
	}
	var keys []assignment.SigningKey
	if s.Signing.ID != skip {
		keys = append(keys, s.Signing)
	}
	for i := len(s.Published) - 1; i >= 0; i-- {
		if id := s.Published[i].ID; id != s.Signing.ID && id != skip {
			keys = append(keys, s.Published[i])
		}
	}
	var err error
	for _, k := range keys {
		var st *assignment.State
		c.signed.Add(1)
		c.signatures.Add(1)
		st, err = call(&assignment.Client{HTTP: c.HTTP, Key: k, Clock: c.Clock})
		if !unknownKey(err) {
			return st, err
		}
	}
	return nil, err
}
