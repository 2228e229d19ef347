package harness

import (
	"context"
	"errors"
	"time"
)

// sleepOrDone waits d, or less if ctx ends first (its error).
func sleepOrDone(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// poll calls check every period until it returns nil (done), ctx ends, or timeout passes. What
// check returns says why it is not done yet — the error poll returns once timeout passed — or,
// wrapped by fatal, why it never will be: poll returns that at once.
func poll(ctx context.Context, timeout, period time.Duration, check func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := check()
		var f fatalError
		switch {
		case err == nil:
			return nil
		case errors.As(err, &f):
			return f.error
		case time.Now().After(deadline):
			return err
		}
		if err := sleepOrDone(ctx, period); err != nil {
			return err
		}
	}
}

type fatalError struct{ error }

// fatal tells poll to stop waiting: err will not go away.
func fatal(err error) error { return fatalError{err} }
