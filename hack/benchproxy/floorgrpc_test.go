package main

import (
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// The floor is only a floor if it is a proxy: a call through it must get what a direct call
// gets — messages both ways, header and trailer metadata, the status — for unary and streaming
// calls, with the default and the tuned options.
func TestFloorGRPCPassesCalls(t *testing.T) {
	for _, tuned := range []bool{false, true} {
		t.Run("tuned="+strconv.FormatBool(tuned), func(t *testing.T) { testFloorGRPC(t, tuned) })
	}
}

func testFloorGRPC(t *testing.T, tuned bool) {
	up := grpc.NewServer(grpc.ForceServerCodec(rawCodec{}))
	up.RegisterService(&grpc.ServiceDesc{
		ServiceName: "t.T",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{
			{MethodName: "Echo", Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				var in []byte
				if err := dec(&in); err != nil {
					return nil, err
				}
				md, _ := metadata.FromIncomingContext(ctx)
				_ = grpc.SetHeader(ctx, metadata.Pairs("x-h", "h-"+first(md["x-in"])))
				_ = grpc.SetTrailer(ctx, metadata.Pairs("x-t", "t"))
				return &in, nil
			}},
			{MethodName: "Full", Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				var in []byte
				if err := dec(&in); err != nil {
					return nil, err
				}
				_ = grpc.SetTrailer(ctx, metadata.Pairs("grpc-retry-pushback-ms", "250"))
				return nil, status.Error(codes.ResourceExhausted, "full")
			}},
		},
		Streams: []grpc.StreamDesc{{StreamName: "Bidi", ServerStreams: true, ClientStreams: true, Handler: func(_ any, ss grpc.ServerStream) error {
			for {
				var in []byte
				err := ss.RecvMsg(&in)
				if errors.Is(err, io.EOF) {
					return nil
				}
				if err != nil {
					return err
				}
				for range 2 { // two answers per message
					if err := ss.SendMsg(&in); err != nil {
						return err
					}
				}
			}
		}}},
	}, nil)
	upLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = up.Serve(upLn) }()
	t.Cleanup(up.Stop)

	floor, closeUp, err := newGRPCNull(upLn.Addr().String(), tuned)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = floor.Serve(ln) }()
	t.Cleanup(func() { floor.Stop(); _ = closeUp() })

	cc, err := grpcClient(ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a bound, not a wait
	defer cancel()

	in, out := []byte("ping"), []byte(nil)
	var header, trailer metadata.MD
	err = cc.Invoke(metadata.AppendToOutgoingContext(ctx, "x-in", "v"), "/t.T/Echo", &in, &out, grpc.Header(&header), grpc.Trailer(&trailer))
	if err != nil || string(out) != "ping" || first(header["x-h"]) != "h-v" || first(trailer["x-t"]) != "t" {
		t.Fatalf("Echo through the floor: %v, %q, header %v, trailer %v", err, out, header, trailer)
	}

	err = cc.Invoke(ctx, "/t.T/Full", &in, &out, grpc.Trailer(&trailer))
	if status.Code(err) != codes.ResourceExhausted || first(trailer["grpc-retry-pushback-ms"]) != "250" {
		t.Fatalf("Full through the floor: %v, trailer %v; want RESOURCE_EXHAUSTED with the pushback", err, trailer)
	}

	s, err := cc.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, "/t.T/Bidi")
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		msg := []byte("m" + strconv.Itoa(i))
		if err := s.SendMsg(&msg); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			var got []byte
			if err := s.RecvMsg(&got); err != nil || string(got) != string(msg) {
				t.Fatalf("Bidi message %d: %q, %v", i, got, err)
			}
		}
	}
	if err := s.CloseSend(); err != nil {
		t.Fatal(err)
	}
	var extra []byte
	if err := s.RecvMsg(&extra); !errors.Is(err, io.EOF) {
		t.Fatalf("Bidi after CloseSend: %q, %v; want io.EOF", extra, err)
	}

	// A call to an upstream that is gone gets a status from the floor, not a hang.
	up.Stop()
	dead, cancelDead := context.WithTimeout(ctx, 30*time.Second)
	defer cancelDead()
	if err := cc.Invoke(dead, "/t.T/Echo", &in, &out, grpc.WaitForReady(false)); status.Code(err) == codes.OK {
		t.Fatal("Echo to a stopped upstream succeeded")
	}
}

func first(v []string) string {
	if len(v) == 0 {
		return ""
	}
	return v[0]
}

// BenchmarkFloors: one gRPC unary call at a time (grpc-go's client, as the load generator's),
// to the upstream directly and through each floor, all in this process. A floor's own cost per
// call is the difference from direct: in allocs/op and B/op (the whole process's: the client's
// and the upstream's cancel out), and in cpu-µs/op, the process's CPU time per call (user and
// system, all threads). The allocation counts do not depend on the machine's load; the times
// do. Run with -cpu 1 -count 6.
func BenchmarkFloors(b *testing.B) {
	up := newGRPCUpstream()
	upAddr := serveOnLoopback(b, up.Serve)
	b.Cleanup(up.Stop)
	ways := []struct{ name, addr string }{{"direct", upAddr}}
	h2 := newH2Null(upAddr)
	ways = append(ways, struct{ name, addr string }{"floor-h2", serveOnLoopback(b, h2.Serve)})
	b.Cleanup(func() { _ = h2.Close() })
	for _, tuned := range []bool{false, true} {
		g, closeUp, err := newGRPCNull(upAddr, tuned)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { g.Stop(); _ = closeUp() })
		name := "floor-grpc"
		if tuned {
			name += "-tuned"
		}
		ways = append(ways, struct{ name, addr string }{name, serveOnLoopback(b, g.Serve)})
	}
	for _, way := range ways {
		b.Run(way.name, func(b *testing.B) {
			cc, err := grpcClient(way.addr)
			if err != nil {
				b.Fatal(err)
			}
			defer func() { _ = cc.Close() }()
			for range 100 { // connections made, windows and HPACK tables warm
				if _, err := grpcCall(cc); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportAllocs()
			before := processCPU(b)
			for b.Loop() {
				if _, err := grpcCall(cc); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(processCPU(b)-before)/float64(time.Microsecond)/float64(b.N), "cpu-µs/op")
		})
	}
}

// serveOnLoopback serves on a new loopback listener (serve returns when its server stops) and
// returns its address.
func serveOnLoopback(b *testing.B, serve func(net.Listener) error) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	go func() { _ = serve(ln) }()
	return ln.Addr().String()
}

// processCPU is the process's CPU time so far, user and system.
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
