package loadgen

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"
)

func TestOpenLoopSendsAtTheRateAndReportsFailures(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/fail" {
			w.WriteHeader(http.StatusTeapot)
		}
	}))
	defer srv.Close()
	c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
	lat, err := OpenLoop(c, srv.URL+"/ok", 200, 250*time.Millisecond)
	if err != nil || len(lat) != 50 {
		t.Fatalf("OpenLoop = %d latencies, %v; want 50, nil", len(lat), err)
	}
	if lat.Pct(0.5) <= 0 || lat.Pct(0.99) < lat.Pct(0.5) {
		t.Fatalf("percentiles p50 %s p99 %s", lat.Pct(0.5), lat.Pct(0.99))
	}
	lat, err = OpenLoop(c, srv.URL+"/fail", 100, 50*time.Millisecond)
	if err == nil || len(lat) != 0 {
		t.Fatalf("failing calls: %d latencies, %v", len(lat), err)
	}
}

func TestPct(t *testing.T) {
	l := Latencies{5, 1, 4, 2, 3}
	if l.Pct(0) != 1 || l.Pct(0.5) != 3 || l.Pct(1) != 5 || (Latencies{}).Pct(0.5) != 0 {
		t.Fatalf("Pct wrong: %v %v %v", l.Pct(0), l.Pct(0.5), l.Pct(1))
	}
}
