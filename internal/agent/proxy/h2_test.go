package proxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/grpcstatus"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/h1"
	"github.com/apportion/apportion/internal/testing/wait"
)

// HTTP/2 and gRPC through the agent, with grpc-go's own client and server on loopback (h2.go).

// rawCodec sends []byte messages as they are: the tests need no protobuf.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "raw" }

// grpcUpstream is a gRPC server with three methods: /test.T/Unary (echoes; "hold" waits until
// released or its context ends), /test.T/Count (server streaming: the request's decimal count of
// messages, each waiting for a token of step when it is set) and /test.T/Chat (bidi echo).
type grpcUpstream struct {
	addr              string
	inFlight, peak    atomic.Int32
	calls             atomic.Int32
	release           chan struct{}
	step              chan struct{} // nil: Count sends at once
	lastDeadline      atomic.Int64  // the remaining time the last Unary call's context had, ns; -1: none
	mu                sync.Mutex
	lastAuthority     string
	lastPath          string
	releaseOnce       sync.Once
	unaryBeforeAnswer func() // run by Unary before it answers (nil: none)
}

func (u *grpcUpstream) enter() func() {
	u.calls.Add(1)
	n := u.inFlight.Add(1)
	for p := u.peak.Load(); n > p && !u.peak.CompareAndSwap(p, n); p = u.peak.Load() {
	}
	return func() { u.inFlight.Add(-1) }
}

func (u *grpcUpstream) releaseAll() { u.releaseOnce.Do(func() { close(u.release) }) }

func newGRPCUpstream(t testing.TB) *grpcUpstream {
	t.Helper()
	u := &grpcUpstream{release: make(chan struct{})}
	u.lastDeadline.Store(-1)
	note := func(ctx context.Context, method string) {
		md, _ := metadata.FromIncomingContext(ctx)
		u.mu.Lock()
		if a := md.Get(":authority"); len(a) > 0 {
			u.lastAuthority = a[0]
		}
		u.lastPath = method
		u.mu.Unlock()
	}
	desc := grpc.ServiceDesc{
		ServiceName: "test.T",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Unary", Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			defer u.enter()()
			note(ctx, "/test.T/Unary")
			if d, ok := ctx.Deadline(); ok {
				u.lastDeadline.Store(int64(time.Until(d)))
			} else {
				u.lastDeadline.Store(-1)
			}
			var in []byte
			if err := dec(&in); err != nil {
				return nil, err
			}
			if string(in) == "hold" {
				select {
				case <-u.release:
				case <-ctx.Done():
					return nil, ctx.Err()
				}
			}
			if string(in) == "exhausted" {
				return nil, status.Error(codes.ResourceExhausted, "upstream is full")
			}
			if u.unaryBeforeAnswer != nil {
				u.unaryBeforeAnswer()
			}
			return &in, nil
		}}},
		Streams: []grpc.StreamDesc{
			{StreamName: "Count", ServerStreams: true, Handler: func(_ any, s grpc.ServerStream) error {
				defer u.enter()()
				var in []byte
				if err := s.RecvMsg(&in); err != nil {
					return err
				}
				n, _ := strconv.Atoi(string(in))
				for i := range n {
					if u.step != nil {
						select {
						case <-u.step:
						case <-s.Context().Done():
							return s.Context().Err()
						}
					}
					m := []byte(strconv.Itoa(i))
					if err := s.SendMsg(&m); err != nil {
						return err
					}
				}
				return nil
			}},
			{StreamName: "Chat", ServerStreams: true, ClientStreams: true, Handler: func(_ any, s grpc.ServerStream) error {
				defer u.enter()()
				for {
					var in []byte
					if err := s.RecvMsg(&in); errors.Is(err, io.EOF) {
						return nil
					} else if err != nil {
						return err
					}
					out := append([]byte("echo "), in...)
					if err := s.SendMsg(&out); err != nil {
						return err
					}
				}
			}},
		},
	}
	srv := grpc.NewServer(grpc.ForceServerCodec(rawCodec{}))
	srv.RegisterService(&desc, nil)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		u.releaseAll()
		srv.Stop()
	})
	u.addr = ln.Addr().String()
	return u
}

// grpcClient dials the agent with grpc-go, naming the downstream by the authority; extra
// options (a service config) are added.
func grpcClient(t *testing.T, a *testAgent, downstream string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	addr := strings.TrimPrefix(a.srv.URL, "http://")
	opts = append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithAuthority(downstream),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})),
	}, opts...)
	cc, err := grpc.NewClient("passthrough:///"+addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

func unary(ctx context.Context, cc *grpc.ClientConn, msg string, opts ...grpc.CallOption) (string, error) {
	in, out := []byte(msg), []byte(nil)
	err := cc.Invoke(ctx, "/test.T/Unary", &in, &out, opts...)
	return string(out), err
}

func grpcDownstream(name, addr string, permits int32) assignment.Downstream {
	d := downstream(name, "http://"+addr, permits)
	d.RequestTimeout = assignment.Duration(10 * time.Second)
	return d
}

// Unary, server streaming and bidi calls pass through with their messages, metadata and status;
// each holds one permit while it lasts (in flight 1 and one stream open mid-stream, 0 after).
func TestGRPCThroughAgent(t *testing.T) {
	u := newGRPCUpstream(t)
	a := newAgent(t, nil)
	a.apply(t, nil, grpcDownstream("echo", u.addr, 5))
	cc := grpcClient(t, a, "echo")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	got, err := unary(ctx, cc, "hello")
	if err != nil || got != "hello" {
		t.Fatalf("unary: %q %v", got, err)
	}
	u.mu.Lock()
	path := u.lastPath
	u.mu.Unlock()
	if path != "/test.T/Unary" {
		t.Fatalf("the upstream saw %q", path)
	}
	// An upstream status passes through as it is (and the breaker counts it as a 429).
	if _, err := unary(ctx, cc, "exhausted"); status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "upstream is full") {
		t.Fatalf("upstream status: %v", err)
	}
	if n := metricValue(t, a.metrics, "apportion_agent_upstream_429_total", "downstream", "echo"); n != 1 {
		t.Fatalf("upstream_429_total %v, want 1 (RESOURCE_EXHAUSTED)", n)
	}

	// Server streaming, stepped: mid-stream the call holds its permit.
	u.step = make(chan struct{})
	cs, err := cc.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, "/test.T/Count")
	if err != nil {
		t.Fatal(err)
	}
	n := []byte("20")
	if err := cs.SendMsg(&n); err != nil {
		t.Fatal(err)
	}
	_ = cs.CloseSend()
	u.step <- struct{}{}
	var m []byte
	if err := cs.RecvMsg(&m); err != nil || string(m) != "0" {
		t.Fatalf("first message %q %v", m, err)
	}
	if in := a.enf.Table().Lookup("echo").Sem.Stats().InFlight; in != 1 {
		t.Fatalf("mid-stream: %d permits held, want 1", in)
	}
	if v := metricValue(t, a.metrics, "apportion_agent_h2_streams_open", "downstream", "echo"); v != 1 {
		t.Fatalf("h2_streams_open %v mid-stream, want 1", v)
	}
	for i := 1; i < 20; i++ {
		u.step <- struct{}{}
		if err := cs.RecvMsg(&m); err != nil || string(m) != strconv.Itoa(i) {
			t.Fatalf("message %d: %q %v", i, m, err)
		}
	}
	if err := cs.RecvMsg(&m); !errors.Is(err, io.EOF) {
		t.Fatalf("end of stream: %v", err)
	}
	u.step = nil

	// Bidi.
	bs, err := cc.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}, "/test.T/Chat")
	if err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		out := []byte("m" + strconv.Itoa(i))
		if err := bs.SendMsg(&out); err != nil {
			t.Fatal(err)
		}
		var in []byte
		if err := bs.RecvMsg(&in); err != nil || string(in) != "echo m"+strconv.Itoa(i) {
			t.Fatalf("bidi %d: %q %v", i, in, err)
		}
		if i == 5 {
			if in := a.enf.Table().Lookup("echo").Sem.Stats().InFlight; in != 1 {
				t.Fatalf("mid-chat: %d permits held, want 1", in)
			}
		}
	}
	_ = bs.CloseSend()
	if err := bs.RecvMsg(&m); !errors.Is(err, io.EOF) {
		t.Fatalf("end of chat: %v", err)
	}
	wait.For(t, "permits released", func() bool { return a.enf.Table().Lookup("echo").Sem.Stats().InFlight == 0 })
	if v := metricValue(t, a.metrics, "apportion_agent_h2_streams_open", "downstream", "echo"); v != 0 {
		t.Fatalf("h2_streams_open %v after the streams, want 0", v)
	}
	if v := metricValue(t, a.metrics, "apportion_agent_h2_stream_duration_seconds", "downstream", "echo"); v != 4 {
		t.Fatalf("h2_stream_duration_seconds has %v samples, want 4", v)
	}
	// The path may name the downstream too (an interceptor that prefixes the method).
	in, out := []byte("prefixed"), []byte(nil)
	if err := cc.Invoke(ctx, "/echo/test.T/Unary", &in, &out); err != nil || string(out) != "prefixed" {
		t.Fatalf("path-prefixed call: %q %v", out, err)
	}
}

// Permits count streams, never connections: 50 calls on one HTTP/2 connection with 5 permits
// have at most 5 at the upstream at once, and the rest are refused RESOURCE_EXHAUSTED (a
// trailers-only status, no pushback: when a permit frees is not known).
func TestGRPCPermitsPerStream(t *testing.T) {
	u := newGRPCUpstream(t)
	a := newAgent(t, nil)
	a.apply(t, nil, grpcDownstream("echo", u.addr, 5))
	cc := grpcClient(t, a, "echo")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	const calls = 50
	var wg sync.WaitGroup
	var ok, refused atomic.Int32
	errs := make(chan error, calls)
	for range calls {
		wg.Go(func() {
			var trailer metadata.MD
			_, err := unary(ctx, cc, "hold", grpc.Trailer(&trailer))
			switch {
			case err == nil:
				ok.Add(1)
			case status.Code(err) == codes.ResourceExhausted:
				refused.Add(1)
				if len(trailer.Get("grpc-retry-pushback-ms")) != 0 || trailer.Get("x-apportion-reason")[0] != "no-permit" {
					errs <- errors.New("no-permit refusal with trailer " + strings.Join(trailer.Get("grpc-retry-pushback-ms"), ",") + " reason " + strings.Join(trailer.Get("x-apportion-reason"), ","))
				}
			default:
				errs <- err
			}
		})
	}
	// Every call either reached the upstream or was refused (acquireTimeout 50ms).
	wait.For(t, "45 refusals", func() bool { return refused.Load()+ok.Load() >= calls-5 })
	u.releaseAll()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	t.Logf("%d forwarded, %d refused, upstream peak %d", ok.Load(), refused.Load(), u.peak.Load())
	if p := u.peak.Load(); p != 5 {
		t.Fatalf("upstream peak %d with 5 permits, want 5", p)
	}
	if ok.Load() != 5 || refused.Load() != calls-5 {
		t.Fatalf("%d forwarded and %d refused, want 5 and %d", ok.Load(), refused.Load(), calls-5)
	}
	if got := metricValue(t, a.metrics, "apportion_agent_rejected_total", "downstream", "echo", "reason", "no-permit"); got != calls-5 {
		t.Fatalf("rejected_total{no-permit} %v", got)
	}
}

// A refusal whose wait is known carries grpc-retry-pushback-ms, and grpc-go's retry policy
// honours it: with a rate of one call per 2 s, the second of two calls is refused (the next
// token is up to 2 s away, far beyond the 50 ms acquire timeout, however slow the machine is
// between the two calls) and retried after the pushback, well before the policy's own backoff
// (60 s, beyond the call's deadline) would have.
func TestGRPCRetryPushback(t *testing.T) {
	u := newGRPCUpstream(t)
	a := newAgent(t, nil)
	d := grpcDownstream("echo", u.addr, 5)
	d.Rate = &assignment.Rate{PerSecond: 0.5, Burst: 1, Mode: "TokenBucket"}
	a.apply(t, nil, d)
	const serviceConfig = `{"methodConfig": [{"name": [{"service": "test.T"}], "retryPolicy": {
		"maxAttempts": 2, "initialBackoff": "60s", "maxBackoff": "60s", "backoffMultiplier": 1,
		"retryableStatusCodes": ["RESOURCE_EXHAUSTED"]}}]}`
	cc := grpcClient(t, a, "echo", grpc.WithDefaultServiceConfig(serviceConfig))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := unary(ctx, cc, "one"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	got, err := unary(ctx, cc, "two")
	took := time.Since(start)
	t.Logf("second call took %v (refused, retried after the pushback)", took)
	if err != nil || got != "two" {
		t.Fatalf("the retried call: %q %v", got, err)
	}
	if r := metricValue(t, a.metrics, "apportion_agent_rejected_total", "downstream", "echo", "reason", "rate-limited"); r != 1 {
		t.Fatalf("rejected_total{rate-limited} %v, want 1: the call was not refused once", r)
	}
	if took >= 20*time.Second {
		t.Fatalf("the retry took %v: the pushback was not honoured", took)
	}
}

// The app's deadline (grpc-timeout) bounds the call: the upstream is told what is left, and a
// call still at the upstream at the deadline ends with DEADLINE_EXCEEDED and frees its permit.
func TestGRPCDeadline(t *testing.T) {
	u := newGRPCUpstream(t)
	a := newAgent(t, nil)
	d := grpcDownstream("echo", u.addr, 5)
	zero := assignment.Duration(0)
	d.AbandonedHold = &zero
	a.apply(t, nil, d)
	cc := grpcClient(t, a, "echo")
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := unary(ctx, cc, "hold")
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("held past the deadline: %v", err)
	}
	if left := time.Duration(u.lastDeadline.Load()); left < 0 || left > 300*time.Millisecond {
		t.Fatalf("the upstream's deadline: %v left, want a grpc-timeout of at most 300ms", left)
	}
	wait.For(t, "permit released", func() bool { return a.enf.Table().Lookup("echo").Sem.Stats().InFlight == 0 })

	// The agent's own answer at the deadline, seen without a client-side timer: a raw HTTP/2
	// request with grpc-timeout 200m to a call that never answers gets a trailers-only
	// DEADLINE_EXCEEDED.
	res := rawGRPC(t, a, "echo", "/test.T/Unary", "hold", http.Header{"Grpc-Timeout": {"200m"}})
	if res.StatusCode != http.StatusOK || res.Header.Get("Grpc-Status") != "4" {
		t.Fatalf("raw call past its deadline: %d %v", res.StatusCode, res.Header)
	}
}

// rawAnswer is an answer as rawGRPC read it.
type rawAnswer struct {
	StatusCode      int
	ContentLength   int64
	Header, Trailer http.Header
}

// rawGRPC sends one gRPC request with net/http's HTTP/2 client (h2c), to read the agent's
// answer as the wire has it; the body is read to its end (the trailers are then known).
func rawGRPC(t *testing.T, a *testAgent, authority, path, msg string, h http.Header) rawAnswer {
	t.Helper()
	frame := make([]byte, 5+len(msg))
	binary.BigEndian.PutUint32(frame[1:], uint32(len(msg)))
	copy(frame[5:], msg)
	req, err := http.NewRequest(http.MethodPost, a.srv.URL+path, strings.NewReader(string(frame)))
	if err != nil {
		t.Fatal(err)
	}
	req.Host = authority
	for k, v := range h {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/grpc")
	req.Header.Set("Te", "trailers")
	res, err := h2cClient(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, res.Body)
	res.Body.Close()
	return rawAnswer{StatusCode: res.StatusCode, ContentLength: res.ContentLength, Header: res.Header, Trailer: res.Trailer}
}

// newAgentWith is newAgent (on the real clock) with o's UpstreamTLS.
func newAgentWith(t *testing.T, o Options) *testAgent {
	t.Helper()
	a := newAgent(t, nil)
	a.h = New(Options{Enforcer: a.enf, Logger: quietLogger(), UpstreamTLS: o.UpstreamTLS})
	a.srv = serveAgent(t, a.h)
	return a
}

func h2cClient(t *testing.T) *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: &p}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

// The agent's refusals to a gRPC caller are statuses in a trailers-only response: HTTP 200,
// application/grpc, grpc-status and a percent-encoded grpc-message, and never a body.
func TestGRPCRefusals(t *testing.T) {
	u := newGRPCUpstream(t)
	a := newAgent(t, nil)
	open := grpcDownstream("open", u.addr, 1)
	open.Breaker = &assignment.Breaker{FailureRatePercent: 50, MinimumCalls: 1, Window: assignment.Duration(10 * time.Second),
		SlowCallThreshold: assignment.Duration(10 * time.Second), SlowCallRatePercent: 100,
		OpenDuration: assignment.Duration(30 * time.Second), HalfOpenProbes: 1}
	dead := grpcDownstream("dead", "127.0.0.1:1", 1)
	a.apply(t, nil, grpcDownstream("zero", u.addr, 0), open, dead)
	for _, tc := range []struct {
		authority, msg string
		want           grpcstatus.Code
		pushback       bool
	}{
		{"zero", "x", grpcstatus.ResourceExhausted, false}, // no permit
		{"nosuch", "x", grpcstatus.Unimplemented, false},   // unknown downstream
		{"dead", "x", grpcstatus.Unavailable, false},       // the upstream refuses connections
		{"open", "exhausted", grpcstatus.OK, false},        // the upstream's RESOURCE_EXHAUSTED opens the breaker...
		{"open", "x", grpcstatus.Unavailable, true},        // ...which refuses the next with its time left
	} {
		res := rawGRPC(t, a, tc.authority, "/test.T/Unary", tc.msg, nil)
		if tc.want == grpcstatus.OK {
			continue
		}
		st := res.Header.Get("Grpc-Status")
		if res.StatusCode != http.StatusOK || st != strconv.Itoa(int(tc.want)) || res.Header.Get("Content-Type") != "application/grpc" ||
			res.Header.Get("Grpc-Message") == "" || res.ContentLength > 0 || len(res.Trailer) != 0 {
			t.Fatalf("%s: %d %v trailer %v", tc.authority, res.StatusCode, res.Header, res.Trailer)
		}
		if pb := res.Header.Get("Grpc-Retry-Pushback-Ms"); (pb != "") != tc.pushback {
			t.Fatalf("%s: grpc-retry-pushback-ms %q", tc.authority, pb)
		}
		t.Logf("%s: grpc-status %s, %q, pushback %q", tc.authority, st, res.Header.Get("Grpc-Message"), res.Header.Get("Grpc-Retry-Pushback-Ms"))
	}
}

// An upstream whose stream breaks after its header was passed on: the gRPC client gets
// UNAVAILABLE in the trailers, not a reset stream (INTERNAL), and the breaker counts a failure.
func TestGRPCUpstreamBreaksMidStream(t *testing.T) {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/grpc")
		_, _ = w.Write([]byte{0, 0, 0, 0, 1, '0'}) // one message
		http.NewResponseController(w).Flush()
		panic(http.ErrAbortHandler) // RST_STREAM
	}))
	up.Config.Protocols = &p
	up.Config.ErrorLog = nil
	up.Start()
	t.Cleanup(up.Close)
	a := newAgent(t, nil)
	a.apply(t, nil, grpcDownstream("brk", strings.TrimPrefix(up.URL, "http://"), 1))
	cc := grpcClient(t, a, "brk")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs, err := cc.NewStream(ctx, &grpc.StreamDesc{ServerStreams: true}, "/test.T/Count")
	if err != nil {
		t.Fatal(err)
	}
	n := []byte("5")
	_ = cs.SendMsg(&n)
	_ = cs.CloseSend()
	var m []byte
	if err := cs.RecvMsg(&m); err != nil || string(m) != "0" {
		t.Fatalf("first message: %q %v", m, err)
	}
	err = cs.RecvMsg(&m)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "apportion") {
		t.Fatalf("the broken stream: %v (want UNAVAILABLE from the agent)", err)
	}
	if f := metricValue(t, a.metrics, "apportion_agent_upstream_responses_total", "downstream", "brk", "class", "2xx"); f != 1 {
		t.Fatalf("upstream_responses_total{2xx} %v", f)
	}
}

// A plain HTTP/2 caller (not gRPC) is forwarded over HTTP/2 and refused with problem+json, as
// over HTTP/1.1.
func TestH2CPlainCaller(t *testing.T) {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-T")
		_, _ = io.WriteString(w, r.Proto+" "+r.URL.Path)
		w.Header().Set("X-T", "t")
	}))
	up.Config.Protocols = &p
	up.Start()
	t.Cleanup(up.Close)
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("plain", up.URL+"/base", 2), downstream("none", up.URL, 0))
	c := h2cClient(t)
	res, err := c.Get(a.srv.URL + "/plain/x")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.ProtoMajor != 2 || string(b) != "HTTP/2.0 /base/x" || res.Trailer.Get("X-T") != "t" {
		t.Fatalf("h2c: %s %q trailer %v", res.Proto, b, res.Trailer)
	}
	res, err = c.Get(a.srv.URL + "/none/x")
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusServiceUnavailable || res.Header.Get("Content-Type") != "application/problem+json" ||
		!strings.Contains(string(b), "APPORTION_NO_PERMIT") {
		t.Fatalf("refusal over h2: %d %s %q", res.StatusCode, res.Header.Get("Content-Type"), b)
	}
}

// An https upstream is reached over TLS with ALPN h2, with the TLS configuration the
// UpstreamTLS seam gives (here the test server's CA); one that does not speak h2 fails the call
// with UNAVAILABLE, naming why.
func TestH2UpstreamTLS(t *testing.T) {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, r.Proto)
	})
	h2up := httptest.NewUnstartedServer(h)
	h2up.EnableHTTP2 = true
	h2up.StartTLS()
	t.Cleanup(h2up.Close)
	h1up := httptest.NewTLSServer(h) // HTTP/1.1 only
	t.Cleanup(h1up.Close)
	pool := x509.NewCertPool()
	pool.AddCert(h2up.Certificate())
	pool.AddCert(h1up.Certificate())
	a := newAgentWith(t, Options{UpstreamTLS: func(cfg *enforce.Config) (*tls.Config, error) {
		return &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}, nil
	}})
	a.apply(t, nil, downstream("tls2", h2up.URL, 2), downstream("tls1", h1up.URL, 2))
	c := h2cClient(t)
	res, err := c.Get(a.srv.URL + "/tls2/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if string(b) != "HTTP/2.0" {
		t.Fatalf("over TLS: %d %q", res.StatusCode, b)
	}
	res, err = c.Get(a.srv.URL + "/tls1/")
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusBadGateway || !strings.Contains(string(b), "HTTP/2") {
		t.Fatalf("an https upstream without h2: %d %q", res.StatusCode, b)
	}
}

// BenchmarkGRPCAddedLatency: what the agent adds to one gRPC unary call at a time (the
// client's calls alternate between the upstream directly and the agent, b.N of each, in one
// process): the p50 and the minimum of each way, and the added p50 and minimum as metrics. On a
// busy machine the p50s carry other processes' time slices; the minimum much less.
func BenchmarkGRPCAddedLatency(b *testing.B) {
	u := newGRPCUpstream(b)
	cc := benchAgentConn(b, u)
	dc, err := grpc.NewClient("passthrough:///"+u.addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { dc.Close() })
	ctx := context.Background()
	var direct, agent []time.Duration
	for i := range b.N + 100 {
		for _, c := range []*grpc.ClientConn{dc, cc} {
			start := time.Now()
			if _, err := unary(ctx, c, "x"); err != nil {
				b.Fatal(err)
			}
			if i < 100 {
				continue // warm-up
			}
			if c == dc {
				direct = append(direct, time.Since(start))
			} else {
				agent = append(agent, time.Since(start))
			}
		}
	}
	slices.Sort(direct)
	slices.Sort(agent)
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	b.ReportMetric(us(agent[len(agent)/2]-direct[len(direct)/2]), "added-p50-µs")
	b.ReportMetric(us(agent[0]-direct[0]), "added-min-µs")
	b.Logf("direct p50 %v min %v; through the agent p50 %v min %v", direct[len(direct)/2], direct[0], agent[len(agent)/2], agent[0])
}

// benchAgentConn serves an agent in front of u (1,000 permits) and returns a gRPC client
// connection to it naming the downstream by the authority.
func benchAgentConn(b *testing.B, u *grpcUpstream) *grpc.ClientConn {
	m := metrics.New()
	enf := enforce.New(enforce.Options{Metrics: m, Logger: quietLogger()})
	d := grpcDownstream("echo", u.addr, 1000)
	if _, err := enf.Apply(&assignment.Assignment{Epoch: 1, Generation: 1, LeaseTTL: assignment.Duration(10 * time.Minute),
		Downstreams: []assignment.Downstream{d}}, time.Time{}); err != nil {
		b.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := &h1.Server{Refusal: Refusal, Handler: New(Options{Enforcer: enf, Logger: quietLogger()}), Logger: quietLogger(),
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 250}}
	go srv.Serve(ln)
	b.Cleanup(func() { srv.Close() })
	cc, err := grpc.NewClient("passthrough:///"+ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithAuthority("echo"), grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})))
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cc.Close() })
	return cc
}

// BenchmarkGRPCUnary: unary gRPC calls through the agent (grpc-go client and server in the
// process, 8 in parallel on one connection), for profiles of the HTTP/2 path; the figures that
// count are make bench-proxy's (its own processes, one core each).
func BenchmarkGRPCUnary(b *testing.B) {
	cc := benchAgentConn(b, newGRPCUpstream(b))
	ctx := context.Background()
	if _, err := unary(ctx, cc, "warm"); err != nil {
		b.Fatal(err)
	}
	b.SetParallelism(8)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := unary(ctx, cc, "x"); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// Hostile HTTP/2 requests through the agent's listener: what RFC 9113 §8.2 calls malformed (a
// connection-specific field, Transfer-Encoding, a TE other than trailers, an uppercase name, a
// Content-Length its DATA contradicts) is refused by net/http's server (a reset stream, a 400, or
// the connection closed with PROTOCOL_ERROR), before the agent's handler but for the body whose
// length lies, which is streamed and found short only as it is read (a 400 to the app, the
// upstream's stream reset): the upstream never gets a whole request of them, and a valid call
// then passes.
func TestH2CHostileRequests(t *testing.T) {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	var upstreamCalls atomic.Int32 // requests the upstream read whole
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := io.Copy(io.Discard, r.Body); err == nil {
			upstreamCalls.Add(1)
		}
		_, _ = io.WriteString(w, "ok")
	}))
	up.Config.Protocols = &p
	up.Start()
	t.Cleanup(up.Close)
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("h", up.URL, 4))
	// call sends one request on a new connection and returns what became of it.
	call := func(extra [][2]string, body string) string {
		c, err := net.Dial("tcp", strings.TrimPrefix(a.srv.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		fr := http2.NewFramer(c, c)
		if _, err := io.WriteString(c, http2.ClientPreface); err != nil {
			t.Fatal(err)
		}
		if err := fr.WriteSettings(); err != nil {
			t.Fatal(err)
		}
		var block bytes.Buffer
		enc := hpack.NewEncoder(&block)
		for _, f := range append([][2]string{{":method", "POST"}, {":scheme", "http"}, {":authority", "agent"}, {":path", "/h/x"}}, extra...) {
			_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
		}
		if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block.Bytes(), EndHeaders: true, EndStream: body == ""}); err != nil {
			t.Fatal(err)
		}
		if body != "" {
			_ = fr.WriteData(1, true, []byte(body))
		}
		dec := hpack.NewDecoder(4096, nil)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return "closed: " + err.Error()
			}
			switch f := f.(type) {
			case *http2.RSTStreamFrame:
				return "reset " + f.ErrCode.String()
			case *http2.GoAwayFrame:
				if f.ErrCode != http2.ErrCodeNo {
					return "goaway " + f.ErrCode.String()
				}
			case *http2.HeadersFrame:
				fields, err := dec.DecodeFull(f.HeaderBlockFragment())
				if err != nil {
					t.Fatal(err)
				}
				for _, hf := range fields {
					if hf.Name == ":status" {
						return hf.Value
					}
				}
			}
		}
	}
	for _, extra := range [][][2]string{
		{{"connection", "keep-alive"}},
		{{"transfer-encoding", "chunked"}},
		{{"te", "gzip"}},
		{{"X-Upper", "v"}},
		{{"content-length", "10"}},
	} {
		o := call(extra, "abc")
		t.Logf("%v: %s", extra, o)
		if o != "reset PROTOCOL_ERROR" && o != "400" && o != "goaway PROTOCOL_ERROR" {
			t.Errorf("hostile request %v: %s", extra, o)
		}
	}
	if n := upstreamCalls.Load(); n != 0 {
		t.Fatalf("the upstream read %d of the hostile requests whole", n)
	}
	if o := call(nil, "abc"); o != "200" || upstreamCalls.Load() != 1 {
		t.Fatalf("the valid call: %s; the upstream got %d calls, want 1", o, upstreamCalls.Load())
	}
}
