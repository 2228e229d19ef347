package e2e

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/test/e2e/harness"
)

// BenchmarkConvergence measures the time from an HPA status change (its desiredReplicas) to every
// agent enforcing its new permits, at 10 and at 100 agents (real agent processes, one per
// loopback address). Each run plays 24 scale decisions, alternating desiredReplicas between N and
// 1.25 N with the N pods running (8 ↔ 6 permits per pod: every agent changes every time), and
// reports p50, p99 and max in ms (with 24 events, p99 is the slowest one), after two untimed
// warm-up events. Agents are polled 16 at a time until each shows its new permits, so a figure
// includes up to one polling round (a few ms at 100 agents). The manager runs with its production timings (lease 10s,
// renewals every 3s); there is no load and no monitor, so the figures are the engine's.
func BenchmarkConvergence(b *testing.B) {
	for _, n := range []int{10, 100} {
		b.Run(fmt.Sprintf("agents=%d", n), func(b *testing.B) { benchConvergence(b, n) })
	}
}

const convergenceEvents = 24

func benchConvergence(b *testing.B, n int) {
	s := scenario(b, harness.ScenarioConfig{
		Limit: int32(10 * n), FactorPercent: 80, Replicas: int32(n), MinReplicas: int32(n), MaxReplicas: int32(2 * n),
		LeaseTTL: 10 * time.Second, RenewEvery: 3 * time.Second, PushTimeout: time.Second,
		NoLoad: true, NoMonitor: true, Logf: func(string, ...any) {},
	})
	ctx := b.Context()
	if err := s.WaitPermits(ctx, s.PerPod(int32(n)), time.Minute); err != nil {
		b.Fatal(err)
	}
	key, err := s.Keys.Key()
	if err != nil {
		b.Fatal(err)
	}
	c := &assignment.Client{HTTP: harnessHTTP(), Key: key}
	agents := s.Workload.Agents()
	up := int32(n + n/4)
	// Two untimed events first: the first push after setup opens connections.
	for i, desired := range []int32{up, int32(n)} {
		if err := s.Workload.SetHPA(ctx, desired, int32(n)); err != nil {
			b.Fatal(err)
		}
		if _, err := waitAll(ctx, c, agents, s.Cfg.Quota, s.PerPod(desired), time.Now(), 30*time.Second); err != nil {
			b.Fatalf("warm-up event %d: %v", i, err)
		}
		_ = sleep(ctx, 300*time.Millisecond)
	}
	b.ResetTimer()
	var lat []time.Duration
	var trace []string
	for range b.N {
		for i := range convergenceEvents {
			desired := int32(n)
			if i%2 == 0 {
				desired = up
			}
			want := s.PerPod(desired)
			t0 := time.Now()
			if err := s.Workload.SetHPA(ctx, desired, int32(n)); err != nil {
				b.Fatal(err)
			}
			d, err := waitAll(ctx, c, agents, s.Cfg.Quota, want, t0, 30*time.Second)
			if err != nil {
				b.Fatalf("event %d (desired %d, %d permits): %v", i, desired, want, err)
			}
			lat = append(lat, d)
			trace = append(trace, fmt.Sprintf("%d→%dp:%s", desired, want, d.Round(time.Millisecond)))
			_ = sleep(ctx, 300*time.Millisecond)
		}
	}
	b.StopTimer()
	slices.Sort(lat)
	p := func(q float64) float64 {
		i := int(q*float64(len(lat)) + 0.5)
		i = min(max(i-1, 0), len(lat)-1)
		return float64(lat[i].Microseconds()) / 1000
	}
	b.ReportMetric(p(0.50), "p50-ms")
	b.ReportMetric(p(0.99), "p99-ms")
	b.ReportMetric(float64(lat[len(lat)-1].Microseconds())/1000, "max-ms")
	b.ReportMetric(float64(len(lat)), "events")
	b.ReportMetric(0, "ns/op")
	b.Logf("%d agents, %d events: p50 %.1f ms, p99 %.1f ms, max %.1f ms\nin order (desired replicas→permits:time): %s", n, len(lat), p(0.5), p(0.99),
		float64(lat[len(lat)-1].Microseconds())/1000, strings.Join(trace, " "))
}

func harnessHTTP() *harness.HTTPClient { return harness.NewHTTPClient(16, time.Second) }

// waitAll polls every agent (16 at a time) until each enforces want; an agent is no longer
// polled once it does. It returns the time from t0 to the last agent's confirming answer.
func waitAll(ctx context.Context, c *assignment.Client, agents []*harness.Agent, ds string, want int32, t0 time.Time, timeout time.Duration) (time.Duration, error) {
	deadline := t0.Add(timeout)
	var mu sync.Mutex
	var last time.Time
	pending := slices.Clone(agents)
	for len(pending) > 0 {
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("%d agents not converged after %s, e.g. %s", len(pending), timeout, pending[0].Pod)
		}
		var wg sync.WaitGroup
		sem := make(chan struct{}, 16)
		done := make([]bool, len(pending))
		for i, a := range pending {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				rctx, cancel := context.WithTimeout(ctx, time.Second)
				defer cancel()
				st, err := c.State(rctx, a.Endpoint(), 0)
				if err != nil {
					return
				}
				at := time.Now()
				for _, d := range st.Downstreams {
					// want, or one more for the pods the remainder went to.
					if d.Name == ds && (d.EffectivePermits == want || d.EffectivePermits == want+1) {
						done[i] = true
						mu.Lock()
						if at.After(last) {
							last = at
						}
						mu.Unlock()
					}
				}
			})
		}
		wg.Wait()
		next := pending[:0]
		for i, a := range pending {
			if !done[i] {
				next = append(next, a)
			}
		}
		pending = next
	}
	return last.Sub(t0), nil
}
