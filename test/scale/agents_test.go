package scale

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/agent/control"
	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/assignment"
)

// simAgent is one pod's agent: the real enforcer (internal/agent/enforce) behind the real control
// API handler (internal/agent/control) with Ed25519 verification, served by its own http.Server
// on its own loopback address, as cmd/agent wires them. Only the data plane is left out: nothing
// calls the downstream in this benchmark. Many of them share the benchmark's process.
type simAgent struct {
	ns, pod string
	ds      string // the downstream (quota) name whose permits are watched
	addr    *net.TCPAddr
	enf     *enforce.Enforcer
	srv     *http.Server

	puts, gets atomic.Int64

	mu      sync.Mutex
	want    int32     // the permits the current event should bring
	since   time.Time // when the event's HPA write for this agent's quota was issued
	reached time.Time // when an accepted push first made the agent enforce want; zero until then
	arrived time.Time // when the first push after since arrived; zero until then
	written time.Time // when the API server answered the HPA write
}

// observer is the control API's Backend: the real Enforcer, with every Apply's outcome noted.
type observer struct {
	*enforce.Enforcer
	a *simAgent
}

func (o observer) Apply(a *assignment.Assignment, signed time.Time) (assignment.State, error) {
	st, err := o.Enforcer.Apply(a, signed)
	if err == nil {
		o.a.note(st)
	}
	return st, err
}

func (a *simAgent) note(st assignment.State) {
	now := time.Now()
	for _, d := range st.Downstreams {
		if d.Name != a.ds {
			continue
		}
		a.mu.Lock()
		if a.reached.IsZero() && a.want > 0 && d.EffectivePermits == a.want {
			a.reached = now
		}
		a.mu.Unlock()
	}
}

// expect arms the agent for an event: it has reached want once an accepted push says so.
func (a *simAgent) expect(want int32) {
	a.mu.Lock()
	a.want, a.reached, a.since, a.arrived, a.written = want, time.Time{}, time.Time{}, time.Time{}, time.Time{}
	a.mu.Unlock()
	// It may hold want already (no push will come then): look at its state now.
	st := a.enf.State()
	a.note(st)
}

func (a *simAgent) setSince(t time.Time) {
	a.mu.Lock()
	a.since = t
	a.mu.Unlock()
}

// latency is from the agent's quota's HPA write to its enforcing want; ok false while it does not.
func (a *simAgent) latency() (time.Duration, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.reached.IsZero() || a.since.IsZero() {
		return 0, false
	}
	return max(a.reached.Sub(a.since), 0), true
}

// firstPush is from the API server's answer to the agent's quota's HPA write to the first push
// that reached the agent after; write is the HPA write's own latency.
func (a *simAgent) firstPush() (push, write time.Duration) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.arrived.IsZero() || a.written.IsZero() {
		return 0, 0
	}
	return a.arrived.Sub(a.written), a.written.Sub(a.since)
}

func (a *simAgent) setWritten(t time.Time) {
	a.mu.Lock()
	a.written = t
	a.mu.Unlock()
}

func (a *simAgent) done() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return !a.reached.IsZero()
}

// countingHandler counts the control requests by kind.
type countingHandler struct {
	a *simAgent
	h http.Handler
}

func (c countingHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case assignment.PathAssignment:
		c.a.puts.Add(1)
		c.a.mu.Lock()
		if !c.a.since.IsZero() && c.a.arrived.IsZero() {
			c.a.arrived = time.Now()
		}
		c.a.mu.Unlock()
	case assignment.PathState:
		c.a.gets.Add(1)
	}
	c.h.ServeHTTP(w, r)
}

// agentFleet is every simulated agent, on 127.<b>.x.y (a /16 of loopback of its own; ports are
// chosen by the kernel, so nothing another test binds can collide).
type agentFleet struct {
	b      int
	agents []*simAgent
	trust  atomic.Pointer[assignment.TrustSet]
	quiet  *slog.Logger
}

func newFleet() *agentFleet {
	return &agentFleet{b: 241 + rand.IntN(14), quiet: slog.New(slog.DiscardHandler)}
}

func (f *agentFleet) setTrust(ts assignment.TrustSet) { f.trust.Store(&ts) }

// start starts an agent for pod ns/name, watching downstream ds, on the fleet's i-th address.
func (f *agentFleet) start(i int, ns, name, ds string) (*simAgent, error) {
	ip := fmt.Sprintf("127.%d.%d.%d", f.b, i/250, i%250+1)
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return nil, err
	}
	a := &simAgent{ns: ns, pod: name, ds: ds, addr: ln.Addr().(*net.TCPAddr)}
	a.enf = enforce.New(enforce.Options{Logger: f.quiet})
	h := control.New(control.Options{
		Backend: observer{Enforcer: a.enf, a: a},
		Trust:   func() assignment.TrustSet { return *f.trust.Load() },
		Pod:     ns + "/" + name,
		Logger:  f.quiet,
	})
	a.srv = &http.Server{
		Handler:           countingHandler{a: a, h: h},
		ReadHeaderTimeout: 5 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(f.quiet.Handler(), slog.LevelDebug),
	}
	go func() {
		if err := a.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			panic(err)
		}
	}()
	f.agents = append(f.agents, a)
	return a, nil
}

func (a *simAgent) ip() string   { return a.addr.IP.String() }
func (a *simAgent) port() string { return strconv.Itoa(a.addr.Port) }

func (f *agentFleet) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 64)
	for _, a := range f.agents {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			_ = a.srv.Shutdown(ctx)
		})
	}
	wg.Wait()
}

// requests is the control requests every agent received so far: pushes (PUT) and state reads.
func (f *agentFleet) requests() (puts, gets int64) {
	for _, a := range f.agents {
		puts += a.puts.Load()
		gets += a.gets.Load()
	}
	return puts, gets
}
