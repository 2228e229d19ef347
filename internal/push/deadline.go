package push

import (
	"context"
	"time"
)

// DeadlineBounded is implemented by an AgentClient that may end every request at its context's
// deadline by itself, without watching the context's Done: keys.SigningClient over h1.HTTPClient,
// which makes the deadline its connection's. When BoundsByDeadline reports true the engine
// bounds a request with a context that carries the PushTimeout deadline and no timer
// (deadlineOnly), sparing a timer and a registration with the engine's context per push —
// the request still ends at the same deadline, by the client's own doing. Any other client
// gets context.WithTimeout's context, whose Done closes at the deadline.
type DeadlineBounded interface {
	BoundsByDeadline() bool
}

// deadlineOnly is a context with a deadline that no timer enforces: Done, Err and Value are
// its parent's, so it is cancelled with the parent (the engine stopping) but not at its
// deadline. Only for a DeadlineBounded client, which ends the request at the deadline itself.
type deadlineOnly struct {
	context.Context
	deadline time.Time
}

// Deadline is the earlier of the parent's deadline and its own.
func (c *deadlineOnly) Deadline() (time.Time, bool) {
	if d, ok := c.Context.Deadline(); ok && d.Before(c.deadline) {
		return d, true
	}
	return c.deadline, true
}

// socketDeadline is when a request to an agent started now must end: timeout later on the real
// clock. It is the one place the engine reads real time for a decision's sake, and the only one
// that should: the deadline is enforced by the network stack and the runtime's timers (a
// connection's SetDeadline, context.WithDeadline), which run on real time whatever clock drives
// the engine. A deadline taken from a fake clock would end a request at once or never. What the
// engine decides — leases, renewals, retries, which request goes next — reads Options.Clock
// (the work's sentAt), never this deadline.
func socketDeadline(timeout time.Duration) time.Time { return time.Now().Add(timeout) }

// requestContext returns the context that ends one request to c at deadline: a deadlineOnly
// for a DeadlineBounded client that says it bounds by deadline, context.WithDeadline's otherwise.
func requestContext(ctx context.Context, c AgentClient, deadline time.Time) (context.Context, context.CancelFunc) {
	if d, ok := c.(DeadlineBounded); ok && d.BoundsByDeadline() {
		return &deadlineOnly{Context: ctx, deadline: deadline}, func() {}
	}
	return context.WithDeadline(ctx, deadline)
}
