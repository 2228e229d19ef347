package main

import (
	"context"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/hack/demo/report"
)

// latency is the partner's latency model, calibrated from the story's figures.
//
// Normal: the story's 1,900 calls/s fit through 50 slots only if the mean latency is near
// 20 ms, while its P99 is 220 ms — a heavy tail. A log-normal distribution has exactly two
// parameters, so those two figures fix it: mean = m·e^(σ²/2) and P99 = m·e^(z·σ) with
// z = 2.326, hence z·σ − σ²/2 = ln(P99/mean); the smaller root is σ ≈ 1.54, median m ≈ 6 ms.
//
// Slow: the partner's tail grows to a P99 of 1.8 s: a small share of calls hang for seconds
// (a lock, a GC pause, a slow shard) while the rest keep their normal latency. SlowShare of
// the calls take a time drawn evenly from [SlowMin, SlowMax]; with 1.25 % in 1.7–2.3 s, the
// 99th percentile lands near 1.8 s.
//
// Every duration is multiplied by Scale: a machine that sends fewer calls per second than the
// story's 1,900 slows the partner by the same factor, so that rate × latency — the calls in
// flight, what the limit is about — keeps the story's values.
type latency struct {
	Mean, P99          time.Duration
	SlowShare          float64
	SlowMin, SlowMax   time.Duration
	Scale              float64
	median             float64 // seconds, scaled
	sigma              float64
	slowMinS, slowMaxS float64
}

// z99 is the standard normal distribution's 99th percentile.
const z99 = 2.3263478740408408

func newLatency(mean, p99 time.Duration, slowShare float64, slowMin, slowMax time.Duration, scale float64) latency {
	l := latency{Mean: mean, P99: p99, SlowShare: slowShare, SlowMin: slowMin, SlowMax: slowMax, Scale: scale}
	// z·σ − σ²/2 = ln(P99/mean); needs P99/mean ≤ e^(z²/2) ≈ 15 (else no log-normal fits).
	k := math.Log(float64(p99) / float64(mean))
	l.sigma = z99 - math.Sqrt(max(z99*z99-2*k, 0))
	l.median = mean.Seconds() * scale / math.Exp(l.sigma*l.sigma/2)
	l.slowMinS, l.slowMaxS = slowMin.Seconds()*scale, slowMax.Seconds()*scale
	return l
}

// draw returns one call's latency.
func (l latency) draw(rng *rand.Rand, slow bool) time.Duration {
	if slow && rng.Float64() < l.SlowShare {
		return time.Duration((l.slowMinS + rng.Float64()*(l.slowMaxS-l.slowMinS)) * float64(time.Second))
	}
	return time.Duration(l.median * math.Exp(l.sigma*rng.NormFloat64()) * float64(time.Second))
}

// partner is the downstream: it admits at most limit calls in flight and answers 429 at once
// to every call beyond, holds each admitted call for a latency drawn from the model, and
// records each admitted call, each 429 and its peak concurrency.
type partner struct {
	limit int64
	lat   latency
	URL   string
	srv   *http.Server
	start time.Time

	slow     atomic.Bool
	inFlight atomic.Int64
	peak     atomic.Int64 // since the last takePeak

	mu      sync.Mutex
	rng     *rand.Rand
	calls   []report.PartnerCall
	refused []time.Duration // when each 429 was answered
}

func startPartner(limit int64, lat latency, seed uint64) (*partner, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &partner{limit: limit, lat: lat, URL: "http://" + ln.Addr().String(), rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), start: time.Now()}
	p.srv = &http.Server{Handler: p, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = p.srv.Serve(ln) }()
	return p, nil
}

// begin starts the recording: admitted calls are timed from now.
func (p *partner) begin(start time.Time) {
	p.mu.Lock()
	p.start, p.calls, p.refused = start, nil, nil
	p.mu.Unlock()
	p.peak.Store(p.inFlight.Load())
}

func (p *partner) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("X-Demo-Partner", "1")
	n := p.inFlight.Add(1)
	defer p.inFlight.Add(-1)
	if n > p.limit {
		p.mu.Lock()
		p.refused = append(p.refused, time.Since(p.start))
		p.mu.Unlock()
		w.Header().Set("Retry-After", "1")
		http.Error(w, "too many concurrent calls", http.StatusTooManyRequests)
		return
	}
	for {
		cur := p.peak.Load()
		if n <= cur || p.peak.CompareAndSwap(cur, n) {
			break
		}
	}
	p.mu.Lock()
	d := p.lat.draw(p.rng, p.slow.Load())
	at := time.Since(p.start)
	p.mu.Unlock()
	t := time.NewTimer(d)
	select {
	case <-t.C:
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"ok":true}` + "\n"))
	case <-r.Context().Done(): // the caller gave up
	}
	t.Stop()
	// What the slot was held for, measured: the drawn latency plus whatever this machine added
	// (a busy machine wakes the handler late), which is what the limit sees.
	held := time.Since(p.start) - at
	p.mu.Lock()
	p.calls = append(p.calls, report.PartnerCall{At: at, Latency: held})
	p.mu.Unlock()
}

// takePeak returns the highest in-flight count since the previous call and starts a new span
// at the current count.
func (p *partner) takePeak() int { return int(p.peak.Swap(p.inFlight.Load())) }

// recorded returns the admitted calls and the times of the 429s since begin.
func (p *partner) recorded() ([]report.PartnerCall, []time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]report.PartnerCall(nil), p.calls...), append([]time.Duration(nil), p.refused...)
}

func (p *partner) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = p.srv.Shutdown(ctx)
}
