package proxy

import (
	"context"
	"math/rand/v2"
	"net/http"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/agent/deadline"
	"github.com/apportion/apportion/internal/agent/degrade"
	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/assignment"
)

// BenchmarkAdmit is the admission chain alone on its hot path: one call at a time admitted at
// once and its permits and ticket given back, on the real clock. "plain" is a downstream with
// permits only; "all" has every step's feature on and passing: a degrade switch that does not
// match (another method), a breaker, a rate limit, priority lanes and the recovery ramp and
// adaptive limit. It isolates admit's own cost from the HTTP work that BenchmarkHandler and
// BenchmarkServeLean add around it. The -observe forms are the same downstreams under Observe
// (issue #31): the same steps, looking only, and the call's shadow permit; "all-observe-over"
// has 0 permits, so that every call is forced beyond them and counted at once as one Enforce
// would refuse; "plain-observe-queue-full" has its one shadow permit held and its shadow
// waiters' bound reached, so that every call starts a shadow waiter that is refused at once
// (queue-full): Observe's dearest path.
func BenchmarkAdmit(b *testing.B) {
	observe := func(mut func(*assignment.Assignment), permits int32) func(*assignment.Assignment) {
		return func(a *assignment.Assignment) {
			if mut != nil {
				mut(a)
			}
			a.Downstreams[0].Observe = true
			a.Downstreams[0].Permits = permits
		}
	}
	for _, bc := range []struct {
		name string
		mut  func(*assignment.Assignment)
	}{
		{"plain", nil},
		{"plain-observe", observe(nil, 1024)},
		{"all", admitAll},
		{"all-observe", observe(admitAll, 1024)},
		{"all-observe-over", observe(admitAll, 0)},
		{"plain-observe-queue-full", observe(func(a *assignment.Assignment) {
			zero := int32(0)
			a.Downstreams[0].MaxWaiting = &zero
		}, 1)},
	} {
		b.Run(bc.name, func(b *testing.B) {
			a := &assignment.Assignment{Epoch: 1, Generation: 1, LeaseTTL: assignment.Duration(10 * time.Minute),
				Downstreams: []assignment.Downstream{{
					Name: "up", Upstream: "http://upstream.invalid", Permits: 1024, SafeDefaultPermits: 1024,
					AcquireTimeout: assignment.Duration(time.Second), RequestTimeout: assignment.Duration(10 * time.Second),
					Fallback: assignment.Fallback{Action: assignment.ActionReject},
				}}}
			if bc.mut != nil {
				bc.mut(a)
			}
			enf := enforce.New(enforce.Options{Metrics: metrics.New(), Logger: quietLogger()})
			if _, err := enf.Apply(a, time.Time{}); err != nil {
				b.Fatal(err)
			}
			clk, t := enf.Clock(), enf.Table()
			ds := t.Lookup("up")
			cfg := ds.Config()
			req := degrade.RequestView{Method: http.MethodGet, Path: "/orders/1", Header: http.Header{}, Rand: rand.Uint32}
			ctx := context.Background()
			if bc.name == "plain-observe-queue-full" && !ds.Shadow.TryAcquire() {
				b.Fatal("the shadow permit is not free")
			}
			b.ReportAllocs()
			for b.Loop() {
				ad := admit(ctx, clk, t, ds, cfg, req, deadline.Budget{})
				if ad.verdict != admitted {
					b.Fatalf("admission %+v", ad)
				}
				ds.Sem.Release()
				ad.releaseLane()
				ad.endShadow(clk)
				ad.ticket.Cancel()
			}
		})
	}
}

// admitAll turns on every step of the chain, each passing: a degrade switch that does not match
// (another method), a breaker, a rate limit, lanes, the recovery ramp and adaptive limit.
func admitAll(a *assignment.Assignment) {
	d := &a.Downstreams[0]
	d.Rate = &assignment.Rate{PerSecond: 1e9, Burst: 1 << 30, Mode: assignment.ModeTokenBucket}
	d.Breaker = &assignment.Breaker{Window: assignment.Duration(10 * time.Second), FailureRatePercent: 50, SlowCallThreshold: assignment.Duration(time.Second), SlowCallRatePercent: 100, MinimumCalls: 20, OpenDuration: assignment.Duration(30 * time.Second), HalfOpenProbes: 3}
	d.Lanes = []assignment.Lane{{Name: "core", ReservePercent: 50, LendPercent: 50, Methods: []string{"POST"}, PathPrefixes: []string{"/orders"}}}
	withRecoveryAndDeadline(d)
	a.Switches = []assignment.Switch{{Name: "ns/pause", Downstream: "up", ExpiresAt: time.Now().Add(time.Hour), Percent: 100,
		Methods: []string{"DELETE"}, Action: assignment.Fallback{Action: assignment.ActionReject}}}
}
