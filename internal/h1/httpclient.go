package h1

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"time"
)

// HTTPClient sends requests the way http.Client.Do does — addressed by their URL, bounded by
// their context — over C's pooled connections, for a caller written against http.Client (the
// manager's control-API client: thousands of agents, each with one kept-alive connection and
// a request every few seconds, where http.Transport's two goroutines per connection were most
// of the manager's CPU and memory).
//
// What differs from http.Client, and what stays:
//
//   - The exchange is bounded by the context's deadline, as the connection's deadline (no
//     timer per call). A context without a deadline is not watched: cancelling it does not end
//     a call already sent. A context already done is not sent at all (its error is returned),
//     nor one past its deadline (context.DeadlineExceeded), whether a timer ended it or not.
//   - A body of known length of at most MaxInlineBody is read from req.Body before anything is
//     sent, then written with the head in one write, on the caller's goroutine (no body-writer
//     goroutine, one system call). It must therefore not block, as a body in memory does not
//     (http.NewRequest's of a bytes.Reader, bytes.Buffer or strings.Reader); one that does
//     blocks the call. A body shorter than its ContentLength fails the call before anything
//     is sent. Other bodies are written as by Client.Do.
//   - No redirects, cookies, proxies or retries: the answer is the upstream's, whatever its
//     status, and nothing is ever re-sent (Client.Do). Only plain http (CanSend); the Host
//     sent is the URL's.
//   - req.Body is closed, as http.Client closes it, once read (an inline body) or when the
//     call fails before sending; otherwise as Client.Do says.
//   - The answer's body must be read to its end and closed for the connection to be pooled.
type HTTPClient struct {
	C *Client
}

// BoundsByDeadline reports that Do ends a call at its context's deadline by itself (the
// connection's deadline), without watching the context's Done: a caller may pass a context
// whose deadline no timer enforces (the manager's push engine: push.DeadlineBounded).
func (HTTPClient) BoundsByDeadline() bool { return true }

// Do sends req and returns the answer (see HTTPClient).
func (c HTTPClient) Do(req *http.Request) (*http.Response, error) {
	fail := func(err error) (*http.Response, error) {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, err
	}
	if req.URL == nil || req.URL.Scheme != "http" || !CanSend(req, req.URL) {
		return fail(fmt.Errorf("h1: cannot send %s %v: plain http only, without Upgrade or Expect", req.Method, req.URL))
	}
	ctx := req.Context()
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	deadline, _ := ctx.Deadline() // zero: none
	if !deadline.IsZero() && !time.Now().Before(deadline) {
		// Past its deadline, even if no timer ended the context (BoundsByDeadline).
		return fail(context.DeadlineExceeded)
	}
	t := Target{Host: req.URL.Host, Path: req.URL.EscapedPath(), RawQuery: req.URL.RawQuery}
	if n := req.ContentLength; n > 0 && n <= MaxInlineBody && req.Body != nil && req.Body != http.NoBody {
		buf := copyBuffers.Get().(*[BufferSize]byte)
		defer copyBuffers.Put(buf)
		body := buf[:n]
		if _, err := io.ReadFull(req.Body, body); err != nil {
			return fail(fmt.Errorf("h1: reading the request body of ContentLength %d: %w", n, err))
		}
		_ = req.Body.Close()
		// The body is written before do returns: the buffer is free again then.
		return c.C.do(req, t, deadline, body)
	}
	return c.C.do(req, t, deadline, nil)
}
