package metrics

import (
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

var t0 = time.Unix(1_772_366_400, 0)

func TestPeak(t *testing.T) {
	var p Peak
	if p.Max(t0) != 0 {
		t.Fatal("empty ring has a peak")
	}
	// 3 calls in second 0, 7 in second 5, 2 in second 30.
	for range 3 {
		p.Add(t0.Add(100 * time.Millisecond))
	}
	for range 7 {
		p.Add(t0.Add(5*time.Second + 999*time.Millisecond))
	}
	for range 2 {
		p.Add(t0.Add(30 * time.Second))
	}
	if got := p.Max(t0.Add(30 * time.Second)); got != 7 {
		t.Fatalf("peak = %d, want 7", got)
	}
	// Second 5 leaves the window 60 s later; second 30 is still in it.
	if got := p.Max(t0.Add(64 * time.Second)); got != 7 {
		t.Fatalf("peak at +64s = %d, want 7", got)
	}
	if got := p.Max(t0.Add(65 * time.Second)); got != 2 {
		t.Fatalf("peak at +65s = %d, want 2", got)
	}
	// A slot reused 60 s later restarts its count.
	p.Add(t0.Add(65 * time.Second)) // same slot as second 5
	if got := p.Max(t0.Add(89 * time.Second)); got != 2 {
		t.Fatalf("peak at +89s = %d, want 2", got)
	}
	if got := p.Max(t0.Add(91 * time.Second)); got != 1 {
		t.Fatalf("peak at +91s = %d, want 1", got)
	}
	if got := p.Max(t0.Add(time.Hour)); got != 0 {
		t.Fatalf("peak an hour later = %d", got)
	}
}

func TestPeakConcurrent(t *testing.T) {
	var p Peak
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 1000 {
				p.Add(t0)
			}
		}()
	}
	wg.Wait()
	if got := p.Max(t0); got != 8000 {
		t.Fatalf("peak = %d, want 8000 (lost updates)", got)
	}
}

type fakeSource Snapshot

func (s fakeSource) MetricsSnapshot() Snapshot { return Snapshot(s) }

func TestCollectAndForget(t *testing.T) {
	m := New()
	d := m.Downstream("pay")
	d.Requests.Inc()
	d.Rejected[ReasonNoPermit].Inc()
	d.Upstream[ClassOf(503)].Inc()
	d.Transition("closed", "open")
	m.SetSource(fakeSource{Generation: 4, LeaseExpired: true,
		Downstreams: []DownstreamSnapshot{{Name: "pay", InFlight: 2, Waiting: 1, Permits: 5, Breaker: 1, PeakRPS: 9}},
		Switches:    []SwitchSnapshot{{Downstream: "pay", Name: "ns/off", Active: true}}})
	text := scrape(m)
	for _, want := range []string{
		`apportion_agent_breaker_state{downstream="pay"} 1`,
		`apportion_agent_breaker_transitions_total{downstream="pay",from="closed",to="open"} 1`,
		`apportion_agent_config_generation 4`,
		`apportion_agent_degrade_switch_active{downstream="pay",switch="ns/off"} 1`,
		`apportion_agent_inflight{downstream="pay"} 2`,
		`apportion_agent_lease_expired 1`,
		`apportion_agent_peak_rps_last_minute{downstream="pay"} 9`,
		`apportion_agent_permits{downstream="pay"} 5`,
		`apportion_agent_waiting{downstream="pay"} 1`,
		`apportion_agent_requests_total{downstream="pay"} 1`,
		`apportion_agent_rejected_total{downstream="pay",reason="no-permit"} 1`,
		`apportion_agent_rejected_total{downstream="pay",reason="degraded"} 0`,
		`apportion_agent_upstream_responses_total{class="5xx",downstream="pay"} 1`,
		`apportion_agent_fallback_total{action="serve-stale",downstream="pay"} 0`,
		`apportion_agent_upstream_duration_seconds_count{downstream="pay"} 0`,
		`apportion_agent_acquire_wait_seconds_count{downstream="pay"} 0`,
	} {
		if !strings.Contains(text, want+"\n") {
			t.Errorf("scrape lacks %s", want)
		}
	}
	m.Forget("pay")
	text = scrape(m)
	for _, gone := range []string{"apportion_agent_requests_total{", "apportion_agent_rejected_total{", "apportion_agent_breaker_transitions_total{",
		"apportion_agent_upstream_responses_total{", "apportion_agent_upstream_duration_seconds_count{"} {
		if strings.Contains(text, gone) {
			t.Errorf("after Forget the scrape still has %s", gone)
		}
	}
}

func scrape(m *Metrics) string {
	rec := httptest.NewRecorder()
	promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{}).ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	return rec.Body.String()
}

// Seconds reports the whole seconds before now's, oldest first, 0 for a second without calls
// or counted over a minute ago.
func TestPeakSeconds(t *testing.T) {
	var p Peak
	base := time.Unix(1_000_000, 0)
	for range 3 {
		p.Add(base.Add(200 * time.Millisecond))
	}
	p.Add(base.Add(2*time.Second + 999*time.Millisecond))
	p.Add(base.Add(3 * time.Second)) // now's second: not reported
	end, counts := p.Seconds(base.Add(3*time.Second+500*time.Millisecond), 4)
	if end != 1_000_003 || len(counts) != 4 || counts[0] != 0 || counts[1] != 3 || counts[2] != 0 || counts[3] != 1 {
		t.Fatalf("Seconds = %d %v, want 1000003 [0 3 0 1]", end, counts)
	}
	// A minute on, second base+61 shares base+1's slot, which holds base+1's 3 calls: not
	// reported as base+61's. base+3's call is still within the 59 seconds.
	if _, counts = p.Seconds(base.Add(62*time.Second+500*time.Millisecond), 59); counts[0] != 1 || counts[58] != 0 {
		t.Fatalf("Seconds a minute on = %v, want 1 first and 0 last", counts)
	}
}
