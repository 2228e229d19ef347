package main

import (
	"context"
	"errors"
	"io"
	"net"
	"strconv"
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
