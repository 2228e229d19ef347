package push

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/h1"
	"github.com/apportion/apportion/internal/keys"
)

// A SigningClient over h1.HTTPClient (which ends a call at its context's deadline itself) gets
// a request context with the PushTimeout deadline and no timer, cancelled with the engine's;
// over net/http it gets a timer context, whose Done closes at the deadline.
func TestRequestContext(t *testing.T) {
	parent, cancel := context.WithCancel(context.Background())
	defer cancel()
	lean := keys.NewSigningClient(h1.HTTPClient{C: h1.NewClient()}, testKeys(t))
	if !lean.BoundsByDeadline() {
		t.Fatal("SigningClient over h1.HTTPClient does not bound by deadline")
	}
	before := time.Now()
	rctx, done := requestContext(parent, lean, time.Now().Add(time.Second))
	defer done()
	if _, ok := rctx.(*deadlineOnly); !ok {
		t.Fatalf("request context over h1 is %T, want *deadlineOnly (no timer)", rctx)
	}
	if d, ok := rctx.Deadline(); !ok || d.Before(before.Add(time.Second)) || d.After(time.Now().Add(time.Second)) {
		t.Fatalf("deadline %v %v, want a second from now", d, ok)
	}
	if rctx.Done() != parent.Done() {
		t.Fatal("the timerless context is not cancelled with the engine's")
	}
	early, cancelEarly := context.WithTimeout(parent, time.Millisecond)
	defer cancelEarly()
	ectx, edone := requestContext(early, lean, time.Now().Add(time.Hour))
	defer edone()
	if d, _ := ectx.Deadline(); d.After(time.Now().Add(time.Second)) {
		t.Fatalf("deadline %v: the parent's earlier deadline is not kept", d)
	}

	std := keys.NewSigningClient(&http.Client{}, testKeys(t))
	if std.BoundsByDeadline() {
		t.Fatal("SigningClient over net/http claims to bound by deadline")
	}
	sctx, sdone := requestContext(parent, std, time.Now().Add(time.Millisecond))
	defer sdone()
	select {
	case <-sctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the request context over net/http did not end at its deadline")
	}
}

// An engine on the lean client (no timer per request) still gives up on a push to an agent that
// does not answer, at PushTimeout: the connection's deadline ends it, and it counts as a timeout.
func TestEngineLeanClientGivesUpAtPushTimeout(t *testing.T) {
	const timeout = 300 * time.Millisecond
	r := newRig(t, 2, nil, nil, 1, func(o *Options) {
		o.Client = keys.NewSigningClient(h1.HTTPClient{C: h1.NewClient()}, testKeys(t))
		o.PushTimeout = timeout
	})
	r.start()
	r.e.SetQuota(r.quota(2, 2))
	r.pastRecovery()
	r.waitFor("convergence", r.converged)
	r.agents[0].mode.Store(agentHang)
	defer func() {
		r.agents[0].mode.Store(agentNormal)
		r.agents[0].unblock()
	}()
	timeouts := func() float64 { return metricValue(r.e.metrics.pushes.WithLabelValues(resultTimeout)) }
	if n := timeouts(); n != 0 {
		t.Fatalf("pushes_total{result=timeout} = %v before the agent hung", n)
	}
	start := time.Now()
	d := r.quota(1, 3)
	d.Limit = 4
	r.e.SetQuota(d)
	r.waitForStepping("a push given up", 0, func() bool { return timeouts() > 0 })
	if el := time.Since(start); el < timeout || el > timeout+5*time.Second {
		t.Fatalf("the push to the hung agent was given up after %s, want about %s", el, timeout)
	}
}

// BenchmarkRequestContext: the per-push cost of bounding a request, under a cancellable engine
// context: context.WithTimeout (a timer, a registration with the parent) against the
// timerless deadlineOnly a DeadlineBounded client gets.
func BenchmarkRequestContext(b *testing.B) {
	parent, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, tc := range []struct {
		name string
		c    AgentClient
	}{
		{"timer", keys.NewSigningClient(&http.Client{}, keys.Schedule{})},
		{"deadline-only", keys.NewSigningClient(h1.HTTPClient{C: h1.NewClient()}, keys.Schedule{})},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				rctx, done := requestContext(parent, tc.c, time.Now().Add(time.Second))
				if _, ok := rctx.Deadline(); !ok {
					b.Fatal("no deadline")
				}
				done()
			}
		})
	}
}
