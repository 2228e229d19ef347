package e2e

import (
	"context"
	"io"
	"net"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// stubborn is a partner that finishes every call it started, whether or not its caller is
// still there, taking work each time: what a real downstream does with a call its client gave
// up on.
type stubborn struct {
	URL            string
	work           time.Duration
	inFlight, peak atomic.Int64
	calls          atomic.Int64
}

func startStubborn(t *testing.T, work time.Duration) *stubborn {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &stubborn{URL: "http://" + ln.Addr().String(), work: work}
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return s
}

func (s *stubborn) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.calls.Add(1)
	storeMax(&s.peak, s.inFlight.Add(1))
	time.Sleep(s.work) // not cut short when the caller leaves
	s.inFlight.Add(-1)
	_, _ = io.WriteString(w, "done")
}

// runAbandoned drives 4 agents × 10 permits with more callers than permits against a partner
// whose calls take 1.8 s, with a request timeout of 1 s: every call is abandoned at its timeout
// while the partner keeps working on it. It returns the partner's peak concurrency.
func runAbandoned(t *testing.T, hold *assignment.Duration) (peak int64, calls int64) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	const agents, permits = 4, 10
	p := startStubborn(t, 1800*time.Millisecond)
	d := assignment.Downstream{
		Name: "partner", Upstream: p.URL, Permits: permits, SafeDefaultPermits: permits,
		AcquireTimeout: assignment.Duration(50 * time.Millisecond), RequestTimeout: assignment.Duration(time.Second),
		Fallback: assignment.Fallback{Action: assignment.ActionReject}, AbandonedHold: hold,
	}
	ags := bootAgents(t, ctx, agents, assignment.Assignment{Downstreams: []assignment.Downstream{d}})
	lctx, stop := context.WithTimeout(ctx, 6*time.Second)
	defer stop()
	load := closedLoad(lctx, ags, "partner", permits+4)
	load.Wait()
	return p.peak.Load(), p.calls.Load()
}

// TestAbandonedCallsKeepTheirPermits: with the default hold (the request timeout), a call
// abandoned at its timeout keeps its permit until the partner can no longer be working on it,
// and the partner's concurrency stays within Σ permits; without the hold (the control) the
// permits are handed on while the partner still works on the abandoned calls, and it exceeds
// Σ permits.
func TestAbandonedCallsKeepTheirPermits(t *testing.T) {
	const sum = 40
	peak, calls := runAbandoned(t, nil)
	t.Logf("with abandonedHold = requestTimeout (1s): the partner's peak %d in flight for Σ permits %d (%d calls)", peak, sum, calls)
	zero := assignment.Duration(0)
	cpeak, ccalls := runAbandoned(t, &zero)
	t.Logf("with abandonedHold 0: the partner's peak %d in flight for Σ permits %d (%d calls)", cpeak, sum, ccalls)
	if peak > sum {
		t.Errorf("with the hold the partner saw %d in flight, above Σ permits %d", peak, sum)
	}
	if cpeak <= sum {
		t.Errorf("without the hold the partner saw only %d in flight: the control does not show the abandoned calls", cpeak)
	}
}
