package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/assignment"
)

// agentBin is the agent, built once for the package's tests.
var agentBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "consumer-agent-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	agentBin = filepath.Join(dir, "agent")
	cmd := exec.Command("go", "build", "-o", agentBin, "github.com/apportion/apportion/cmd/agent")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building the agent:", err)
		os.Exit(1)
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

func freePort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// startAgent runs the agent binary with a bootstrap assignment of dss and returns its data URL.
func startAgent(t *testing.T, dss ...assignment.Downstream) string {
	t.Helper()
	dir := t.TempDir()
	b, err := json.Marshal(assignment.Assignment{Downstreams: dss})
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, "bootstrap.json")
	if err := os.WriteFile(file, b, 0o600); err != nil {
		t.Fatal(err)
	}
	data, ctl := freePort(t), freePort(t)
	cmd := exec.Command(agentBin, "--listen="+data, "--control-listen="+ctl, "--insecure-no-auth", "--bootstrap="+file, "--log-level=warn")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	for deadline := time.Now().Add(20 * time.Second); ; {
		res, err := http.Get("http://" + ctl + "/readyz")
		if err == nil {
			res.Body.Close()
			if res.StatusCode == 200 {
				return "http://" + data
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent not ready: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func downstream(name, upstream string, permits int32) assignment.Downstream {
	return assignment.Downstream{
		Name: name, Upstream: upstream, Permits: permits, SafeDefaultPermits: permits,
		AcquireTimeout: assignment.Duration(10 * time.Millisecond), RequestTimeout: assignment.Duration(5 * time.Second),
		Fallback: assignment.Fallback{Action: assignment.ActionReject},
	}
}

// refusing is the downstream: by the message's Idempotency-Key, "ok-*" is taken at once,
// "slow-*" refused twice with 429 and Retry-After 2 and then taken, "never-*" always refused
// with Retry-After 1, "bad-*" rejected with 400.
func refusing(t *testing.T) (*httptest.Server, func(id string) int) {
	var mu sync.Mutex
	seen := map[string]int{}
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := r.Header.Get("Idempotency-Key")
		mu.Lock()
		seen[id]++
		n := seen[id]
		mu.Unlock()
		switch {
		case strings.HasPrefix(id, "slow-") && n <= 2:
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusTooManyRequests)
		case strings.HasPrefix(id, "never-"):
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
		case strings.HasPrefix(id, "bad-"):
			w.WriteHeader(http.StatusBadRequest)
		}
	}))
	t.Cleanup(s.Close)
	return s, func(id string) int { mu.Lock(); defer mu.Unlock(); return seen[id] }
}

type redelivery struct {
	id      string
	attempt int
	after   time.Duration // from the refused delivery
}

// run drains q with c until it is empty, moving the fake clock to each due time, and returns the
// re-deliveries scheduled.
func run(t *testing.T, c *Consumer, q *MemQueue, clk *testingclock.FakeClock) []redelivery {
	t.Helper()
	var got []redelivery
	q.OnRedeliver = func(m Message, at time.Time) { got = append(got, redelivery{m.ID, m.Attempt, at.Sub(clk.Now())}) }
	for range 100 {
		c.Drain(context.Background())
		next, ok := q.Next()
		if !ok {
			return got
		}
		clk.SetTime(next)
	}
	t.Fatal("the queue never emptied")
	return nil
}

// TestConsumerAgainstARealAgent: refusals by the downstream (429) and by the agent (no permit)
// are re-delivered later with backoff that respects Retry-After, up to MaxAttempts, then
// dead-lettered and counted as drops; a 400 is dead-lettered at once; nothing is retried in a
// loop (every re-delivery is a queue entry with a due time).
func TestConsumerAgainstARealAgent(t *testing.T) {
	up, seen := refusing(t)
	agent := startAgent(t, downstream("orders", up.URL, 4), downstream("closed", up.URL, 0))
	clk := testingclock.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	var dead []string
	newConsumer := func(q *MemQueue, url string) *Consumer {
		return &Consumer{
			Queue: q, Client: &http.Client{Timeout: 10 * time.Second}, URL: url, MaxAttempts: 4,
			// The jitter drawn is always half the ceiling here, so the delays are exact.
			Backoff:    Backoff{Base: time.Second, Max: 8 * time.Second, Rand: func() float64 { return 0.5 }},
			DeadLetter: func(m Message, reason string) { dead = append(dead, m.ID+" "+reason) },
			Clock:      clk, Metrics: m,
		}
	}

	q := NewMemQueue(clk)
	for _, id := range []string{"ok-1", "slow-1", "never-1", "bad-1"} {
		q.Publish(id, []byte(`{"order":"`+id+`"}`))
	}
	got := run(t, newConsumer(q, agent+"/orders/events"), q, clk)
	want := []redelivery{
		// attempt 1 refused: the jittered delay (half of 1s) is below Retry-After: Retry-After.
		{"slow-1", 2, 2 * time.Second},
		{"never-1", 2, time.Second},
		// attempt 2: half of 2s; slow-1's Retry-After 2s is longer, never-1's 1s is not.
		{"never-1", 3, time.Second},
		{"slow-1", 3, 2 * time.Second},
		// attempt 3: half of 4s, above Retry-After.
		{"never-1", 4, 2 * time.Second},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("re-deliveries\n got %v\nwant %v", got, want)
	}
	if seen("ok-1") != 1 || seen("slow-1") != 3 || seen("never-1") != 4 || seen("bad-1") != 1 {
		t.Fatalf("deliveries: ok %d slow %d never %d bad %d", seen("ok-1"), seen("slow-1"), seen("never-1"), seen("bad-1"))
	}

	// The agent's own refusal (no permit at all) carries no Retry-After: backoff alone.
	q2 := NewMemQueue(clk)
	q2.Publish("c-1", []byte(`{}`))
	got = run(t, newConsumer(q2, agent+"/closed/events"), q2, clk)
	want = []redelivery{{"c-1", 2, 500 * time.Millisecond}, {"c-1", 3, time.Second}, {"c-1", 4, 2 * time.Second}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("re-deliveries of agent refusals\n got %v\nwant %v", got, want)
	}
	if n := seen("c-1"); n != 0 {
		t.Fatalf("the closed downstream was called %d times", n)
	}

	wantDead := []string{"bad-1 rejected: status 400", "never-1 max-attempts: 429", "c-1 max-attempts: no-permit"}
	if fmt.Sprint(dead) != fmt.Sprint(wantDead) {
		t.Fatalf("dead letters %q, want %q", dead, wantDead)
	}
	for _, c := range []struct {
		metric prometheus.Collector
		want   float64
	}{
		{m.Delivered, 2},
		{m.Dropped.WithLabelValues("max-attempts"), 2},
		{m.Dropped.WithLabelValues("rejected"), 1},
		{m.Redelivered.WithLabelValues("429"), 5},
		{m.Redelivered.WithLabelValues("no-permit"), 3},
	} {
		if v := testutil.ToFloat64(c.metric); v != c.want {
			t.Errorf("%v = %v, want %v", c.metric, v, c.want)
		}
	}
}

// TestBackoffBounds: every delay lies in [Retry-After, max(Retry-After, min(Max, Base·2^(n-1)))],
// and the jitter spreads them.
func TestBackoffBounds(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	b := Backoff{Base: 100 * time.Millisecond, Max: 5 * time.Second, Rand: r.Float64}
	for attempt := 1; attempt <= 80; attempt++ {
		ceiling := b.Max
		if attempt <= 10 {
			ceiling = min(b.Max, b.Base<<(attempt-1))
		}
		for _, ra := range []time.Duration{0, time.Second, 10 * time.Second} {
			seen := map[time.Duration]bool{}
			for range 50 {
				d := b.Delay(attempt, ra)
				if d < ra || d > max(ra, ceiling) {
					t.Fatalf("attempt %d, Retry-After %v: delay %v outside [%v, %v]", attempt, ra, d, ra, max(ra, ceiling))
				}
				seen[d] = true
			}
			if ra < ceiling && len(seen) < 10 {
				t.Fatalf("attempt %d: only %d distinct delays in 50: no jitter", attempt, len(seen))
			}
		}
	}
}

func TestRetryAfter(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for v, want := range map[string]time.Duration{
		"": 0, "3": 3 * time.Second, "-1": 0, "soon": 0,
		now.Add(90 * time.Second).Format(http.TimeFormat): 90 * time.Second,
		now.Add(-time.Second).Format(http.TimeFormat):     0,
	} {
		if got := retryAfter(v, now); got != want {
			t.Errorf("retryAfter(%q) = %v, want %v", v, got, want)
		}
	}
}
