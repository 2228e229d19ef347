package harness

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// The judge's and the load's HTTP/2 and gRPC side: the Downstream answers HTTP/1.1 and HTTP/2
// with prior knowledge (h2c) on one port, and a gRPC call (Content-Type application/grpc*)
// with a server stream; the Load calls with h2c or with grpc-go's client.

// Load protocols (LoadConfig.Protocol).
const (
	ProtocolHTTP1 = ""    // HTTP/1.1, a connection per call in flight
	ProtocolH2C   = "h2c" // HTTP/2 with prior knowledge: every call of an agent's workers a stream on one connection
	// ProtocolGRPCStream: grpc-go's client, one ClientConn per agent (its calls streams on one
	// connection), each call a server-streaming call of GRPCStreamMethod that lasts the
	// downstream's latency, the downstream named by the authority.
	ProtocolGRPCStream = "grpc-stream"
)

// GRPCStreamMethod is the judge's server-streaming method: one request message in, then
// grpcStreamParts messages spread over the downstream's latency, then grpc-status 0.
const GRPCStreamMethod = "/e2e.Judge/Stream"

const grpcStreamParts = 4

func isGRPC(r *http.Request) bool {
	rest, ok := strings.CutPrefix(r.Header.Get("Content-Type"), "application/grpc")
	return ok && (rest == "" || rest[0] == '+' || rest[0] == ';')
}

// serveGRPC is the judge's gRPC method: admitted calls are counted, held and peaked as HTTP
// calls are (the stream holds its slot until its trailers), and a call beyond the limit is
// refused RESOURCE_EXHAUSTED, counted as a 429.
func (d *Downstream) serveGRPC(w http.ResponseWriter, r *http.Request) {
	d.total.Add(1)
	d.grpcCalls.Add(1)
	n := d.inFlight.Add(1)
	defer d.inFlight.Add(-1)
	_, _ = io.Copy(io.Discard, r.Body) // the request message; the client half-closes after it
	w.Header().Set("Content-Type", "application/grpc")
	if n > d.CurrentLimit() {
		d.refused()
		w.Header().Set("Grpc-Status", strconv.Itoa(int(codes.ResourceExhausted)))
		w.Header().Set("Grpc-Message", "too many concurrent calls")
		w.WriteHeader(http.StatusOK)
		return
	}
	storeMax(&d.peak, n)
	storeMax(&d.winPeak, n)
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	step := time.Duration(d.latency.Load()) / grpcStreamParts
	t := time.NewTimer(step)
	defer t.Stop()
	for i := range grpcStreamParts {
		select {
		case <-t.C:
		case <-r.Context().Done():
			return
		}
		t.Reset(step)
		msg := []byte("part " + strconv.Itoa(i))
		frame := make([]byte, 5, 5+len(msg))
		binary.BigEndian.PutUint32(frame[1:], uint32(len(msg)))
		if _, err := w.Write(append(frame, msg...)); err != nil {
			return
		}
		if rc.Flush() != nil {
			return
		}
	}
	d.ok.Add(1)
	w.Header().Set(http.TrailerPrefix+"Grpc-Status", "0")
}

// rawCodec sends []byte messages as they are: the judge needs no protobuf.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "raw" }

// grpcConns are the load's gRPC client connections, one per agent.
type grpcConns struct {
	mu sync.Mutex
	m  map[*Agent]*grpc.ClientConn
}

// get returns the agent's connection, dialled (lazily: grpc-go connects at the first call) with
// the downstream as the authority.
func (g *grpcConns) get(a *Agent, downstream string) (*grpc.ClientConn, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if cc := g.m[a]; cc != nil {
		return cc, nil
	}
	host := strings.TrimPrefix(a.DataURL(""), "http://")
	host = strings.TrimSuffix(host, "/")
	cc, err := grpc.NewClient("passthrough:///"+host,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithAuthority(downstream),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})))
	if err != nil {
		return nil, err
	}
	if g.m == nil {
		g.m = map[*Agent]*grpc.ClientConn{}
	}
	g.m[a] = cc
	return cc, nil
}

func (g *grpcConns) closeAll() {
	g.mu.Lock()
	defer g.mu.Unlock()
	for a, cc := range g.m {
		_ = cc.Close()
		delete(g.m, a)
	}
}

// grpcCall makes one server-streaming call through the agent and reads it to its end. Its
// outcome is told as the HTTP load's is, by an HTTP status: 200 OK; 503 the agent's refusal (a
// grpc-message of the agent's, "apportion: ..."); 429 the downstream's RESOURCE_EXHAUSTED; 504
// DEADLINE_EXCEEDED, 404 UNIMPLEMENTED (an agent not yet configured for the downstream), 502
// any other status.
func (l *Load) grpcCall(ctx context.Context, a *Agent) (int, error) {
	cc, err := l.grpc.get(a, l.cfg.Downstream)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithTimeout(ctx, l.cfg.Timeout)
	defer cancel()
	cs, err := cc.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, GRPCStreamMethod)
	if err == nil {
		req := []byte("go")
		if err = cs.SendMsg(&req); err == nil {
			err = cs.CloseSend()
		}
		for err == nil {
			var m []byte
			err = cs.RecvMsg(&m)
		}
		if errors.Is(err, io.EOF) {
			return http.StatusOK, nil
		}
	}
	st, ok := status.FromError(err)
	if !ok {
		return 0, err
	}
	switch {
	case st.Code() == codes.OK:
		return http.StatusOK, nil
	case strings.HasPrefix(st.Message(), "apportion: ") && (st.Code() == codes.ResourceExhausted || st.Code() == codes.Unavailable):
		return http.StatusServiceUnavailable, nil
	case st.Code() == codes.ResourceExhausted:
		return http.StatusTooManyRequests, nil
	case st.Code() == codes.DeadlineExceeded:
		return http.StatusGatewayTimeout, nil
	case st.Code() == codes.Unimplemented:
		return http.StatusNotFound, nil
	case st.Code() == codes.Unavailable && ctx.Err() == nil && !strings.HasPrefix(st.Message(), "apportion: "):
		return 0, err // the connection failed (an agent killed or stopped): a transport error
	}
	return http.StatusBadGateway, nil
}

// h2cTransport speaks HTTP/2 with prior knowledge only.
func h2cTransport() *http.Transport {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Transport{Protocols: &p, IdleConnTimeout: 30 * time.Second, DisableCompression: true,
		DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext}
}
