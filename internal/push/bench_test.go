package push

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"slices"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/keys"
)

// BenchmarkConverge measures, with N in-process agents on loopback (real control handler, Ed25519
// signatures, JSON), the time from SetQuota with new permits until every agent acknowledged them
// (Report.Converged). Each change swaps the shares of the even and odd pods (12 ↔ 8 permits)
// under a limit of 10 per pod, so every change needs two rounds: the lowerings must be
// acknowledged before the raises fit. Reports p50-ms, p99-ms and max-ms over max(b.N, 20)
// changes. The fake clock skips the recovery window and otherwise follows real time.
// APPORTION_BENCH_1000=1 adds a run with 1000 agents.
func BenchmarkConverge(b *testing.B) {
	sizes := []int{10, 100}
	if os.Getenv("APPORTION_BENCH_1000") != "" {
		sizes = append(sizes, 1000)
	}
	for _, n := range sizes {
		b.Run(fmt.Sprintf("agents=%d", n), func(b *testing.B) { benchConverge(b, n) })
	}
}

func benchConverge(b *testing.B, n int) {
	clk := testingclock.NewFakeClock(time.Date(2026, 7, 1, 12, 0, 0, 0, time.UTC))
	agents := make([]*testAgent, n)
	for i := range agents {
		agents[i] = newTestAgent(b, clk.Now, fmt.Sprintf("%s/p%03d", qKey.Namespace, i))
	}
	notify := make(chan struct{}, 1)
	hc := &http.Client{Transport: &http.Transport{MaxIdleConns: 4 * n, MaxIdleConnsPerHost: 4, IdleConnTimeout: time.Minute}}
	e, err := New(Options{
		Client:      keys.NewSigningClient(hc, testKeys(b)),
		Epoch:       EpochFunc(func(context.Context) (int64, error) { return 1, nil }),
		Clock:       clk,
		PushTimeout: time.Second,
		OnChange: func(types.NamespacedName) {
			select {
			case notify <- struct{}{}:
			default:
			}
		},
	})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Start(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	for e.Epoch() == 0 {
		time.Sleep(time.Millisecond)
	}
	desired := func(flip bool) DesiredQuota {
		d := DesiredQuota{Key: qKey, Limit: int32(10 * n), Downstream: template("q")}
		d.Downstream.RequestTimeout = assignment.Duration(100 * time.Millisecond)
		for i, a := range agents {
			p := int32(8)
			if (i%2 == 0) != flip {
				p = 12
			}
			d.Pods = append(d.Pods, DesiredPod{Name: fmt.Sprintf("p%03d", i), UID: types.UID(fmt.Sprintf("uid-%d", i)),
				Target: "web", Endpoint: a.srv.URL, Permits: p, SafeDefault: 2})
		}
		return d
	}
	// While waiting, the fake clock follows real time, so that a request that timed out under
	// load is retried (and renewals happen) as they would on the real clock.
	wait := func() {
		deadline := time.After(30 * time.Second)
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		last := time.Now()
		for {
			if r := e.Report(qKey); r.Converged && !r.Recovering {
				return
			}
			select {
			case <-notify:
			case <-tick.C:
				now := time.Now()
				clk.Step(now.Sub(last))
				last = now
			case <-deadline:
				b.Fatalf("no convergence: %+v", e.Report(qKey))
			}
		}
	}
	e.SetQuota(desired(false))
	for e.Report(qKey).Recovering {
		clk.Step(15 * time.Second)
		time.Sleep(time.Millisecond)
	}
	wait()

	changes := max(b.N, 20)
	durs := make([]time.Duration, 0, changes)
	b.ResetTimer()
	for i := range changes {
		start := time.Now()
		e.SetQuota(desired(i%2 == 0))
		wait()
		durs = append(durs, time.Since(start))
	}
	b.StopTimer()
	last := desired((changes-1)%2 == 0)
	for i, a := range agents {
		if p, _ := a.b.permits("q"); p != last.Pods[i].Permits {
			b.Fatalf("agent %d holds %d, want %d", i, p, last.Pods[i].Permits)
		}
	}
	slices.Sort(durs)
	q := func(p float64) float64 {
		return float64(durs[min(len(durs)-1, int(p*float64(len(durs))))].Microseconds()) / 1000
	}
	b.ReportMetric(q(0.50), "p50-ms")
	b.ReportMetric(q(0.99), "p99-ms")
	b.ReportMetric(float64(durs[len(durs)-1].Microseconds())/1000, "max-ms")
	b.ReportMetric(0, "ns/op")
}
