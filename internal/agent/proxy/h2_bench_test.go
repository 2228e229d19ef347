package proxy

import (
	"context"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// BenchmarkGRPCUnaryPath: one gRPC unary call at a time (grpc-go client and upstream in this
// process, one connection each), to the upstream directly and through the agent (h2c both
// ways). The agent's own cost per call is the difference between the two: agent minus direct
// in ns/op, B/op and allocs/op (the allocation counts are the whole process's, so the client's
// and the upstream's cancel out), and in cpu-µs/op, the process's CPU time (user and system, all
// threads) per call. Run with -count 6 and compare with benchstat.
func BenchmarkGRPCUnaryPath(b *testing.B) {
	u := newGRPCUpstream(b)
	dc, err := grpc.NewClient("passthrough:///"+u.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { dc.Close() })
	for _, way := range []struct {
		name string
		cc   *grpc.ClientConn
	}{{"direct", dc}, {"agent", benchAgentConn(b, u)}} {
		b.Run(way.name, func(b *testing.B) {
			ctx := context.Background()
			for range 100 { // connections made, windows and HPACK tables warm
				if _, err := unary(ctx, way.cc, "x"); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			before := processCPU(b)
			for b.Loop() {
				if _, err := unary(ctx, way.cc, "x"); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(processCPU(b)-before)/float64(time.Microsecond)/float64(b.N), "cpu-µs/op")
		})
	}
}

// processCPU is the process's CPU time so far, user and system.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
