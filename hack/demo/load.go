package main

import (
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net/http"
	"sync"
	"time"

	"golang.org/x/sync/semaphore"

	"github.com/apportion/apportion/hack/demo/report"
)

// pod is one replica of the gateway as its app sees it: something to send a call through.
type pod interface {
	call(ctx context.Context) report.Outcome
}

// localPod is a gateway pod without Apportion, as in the story: its app holds a local
// Semaphore(50) and calls the partner directly. A call that gets no slot within acquire is
// refused by the app (its fallback), as the agent refuses one without a permit. With retry,
// the app has the seed's old habit: a call answered 429 is sent once more at once, still
// holding its slot, and ends with the retry's answer.
type localPod struct {
	sem     *semaphore.Weighted
	acquire time.Duration
	url     string
	client  *http.Client
	retry   bool
}

func (p *localPod) call(ctx context.Context) report.Outcome {
	actx, cancel := context.WithTimeout(ctx, p.acquire)
	err := p.sem.Acquire(actx, 1)
	cancel()
	if err != nil {
		if ctx.Err() != nil {
			return report.Timeout
		}
		return report.Fallback
	}
	defer p.sem.Release(1)
	o := do(ctx, p.client, p.url)
	if o == report.TooMany && p.retry {
		o = do(ctx, p.client, p.url)
	}
	return o
}

// agentPod is a gateway pod with Apportion: its app calls the partner through its agent.
type agentPod struct {
	url    string
	client *http.Client
}

func (p *agentPod) call(ctx context.Context) report.Outcome { return do(ctx, p.client, p.url) }

// do sends one GET and classifies the answer. A 503 carrying X-Apportion-Fallback is the
// agent's fallback; a 504 is the agent's own upstream timeout (the call took longer than the
// quota's requestTimeout), which the app sees as a timeout like its own.
func do(ctx context.Context, c *http.Client, url string) report.Outcome {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return report.Failed
	}
	resp, err := c.Do(req)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil {
			return report.Timeout
		}
		return report.Failed
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	switch {
	case resp.StatusCode >= 200 && resp.StatusCode < 300:
		return report.OK
	case resp.StatusCode == http.StatusTooManyRequests:
		return report.TooMany
	case resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("X-Apportion-Fallback") != "":
		return report.Fallback
	case resp.StatusCode == http.StatusGatewayTimeout:
		return report.Timeout
	}
	return report.Failed
}

// recorder keeps every call of a run.
type recorder struct {
	start time.Time
	mu    sync.Mutex
	calls []report.Call
}

func (r *recorder) add(c report.Call) {
	r.mu.Lock()
	r.calls = append(r.calls, c)
	r.mu.Unlock()
}

func (r *recorder) snapshot() []report.Call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]report.Call(nil), r.calls...)
}

// openLoop sends calls at rate per second in total, as traffic arrives at a gateway: arrivals
// are a Poisson process (exponential gaps), each call goes to the next pod in turn (a load
// balancer's round robin over the pods that are ready), carries its own timeout, and is not
// retried — a refused call is the user's error or fallback, not a reason to call again at
// once. The sender never waits for an answer, so a slow partner does not slow the arrivals.
//
// It returns when ctx ends, after every call it started has ended; lag is the largest delay
// of a call behind its scheduled arrival (how far the machine fell behind).
func openLoop(ctx context.Context, rate float64, timeout time.Duration, pods func() []pod, rec *recorder, seed uint64) (sent int, lag time.Duration) {
	rng := rand.New(rand.NewPCG(seed, seed+1))
	var wg sync.WaitGroup
	next := time.Since(rec.start)
	turn := 0
	for ctx.Err() == nil {
		now := time.Since(rec.start)
		if wait := next - now; wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
			case <-t.C:
			}
			t.Stop()
			continue
		}
		lag = max(lag, now-next)
		next += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		list := pods()
		if len(list) == 0 {
			continue
		}
		p := list[turn%len(list)]
		turn++
		sent++
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(context.Background(), timeout)
			start := time.Since(rec.start)
			o := p.call(cctx)
			cancel()
			rec.add(report.Call{Start: start, End: time.Since(rec.start), Outcome: o})
		})
	}
	wg.Wait()
	return sent, lag
}
