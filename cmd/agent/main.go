// Command agent is Apportion's in-pod sidecar: a local HTTP proxy between the app and its
// downstreams that enforces, per downstream, the permits, rate, circuit breaker, degrade switches
// and fallbacks pushed by the manager (see internal/agent/proxy and internal/agent/control).
//
// Usage:
//
//	agent --trust-dir /etc/apportion/trust [flags]   (with POD_NAMESPACE and POD_NAME set)
//
// Flags:
//
//	--listen ADDR            data plane, for the app (default 127.0.0.1:15001)
//	--control-listen ADDR    control API, for the manager and the kubelet (default :15000)
//	--trust-dir DIR          the manager's Ed25519 public keys, one "<key id>.pem" file per key
//	                         (the apportion-trust ConfigMap, mounted); re-read every 30s
//	--pod-namespace NS       this pod's namespace (default $POD_NAMESPACE) and
//	--pod-name NAME          name (default $POD_NAME): control requests must be signed for it
//	--insecure-no-auth       no authentication on the control API (local experiments only)
//	--bootstrap FILE         a JSON Assignment applied at start as generation 0 on safe
//	                         defaults, to run without a manager (epoch, generation, leaseTTL may
//	                         be omitted)
//	--drain-timeout D        how long SIGTERM waits for calls in flight (default 10s)
//	--stale-cache-bytes N    bound of the ServeStale cache; accepts Ki, Mi, Gi (default 16Mi)
//	--log-level L            debug, info, warn or error (default info)
//	--version                print the version and exit
//
// Exit status: 0 after a graceful shutdown (SIGTERM or SIGINT) and for -h, 1 when the agent
// cannot start or a listener fails, 2 for invalid flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/apportion/apportion/internal/agent/control"
	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/agent/proxy"
	"github.com/apportion/apportion/internal/agent/stall"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/h1"
	"github.com/apportion/apportion/internal/version"
)

func main() {
	// One processor unless GOMAXPROCS says otherwise. The agent's work is many short calls a
	// few system calls each; with more processors the runtime hands them between threads,
	// which cost about a quarter more CPU per call (docs/benchmarks.md), and Go's own default
	// under a container CPU limit is never below 2.
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(1)
	}
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

type config struct {
	listen          string
	controlListen   string
	trustDir        string
	podNamespace    string
	podName         string
	insecureNoAuth  bool
	bootstrap       string
	drainTimeout    time.Duration
	staleCacheBytes int64
	logLevel        slog.Level
	version         bool

	bootstrapAssignment *assignment.Assignment
	trust               assignment.TrustSet
}

// trustReloadInterval is how often --trust-dir is read again, to pick up a published or
// withdrawn key (the kubelet refreshes a ConfigMap volume within about a minute).
const trustReloadInterval = 30 * time.Second

func parseFlags(args []string, stderr io.Writer) (*config, error) {
	c := &config{}
	fs := flag.NewFlagSet("agent", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.listen, "listen", "127.0.0.1:15001", "data plane `address` the app calls")
	fs.StringVar(&c.controlListen, "control-listen", ":15000", "control API `address` (manager, kubelet probes, metrics)")
	fs.StringVar(&c.trustDir, "trust-dir", "", "`directory` of the manager's Ed25519 public keys, one <key id>.pem file per key (the apportion-trust ConfigMap); required unless --insecure-no-auth")
	fs.StringVar(&c.podNamespace, "pod-namespace", os.Getenv("POD_NAMESPACE"), "this pod's `namespace` (default $POD_NAMESPACE); control requests must be signed for this pod")
	fs.StringVar(&c.podName, "pod-name", os.Getenv("POD_NAME"), "this pod's `name` (default $POD_NAME)")
	fs.BoolVar(&c.insecureNoAuth, "insecure-no-auth", false, "serve the control API without authentication (local experiments only)")
	fs.StringVar(&c.bootstrap, "bootstrap", "", "JSON Assignment `file` applied at start as generation 0 on safe defaults")
	fs.DurationVar(&c.drainTimeout, "drain-timeout", 10*time.Second, "how long shutdown waits for calls in flight")
	stale := fs.String("stale-cache-bytes", "16Mi", "`size` bound of the stale cache (bytes, or with Ki, Mi, Gi)")
	level := fs.String("log-level", "info", "`level`: debug, info, warn or error")
	fs.BoolVar(&c.version, "version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if c.version {
		// Answered before the other flags are checked: an image's binary must say what it is
		// without keys or a bootstrap file (hack/images tests exactly that).
		return c, nil
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	for _, a := range []struct{ flag, addr string }{{"--listen", c.listen}, {"--control-listen", c.controlListen}} {
		if _, port, err := net.SplitHostPort(a.addr); err != nil {
			return nil, fmt.Errorf("%s %q: must be host:port: %w", a.flag, a.addr, err)
		} else if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
			return nil, fmt.Errorf("%s %q: invalid port", a.flag, a.addr)
		}
	}
	if c.listen == c.controlListen && !strings.HasSuffix(c.listen, ":0") {
		return nil, fmt.Errorf("--listen and --control-listen must differ")
	}
	switch {
	case c.trustDir == "" && !c.insecureNoAuth:
		return nil, errors.New("--trust-dir is required (or --insecure-no-auth for local experiments)")
	case c.trustDir != "" && c.insecureNoAuth:
		return nil, errors.New("--trust-dir and --insecure-no-auth are exclusive")
	case c.trustDir != "":
		if c.podNamespace == "" || c.podName == "" {
			return nil, errors.New("--pod-namespace and --pod-name (or $POD_NAMESPACE and $POD_NAME from the downward API) are required: control requests are signed for one pod")
		}
		if strings.ContainsAny(c.podNamespace+c.podName, "/,= ") {
			return nil, fmt.Errorf("--pod-namespace %q / --pod-name %q: not a Kubernetes name", c.podNamespace, c.podName)
		}
		ts, err := assignment.LoadTrustDir(c.trustDir)
		if err != nil {
			return nil, fmt.Errorf("--trust-dir: %w", err)
		}
		c.trust = ts
	}
	if c.drainTimeout < 0 || c.drainTimeout > 10*time.Minute {
		return nil, fmt.Errorf("--drain-timeout %s: must be between 0 and 10m", c.drainTimeout)
	}
	n, err := parseSize(*stale)
	if err != nil {
		return nil, fmt.Errorf("--stale-cache-bytes %q: %w", *stale, err)
	}
	c.staleCacheBytes = n
	if err := c.logLevel.UnmarshalText([]byte(*level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: must be debug, info, warn or error", *level)
	}
	if c.bootstrap != "" {
		f, err := os.Open(c.bootstrap)
		if err != nil {
			return nil, fmt.Errorf("--bootstrap: %w", err)
		}
		defer func() { _ = f.Close() }()
		a, err := assignment.DecodeBootstrap(f, assignment.DefaultMaxBytes)
		if err != nil {
			return nil, fmt.Errorf("--bootstrap %s: %w", c.bootstrap, err)
		}
		c.bootstrapAssignment = a
	}
	return c, nil
}

// parseSize reads "16777216", "16Mi", "512Ki" or "1Gi".
func parseSize(s string) (int64, error) {
	mult := int64(1)
	for suffix, m := range map[string]int64{"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30} {
		if strings.HasSuffix(s, suffix) {
			s, mult = strings.TrimSuffix(s, suffix), m
			break
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > (1<<40)/mult {
		return 0, errors.New("must be a non-negative number of bytes, optionally with Ki, Mi or Gi")
	}
	return n * mult, nil
}

func run(args []string, stdout, stderr io.Writer) int {
	cfg, err := parseFlags(args, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		_, _ = fmt.Fprintf(stderr, "agent: %v\n", err)
		return 2
	}
	if cfg.version {
		_, _ = fmt.Fprintln(stdout, version.String("agent"))
		return 0
	}
	log := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: cfg.logLevel}))
	slog.SetDefault(log)

	m := metrics.New()
	enf := enforce.New(enforce.Options{Metrics: m, Logger: log})
	if cfg.bootstrapAssignment != nil {
		if err := enf.ApplyBootstrap(cfg.bootstrapAssignment); err != nil {
			log.Error("applying the bootstrap configuration failed", "err", err)
			return 1
		}
	}

	var trustFn func() assignment.TrustSet
	stopReload := func() {}
	if cfg.insecureNoAuth {
		log.Warn("INSECURE: the control API accepts unauthenticated requests (--insecure-no-auth); anyone who reaches " +
			cfg.controlListen + " can change this agent's limits. Use it for local experiments only.")
	} else {
		var mu sync.RWMutex
		trust := cfg.trust
		trustFn = func() assignment.TrustSet {
			mu.RLock()
			defer mu.RUnlock()
			return trust
		}
		stopReload = every(trustReloadInterval, func() {
			ts, err := assignment.LoadTrustDir(cfg.trustDir)
			if err != nil {
				log.Warn("reloading --trust-dir failed; keeping the keys loaded before", "err", err)
				return
			}
			mu.Lock()
			changed := strings.Join(ts.IDs(), ",") != strings.Join(trust.IDs(), ",")
			trust = ts
			mu.Unlock()
			if changed {
				log.Info("control API trust reloaded", "keyIDs", ts.IDs())
			}
		})
	}
	defer stopReload()

	dataLn, err := net.Listen("tcp", cfg.listen)
	if err != nil {
		log.Error("data plane listener", "addr", cfg.listen, "err", err)
		return 1
	}
	controlLn, err := net.Listen("tcp", cfg.controlListen)
	if err != nil {
		_ = dataLn.Close()
		log.Error("control listener", "addr", cfg.controlListen, "err", err)
		return 1
	}
	errLog := slog.NewLogLogger(log.Handler(), slog.LevelDebug)
	stalls := watchStalls(log)
	defer stalls.stop()
	// The data plane runs on the agent's own HTTP/1.1 server (see h1.Server, which hands HTTP/2
	// connections to net/http's); the requests it
	// refuses itself get the data plane's problem+json (proxy.Refusal).
	dataSrv := &h1.Server{
		Handler:           proxy.New(proxy.Options{Enforcer: enf, StaleCacheBytes: cfg.staleCacheBytes, Logger: log}),
		Refusal:           proxy.Refusal,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		Logger:            log,
		// HTTP/2 with prior knowledge (h2c, gRPC) on the same listener; every stream is a call
		// with its own permit (docs/agent.md, "HTTP/2 and gRPC").
		HTTP2: &http.HTTP2Config{MaxConcurrentStreams: 250},
	}
	controlSrv := &http.Server{
		Handler: control.New(control.Options{
			Backend: enf, Trust: trustFn, Pod: cfg.podNamespace + "/" + cfg.podName, Logger: log,
			Rejected: m.RejectedPush,
			Metrics:  promhttp.HandlerFor(m.Registry, promhttp.HandlerOpts{ErrorLog: errLog}),
			Stalled:  stalls.stalled,
		}),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          errLog,
	}
	// Signals are caught before anything is served: a SIGTERM that arrives as soon as the probes
	// answer must drain, not kill.
	sigCtx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	serveErr := make(chan error, 2)
	go func() { serveErr <- dataSrv.Serve(dataLn) }()
	go func() { serveErr <- controlSrv.Serve(controlLn) }()
	log.Info("agent started", "listen", dataLn.Addr().String(), "controlListen", controlLn.Addr().String(),
		"auth", !cfg.insecureNoAuth, "bootstrap", cfg.bootstrap != "", "drainTimeout", cfg.drainTimeout.String(),
		"staleCacheBytes", cfg.staleCacheBytes)

	code := 0
	select {
	case <-sigCtx.Done():
		log.Info("shutting down: draining calls in flight", "drainTimeout", cfg.drainTimeout.String())
	case err := <-serveErr:
		log.Error("a listener failed", "err", err)
		code = 1
	}
	stop()

	// Not ready any more; stop accepting on the data plane and wait for calls in flight. The
	// control port keeps answering (readyz 503, state) until the drain is over.
	enf.SetDraining()
	drainCtx, cancel := context.WithTimeout(context.Background(), cfg.drainTimeout)
	defer cancel()
	if err := dataSrv.Shutdown(drainCtx); err != nil {
		log.Warn("drain timeout passed with calls still in flight; closing them", "err", err)
		_ = dataSrv.Close()
	}
	ctlCtx, cancel2 := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel2()
	if err := controlSrv.Shutdown(ctlCtx); err != nil {
		_ = controlSrv.Close()
	}
	log.Info("agent stopped")
	return code
}

// Stall detection (package stall): a gap of more than stallThreshold between ticks of a
// goroutine that ticks every stallTick is a stall; pushes are refused during one and for
// stallHold after it. The threshold is half the manager's default AcceptGrace.
const (
	stallThreshold = 500 * time.Millisecond
	stallTick      = 100 * time.Millisecond
	stallHold      = time.Second
)

type stallWatch struct {
	d    *stall.Detector
	stop func()
}

func (s stallWatch) stalled() bool { return s.d.Stalled(time.Now()) }

func watchStalls(log *slog.Logger) stallWatch {
	d := stall.New(stallThreshold, stallHold, time.Now())
	stop := every(stallTick, func() {
		now := time.Now()
		if d.Stalled(now) {
			log.Warn("the agent process did not run for a while (frozen or starved); pushes are refused for a moment", "threshold", stallThreshold.String())
		}
		d.Tick(now)
	})
	return stallWatch{d: d, stop: stop}
}

// every runs f on a goroutine of its own every period until the returned stop is called.
func every(period time.Duration, f func()) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
				f()
			}
		}
	}()
	return cancel
}
