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
	if n > d.Limit {
		d.refused()
		w.Header().Set("Retry-After", "1")
		http.Error(w, fmt.Sprintf("too many concurrent calls (%d > %d)", n, d.Limit), http.StatusTooManyRequests)
		return
	}
	storeMax(&d.peak, n)
	storeMax(&d.winPeak, n)
	t := time.NewTimer(time.Duration(d.latency.Load()))
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
		Limit: d.Limit, InFlight: d.inFlight.Load(), Peak: d.peak.Load(), WindowPeak: d.winPeak.Load(),
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
