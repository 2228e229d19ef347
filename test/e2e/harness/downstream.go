package harness

import (
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Downstream is the test partner API: it admits at most Limit calls in flight, answers 429 to
// every call beyond (counting them), holds each admitted call for Latency and records its peak
// concurrency.
type Downstream struct {
	Limit int64
	URL   string

	latency  atomic.Int64 // ns
	inFlight atomic.Int64
	peak     atomic.Int64
	winPeak  atomic.Int64 // peak since the last ResetWindow
	total    atomic.Int64
	ok       atomic.Int64
	tooMany  atomic.Int64
	// Calls that came over HTTP/2, and gRPC calls among them (grpc.go).
	h2Calls, grpcCalls atomic.Int64
	srv                *http.Server
	ln                 net.Listener

	// limitNow, when > 0, replaces Limit (SetLimit). failPermille of the admitted calls are
	// answered 500 at once, slowPermille are held slowLatency instead of the latency (SetFaults);
	// failed counts the 500s.
	limitNow     atomic.Int64
	failPermille atomic.Int64
	slowPermille atomic.Int64
	slowLatency  atomic.Int64
	failed       atomic.Int64
	seq          atomic.Uint64

	mu       sync.Mutex
	first429 []time.Time
}

// First429s returns the times of the first (up to 20) 429 answers.
func (d *Downstream) First429s() []time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]time.Time(nil), d.first429...)
}

// DownstreamStats is a snapshot of the downstream's counters.
type DownstreamStats struct {
	Limit       int64
	InFlight    int64
	Peak        int64
	WindowPeak  int64
	Total       int64
	OK          int64
	TooMany429  int64
	LatencyNano int64
	// HTTP2 calls came over HTTP/2, GRPC of them were gRPC calls.
	HTTP2, GRPC int64
}

// StartDownstream listens on 127.0.0.1 (a free port), for HTTP/1.1 and HTTP/2 with prior
// knowledge (h2c) alike.
func StartDownstream(limit int64, latency time.Duration) (*Downstream, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	d := &Downstream{Limit: limit, ln: ln, URL: "http://" + ln.Addr().String()}
	d.latency.Store(int64(latency))
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	d.srv = &http.Server{Handler: d, ReadHeaderTimeout: 5 * time.Second, Protocols: &p}
	go func() { _ = d.srv.Serve(ln) }()
	return d, nil
}

// StartDownstreamTLS is StartDownstream served over TLS with cert (for 127.0.0.1): the partner
// reached at an https upstream.
func StartDownstreamTLS(limit int64, latency time.Duration, cert tls.Certificate) (*Downstream, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	d := &Downstream{Limit: limit, ln: ln, URL: "https://" + ln.Addr().String()}
	d.latency.Store(int64(latency))
	d.srv = &http.Server{Handler: d, ReadHeaderTimeout: 5 * time.Second,
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}},
		ErrorLog:  log.New(io.Discard, "", 0)}
	go func() { _ = d.srv.ServeTLS(ln, "", "") }()
	return d, nil
}

// SetLatency changes how long calls are held (a partner slowing down).
func (d *Downstream) SetLatency(l time.Duration) { d.latency.Store(int64(l)) }

// SetLimit changes the calls the partner admits at once (the partner's own limit changed, or a
// lowered quota is judged by its new limit once the calls admitted under the old one drained).
func (d *Downstream) SetLimit(n int64) { d.limitNow.Store(n) }

// CurrentLimit is the limit in force: SetLimit's, else Limit.
func (d *Downstream) CurrentLimit() int64 {
	if n := d.limitNow.Load(); n > 0 {
		return n
	}
	return d.Limit
}

// SetFaults makes the partner misbehave: failPermille of the admitted calls (per mille, spread
// evenly) are answered 500 at once, and slowPermille are held slow instead of the latency — its
// tail (slowPermille ≥ 10 at 8 × the latency is a P99 eight times the median). Zeros end it.
func (d *Downstream) SetFaults(failPermille, slowPermille int64, slow time.Duration) {
	d.failPermille.Store(failPermille)
	d.slowPermille.Store(slowPermille)
	d.slowLatency.Store(int64(slow))
}

// Failed counts the calls answered 500 by SetFaults.
func (d *Downstream) Failed() int64 { return d.failed.Load() }

// ServeHTTP implements the partner.
func (d *Downstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor == 2 {
		d.h2Calls.Add(1)
	}
	if isGRPC(r) {
		d.serveGRPC(w, r)
		return
	}
	d.total.Add(1)
	n := d.inFlight.Add(1)
	defer d.inFlight.Add(-1)
	if n > d.CurrentLimit() {
		d.refused()
		w.Header().Set("Retry-After", "1")
		http.Error(w, fmt.Sprintf("too many concurrent calls (%d > %d)", n, d.CurrentLimit()), http.StatusTooManyRequests)
		return
	}
	storeMax(&d.peak, n)
	storeMax(&d.winPeak, n)
	latency := time.Duration(d.latency.Load())
	// Faults, spread evenly over the calls by a counter (no randomness: a run repeats).
	if fp, sp := d.failPermille.Load(), d.slowPermille.Load(); fp > 0 || sp > 0 {
		k := int64(d.seq.Add(1) % 1000)
		switch {
		case (k*7919)%1000 < fp:
			d.failed.Add(1)
			http.Error(w, "partner failure", http.StatusInternalServerError)
			return
		case (k*104729+500)%1000 < sp:
			latency = time.Duration(d.slowLatency.Load())
		}
	}
	t := time.NewTimer(latency)
	defer t.Stop()
	select {
	case <-t.C:
	case <-r.Context().Done():
		return
	}
	d.ok.Add(1)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write([]byte(`{"ok":true}` + "\n"))
}

// refused counts a call beyond the limit (answered 429, or RESOURCE_EXHAUSTED to gRPC).
func (d *Downstream) refused() {
	d.tooMany.Add(1)
	d.mu.Lock()
	if len(d.first429) < 20 {
		d.first429 = append(d.first429, time.Now())
	}
	d.mu.Unlock()
}

func storeMax(v *atomic.Int64, n int64) {
	for {
		cur := v.Load()
		if n <= cur || v.CompareAndSwap(cur, n) {
			return
		}
	}
}

// Stats returns the counters.
func (d *Downstream) Stats() DownstreamStats {
	return DownstreamStats{
		Limit: d.CurrentLimit(), InFlight: d.inFlight.Load(), Peak: d.peak.Load(), WindowPeak: d.winPeak.Load(),
		Total: d.total.Load(), OK: d.ok.Load(), TooMany429: d.tooMany.Load(), LatencyNano: d.latency.Load(),
		HTTP2: d.h2Calls.Load(), GRPC: d.grpcCalls.Load(),
	}
}

// ResetWindow starts a new window for WindowPeak and returns the previous window's peak.
func (d *Downstream) ResetWindow() int64 { return d.winPeak.Swap(d.inFlight.Load()) }

// Close stops the server.
func (d *Downstream) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return d.srv.Shutdown(ctx)
}
