package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// queueing is a downstream that serves capacity calls at base latency and queues beyond: a call
// takes base × max(1, in flight / capacity).
type queueing struct {
	URL        string
	base       time.Duration
	capacity   atomic.Int64
	inFlight   atomic.Int64
	calls, sum atomic.Int64 // finished calls and their summed latency (ns), for the sampler
}

func startQueueing(t *testing.T, capacity int64, base time.Duration) *queueing {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	q := &queueing{URL: "http://" + ln.Addr().String(), base: base}
	q.capacity.Store(capacity)
	srv := &http.Server{Handler: q, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return q
}

func (q *queueing) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := q.inFlight.Add(1)
	lat := q.base * time.Duration(max(n, q.capacity.Load())) / time.Duration(q.capacity.Load())
	time.Sleep(lat)
	q.inFlight.Add(-1)
	q.calls.Add(1)
	q.sum.Add(int64(lat))
	_, _ = io.WriteString(w, "ok")
}

// TestAdaptiveConcurrency: one agent with adaptive concurrency (no ramp) in front of a
// downstream whose capacity drops from 40 to 8 calls and comes back; the effective limit follows
// the latency down toward what the downstream takes and back up to the permits. It logs the
// effective limit against the latency over time.
func TestAdaptiveConcurrency(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	const permits = 40
	q := startQueueing(t, permits, 20*time.Millisecond)
	d := assignment.Downstream{
		Name: "adaptive", Upstream: q.URL, Permits: permits, SafeDefaultPermits: permits,
		AcquireTimeout: assignment.Duration(20 * time.Millisecond), RequestTimeout: assignment.Duration(5 * time.Second),
		Fallback: assignment.Fallback{Action: assignment.ActionReject},
		Recovery: &assignment.Recovery{Window: assignment.Duration(250 * time.Millisecond),
			Adaptive: &assignment.Adaptive{TolerancePercent: 150, BaselineWindows: 60, MinLimit: 1}},
	}
	ags := bootAgents(t, ctx, 1, assignment.Assignment{Downstreams: []assignment.Downstream{d}})
	lctx, stop := context.WithCancel(ctx)
	load := closedLoad(lctx, ags, "adaptive", permits+10)
	defer func() { stop(); load.Wait() }()

	type sample struct {
		at            time.Duration
		capacity      int64
		limit         int32
		latency       time.Duration
		inFlight      int64
		phaseDegraded bool
	}
	var samples []sample
	start := time.Now()
	var lastCalls, lastSum int64
	sampleNow := func(degraded bool) {
		st, err := agentState(ctx, ags[0])
		if err != nil || len(st.Downstreams) != 1 {
			t.Fatalf("state: %v", err)
		}
		c, s := q.calls.Load(), q.sum.Load()
		var lat time.Duration
		if c > lastCalls {
			lat = time.Duration((s - lastSum) / (c - lastCalls))
		}
		lastCalls, lastSum = c, s
		samples = append(samples, sample{time.Since(start), q.capacity.Load(), st.Downstreams[0].EffectivePermits, lat, q.inFlight.Load(), degraded})
	}
	phase := func(capacity int64, d time.Duration, degraded bool) {
		q.capacity.Store(capacity)
		for end := time.Now().Add(d); time.Now().Before(end); {
			_ = sleep(ctx, 500*time.Millisecond)
			sampleNow(degraded)
		}
	}
	phase(permits, 5*time.Second, false)
	phase(8, 8*time.Second, true)
	phase(permits, 10*time.Second, false)

	var b strings.Builder
	fmt.Fprintf(&b, "%8s %9s %16s %13s %10s\n", "t", "capacity", "effective limit", "mean latency", "in flight")
	for _, s := range samples {
		fmt.Fprintf(&b, "%8s %9d %16d %13s %10d\n", s.at.Round(100*time.Millisecond), s.capacity, s.limit, s.latency.Round(100*time.Microsecond), s.inFlight)
	}
	t.Logf("adaptive concurrency, permits %d, downstream 20 ms up to its capacity:\n%s", permits, b.String())

	// During the degraded phase the limit fell well below the permits, and the latency came down
	// from its first degraded sample; after it, the limit went back to the permits.
	var minDegraded int32 = permits
	var firstDeg, lastDeg time.Duration
	for _, s := range samples {
		if s.phaseDegraded {
			minDegraded = min(minDegraded, s.limit)
			if firstDeg == 0 {
				firstDeg = s.latency
			}
			lastDeg = s.latency
		}
	}
	if minDegraded > permits/2 {
		t.Errorf("while the capacity was 8, the effective limit stayed at %d or above: it did not follow the latency", minDegraded)
	}
	if lastDeg >= firstDeg {
		t.Errorf("latency %v at the end of the degraded phase, %v at its start: the shrinking limit did not bring it down", lastDeg, firstDeg)
	}
	if last := samples[len(samples)-1]; last.limit != permits {
		t.Errorf("after the capacity came back, the effective limit is %d, want the permits %d", last.limit, permits)
	}
}
