package scale

import (
	"context"
	"errors"
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
// API handler (internal/agent/control) with Ed25519 verification, on its own loopback address,
// as cmd/agent wires them. Only the data plane is left out: nothing
// calls the downstream in this benchmark. Many of them share the benchmark's process.
type simAgent struct {
	ns, pod string
	ds      string // the downstream (quota) name whose permits are watched
	addr    *net.TCPAddr
	enf     *enforce.Enforcer
	h       http.Handler // the control API

	puts, gets atomic.Int64

	mu   sync.Mutex
	want int32 // the permits the current event should bring
	// orMore: want+1 counts too: the quota's budget leaves a remainder, which the split hands out
	// one permit more to some of its pods (which ones rotates: internal/apportion)
	orMore  bool
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
		if a.reached.IsZero() && a.want > 0 && (d.EffectivePermits == a.want || a.orMore && d.EffectivePermits == a.want+1) {
			a.reached = now
		}
		a.mu.Unlock()
	}
}

// expect arms the agent for an event: it has reached want once an accepted push says so.
func (a *simAgent) expect(want int32, orMore bool) {
	a.mu.Lock()
	a.want, a.orMore, a.reached, a.since, a.arrived, a.written = want, orMore, time.Time{}, time.Time{}, time.Time{}, time.Time{}
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

// agentFleet is every simulated agent, each on its own address 127.<b>.x.y (a /16 of loopback
// of its own). One listening socket, on the wildcard address and a port the kernel chooses,
// accepts for all of them (a socket per agent would take twice the file descriptors at 10,000
// agents); each connection goes to the agent whose address it was made to, and a connection to
// any other address is closed.
type agentFleet struct {
	b      int
	ln     net.Listener
	port   int
	srv    *http.Server
	agents []*simAgent
	byIP   map[string]*simAgent // written before the listener serves the agent's address
	mu     sync.RWMutex
	trust  atomic.Pointer[assignment.TrustSet]
	quiet  *slog.Logger
}

type agentKey struct{}

func newFleet() (*agentFleet, error) {
	f := &agentFleet{b: 241 + rand.IntN(14), quiet: slog.New(slog.DiscardHandler), byIP: map[string]*simAgent{}}
	ln, err := net.Listen("tcp4", "0.0.0.0:0")
	if err != nil {
		return nil, err
	}
	f.ln, f.port = ln, ln.Addr().(*net.TCPAddr).Port
	f.srv = &http.Server{
		Handler:           http.HandlerFunc(f.serve),
		ReadHeaderTimeout: 5 * time.Second,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          slog.NewLogLogger(f.quiet.Handler(), slog.LevelDebug),
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			ip := c.LocalAddr().(*net.TCPAddr).IP.String()
			f.mu.RLock()
			a := f.byIP[ip]
			f.mu.RUnlock()
			return context.WithValue(ctx, agentKey{}, a)
		},
	}
	go func() {
		if err := f.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			panic(err)
		}
	}()
	return f, nil
}

func (f *agentFleet) serve(w http.ResponseWriter, r *http.Request) {
	a, _ := r.Context().Value(agentKey{}).(*simAgent)
	if a == nil {
		// Not one of the fleet's addresses: nobody else is served on this socket.
		if hj, ok := w.(http.Hijacker); ok {
			if c, _, err := hj.Hijack(); err == nil {
				_ = c.Close()
				return
			}
		}
		http.NotFound(w, r)
		return
	}
	switch r.URL.Path {
	case assignment.PathAssignment:
		a.puts.Add(1)
		a.mu.Lock()
		if !a.since.IsZero() && a.arrived.IsZero() {
			a.arrived = time.Now()
		}
		a.mu.Unlock()
	case assignment.PathState:
		a.gets.Add(1)
	}
	a.h.ServeHTTP(w, r)
}

func (f *agentFleet) setTrust(ts assignment.TrustSet) { f.trust.Store(&ts) }

// start starts an agent for pod ns/name, watching downstream ds, on the fleet's i-th address.
func (f *agentFleet) start(i int, ns, name, ds string) (*simAgent, error) {
	ip := net.IPv4(127, byte(f.b), byte(i/250), byte(i%250+1))
	a := &simAgent{ns: ns, pod: name, ds: ds, addr: &net.TCPAddr{IP: ip, Port: f.port}}
	a.enf = enforce.New(enforce.Options{Logger: f.quiet})
	a.h = control.New(control.Options{
		Backend: observer{Enforcer: a.enf, a: a},
		Trust:   func() assignment.TrustSet { return *f.trust.Load() },
		Pod:     ns + "/" + name,
		Logger:  f.quiet,
	})
	f.mu.Lock()
	f.byIP[ip.String()] = a
	f.mu.Unlock()
	f.agents = append(f.agents, a)
	return a, nil
}

func (a *simAgent) ip() string   { return a.addr.IP.String() }
func (a *simAgent) port() string { return strconv.Itoa(a.addr.Port) }

func (f *agentFleet) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = f.srv.Shutdown(ctx)
}

// requests is the control requests every agent received so far: pushes (PUT) and state reads.
func (f *agentFleet) requests() (puts, gets int64) {
	for _, a := range f.agents {
		puts += a.puts.Load()
		gets += a.gets.Load()
	}
	return puts, gets
}
