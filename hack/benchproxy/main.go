// Command benchproxy measures the agent side by side with HAProxy and nginx (`make bench-proxy`):
// the same load generator process (this one) drives each proxy in turn, in several rounds that
// alternate the order, against the same upstream, which answers at once. Each proxy runs on one
// core (taskset -c PROXY_CPU, GOMAXPROCS=1 / nbthread 1 / worker_processes 1); the load
// generator and the upstream share the other.
//
// Per proxy and round: the latency it adds over calling the upstream directly (p50 and p99 of
// an open loop at -rate calls/s, minus those of the direct calls in the same round), its CPU
// time per 1,000 calls/s over that loop (the sum of its threads' /proc/<pid>/task/*/schedstat),
// and the rate a closed loop of -conns connections reaches through it. Then per proxy the
// median and range over the rounds, and the agent's ratios to each other proxy. Beside the
// proxies two floors, run like the agent (this binary's subcommands, GOMAXPROCS=1, on the
// proxies' CPU): floor-h1 (floorh1.go), a do-nothing HTTP/1.1 proxy on Go's poller, and
// floor-tcp, a byte relay: what any proxy in Go costs here before it does anything.
//
// The load generator speaks raw HTTP/1.1 over kept-alive connections (a request line, a
// Host, the answer's head and Content-Length body): its cost per call is a fraction of a
// proxy's, so that the closed loop measures the proxy, not the client.
//
// Then gRPC (grpc.go): unary calls of grpc-go's client at -grpc-rate calls/s on one
// connection, to a grpc-go upstream directly, through the agent (h2c both ways), HAProxy
// (proto h2) and nginx (grpc_pass): added p50 and p99, CPU per 1,000 calls/s, and the agent's
// target of at most 150 µs added at p50. Beside them three floors of the arrangement, run like
// the agent: floor-tcp (a byte relay, no HTTP/2), floor-h2 (a do-nothing HTTP/2 proxy on
// net/http's HTTP/2) and floor-grpc (a do-nothing gRPC proxy on grpc-go's transport; and
// floor-grpc-tuned, the same with static flow-control windows and no client retries): what any
// proxy, and any HTTP/2 or gRPC proxy in Go on each library, adds here. -grpc-procs 2 adds the
// agent with GOMAXPROCS=2, allowed every CPU (as -agent-procs).
//
// https origination (-tls, on by default): the same upstream process also serves TLS (a CA and
// an ECDSA P-256 certificate for bench.test made here with crypto/x509), and each proxy is
// measured a second time forwarding to it, verifying the chain against the CA and the name
// (agent-tls: the agent's upstreamTLS caBundle and serverName; haproxy-tls: `ssl verify
// required ca-file … verifyhost`; nginx-tls: `proxy_ssl_verify on`), keeping connections
// alive and resuming sessions as each does by default. The load generator still calls the
// proxies in plain HTTP (the app's side is loopback); "added" is over the direct plain calls,
// so it includes the upstream's share of TLS.
//
// -agent-procs 2,all adds the agent with GOMAXPROCS=2 and with GOMAXPROCS = every CPU, plain
// HTTP, allowed every CPU (taskset) rather than the proxies' one.
//
// Usage (needs haproxy and nginx on PATH: hack/install-proxies.sh):
//
//	benchproxy -agent bin/agent [-agent-before /tmp/agent-old] [-rounds 3] [-rate 2000]
//	           [-open 4s] [-closed 4s] [-conns 64] [-proxy-cpu 1] [-load-cpu 0] [-only agent,haproxy]
//	           [-protocols http,grpc] [-grpc-rate 1000] [-grpc-procs 2] [-tls=false] [-agent-procs 2,all]
//
// It prints figures; it never fails on them.
package main

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/apportion/apportion/internal/testing/tlstest"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "upstream" {
		runtime.GOMAXPROCS(1)
		fmt.Fprintln(os.Stderr, serveUpstream(os.Args[2:])) // it returns only when it fails
		os.Exit(1)
	}
	if len(os.Args) > 3 && strings.HasPrefix(os.Args[1], "floor-") {
		serve := serveTCPRelay
		switch os.Args[1] {
		case "floor-h1":
			serve = serveH1Relay
		case "floor-h2":
			serve = serveH2Null
		case "floor-grpc", "floor-grpc-tuned":
			serve = func(addr, upAddr string) error { return serveGRPCNull(addr, upAddr, os.Args[1] == "floor-grpc-tuned") }
		}
		fmt.Fprintln(os.Stderr, serve(os.Args[2], os.Args[3])) // it returns only when it fails
		os.Exit(1)
	}
	if len(os.Args) > 1 && os.Args[1] == "grpc-upstream" {
		runtime.GOMAXPROCS(1)
		fmt.Fprintln(os.Stderr, serveGRPCUpstream(os.Args[2])) // it returns only when it fails
		os.Exit(1)
	}
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "benchproxy:", err)
		os.Exit(1)
	}
}

type options struct {
	agent, agentBefore string
	rounds, rate       int
	open, closed       time.Duration
	conns              int
	proxyCPU, loadCPU  string
	only               string
	protocols          string
	grpcRate           int
	tls                bool
	agentProcs         string
	grpcProcs          string
}

// upstream is where the proxies forward: plain, and with TLS (tlsAddr "" without -tls).
type upstream struct {
	addr, tlsAddr string
	caFile        string // the CA the TLS upstream's certificate chains to
}

// tlsName is the TLS upstream's name (its certificate's, verified by every proxy).
const tlsName = "bench.test"

func run() error {
	var o options
	flag.StringVar(&o.agent, "agent", "bin/agent", "the agent binary")
	flag.StringVar(&o.agentBefore, "agent-before", "", "another agent binary to measure beside it (e.g. built from an earlier commit)")
	flag.IntVar(&o.rounds, "rounds", 3, "rounds; each measures every proxy once, in a rotated order")
	flag.IntVar(&o.rate, "rate", 2000, "open-loop calls per second")
	flag.DurationVar(&o.open, "open", 4*time.Second, "open-loop duration")
	flag.DurationVar(&o.closed, "closed", 4*time.Second, "closed-loop duration")
	flag.IntVar(&o.conns, "conns", 64, "closed-loop connections")
	flag.StringVar(&o.proxyCPU, "proxy-cpu", "1", "the CPU each proxy runs on (taskset -c)")
	flag.StringVar(&o.loadCPU, "load-cpu", "0", "the CPU of the upstream (taskset -c); run this command on it too")
	flag.StringVar(&o.only, "only", "", "measure only these proxies (comma-separated: agent,agent-before,haproxy,nginx, agent-tls,haproxy-tls,nginx-tls, agent-gmpN, floor-h1,floor-tcp; gRPC: floor-tcp,floor-h2,floor-grpc,floor-grpc-tuned)")
	flag.StringVar(&o.protocols, "protocols", "http,grpc", "what to measure (comma-separated: http, grpc)")
	flag.IntVar(&o.grpcRate, "grpc-rate", 1000, "gRPC open-loop calls per second")
	flag.BoolVar(&o.tls, "tls", true, "also measure https origination (agent-tls, haproxy-tls, nginx-tls)")
	flag.StringVar(&o.grpcProcs, "grpc-procs", "", "also measure the agent with these GOMAXPROCS in the gRPC part, allowed every CPU (comma-separated numbers)")
	flag.StringVar(&o.agentProcs, "agent-procs", "", "also measure the agent with these GOMAXPROCS on every CPU, plain HTTP (comma-separated numbers or all)")
	flag.Parse()
	protocols := strings.Split(o.protocols, ",")

	dir, err := os.MkdirTemp("", "benchproxy")
	if err != nil {
		return err
	}
	defer func() { _ = os.RemoveAll(dir) }()
	self, err := os.Executable()
	if err != nil {
		return err
	}
	fmt.Printf("benchproxy: %d CPUs, load average %s\n", onlineCPUs(), loadAvg())
	if slices.Contains(protocols, "http") {
		if err := runHTTP(o, self, dir); err != nil {
			return err
		}
	}
	if slices.Contains(protocols, "grpc") {
		return runGRPC(o, self, dir)
	}
	return nil
}

// onlyTargets keeps direct and the proxies only names (all when only is empty).
func onlyTargets(targets []target, only string) []target {
	if only == "" {
		return targets
	}
	keep := strings.Split(only, ",")
	return slices.DeleteFunc(targets, func(t target) bool { return t.name != "direct" && !slices.Contains(keep, t.name) })
}

// runHTTP measures the HTTP/1.1 targets in rounds and reports them.
func runHTTP(o options, self, dir string) error {
	upAddr := freeAddr()
	ups := upstream{addr: upAddr}
	args := []string{"-c", o.loadCPU, self, "upstream", upAddr}
	if o.tls {
		ups.tlsAddr = freeAddr()
		crt, key, ca, err := makeCerts(dir)
		if err != nil {
			return err
		}
		ups.caFile = ca
		args = append(args, ups.tlsAddr, crt, key)
	}
	up := exec.Command("taskset", args...)
	up.Stderr = os.Stderr
	up.SysProcAttr = orphanKill()
	if err := up.Start(); err != nil {
		return err
	}
	defer func() { _ = up.Process.Kill(); _ = up.Wait() }()
	if err := waitCall(upAddr); err != nil {
		return fmt.Errorf("upstream: %w", err)
	}

	targets := []target{{name: "direct"}, agentTarget("agent", o.agent, ups, false, dir, "")}
	if o.agentBefore != "" {
		targets = append(targets, agentTarget("agent-before", o.agentBefore, ups, false, dir, ""))
	}
	targets = append(targets, haproxyTarget(ups, false, dir), nginxTarget(ups, false, dir),
		floorTarget("floor-h1", self, upAddr), floorTarget("floor-tcp", self, upAddr))
	if o.tls {
		targets = append(targets, agentTarget("agent-tls", o.agent, ups, true, dir, ""),
			haproxyTarget(ups, true, dir), nginxTarget(ups, true, dir))
	}
	for _, p := range strings.Split(o.agentProcs, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if p == "all" {
			p = strconv.Itoa(onlineCPUs())
		}
		targets = append(targets, agentTarget("agent-gmp"+p, o.agent, ups, false, dir, p))
	}
	targets = onlyTargets(targets, o.only)
	fmt.Printf("HTTP/1.1: %d rounds; open loop %d calls/s for %v, closed loop %d connections for %v; proxies on CPU %s, upstream and load on CPU %s\n",
		o.rounds, o.rate, o.open, o.conns, o.closed, o.proxyCPU, o.loadCPU)
	res := map[string][]result{}
	for r := range o.rounds {
		order := slices.Clone(targets[1:])
		rot := r % len(order)
		order = append(order[rot:], order[:rot]...)
		order = append([]target{targets[0]}, order...) // direct first: the round's baseline
		for _, t := range order {
			m, err := measure(t, o, upAddr)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", r+1, t.name, err)
			}
			res[t.name] = append(res[t.name], m)
			fmt.Printf("round %d %-13s p50 %7.1f µs  p99 %7.1f µs  cpu %.4f vCPU/1000 calls/s  closed loop %8.0f calls/s  (errors %d)\n",
				r+1, t.name, m.p50, m.p99, m.cpuPer1000, m.closedRate, m.errors)
			if e := firstErr.Swap(nil); e != nil && m.errors > 0 {
				fmt.Printf("        first error: %v\n", *e)
			}
		}
	}
	report(res, targets)
	return nil
}

// target is a proxy to measure; start returns its address and process (nil for direct).
type target struct {
	name  string
	start func(proxyCPU string) (addr string, cmd *exec.Cmd, err error)
}

// agentTarget is an agent forwarding to ups (its TLS side when withTLS); procs, when set, is its
// GOMAXPROCS, and it then runs on every CPU.
func agentTarget(name, bin string, ups upstream, withTLS bool, dir, procs string) target {
	return target{name: name, start: func(cpu string) (string, *exec.Cmd, error) {
		boot := filepath.Join(dir, name+".json")
		url, tlsJSON := "http://"+ups.addr, ""
		if withTLS {
			url = "https://" + ups.tlsAddr
			tlsJSON = `,"tls":{"serverName":"` + tlsName + `","caFile":"` + ups.caFile + `","minVersion":"1.2"}`
		}
		b := `{"downstreams":[{"name":"bench","upstream":"` + url + `","permits":4096,"safeDefaultPermits":4096,` +
			`"acquireTimeout":"1s","requestTimeout":"10s","fallback":{"action":"Reject"}` + tlsJSON + `}]}`
		if err := os.WriteFile(boot, []byte(b), 0o600); err != nil {
			return "", nil, err
		}
		addr := freeAddr()
		if procs != "" {
			cpu = "0-" + strconv.Itoa(onlineCPUs()-1)
		}
		// The agent runs on one processor unless GOMAXPROCS is set: as shipped.
		cmd := exec.Command("taskset", "-c", cpu, bin, "--insecure-no-auth", "--bootstrap", boot,
			"--listen", addr, "--control-listen", freeAddr(), "--log-level", "error")
		if procs != "" {
			cmd.Env = append(os.Environ(), "GOMAXPROCS="+procs)
		}
		return addr, cmd, nil
	}}
}

func haproxyTarget(ups upstream, withTLS bool, dir string) target {
	name, server := "haproxy", ups.addr
	if withTLS {
		// Verified as the agent verifies: the chain against the CA, the name; SNI sent.
		name = "haproxy-tls"
		server = ups.tlsAddr + " ssl verify required ca-file " + ups.caFile + " verifyhost " + tlsName + " sni str(" + tlsName + ")"
	}
	return target{name: name, start: func(cpu string) (string, *exec.Cmd, error) {
		addr := freeAddr()
		cfg := filepath.Join(dir, name+".cfg")
		c := haproxyHead + `
  option http-keep-alive
  http-reuse always
frontend fe
  bind ` + addr + `
  default_backend be
backend be
  server up ` + server + `
`
		if err := os.WriteFile(cfg, []byte(c), 0o600); err != nil {
			return "", nil, err
		}
		return addr, exec.Command("taskset", "-c", cpu, "haproxy", "-db", "-f", cfg), nil
	}}
}

func nginxTarget(ups upstream, withTLS bool, dir string) target {
	name, upAddr, scheme, ssl := "nginx", ups.addr, "http", ""
	if withTLS {
		name, upAddr, scheme = "nginx-tls", ups.tlsAddr, "https"
		ssl = `
      proxy_ssl_verify on;
      proxy_ssl_trusted_certificate ` + ups.caFile + `;
      proxy_ssl_name ` + tlsName + `;
      proxy_ssl_server_name on;
      proxy_ssl_session_reuse on;
      proxy_ssl_protocols TLSv1.2 TLSv1.3;`
	}
	return target{name: name, start: func(cpu string) (string, *exec.Cmd, error) {
		addr := freeAddr()
		prefix := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Join(prefix, "tmp"), 0o700); err != nil {
			return "", nil, err
		}
		t := filepath.Join(prefix, "tmp")
		c := nginxHead(prefix, t) + `
  upstream up { server ` + upAddr + `; keepalive 256; keepalive_requests 100000000; }
  keepalive_requests 100000000;
  server {
    listen ` + addr + `;
    location / {
      proxy_pass ` + scheme + `://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";` + ssl + `
    }
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

type result struct {
	p50, p99   float64 // µs
	cpuPer1000 float64 // vCPU per 1,000 calls/s; 0 for direct
	closedRate float64 // calls/s
	errors     int64
}

// measure starts t, warms it up, runs the open loop (latency, CPU) and the closed loop, and
// stops it.
func measure(t target, o options, upAddr string) (result, error) {
	addr, pid := upAddr, 0
	if t.start != nil {
		a, cmd, stop, err := startProxy(t, o)
		if err != nil {
			return result{}, err
		}
		defer stop()
		if err := waitCall(a); err != nil {
			return result{}, err
		}
		addr, pid = a, cmd.Process.Pid // taskset execs the proxy: same process
	}
	cl := newClient(addr)
	defer cl.close()
	_, _ = cl.openLoop(o.rate, time.Second) // warm-up: connections, pools, caches
	var before time.Duration
	if pid != 0 {
		before = cpuTime(pid)
	}
	start := time.Now()
	lat, errs := cl.openLoop(o.rate, o.open)
	elapsed := time.Since(start)
	var r result
	if pid != 0 {
		used := cpuTime(pid) - before
		r.cpuPer1000 = used.Seconds() / elapsed.Seconds() / (float64(o.rate) / 1000)
	}
	slices.Sort(lat)
	if len(lat) > 0 {
		r.p50, r.p99 = micros(lat[len(lat)/2]), micros(lat[min(len(lat)-1, len(lat)*99/100)])
	}
	n, cerrs := closedLoop(addr, o.conns, o.closed)
	r.closedRate = float64(n) / o.closed.Seconds()
	r.errors = errs + cerrs
	return r, nil
}

// startProxy starts t on the proxies' CPU; stop kills it (its stderr is printed when it failed
// to start).
func startProxy(t target, o options) (addr string, cmd *exec.Cmd, stop func(), err error) {
	addr, cmd, err = t.start(o.proxyCPU)
	if err != nil {
		return "", nil, nil, err
	}
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = io.Discard, &stderr
	cmd.SysProcAttr = orphanKill()
	if err := cmd.Start(); err != nil {
		return "", nil, nil, err
	}
	stop = func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }
	if err := waitListening(addr); err != nil {
		stop()
		return "", nil, nil, fmt.Errorf("%s: %w; its stderr: %s", t.name, err, stderr.String())
	}
	return addr, cmd, stop, nil
}

// waitListening waits until addr accepts connections.
func waitListening(addr string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			return c.Close()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s does not listen: %w", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func listen(addr string) (net.Listener, error) { return net.Listen("tcp", addr) }

// orphanKill makes the kernel kill a child when this process ends, however it ends (an
// interrupted run leaves no proxy or upstream behind).
func orphanKill() *syscall.SysProcAttr { return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} }

func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// report prints, per proxy, the median and range over the rounds, and the agent's ratios (and
// the floors' to HAProxy).
func report(res map[string][]result, targets []target) {
	direct := res["direct"]
	type summary struct{ addP50, addP99, cpu, rate []float64 }
	sums := map[string]summary{}
	fmt.Println()
	fmt.Println("proxy          added p50 µs             added p99 µs             vCPU per 1,000 calls/s       closed loop calls/s")
	for _, t := range targets[1:] {
		var s summary
		for i, r := range res[t.name] {
			s.addP50 = append(s.addP50, r.p50-direct[i].p50)
			s.addP99 = append(s.addP99, r.p99-direct[i].p99)
			s.cpu = append(s.cpu, r.cpuPer1000)
			s.rate = append(s.rate, r.closedRate)
		}
		sums[t.name] = s
		fmt.Printf("%-13s  %-23s  %-23s  %-27s  %s\n", t.name, span(s.addP50, "%.0f"), span(s.addP99, "%.0f"), span(s.cpu, "%.3f"), span(s.rate, "%.0f"))
	}
	fmt.Printf("direct         p50 %s µs, p99 %s µs; closed loop %s calls/s\n",
		span(field(direct, func(r result) float64 { return r.p50 }), "%.0f"),
		span(field(direct, func(r result) float64 { return r.p99 }), "%.0f"),
		span(field(direct, func(r result) float64 { return r.closedRate }), "%.0f"))
	fmt.Println()
	vs := [][2]string{}
	for _, agent := range []string{"agent", "agent-before"} {
		for _, other := range []string{"agent-before", "haproxy", "nginx"} {
			vs = append(vs, [2]string{agent, other})
		}
	}
	vs = append(vs, [2]string{"agent", "floor-h1"}, [2]string{"floor-h1", "haproxy"}, [2]string{"floor-tcp", "haproxy"},
		[2]string{"agent-tls", "haproxy-tls"}, [2]string{"agent-tls", "nginx-tls"}, [2]string{"agent-tls", "agent"})
	for _, t := range targets {
		if strings.HasPrefix(t.name, "agent-gmp") {
			vs = append(vs, [2]string{t.name, "agent"})
		}
	}
	for _, pair := range vs {
		agent := pair[0]
		a, ok := sums[agent]
		if !ok {
			continue
		}
		for _, other := range pair[1:] {
			b, ok := sums[other]
			if !ok || other == agent {
				continue
			}
			fmt.Printf("%s / %s: CPU %s×, added p50 %s×, closed-loop rate %s× (median of per-round ratios, range)\n",
				agent, other, ratios(a.cpu, b.cpu), ratios(a.addP50, b.addP50), ratios(a.rate, b.rate))
		}
	}
}

func field(rs []result, f func(result) float64) []float64 {
	out := make([]float64, len(rs))
	for i, r := range rs {
		out[i] = f(r)
	}
	return out
}

// span prints "median (min–max)".
func span(v []float64, f string) string {
	if len(v) == 0 {
		return "-"
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return fmt.Sprintf(f+" ("+f+"–"+f+")", s[len(s)/2], s[0], s[len(s)-1])
}

func ratios(a, b []float64) string {
	var r []float64
	for i := range min(len(a), len(b)) {
		if b[i] != 0 {
			r = append(r, a[i]/b[i])
		}
	}
	return span(r, "%.2f")
}

// cpuTime is the CPU time a process's threads have used: the sum of the first field of
// /proc/<pid>/task/*/schedstat, in nanoseconds.
func cpuTime(pid int) time.Duration {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	var sum time.Duration
	for _, f := range tasks {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if fs := strings.Fields(string(b)); len(fs) > 0 {
			ns, _ := strconv.ParseInt(fs[0], 10, 64)
			sum += time.Duration(ns)
		}
	}
	return sum
}

// onlineCPUs is the machine's CPU count, not this process's (it runs under taskset, which
// runtime.NumCPU reflects): the CPUs of /sys/devices/system/cpu/online ("0-1", "0,2-3").
func onlineCPUs() int {
	b, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		return runtime.NumCPU()
	}
	n := 0
	for _, r := range strings.Split(strings.TrimSpace(string(b)), ",") {
		lo, hi, ok := strings.Cut(r, "-")
		a, _ := strconv.Atoi(lo)
		z := a
		if ok {
			z, _ = strconv.Atoi(hi)
		}
		n += z - a + 1
	}
	return max(n, 1)
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Join(strings.Fields(string(b))[:3], " ")
}

func freeAddr() string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// waitCall waits until a call through addr answers 200.
func waitCall(addr string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		cl := newClient(addr)
		_, err := cl.call()
		cl.close()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s does not answer: %w", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// The load generator: raw HTTP/1.1 over kept-alive connections.

const request = "GET /bench/x HTTP/1.1\r\nHost: bench\r\n\r\n"

type conn struct {
	c  net.Conn
	br *bufio.Reader
}

type client struct {
	addr string
	mu   sync.Mutex
	idle []*conn
}

func newClient(addr string) *client { return &client{addr: addr} }

func (cl *client) close() {
	cl.mu.Lock()
	defer cl.mu.Unlock()
	for _, c := range cl.idle {
		_ = c.c.Close()
	}
	cl.idle = nil
}

func (cl *client) get() (*conn, error) {
	cl.mu.Lock()
	if n := len(cl.idle); n > 0 {
		c := cl.idle[n-1]
		cl.idle = cl.idle[:n-1]
		cl.mu.Unlock()
		return c, nil
	}
	cl.mu.Unlock()
	c, err := net.Dial("tcp", cl.addr)
	if err != nil {
		return nil, err
	}
	return &conn{c: c, br: bufio.NewReaderSize(c, 4096)}, nil
}

// call sends one request on a pooled connection and reads the answer; it returns the time from
// the write to the answer's last byte.
func (cl *client) call() (time.Duration, error) {
	c, err := cl.get()
	if err != nil {
		return 0, err
	}
	start := time.Now()
	if err := roundTrip(c); err != nil {
		_ = c.c.Close()
		firstErr.CompareAndSwap(nil, &err)
		return 0, err
	}
	d := time.Since(start)
	cl.mu.Lock()
	cl.idle = append(cl.idle, c)
	cl.mu.Unlock()
	return d, nil
}

var errStatus = errors.New("answer is not 200")

// firstErr is the first failed call's error since measure last took it, printed with the
// round's line.
var firstErr atomic.Pointer[error]

func roundTrip(c *conn) error {
	_ = c.c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c.c, request); err != nil {
		return err
	}
	line, err := c.br.ReadSlice('\n')
	if err != nil {
		return err
	}
	if !bytes.HasPrefix(line, []byte("HTTP/1.1 200 ")) {
		return fmt.Errorf("%w: %q", errStatus, line)
	}
	length := -1
	for {
		line, err := c.br.ReadSlice('\n')
		if err != nil {
			return err
		}
		if len(line) <= 2 {
			break
		}
		if k, v, ok := bytes.Cut(line, []byte(":")); ok && bytes.EqualFold(k, []byte("Content-Length")) {
			length, _ = strconv.Atoi(string(bytes.TrimSpace(v)))
		}
	}
	if length < 0 {
		return errors.New("answer without Content-Length")
	}
	_, err = c.br.Discard(length)
	return err
}

// openLoop sends calls at rate for dur, each from its own goroutine at its scheduled time, and
// returns the latencies of those that answered and the count of the others.
func (cl *client) openLoop(rate int, dur time.Duration) ([]time.Duration, int64) {
	return openLoop(rate, dur, cl.call)
}

// openLoop calls call at rate for dur, each call from its own goroutine at its scheduled time
// (an open loop: a slow answer does not delay the next call), and returns the latencies of the
// calls that answered and the count of the others. The HTTP/1.1 and the gRPC parts share it.
func openLoop(rate int, dur time.Duration, call func() (time.Duration, error)) ([]time.Duration, int64) {
	interval := time.Second / time.Duration(rate)
	n := int(dur / interval)
	lat := make([]time.Duration, n)
	var errs atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for k := range n {
		if d := time.Until(start.Add(time.Duration(k) * interval)); d > 0 {
			time.Sleep(d)
		}
		wg.Go(func() {
			d, err := call()
			if err != nil {
				errs.Add(1)
				d = -1
			}
			lat[k] = d
		})
	}
	wg.Wait()
	out := lat[:0]
	for _, d := range lat {
		if d >= 0 {
			out = append(out, d)
		}
	}
	return out, errs.Load()
}

// closedLoop runs conns connections calling back to back for dur; it returns the calls answered
// and the failures.
func closedLoop(addr string, conns int, dur time.Duration) (int64, int64) {
	var done, errs atomic.Int64
	var wg sync.WaitGroup
	stop := time.Now().Add(dur)
	for range conns {
		wg.Go(func() {
			cl := newClient(addr)
			defer cl.close()
			for time.Now().Before(stop) {
				if _, err := cl.call(); err != nil {
					errs.Add(1)
					continue
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	return done.Load(), errs.Load()
}

// makeCerts writes a CA and a certificate of it for tlsName into dir: the TLS upstream's
// certificate and key, and the CA the proxies verify it with.
func makeCerts(dir string) (crt, key, ca string, err error) {
	c, err := tlstest.NewCA("benchproxy CA")
	if err != nil {
		return "", "", "", err
	}
	leaf, err := c.Issue(tlstest.LeafOptions{Names: []string{tlsName}})
	if err != nil {
		return "", "", "", err
	}
	crt, key, ca = filepath.Join(dir, "upstream.crt"), filepath.Join(dir, "upstream.key"), filepath.Join(dir, "ca.crt")
	for f, b := range map[string][]byte{crt: leaf.CertPEM, key: leaf.KeyPEM, ca: c.PEM} {
		if err := os.WriteFile(f, b, 0o600); err != nil {
			return "", "", "", err
		}
	}
	return crt, key, ca, nil
}

// serveUpstream answers every request at once with 200 "ok" (requests without a body), on
// args[0] in plain HTTP and, when args has a TLS address, certificate and key, on args[1] over
// TLS; it returns only when it cannot listen or accept.
func serveUpstream(args []string) error {
	ln, err := net.Listen("tcp", args[0])
	if err != nil {
		return err
	}
	if len(args) == 4 {
		cert, err := tls.LoadX509KeyPair(args[2], args[3])
		if err != nil {
			return err
		}
		tln, err := tls.Listen("tcp", args[1], &tls.Config{Certificates: []tls.Certificate{cert}})
		if err != nil {
			return err
		}
		go func() { fmt.Fprintln(os.Stderr, serveOn(tln)); os.Exit(1) }()
	}
	return serveOn(ln)
}

func serveOn(ln net.Listener) error {
	const answer = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
	return serveEach(ln, func(c net.Conn) {
		defer func() { _ = c.Close() }()
		br := bufio.NewReaderSize(c, 4096)
		for {
			for {
				line, err := br.ReadSlice('\n')
				if err != nil {
					return
				}
				if len(line) <= 2 {
					break
				}
			}
			if _, err := io.WriteString(c, answer); err != nil {
				return
			}
		}
	})
}

// nginxHead is the start of an nginx configuration of one worker in the foreground whose files
// (error log, pid, temporary files) are under prefix and t, up to the http block's own
// directives: the HTTP/1.1 and the gRPC targets add their upstream and server.
func nginxHead(prefix, t string) string {
	return `daemon off;
master_process off;
worker_processes 1;
error_log ` + filepath.Join(prefix, "error.log") + ` error;
pid ` + filepath.Join(prefix, "nginx.pid") + `;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_temp_path ` + t + `; proxy_temp_path ` + t + `; fastcgi_temp_path ` + t + `;
  uwsgi_temp_path ` + t + `; scgi_temp_path ` + t + `;`
}

// haproxyHead is the start of an HAProxy configuration of one thread in HTTP mode with the
// timeouts every target shares; the HTTP/1.1 and the gRPC targets add their defaults, frontend
// and backend.
const haproxyHead = `global
  nbthread 1
  maxconn 8000
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s`
