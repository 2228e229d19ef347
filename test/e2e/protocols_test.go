package e2e

import (
	"testing"
	"time"

	"github.com/apportion/apportion/test/e2e/harness"
)

// The bound holds for every protocol the apps speak: a scale step under a load that speaks
// HTTP/2 with prior knowledge (every call of an agent's workers a stream on one connection to
// it), and one that makes gRPC server-streaming calls with grpc-go (each stream holds its permit
// for the downstream's latency, over which the judge sends its messages). The usual checks
// apply (Σ permits and Σ in-flight within the limit, no 429 at the judge, whose peak stays
// within the limit), and every call the judge saw came in the load's protocol: the agents
// forward the caller's protocol.

// TestH2ScaleStep: h2c apps, 8 → 12 → 6 pods.
func TestH2ScaleStep(t *testing.T) { protocolScaleStep(t, harness.ProtocolH2C) }

// TestGRPCStreamingScaleStep: gRPC streaming apps, 8 → 12 → 6 pods.
func TestGRPCStreamingScaleStep(t *testing.T) { protocolScaleStep(t, harness.ProtocolGRPCStream) }

func protocolScaleStep(t *testing.T, protocol string) {
	s := scenario(t, harness.ScenarioConfig{Protocol: protocol})
	ctx := t.Context()
	start := time.Now()
	mustConverge(t, ctx, s)
	hold := dur(time.Second, 5*time.Second)
	for _, n := range []int32{12, 6} {
		if err := s.Workload.ScaleTo(ctx, n, harness.ScaleOptions{Step: 100 * time.Millisecond}); err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		mustConverge(t, ctx, s)
		t.Logf("%d pods × %d permits after %s", n, s.PerPod(n), time.Since(t0).Round(time.Millisecond))
		_ = sleep(ctx, hold)
	}
	finish(t, s, start)
	ds := s.DS.Stats()
	t.Logf("the judge: %d calls, %d over HTTP/2, %d gRPC, peak %d of %d", ds.Total, ds.HTTP2, ds.GRPC, ds.Peak, ds.Limit)
	if ds.Total == 0 || ds.HTTP2 != ds.Total {
		t.Errorf("%d of the judge's %d calls came over HTTP/2, want all", ds.HTTP2, ds.Total)
	}
	if protocol == harness.ProtocolGRPCStream && ds.GRPC != ds.Total {
		t.Errorf("%d of the judge's %d calls were gRPC calls, want all", ds.GRPC, ds.Total)
	}
}
