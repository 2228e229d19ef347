package push

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"k8s.io/apimachinery/pkg/types"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/keys"
)

// engineRig is an Engine with in-process agents on loopback, on a fake clock: leases, renewals,
// retries and recovery move only when the test steps the clock; requests run in real time.
type engineRig struct {
	t       *testing.T
	rec     *testRecord
	clk     *testingclock.FakeClock
	agents  []*testAgent
	e       *Engine
	cancel  context.CancelFunc
	done    chan error
	changes atomic.Int64
	reg     *prometheus.Registry
}

const rigRT = 100 * time.Millisecond

func newRig(t *testing.T, n int, clk *testingclock.FakeClock, agents []*testAgent, epoch int64, mut func(*Options)) *engineRig {
	t.Helper()
	if clk == nil {
		clk = testingclock.NewFakeClock(time.Date(2026, 7, 1, 12, 0, 0, 0, time.UTC))
	}
	r := &engineRig{t: t, clk: clk, agents: agents, reg: prometheus.NewRegistry(), rec: &testRecord{}}
	for len(r.agents) < n {
		r.agents = append(r.agents, newTestAgent(t, clk.Now, fmt.Sprintf("%s/p%d", qKey.Namespace, len(r.agents))))
	}
	o := Options{
		Client:      keys.NewSigningClient(&http.Client{}, testKeys(t)),
		Epoch:       r.rec.take(epoch),
		Record:      r.rec,
		Clock:       clk,
		PushTimeout: 500 * time.Millisecond,
		AcceptGrace: 100 * time.Millisecond,
		RetryBase:   10 * time.Millisecond,
		RetryMax:    100 * time.Millisecond,
		Registry:    r.reg,
		OnChange:    func(types.NamespacedName) { r.changes.Add(1) },
	}
	if mut != nil {
		mut(&o)
	}
	e, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	r.e = e
	return r
}

func (r *engineRig) start() {
	ctx, cancel := context.WithCancel(context.Background())
	r.cancel, r.done = cancel, make(chan error, 1)
	go func() { r.done <- r.e.Start(ctx) }()
	r.t.Cleanup(r.stop)
	r.waitFor("the epoch", func() bool { return r.e.Epoch() != 0 })
}

func (r *engineRig) stop() {
	if r.cancel == nil {
		return
	}
	r.cancel()
	select {
	case <-r.done:
	case <-time.After(10 * time.Second):
		r.t.Error("Start did not return after cancel")
	}
	r.cancel = nil
}

// waitForStepping polls cond in real time (bounded), stepping the fake clock by step each
// round (about 1ms of real time).
func (r *engineRig) waitForStepping(what string, step time.Duration, cond func() bool) {
	r.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			r.t.Fatalf("timed out waiting for %s: %+v", what, r.e.Report(qKey))
		}
		if step > 0 {
			r.clk.Step(step)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitFor polls cond with the fake clock following real time roughly: a request that timed out
// on a loaded machine is then retried, as it would be on the real clock.
func (r *engineRig) waitFor(what string, cond func() bool) {
	r.t.Helper()
	r.waitForStepping(what, time.Millisecond, cond)
}

func (r *engineRig) quota(permits ...int32) DesiredQuota {
	d := DesiredQuota{Key: qKey, Limit: 0, Downstream: template("q")}
	d.Downstream.RequestTimeout = assignment.Duration(rigRT)
	for i, a := range r.agents {
		if i >= len(permits) {
			break
		}
		d.Limit += permits[i]
		d.Pods = append(d.Pods, DesiredPod{Name: fmt.Sprintf("p%d", i), UID: types.UID(fmt.Sprintf("uid-p%d", i)), Target: "web",
			Endpoint: a.srv.URL, Permits: permits[i], SafeDefault: 1})
	}
	return d
}

// pastRecovery steps the fake clock past the recovery window.
func (r *engineRig) pastRecovery() {
	r.clk.Step(r.e.opts.PushTimeout + r.e.opts.AcceptGrace + r.e.opts.LeaseTTL + rigRT + time.Millisecond)
}

func (r *engineRig) converged() bool {
	rep := r.e.Report(qKey)
	return rep.Converged && !rep.Recovering
}

func (r *engineRig) holds(i int) (int32, int64) { return r.agents[i].b.permits("q") }

func TestEngineConvergesOverHTTP(t *testing.T) {
	r := newRig(t, 5, nil, nil, 7, nil)
	r.start()
	r.e.SetQuota(r.quota(4, 4, 4, 4, 4))
	r.waitFor("probes", func() bool {
		rep := r.e.Report(qKey)
		return rep.Recovering && len(rep.Holdings) == 5 && r.agents[4].calls.Load() > 0
	})
	if p, _ := r.holds(0); p != -1 {
		t.Fatalf("an agent was configured during recovery: %d", p)
	}
	r.pastRecovery()
	r.waitFor("convergence", r.converged)
	for i := range r.agents {
		if p, ep := r.holds(i); p != 4 || ep != 7 {
			t.Fatalf("agent %d holds %d permits at epoch %d", i, p, ep)
		}
	}
	// A rebalance that needs lowerings acknowledged before raises.
	d := r.quota(6, 6, 2, 3, 3)
	d.Limit = 20
	r.e.SetQuota(d)
	r.waitFor("rebalance", r.converged)
	want := []int32{6, 6, 2, 3, 3}
	for i := range r.agents {
		if p, _ := r.holds(i); p != want[i] {
			t.Fatalf("agent %d holds %d, want %d", i, p, want[i])
		}
	}
	rep := r.e.Report(qKey)
	if rep.Ledger != 20 || len(rep.Unreachable) > 0 {
		t.Fatalf("report %+v", rep)
	}
	if r.changes.Load() == 0 {
		t.Fatal("OnChange never called")
	}
	if n := metricValue(r.e.metrics.pushes.WithLabelValues(resultOK)); n < 10 {
		t.Fatalf("pushes_total{result=ok} = %v", n)
	}
	// The gauge follows at the end of the next planning pass (the report is read live).
	r.waitForStepping("ledger_permits = 20", 0, func() bool {
		return metricValue(r.e.metrics.ledger.WithLabelValues("ns/q")) == 20
	})
	// Renewals: stepping past RenewEvery re-sends the same pair.
	before := r.agents[0].calls.Load()
	r.clk.Step(DefaultRenewEvery)
	r.waitFor("a renewal", func() bool { return r.agents[0].calls.Load() > before })
}

func TestEngineFailingAgent(t *testing.T) {
	r := newRig(t, 3, nil, nil, 1, nil)
	r.start()
	r.e.SetQuota(r.quota(5, 5, 5))
	r.pastRecovery()
	r.waitFor("convergence", r.converged)
	r.agents[1].mode.Store(agentFail)
	d := r.quota(3, 3, 9) // p2 wants what p1 held: only after p1 is surely lowered
	d.Limit = 15
	r.e.SetQuota(d)
	r.waitForStepping("p1 unreachable", 20*time.Millisecond, func() bool {
		return slices.Contains(r.e.Report(qKey).Unreachable, "p1")
	})
	rep := r.e.Report(qKey)
	if g := grants(rep); g["p0"] != 3 || g["p2"] > 7 {
		t.Fatalf("grants %v while p1 (5) is unreachable", g)
	}
	if rep.Converged {
		t.Fatal("converged with an unreachable pod")
	}
	// The gauge follows at the end of the quota's next planning pass, which the failure
	// scheduled; the report is read live, so it can be a pass ahead.
	r.waitForStepping("unreachable_pods = 1", 0, func() bool {
		return metricValue(r.e.metrics.unreachable.WithLabelValues("ns/q")) == 1
	})
	// It comes back: lowered, then p2 gets its 9.
	r.agents[1].mode.Store(agentNormal)
	r.waitForStepping("recovery of p1", 20*time.Millisecond, r.converged)
	if p, _ := r.holds(2); p != 9 {
		t.Fatalf("p2 holds %d", p)
	}
}

func TestEngineSlowAgentDoesNotDelayOthers(t *testing.T) {
	// Four workers: the pods' namespace may hold two of them (the fair queue's bound per flow).
	r := newRig(t, 4, nil, nil, 1, func(o *Options) { o.PushTimeout = 5 * time.Second; o.Workers = 4 })
	r.start()
	r.e.SetQuota(r.quota(2, 2, 2, 2))
	r.pastRecovery()
	r.waitFor("convergence", r.converged)
	r.agents[0].mode.Store(agentHang) // holds every request for up to PushTimeout
	d := r.quota(1, 3, 3, 1)
	d.Limit = 8
	start := time.Now()
	r.e.SetQuota(d)
	// Two workers for the namespace, one stuck on the slow agent: the others still go through the other one. p3's
	// acknowledged lowering frees one permit, which raises p1 (name order); p2's raise waits for
	// the slow p0's lowering.
	r.waitFor("the other agents", func() bool {
		p1, _ := r.holds(1)
		p3, _ := r.holds(3)
		return p1 == 3 && p3 == 1
	})
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("the other agents took %s", el)
	}
	if p, _ := r.holds(0); p != 2 {
		t.Fatalf("the slow agent holds %d", p)
	}
	if p, _ := r.holds(2); p != 2 {
		t.Fatalf("p2 raised to %d before p0's lowering was acknowledged", p)
	}
	r.agents[0].mode.Store(agentNormal)
	r.agents[0].unblock()
	r.waitFor("convergence", r.converged)
}

func TestEngineRestartWithNewEpochFencesTheOldOne(t *testing.T) {
	old := newRig(t, 3, nil, nil, 41, nil)
	old.start()
	old.e.SetQuota(old.quota(3, 3, 3))
	old.pastRecovery()
	old.waitFor("convergence", old.converged)

	// A new manager (leader change) takes epoch 42 on the same agents while the old one still
	// runs (a partitioned former leader). It writes the epoch record both read.
	nu := newRig(t, 3, old.clk, old.agents, 42, func(o *Options) { o.Epoch, o.Record = old.rec.take(42), old.rec })
	nu.start()
	nu.e.SetQuota(nu.quota(3, 3, 3))
	// During its recovery it learns what they hold and takes them over at what they hold.
	nu.waitFor("takeover", func() bool {
		for i := range nu.agents {
			if p, ep := nu.holds(i); p != 3 || ep != 42 {
				return false
			}
		}
		return true
	})
	// The old engine's next renewal is refused (409, newer epoch); the record confirms a newer
	// manager: it stops with ErrFenced.
	old.clk.Step(DefaultRenewEvery)
	select {
	case err := <-old.done:
		if !errors.Is(err, ErrFenced) {
			t.Fatalf("old engine stopped with %v", err)
		}
		old.cancel = nil
	case <-time.After(10 * time.Second):
		t.Fatal("the old engine was not fenced")
	}
	for i, a := range nu.agents {
		a.b.mu.Lock()
		hist := slices.Clone(a.b.accepted)
		a.b.mu.Unlock()
		seen42 := false
		for _, h := range hist {
			if strings.HasPrefix(h, "e42/") {
				seen42 = true
			} else if seen42 {
				t.Fatalf("agent %d accepted %s after epoch 42: %v", i, h, hist)
			}
		}
	}
	if n := metricValue(old.e.metrics.pushes.WithLabelValues(resultStale)); n < 1 {
		t.Fatalf("old engine saw no stale answer: %v", n)
	}
	nu.pastRecovery()
	nu.waitFor("convergence", nu.converged)
}

func TestEngineStartRetriesEpochAndStops(t *testing.T) {
	var calls atomic.Int32
	clk := testingclock.NewFakeClock(time.Date(2026, 7, 1, 12, 0, 0, 0, time.UTC))
	e, err := New(Options{
		Client: keys.NewSigningClient(nil, testKeys(t)),
		Clock:  clk,
		Epoch: EpochFunc(func(context.Context) (int64, error) {
			if calls.Add(1) < 3 {
				return 0, errors.New("conflict")
			}
			return 5, nil
		}),
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Start(ctx) }()
	deadline := time.Now().Add(5 * time.Second)
	for e.Epoch() != 5 {
		if time.Now().After(deadline) {
			t.Fatal("no epoch")
		}
		clk.Step(time.Second)
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Start returned %v", err)
	}
	if err := e.Start(context.Background()); err == nil {
		t.Fatal("a second Start succeeded")
	}
}

func TestNewValidatesOptions(t *testing.T) {
	ep := EpochFunc(func(context.Context) (int64, error) { return 1, nil })
	for _, o := range []Options{
		{Epoch: ep},
		{Client: nopClient{}},
		{Client: nopClient{}, Epoch: ep, LeaseTTL: time.Second, RenewEvery: 900 * time.Millisecond},
	} {
		if _, err := New(o); err == nil {
			t.Errorf("New(%+v) succeeded", o)
		}
	}
	if _, err := New(Options{Client: nopClient{}, Epoch: ep}); err != nil {
		t.Fatal(err)
	}
}

// Concurrent controller calls while the engine runs (for -race).
func TestEngineConcurrentCalls(t *testing.T) {
	r := newRig(t, 4, nil, nil, 1, nil)
	r.start()
	r.pastRecovery()
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 50 {
				r.e.SetQuota(r.quota(int32(1+(i+g)%3), 2, 2, 1))
				_ = r.e.Report(qKey)
				_, _ = r.e.SwitchApplied("ns/x")
			}
		})
	}
	wg.Wait()
	r.e.SetQuota(r.quota(2, 2, 2, 2))
	r.waitFor("convergence", r.converged)
	r.e.DeleteQuota(qKey)
	r.waitFor("empty assignments", func() bool {
		for i := range r.agents {
			if p, _ := r.holds(i); p != 0 {
				return false
			}
		}
		return true
	})
}

// metricValue reads a counter's or gauge's value.
func metricValue(c prometheus.Collector) float64 {
	ch := make(chan prometheus.Metric, 1)
	c.Collect(ch)
	var m dto.Metric
	if err := (<-ch).Write(&m); err != nil {
		panic(err)
	}
	switch {
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	}
	return 0
}

// docs/protocol.md §8b: an epoch below 1 from the epoch source stops Start with an error (the
// manager exits); it is never pushed.
func TestEngineStartRefusesAnEpochBelowOne(t *testing.T) {
	for _, epoch := range []int64{0, -3} {
		e, err := New(Options{
			Client: keys.NewSigningClient(nil, testKeys(t)),
			Epoch:  EpochFunc(func(context.Context) (int64, error) { return epoch, nil }),
		})
		if err != nil {
			t.Fatal(err)
		}
		err = e.Start(t.Context())
		if err == nil || !strings.Contains(err.Error(), "epoch source returned") {
			t.Fatalf("epoch %d: Start returned %v", epoch, err)
		}
		if e.Epoch() != 0 {
			t.Fatalf("epoch %d: the engine took epoch %d", epoch, e.Epoch())
		}
	}
}

// docs/protocol.md §10, batch signatures: the renewals ready at the same moment are signed
// together, but only those to agents whose last State advertised batch-signatures, so that
// agents of the first release get every request signed alone (they would refuse a proof).
func TestEngineBatchSignaturesOnlyWhereAdvertised(t *testing.T) {
	r := newRig(t, 6, nil, nil, 3, nil)
	for _, a := range r.agents[3:] {
		a.old.Store(true)
	}
	r.start()
	r.pastRecovery()
	r.e.SetQuota(r.quota(2, 2, 2, 2, 2, 2))
	r.waitFor("convergence", r.converged)
	// Three rounds of renewals, all due at once.
	for range 3 {
		before := make([]int64, len(r.agents))
		for i, a := range r.agents {
			before[i] = a.calls.Load()
		}
		r.clk.Step(r.e.opts.RenewEvery)
		r.waitFor("renewals", func() bool {
			for i, a := range r.agents {
				if a.calls.Load() == before[i] {
					return false
				}
			}
			return true
		})
	}
	r.waitFor("convergence", r.converged)
	for i, a := range r.agents {
		n := a.proofs.Load()
		if old := i >= 3; old && n != 0 {
			t.Errorf("agent %d of the first release got %d requests with a batch proof", i, n)
		} else if !old && n == 0 {
			t.Errorf("agent %d: no renewal of three signed in a batch with the others", i)
		}
	}
	c := r.e.opts.Client.(*keys.SigningClient)
	if signed, sigs := c.SignStats(); sigs >= signed {
		t.Errorf("signed %d requests with %d signatures", signed, sigs)
	}
}

// testRecord is an epoch record shared by the engines of one test, as the ConfigMap is by
// managers: an engine taking an epoch raises it (take), CurrentEpoch reads it, or fails with
// err when set.
type testRecord struct {
	mu    sync.Mutex
	v     int64
	err   error
	reads atomic.Int64
}

func (r *testRecord) take(epoch int64) EpochSource {
	return EpochFunc(func(context.Context) (int64, error) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.v = max(r.v, epoch)
		return epoch, nil
	})
}

func (r *testRecord) CurrentEpoch(context.Context) (int64, error) {
	r.reads.Add(1)
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.v, r.err
}

func (r *testRecord) set(v int64, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.v, r.err = v, err
}
