package push

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// SigningClient is an AgentClient that signs with the current key of a KeySet (the id that sorts
// last) and, when an agent answers 401 or 403 (it has not loaded that key yet, typically right
// after a rotation), tries the other keys, newest first. Such an answer means the request was
// not accepted, so trying again is safe. The keys can be swapped at run time with SetKeys.
type SigningClient struct {
	// HTTP sends the requests; nil means http.DefaultClient. The engine bounds each request
	// with Options.PushTimeout through its context.
	HTTP *http.Client
	// Now is the clock for signatures; nil means time.Now.
	Now func() time.Time

	keys atomic.Pointer[assignment.KeySet]
}

// NewSigningClient returns a SigningClient with keys.
func NewSigningClient(hc *http.Client, keys assignment.KeySet) *SigningClient {
	c := &SigningClient{HTTP: hc}
	c.SetKeys(keys)
	return c
}

// SetKeys replaces the keys.
func (c *SigningClient) SetKeys(keys assignment.KeySet) { c.keys.Store(&keys) }

// Push implements AgentClient.
func (c *SigningClient) Push(ctx context.Context, baseURL string, a *assignment.Assignment) (*assignment.State, error) {
	return c.try(func(cl *assignment.Client) (*assignment.State, error) { return cl.Push(ctx, baseURL, a) })
}

// State implements AgentClient.
func (c *SigningClient) State(ctx context.Context, baseURL string) (*assignment.State, error) {
	return c.try(func(cl *assignment.Client) (*assignment.State, error) { return cl.State(ctx, baseURL) })
}

func (c *SigningClient) try(call func(*assignment.Client) (*assignment.State, error)) (*assignment.State, error) {
	ks := c.keys.Load()
	if ks == nil || ks.Len() == 0 {
		return nil, errors.New("push: no signing key")
	}
	ids := ks.IDs()
	slices.Reverse(ids)
	var err error
	for _, id := range ids {
		k, _ := ks.Key(id)
		var st *assignment.State
		st, err = call(&assignment.Client{HTTP: c.HTTP, Key: k, Now: c.Now})
		var se *assignment.StatusError
		if !errors.As(err, &se) || (se.StatusCode != http.StatusUnauthorized && se.StatusCode != http.StatusForbidden) {
			return st, err
		}
	}
	return nil, err
}
