package harness

import (
	"context"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// OpenLoadConfig is an open-loop load: calls start at a fixed rate whatever the answers' pace
// (a closed loop slows down with the partner and so hides what a slow partner does to a real
// app's traffic).
type OpenLoadConfig struct {
	Source AgentSource
	// Downstreams are the downstreams' names (the first path segment); the calls go to each in
	// turn.
	Downstreams []string
	// Rate is the calls started per second, spread over the agents that may take traffic.
	Rate float64
	// Timeout bounds one call (default 5s).
	Timeout time.Duration
	// MaxOutstanding bounds the calls under way (default 4096); a call the bound refuses is
	// counted as Shed, not made.
	MaxOutstanding int64
	// Logf, when set, logs every unanswered call as it happens.
	Logf func(format string, args ...any)
}

// OpenLoadStats counts what became of the calls.
type OpenLoadStats struct {
	Calls int64
	// Downstream: answered by the partner (any status it sent: 2xx, or its own 5xx).
	Downstream, OK, Partner5xx int64
	// Fallback: answered by the agent's fallback (any answer carrying X-Apportion-Fallback).
	Fallback int64
	// AgentProblem: the agent's own answer for a call the partner did not answer in time or at
	// all — a problem+json 504 (APPORTION_UPSTREAM_TIMEOUT: requestTimeout passed) or 502
	// (internal/agent/proxy) — explicit, but neither the partner's nor a fallback's.
	AgentProblem int64
	// TooMany429 is a 429 reaching the app.
	TooMany429 int64
	// Lost: a transport error at an agent that was killed or frozen during the call (its calls
	// die with it); Unanswered: any other transport error or status — a lost call.
	Lost, Unanswered int64
	// Shed: not made (MaxOutstanding).
	Shed int64
}

// Sub is s − o, counter by counter.
func (s OpenLoadStats) Sub(o OpenLoadStats) OpenLoadStats {
	return OpenLoadStats{Calls: s.Calls - o.Calls, Downstream: s.Downstream - o.Downstream, OK: s.OK - o.OK,
		Partner5xx: s.Partner5xx - o.Partner5xx, Fallback: s.Fallback - o.Fallback, AgentProblem: s.AgentProblem - o.AgentProblem, TooMany429: s.TooMany429 - o.TooMany429,
		Lost: s.Lost - o.Lost, Unanswered: s.Unanswered - o.Unanswered, Shed: s.Shed - o.Shed}
}

// OpenLoad runs the calls.
type OpenLoad struct {
	cfg    OpenLoadConfig
	client *http.Client
	cancel context.CancelFunc
	wg     sync.WaitGroup
	done   chan struct{}

	outstanding                                                                     atomic.Int64
	calls, downstream, ok, p5xx, fallback, problem, tooMany, lost, unanswered, shed atomic.Int64

	mu           sync.Mutex
	unansweredAt []string // the first ones, for the failure message
}

// StartOpenLoad starts the load.
func StartOpenLoad(ctx context.Context, cfg OpenLoadConfig) *OpenLoad {
	if cfg.Timeout <= 0 {
		cfg.Timeout = 5 * time.Second
	}
	if cfg.MaxOutstanding <= 0 {
		cfg.MaxOutstanding = 4096
	}
	l := &OpenLoad{cfg: cfg, done: make(chan struct{}), client: &http.Client{Timeout: cfg.Timeout, Transport: &http.Transport{
		MaxIdleConnsPerHost: 32, MaxIdleConns: 2048, IdleConnTimeout: 30 * time.Second, DisableCompression: true}}}
	ctx, l.cancel = context.WithCancel(ctx)
	go l.run(ctx)
	return l
}

func (l *OpenLoad) run(ctx context.Context) {
	defer close(l.done)
	period := time.Duration(float64(time.Second) / l.cfg.Rate)
	t := time.NewTicker(period)
	defer t.Stop()
	var n uint64
	lastPid := map[*Agent]int{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		var ready []*Agent
		var pids []int
		var dones []<-chan struct{}
		for _, a := range l.cfg.Source.Agents() {
			// The traffic a Service sends: ready endpoints of pods not terminating, whose agent
			// container is up (a restarted one is not ready until it answers); a frozen pod's
			// app is frozen with it and calls nothing. The pid is read first: Start clears Up
			// before it starts a new process, so a new pid read here is up only once that
			// process answered (an old one's calls fail as lost with it).
			pid, done := a.Pid(), a.Done()
			if a.Running() && a.Serving() && a.Up() && !a.Draining() && !a.Suspended() {
				ready = append(ready, a)
				pids = append(pids, pid)
				dones = append(dones, done)
			}
		}
		if len(ready) == 0 {
			continue
		}
		i := n % uint64(len(ready))
		a, pid, done := ready[i], pids[i], dones[i]
		ds := l.cfg.Downstreams[(n/uint64(len(ready)))%uint64(len(l.cfg.Downstreams))]
		n++
		if last, ok := lastPid[a]; ok && last != pid {
			// The agent restarted: the kept connections to its previous process are dead (a
			// crashed process's peer may answer a reused one with a reset), as an app's client
			// finds out; the harness drops them instead of counting those calls.
			l.client.CloseIdleConnections()
		}
		lastPid[a] = pid
		if l.outstanding.Load() >= l.cfg.MaxOutstanding {
			l.shed.Add(1)
			continue
		}
		if !a.beginAppCall() {
			continue
		}
		l.outstanding.Add(1)
		l.calls.Add(1)
		l.wg.Go(func() {
			defer l.outstanding.Add(-1)
			defer a.endAppCall()
			l.call(a, pid, done, ds)
		})
	}
}

// call makes one call to a's process pid (done is closed when that process exits); it is not
// cancelled when the load stops (Stop waits for it: every call started is answered or counted
// lost), only bounded by the timeout.
func (l *OpenLoad) call(a *Agent, pid int, done <-chan struct{}, ds string) {
	req, _ := http.NewRequest(http.MethodGet, a.DataURL(ds)+"/work", nil)
	resp, err := l.client.Do(req)
	if err != nil {
		// Lost with its agent when that process died (it is reaped a moment after the kill: wait
		// for it a little), was frozen, or was replaced.
		select {
		case <-done:
			l.lost.Add(1)
			return
		case <-time.After(time.Second):
		}
		if a.Pid() != pid || !a.Running() || !a.Up() || a.Suspended() {
			l.lost.Add(1)
		} else {
			l.noteUnanswered(a.Pod + ": " + err.Error())
		}
		return
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	switch c := resp.StatusCode; {
	case resp.Header.Get("X-Apportion-Fallback") != "":
		// Every answer that is not the upstream's carries it (internal/agent/proxy): a refusal.
		l.fallback.Add(1)
	case c == http.StatusTooManyRequests:
		l.tooMany.Add(1)
	case c >= 200 && c < 300:
		l.downstream.Add(1)
		l.ok.Add(1)
	case c == http.StatusInternalServerError:
		l.downstream.Add(1)
		l.p5xx.Add(1)
	case (c == http.StatusGatewayTimeout || c == http.StatusBadGateway) && resp.Header.Get("Content-Type") == "application/problem+json":
		l.problem.Add(1)
	default:
		l.noteUnanswered(a.Pod + ": " + resp.Status)
	}
}

func (l *OpenLoad) noteUnanswered(what string) {
	l.unanswered.Add(1)
	if l.cfg.Logf != nil {
		l.cfg.Logf("unanswered call: %s", what)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.unansweredAt) < 20 {
		l.unansweredAt = append(l.unansweredAt, time.Now().Format("15:04:05.000")+" "+what)
	}
}

// Unanswered describes the first unanswered calls.
func (l *OpenLoad) Unanswered() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.unansweredAt...)
}

// Stats returns the counters so far (the calls under way are in Calls only).
func (l *OpenLoad) Stats() OpenLoadStats {
	return OpenLoadStats{Calls: l.calls.Load(), Downstream: l.downstream.Load(), OK: l.ok.Load(), Partner5xx: l.p5xx.Load(),
		Fallback: l.fallback.Load(), AgentProblem: l.problem.Load(), TooMany429: l.tooMany.Load(), Lost: l.lost.Load(), Unanswered: l.unanswered.Load(), Shed: l.shed.Load()}
}

// Stop stops starting calls, waits for those under way (each ends within the timeout) and
// returns the counters.
func (l *OpenLoad) Stop() OpenLoadStats {
	l.cancel()
	<-l.done
	l.wg.Wait()
	l.client.CloseIdleConnections()
	return l.Stats()
}
