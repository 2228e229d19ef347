package main

// floor-grpc: a do-nothing gRPC proxy on grpc-go alone, the floor of a gRPC path built on
// grpc-go's transport (its loopy writer batches a stream's frames into few writes, where
// net/http's HTTP/2 flushes each frame: floor-h2). Every call, whatever its method, is taken by
// an UnknownServiceHandler, opened as a client stream on one grpc.ClientConn to the upstream
// (h2c), its incoming metadata copied to the outgoing call, its messages pumped both ways as
// opaque bytes (a codec that hands grpc-go's buffers on without a copy or a decode), and the
// upstream's header, trailer and status passed back. No admission, no policy.

import (
	"errors"
	"io"
	"os"
	"strconv"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
)

// rawFrame is one message's bytes as grpc-go received them.
type rawFrame struct{ data mem.BufferSlice }

// passCodec passes messages through as their received buffers: Unmarshal keeps a reference to
// the buffers (grpc-go frees its own when Unmarshal returns), Marshal hands that reference to
// grpc-go, which frees it once the message is written. A frame is marshalled exactly once.
type passCodec struct{}

func (passCodec) Marshal(v any) (mem.BufferSlice, error) {
	f := v.(*rawFrame)
	out := f.data
	f.data = nil
	return out, nil
}

func (passCodec) Unmarshal(data mem.BufferSlice, v any) error {
	data.Ref()
	v.(*rawFrame).data = data
	return nil
}

// Name is the content-subtype the upstream is called with ("application/grpc+proto"), the one
// grpc-go clients send by default.
func (passCodec) Name() string { return "proto" }

// serveGRPCNull serves gRPC (h2c) on addr and forwards every call to upAddr (see the file's
// comment and newGRPCNull); it returns only when it cannot serve.
func serveGRPCNull(addr, upAddr string, tuned bool) error {
	srv, _, err := newGRPCNull(upAddr, tuned) // the process ends with the server
	if err != nil {
		return err
	}
	ln, err := listen(addr)
	if err != nil {
		return err
	}
	return srv.Serve(ln)
}

// newGRPCNull returns the do-nothing gRPC proxy to upAddr, to be served, and what closes its
// upstream connection once it stopped. Tuned (floor-grpc-tuned) adds what a proxy on grpc-go
// can set beyond the defaults: static flow-control windows of 1 MiB on both sides (no BDP
// pings of its own) and no client retries (grpc-go otherwise keeps each call's messages for a
// replay until the call commits).
// BENCH_GRPC_WORKERS=n adds a pool of n stream workers instead of a goroutine per stream.
func newGRPCNull(upAddr string, tuned bool) (*grpc.Server, func() error, error) {
	const window = 1 << 20
	dial := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(passCodec{}))}
	opts := []grpc.ServerOption{grpc.ForceServerCodecV2(passCodec{})}
	if tuned {
		dial = append(dial, grpc.WithStaticStreamWindowSize(window), grpc.WithStaticConnWindowSize(window), grpc.WithDisableRetry())
		opts = append(opts, grpc.StaticStreamWindowSize(window), grpc.StaticConnWindowSize(window))
	}
	if n, err := strconv.Atoi(os.Getenv("BENCH_GRPC_WORKERS")); err == nil && n > 0 {
		opts = append(opts, grpc.NumStreamWorkers(uint32(n)))
	}
	cc, err := grpc.NewClient("passthrough:///"+upAddr, dial...)
	if err != nil {
		return nil, nil, err
	}
	desc := &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}
	srv := grpc.NewServer(append(opts, grpc.UnknownServiceHandler(func(_ any, ss grpc.ServerStream) error {
		method, _ := grpc.MethodFromServerStream(ss)
		ctx := ss.Context()
		md, _ := metadata.FromIncomingContext(ctx)
		// grpc-go's client drops the reserved and pseudo headers of md (content-type, te,
		// grpc-timeout, :authority …) and sends the deadline of ctx as grpc-timeout.
		cs, err := cc.NewStream(metadata.NewOutgoingContext(ctx, md), desc, method)
		if err != nil {
			return err
		}
		go func() {
			for {
				var f rawFrame
				if err := ss.RecvMsg(&f); err != nil {
					if errors.Is(err, io.EOF) {
						_ = cs.CloseSend()
					}
					return // otherwise ctx is cancelled, and cs with it
				}
				if err := cs.SendMsg(&f); err != nil {
					f.data.Free()
					return
				}
			}
		}()
		if h, err := cs.Header(); err == nil && len(h) > 0 {
			if err := ss.SendHeader(h); err != nil {
				return err
			}
		}
		for {
			var f rawFrame
			err := cs.RecvMsg(&f)
			if errors.Is(err, io.EOF) {
				ss.SetTrailer(cs.Trailer())
				return nil
			}
			if err != nil {
				ss.SetTrailer(cs.Trailer())
				return err // the upstream's status (or the transport's), passed back
			}
			if err := ss.SendMsg(&f); err != nil {
				f.data.Free()
				return err
			}
		}
	}))...)
	return srv, cc.Close, nil
}
