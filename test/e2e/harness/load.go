package harness

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// AgentSource lists the agents that are alive now.
type AgentSource interface {
	Agents() []*Agent
}

// LoadConfig is a closed-loop load through the agents.
type LoadConfig struct {
	Source AgentSource
	// Downstream is the downstream's name (the first path segment).
	Downstream string
	// WorkersPerAgent call in a closed loop through each agent.
	WorkersPerAgent int
	// Workers, when set, is how many of an agent's WorkersPerAgent workers call now (the others
	// idle): a skewed or changing load. Read before every call.
	Workers func(a *Agent) int
	// Think is the pause between a worker's calls.
	Think time.Duration
	// Timeout bounds one call.
	Timeout time.Duration
	// MaxRequests stops the load after this many calls (0: no bound); MaxDuration after this
	// long (0: until Stop).
	MaxRequests int64
	MaxDuration time.Duration
	// CallSuspended keeps calling an agent that is SIGSTOPped (only the agent froze, not the
	// app): the calls wait in the kernel's queues until it resumes. By default the app is taken
	// to be frozen with it.
	CallSuspended bool
	// Protocol the apps speak to their agents: ProtocolHTTP1 (""), ProtocolH2C or
	// ProtocolGRPCStream (grpc.go).
	Protocol string
}

// LoadStats counts the app's outcomes.
type LoadStats struct {
	Requests   int64
	OK         int64 // 2xx
	Fallback   int64 // 503 from the agent: no permit (or breaker/fail-closed)
	TooMany429 int64 // 429 seen by the app
	Other      int64 // other statuses
	Errors     int64 // transport errors (an agent killed or stopped)
	// OtherCodes counts the other statuses by code.
	OtherCodes map[int]int64
	// ErrorsByPod counts the transport errors by the pod whose agent was called.
	ErrorsByPod map[string]int64
}

func (s LoadStats) String() string {
	out := fmt.Sprintf("requests=%d 2xx=%d 503-fallback=%d 429=%d other=%d errors=%d",
		s.Requests, s.OK, s.Fallback, s.TooMany429, s.Other, s.Errors)
	if len(s.OtherCodes) > 0 {
		out += fmt.Sprintf(" (other by status: %v)", s.OtherCodes)
	}
	return out
}

// Load runs the workers; it follows the source, starting workers for new agents and stopping
// those of agents that are gone.
type Load struct {
	cfg      LoadConfig
	client   *http.Client
	cancel   context.CancelFunc
	done     chan struct{}
	stopping atomic.Bool

	requests, ok, fallback, tooMany, other, errs atomic.Int64
	codes                                        [600]atomic.Int64
	grpc                                         grpcConns // ProtocolGRPCStream's connections

	errMu    sync.Mutex
	errByPod map[string]int64
}

// StartLoad starts the load.
func StartLoad(ctx context.Context, cfg LoadConfig) *Load {
	if cfg.WorkersPerAgent <= 0 {
		cfg.WorkersPerAgent = 3
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 5 * time.Second
	}
	l := &Load{cfg: cfg, done: make(chan struct{})}
	l.client = &http.Client{
		Timeout: cfg.Timeout,
		Transport: &http.Transport{
			MaxIdleConnsPerHost: cfg.WorkersPerAgent,
			IdleConnTimeout:     30 * time.Second,
			DisableCompression:  true,
		},
	}
	if cfg.Protocol == ProtocolH2C {
		l.client.Transport = h2cTransport()
	}
	if cfg.MaxDuration > 0 {
		ctx, l.cancel = context.WithTimeout(ctx, cfg.MaxDuration)
	} else {
		ctx, l.cancel = context.WithCancel(ctx)
	}
	go l.run(ctx)
	return l
}

func (l *Load) run(ctx context.Context) {
	defer close(l.done)
	defer l.grpc.closeAll()
	type running struct {
		cancel context.CancelFunc
	}
	workers := map[*Agent]running{}
	var wg sync.WaitGroup
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		if l.stopping.Load() {
			// Graceful: every worker finishes its call (a cancelled call frees its agent's permit
			// while the downstream may still count it).
			wg.Wait()
			l.client.CloseIdleConnections()
			return
		}
		alive := map[*Agent]bool{}
		for _, a := range l.cfg.Source.Agents() {
			if a.Draining() || !a.Serving() {
				continue
			}
			alive[a] = true
			if _, ok := workers[a]; ok {
				continue
			}
			actx, cancel := context.WithCancel(ctx)
			workers[a] = running{cancel: cancel}
			for i := range l.cfg.WorkersPerAgent {
				wg.Go(func() { l.worker(actx, a, i) })
			}
		}
		for a, r := range workers {
			if !alive[a] || !a.Running() {
				r.cancel()
				delete(workers, a)
			}
		}
		select {
		case <-ctx.Done():
			for _, r := range workers {
				r.cancel()
			}
			wg.Wait()
			l.client.CloseIdleConnections()
			return
		case <-t.C:
		}
	}
}

func (l *Load) worker(ctx context.Context, a *Agent, i int) {
	url := a.DataURL(l.cfg.Downstream) + "/work"
	for ctx.Err() == nil && !a.Draining() && !l.stopping.Load() {
		if l.cfg.MaxRequests > 0 && l.requests.Load() >= l.cfg.MaxRequests {
			l.cancel()
			return
		}
		if l.cfg.Workers != nil && i >= l.cfg.Workers(a) {
			sleepCtx(ctx, 20*time.Millisecond)
			continue
		}
		if a.Suspended() && !l.cfg.CallSuspended {
			// Its app is frozen with it (SIGSTOP of the pod's processes).
			sleepCtx(ctx, 20*time.Millisecond)
			continue
		}
		if !a.beginAppCall() {
			return
		}
		l.requests.Add(1)
		a.noteCall()
		code, err := l.call(ctx, a, url)
		a.endAppCall() // the call ended, its body read (or it failed)
		if err == nil {
			a.firstStatus.CompareAndSwap(0, int32(code))
		}
		switch {
		case err != nil:
			if ctx.Err() != nil {
				l.requests.Add(-1)
				return
			}
			l.errs.Add(1)
			l.errMu.Lock()
			if l.errByPod == nil {
				l.errByPod = map[string]int64{}
			}
			l.errByPod[a.Pod]++
			l.errMu.Unlock()
			sleepCtx(ctx, 20*time.Millisecond)
			continue
		case code >= 200 && code < 300:
			l.ok.Add(1)
		case code == http.StatusServiceUnavailable:
			l.fallback.Add(1)
		case code == http.StatusTooManyRequests:
			l.tooMany.Add(1)
		default:
			l.other.Add(1)
			if code > 0 && code < len(l.codes) {
				l.codes[code].Add(1)
			}
		}
		if code != http.StatusOK && code != http.StatusServiceUnavailable {
			// e.g. 404 before the agent's first assignment names the downstream: do not spin.
			sleepCtx(ctx, 20*time.Millisecond)
		} else if l.cfg.Think > 0 {
			sleepCtx(ctx, l.cfg.Think)
		}
	}
}

// call makes one call through the agent in the load's protocol and returns its status (a gRPC
// call's told as an HTTP status, see grpcCall); an error: no answer.
func (l *Load) call(ctx context.Context, a *Agent, url string) (int, error) {
	if l.cfg.Protocol == ProtocolGRPCStream {
		return l.grpcCall(ctx, a)
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := l.client.Do(req)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode, nil
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// Stats returns the counters so far.
func (l *Load) Stats() LoadStats {
	st := LoadStats{
		Requests: l.requests.Load(), OK: l.ok.Load(), Fallback: l.fallback.Load(),
		TooMany429: l.tooMany.Load(), Other: l.other.Load(), Errors: l.errs.Load(),
	}
	for code := range l.codes {
		if n := l.codes[code].Load(); n > 0 {
			if st.OtherCodes == nil {
				st.OtherCodes = map[int]int64{}
			}
			st.OtherCodes[code] = n
		}
	}
	l.errMu.Lock()
	if len(l.errByPod) > 0 {
		st.ErrorsByPod = make(map[string]int64, len(l.errByPod))
		for pod, n := range l.errByPod {
			st.ErrorsByPod[pod] = n
		}
	}
	l.errMu.Unlock()
	return st
}

// Stop lets every worker finish its call, up to the call timeout, then cancels the rest, and
// returns the counters.
func (l *Load) Stop() LoadStats {
	l.stopping.Store(true)
	select {
	case <-l.done:
	case <-time.After(l.cfg.Timeout + time.Second):
	}
	l.cancel()
	<-l.done
	return l.Stats()
}

// HTTPClient is an *http.Client for polling agents.
type HTTPClient = http.Client

// NewHTTPClient returns a client keeping up to conns idle connections per agent.
func NewHTTPClient(conns int, timeout time.Duration) *http.Client {
	return &http.Client{Timeout: timeout, Transport: &http.Transport{MaxIdleConnsPerHost: conns, MaxIdleConns: 1000}}
}
