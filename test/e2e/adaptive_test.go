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
		samples = append(samples, sample{time.Since(start), q.capacity.Load(), st.Downstreams[0].Limit, lat, q.inFlight.Load(), degraded})
	}
	// phase sets the capacity and samples for at least d, then until done says so (at most 60 s
	// more: a busy machine may take longer to show what the load does).
	phase := func(capacity int64, d time.Duration, degraded bool, done func() bool) {
		q.capacity.Store(capacity)
		end, limit := time.Now().Add(d), time.Now().Add(d+60*time.Second)
		for time.Now().Before(end) || (!done() && time.Now().Before(limit)) {
			_ = sleep(ctx, 500*time.Millisecond)
			sampleNow(degraded)
		}
	}
	lastLimit := func() int32 { return samples[len(samples)-1].limit }
	phase(permits, 5*time.Second, false, func() bool { return true })
	phase(8, 8*time.Second, true, func() bool { return lastLimit() <= permits/2 })
	phase(permits, 5*time.Second, false, func() bool { return lastLimit() == permits })

	var b strings.Builder
	fmt.Fprintf(&b, "%8s %9s %16s %13s %10s\n", "t", "capacity", "effective limit", "mean latency", "in flight")
	for _, s := range samples {
		fmt.Fprintf(&b, "%8s %9d %16d %13s %10d\n", s.at.Round(100*time.Millisecond), s.capacity, s.limit, s.latency.Round(100*time.Microsecond), s.inFlight)
	}
	t.Logf("adaptive concurrency, permits %d, downstream 20 ms up to its capacity:\n%s", permits, b.String())

	// During the degraded phase the limit fell well below the permits; after it, the limit went
	// back to the permits. (The latencies are the figure; they are not asserted: on a busy
	// machine scheduling delays add to them.)
	var minDegraded int32 = permits
	for _, s := range samples {
		if s.phaseDegraded {
			minDegraded = min(minDegraded, s.limit)
		}
	}
	if minDegraded > permits/2 {
		t.Errorf("while the capacity was 8, the effective limit stayed at %d or above: it did not follow the latency", minDegraded)
	}
	if last := lastLimit(); last != permits {
		t.Errorf("after the capacity came back, the effective limit is %d, want the permits %d", last, permits)
	}
}
