package main

// The gRPC part: unary calls through the agent (h2c in, h2c out, one permit per stream) beside
// calling the upstream directly, nginx's grpc_pass and HAProxy's proto h2, with grpc-go as the
// load generator and as the upstream (which answers at once). The target: the agent adds at
// most 150 µs at p50 (docs/benchmarks.md).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// grpcMethod is the upstream's unary method: it answers the request's bytes.
const grpcMethod = "/bench.B/Echo"

// grpcTargetP50 is the agent's target for the p50 it adds to a gRPC unary call.
const grpcTargetP50 = 150.0 // µs

type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "raw" }

// serveGRPCUpstream serves grpcMethod on addr; it returns only when it cannot serve.
func serveGRPCUpstream(addr string) error {
	ln, err := listen(addr)
	if err != nil {
		return err
	}
	return newGRPCUpstream().Serve(ln)
}

// newGRPCUpstream returns the upstream's server, to be served: grpcMethod answers at once.
func newGRPCUpstream() *grpc.Server {
	srv := grpc.NewServer(grpc.ForceServerCodec(rawCodec{}))
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: "bench.B",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Echo", Handler: func(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			var in []byte
			if err := dec(&in); err != nil {
				return nil, err
			}
			return &in, nil
		}}},
	}, nil)
	return srv
}

// The floors of the arrangement: what any proxy adds, run like the agent (this binary's own
// subcommands, GOMAXPROCS=1, on the proxies' CPU). floor-tcp relays the bytes of each
// connection both ways (io.Copy, nothing parsed: no HTTP/2 at all): the two extra hops across
// cores and the relay's wake-ups. floor-h2 is a do-nothing HTTP/2 proxy in library code only:
// net/http's h2c server, the request sent on with net/http's HTTP/2 transport (h2c), the answer's
// header, body (flushed as it arrives) and trailers passed back; no admission, no copies of
// header maps. The agent's HTTP/2 path is that plus its policy; the distance between the two
// floors is the HTTP/2 library's share. floor-grpc (floorgrpc.go) is the same on grpc-go's
// server and client transport instead of net/http's HTTP/2.
func floorTarget(name, self, upAddr string) target {
	return target{name: name, start: func(cpu string) (string, *exec.Cmd, error) {
		addr := freeAddr()
		cmd := exec.Command("taskset", "-c", cpu, self, name, addr, upAddr)
		cmd.Env = append(os.Environ(), "GOMAXPROCS=1")
		return addr, cmd, nil
	}}
}

// serveTCPRelay relays every connection to addr to upAddr, bytes both ways.
func serveTCPRelay(addr, upAddr string) error {
	ln, err := listen(addr)
	if err != nil {
		return err
	}
	return serveEach(ln, func(c net.Conn) {
		defer func() { _ = c.Close() }()
		u, err := net.Dial("tcp", upAddr)
		if err != nil {
			return
		}
		defer func() { _ = u.Close() }()
		go func() { _, _ = io.Copy(u, c) }()
		_, _ = io.Copy(c, u)
	})
}

// serveH2Null serves h2c on addr and forwards every request to upAddr over h2c, as little as an
// HTTP/2 proxy can do with the library (see floorTarget and newH2Null).
func serveH2Null(addr, upAddr string) error {
	ln, err := listen(addr)
	if err != nil {
		return err
	}
	return newH2Null(upAddr).Serve(ln)
}

// newH2Null returns floor-h2's server, to be served: h2c in, every request forwarded to upAddr
// over h2c.
func newH2Null(upAddr string) *http.Server {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	tr := &http.Transport{Protocols: &p, DisableCompression: true}
	return &http.Server{Protocols: &p, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.URL.Scheme, r.URL.Host, r.Host, r.RequestURI = "http", upAddr, "", ""
		if r.ContentLength == 0 {
			r.Body = nil
		}
		res, err := tr.RoundTrip(r)
		if err != nil {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		defer func() { _ = res.Body.Close() }()
		h := w.Header()
		for k, v := range res.Header {
			h[k] = v
		}
		w.WriteHeader(res.StatusCode)
		rc := http.NewResponseController(w)
		buf := make([]byte, 32<<10)
		for {
			n, err := res.Body.Read(buf)
			if n > 0 {
				if _, werr := w.Write(buf[:n]); werr != nil || rc.Flush() != nil {
					return
				}
			}
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				panic(http.ErrAbortHandler)
			}
		}
		for k, v := range res.Trailer {
			h[http.TrailerPrefix+k] = v
		}
	})}
}

func grpcNginxTarget(upAddr, dir string) target {
	return target{name: "nginx", start: func(cpu string) (string, *exec.Cmd, error) {
		addr := freeAddr()
		prefix := filepath.Join(dir, "nginx-grpc")
		t := filepath.Join(prefix, "tmp")
		if err := os.MkdirAll(t, 0o700); err != nil {
			return "", nil, err
		}
		c := nginxHead(prefix, t) + `
  upstream up { server ` + upAddr + `; keepalive 64; keepalive_requests 100000000; }
  server {
    listen ` + addr + ` http2;
    http2_max_requests 100000000;
    location / { grpc_pass grpc://up; }
  }
}
`
		cfg := filepath.Join(prefix, "nginx.conf")
		if err := os.WriteFile(cfg, []byte(c), 0o600); err != nil {
			return "", nil, err
		}
		return addr, exec.Command("taskset", "-c", cpu, "nginx", "-p", prefix, "-c", cfg, "-e", filepath.Join(prefix, "error.log")), nil
	}}
}

func grpcHAProxyTarget(upAddr, dir string) target {
	return target{name: "haproxy", start: func(cpu string) (string, *exec.Cmd, error) {
		addr := freeAddr()
		cfg := filepath.Join(dir, "haproxy-grpc.cfg")
		c := haproxyHead + `
frontend fe
  bind ` + addr + ` proto h2
  default_backend be
backend be
  server up ` + upAddr + ` proto h2
`
		if err := os.WriteFile(cfg, []byte(c), 0o600); err != nil {
			return "", nil, err
		}
		return addr, exec.Command("taskset", "-c", cpu, "haproxy", "-db", "-f", cfg), nil
	}}
}

// grpcClient is one ClientConn to addr (its calls are streams on one connection), naming the
// agent's downstream "bench" by the authority.
func grpcClient(addr string) (*grpc.ClientConn, error) {
	return grpc.NewClient("passthrough:///"+addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithAuthority("bench"),
		grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})))
}

func grpcCall(cc *grpc.ClientConn) (time.Duration, error) {
	in, out := []byte("ping"), []byte(nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	err := cc.Invoke(ctx, grpcMethod, &in, &out)
	return time.Since(start), err
}

// measureGRPC starts t (nil start: the upstream itself), warms it up and runs the open loop of
// unary calls: latency, and the proxy's CPU per 1,000 calls/s.
func measureGRPC(t target, o options, upAddr string) (result, error) {
	addr, pid := upAddr, 0
	if t.start != nil {
		a, cmd, stop, err := startProxy(t, o)
		if err != nil {
			return result{}, err
		}
		defer stop()
		addr, pid = a, cmd.Process.Pid
	}
	cc, err := grpcClient(addr)
	if err != nil {
		return result{}, err
	}
	defer func() { _ = cc.Close() }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		_, err := grpcCall(cc)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			return result{}, fmt.Errorf("%s does not answer gRPC: %w", t.name, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	_, _ = grpcOpenLoop(cc, o.grpcRate, time.Second) // warm-up
	var before time.Duration
	if pid != 0 {
		before = cpuTime(pid)
	}
	start := time.Now()
	lat, errs := grpcOpenLoop(cc, o.grpcRate, o.open)
	elapsed := time.Since(start)
	var r result
	if pid != 0 {
		r.cpuPer1000 = (cpuTime(pid) - before).Seconds() / elapsed.Seconds() / (float64(o.grpcRate) / 1000)
	}
	slices.Sort(lat)
	if len(lat) > 0 {
		r.p50, r.p99 = micros(lat[len(lat)/2]), micros(lat[min(len(lat)-1, len(lat)*99/100)])
	}
	r.errors = errs
	return r, nil
}

// grpcOpenLoop sends unary calls at rate for dur, each from its own goroutine at its scheduled
// time, on one connection.
func grpcOpenLoop(cc *grpc.ClientConn, rate int, dur time.Duration) ([]time.Duration, int64) {
	return openLoop(rate, dur, func() (time.Duration, error) { return grpcCall(cc) })
}

// runGRPC measures the gRPC targets in rounds, as run does the HTTP ones, and reports them.
func runGRPC(o options, self, dir string) error {
	upAddr := freeAddr()
	up := exec.Command("taskset", "-c", o.loadCPU, self, "grpc-upstream", upAddr)
	up.Stderr = os.Stderr
	up.SysProcAttr = orphanKill()
	if err := up.Start(); err != nil {
		return err
	}
	defer func() { _ = up.Process.Kill(); _ = up.Wait() }()
	targets := []target{{name: "direct"}, agentTarget("agent", o.agent, upstream{addr: upAddr}, false, dir, "")}
	for n := range strings.SplitSeq(o.grpcProcs, ",") {
		if n != "" {
			// The agent with GOMAXPROCS=n, allowed every CPU, as -agent-procs (-grpc-procs).
			targets = append(targets, agentTarget("agent-gmp"+n, o.agent, upstream{addr: upAddr}, false, dir, n))
		}
	}
	if o.agentBefore != "" {
		targets = append(targets, agentTarget("agent-before", o.agentBefore, upstream{addr: upAddr}, false, dir, ""))
	}
	targets = append(targets, grpcHAProxyTarget(upAddr, dir), grpcNginxTarget(upAddr, dir),
		floorTarget("floor-tcp", self, upAddr), floorTarget("floor-h2", self, upAddr), floorTarget("floor-grpc", self, upAddr),
		floorTarget("floor-grpc-tuned", self, upAddr))
	targets = onlyTargets(targets, o.only)
	fmt.Printf("\ngRPC unary (grpc-go client and upstream): %d rounds; open loop %d calls/s for %v on one connection\n", o.rounds, o.grpcRate, o.open)
	res := map[string][]result{}
	for r := range o.rounds {
		order := slices.Clone(targets[1:])
		rot := r % max(len(order), 1)
		order = append(append([]target{targets[0]}, order[rot:]...), order[:rot]...)
		for _, t := range order {
			m, err := measureGRPC(t, o, upAddr)
			if err != nil {
				// A proxy without gRPC support (an nginx built without it) is reported, not fatal.
				fmt.Printf("round %d %-13s gRPC: %v\n", r+1, t.name, err)
				continue
			}
			res[t.name] = append(res[t.name], m)
			fmt.Printf("round %d %-13s gRPC p50 %7.1f µs  p99 %7.1f µs  cpu %.4f vCPU/1000 calls/s  (errors %d)\n",
				r+1, t.name, m.p50, m.p99, m.cpuPer1000, m.errors)
		}
	}
	direct := res["direct"]
	fmt.Println()
	fmt.Println("gRPC proxy     added p50 µs             added p99 µs             vCPU per 1,000 calls/s")
	added := map[string][]float64{}
	cpu := map[string][]float64{}
	for _, t := range targets[1:] {
		rs := res[t.name]
		if len(rs) != len(direct) {
			fmt.Printf("%-13s  not measured in every round\n", t.name)
			continue
		}
		var p50, p99 []float64
		for i, r := range rs {
			p50 = append(p50, r.p50-direct[i].p50)
			p99 = append(p99, r.p99-direct[i].p99)
			cpu[t.name] = append(cpu[t.name], r.cpuPer1000)
		}
		added[t.name] = p50
		fmt.Printf("%-13s  %-23s  %-23s  %s\n", t.name, span(p50, "%.0f"), span(p99, "%.0f"), span(cpu[t.name], "%.3f"))
	}
	fmt.Printf("direct         p50 %s µs, p99 %s µs\n",
		span(field(direct, func(r result) float64 { return r.p50 }), "%.0f"),
		span(field(direct, func(r result) float64 { return r.p99 }), "%.0f"))
	if a, ok := added["agent"]; ok {
		s := slices.Clone(a)
		slices.Sort(s)
		verdict := "met"
		if s[len(s)/2] > grpcTargetP50 {
			verdict = "NOT met"
		}
		fmt.Printf("target: the agent adds at most %.0f µs at p50 to a gRPC unary call: %s (median %.0f µs)\n", grpcTargetP50, verdict, s[len(s)/2])
		for _, other := range []string{"haproxy", "nginx", "agent-before", "floor-h2", "floor-grpc"} {
			if b, ok := added[other]; ok {
				fmt.Printf("agent / %s (gRPC): CPU %s×, added p50 %s×\n", other, ratios(cpu["agent"], cpu[other]), ratios(a, b))
			}
		}
	}
	// The two libraries' floors: grpc-go's transport against net/http's HTTP/2.
	if h, ok := added["floor-h2"]; ok {
		for _, f := range []string{"floor-grpc", "floor-grpc-tuned"} {
			if g, ok := added[f]; ok {
				fmt.Printf("%s / floor-h2: CPU %s×, added p50 %s×\n", f, ratios(cpu[f], cpu["floor-h2"]), ratios(g, h))
			}
		}
	}
	return nil
}
