// Package enforce holds the agent's per-downstream enforcement table and the lease, and applies
// Assignments to them under the fencing rules of package assignment.
//
// Model. The Enforcer publishes an immutable Table (downstreams by name, degrade switches)
// through an atomic pointer: the data plane loads it once per call, and an accepted Assignment
// replaces it in one store, so a call sees either the old or the new configuration, never a mix.
// The per-downstream runtime objects (Downstream: semaphore, rate limiter, circuit breaker,
// counters, metric children) outlive tables: an Assignment that keeps a downstream keeps its
// objects and reconfigures them in place (Semaphore.SetLimit, Limiter.Set, Breaker.SetConfig),
// so calls in flight keep their permits and are counted against the new limit. A downstream
// that is removed leaves the table (new calls get 404) while its calls in flight finish on the
// objects they hold.
//
// Outcomes of Apply(a):
//   - (a.Epoch, a.Generation) below the pair held: nothing changes; the State and an error
//     wrapping assignment.ErrStale.
//   - the same pair: a lease renewal. The lease is extended to its new end (below) and, if it had
//     expired and the new end is still ahead, every downstream gets its Permits back. A renewal
//     never shortens a lease. The rest of a is not looked at (a different content under the same
//     pair is a manager bug and is logged).
//   - a higher pair: a replaces the configuration entirely, atomically, with a lease to its end
//     (already expired when that end has passed: the configuration then starts on its fallbacks).
//
// Lease end. A push signed at time s (the signature's timestamp; zero without authentication)
// and accepted at time t holds until min(s, t) + LeaseTTL: anchored to the signed time, so that a
// signed push replayed within the signature's two-minute window can never extend a lease beyond
// what the manager's own push gave, nor revive one that lapsed. A manager clock ahead of the
// agent's only shortens leases by the difference (the bound by t); one behind shortens them too,
// so clocks should agree to well under LeaseTTL (NTP does).
//
// Lease. While the lease holds, a downstream's effective limit is Permits. When LeaseTTL passes
// without renewal (timed with the injected k8s.io/utils/clock), it drops to min(Permits,
// SafeDefaultPermits), or to 0 with FailClosed (every call then gets the fallback at once):
// never unlimited and never above what it held. A renewal, or any newer Assignment, restores
// Permits. The --bootstrap configuration is applied as epoch 0, generation 0, already on safe
// defaults (as if its lease had expired), so that any manager push replaces it.
//
// Recovery. Within what the grant allows (the permits, or the safe limit after the lease passed:
// the base, reported as EffectivePermits), a downstream with a recovery configuration narrows its
// limit with package recovery, and only on the downstream's own evidence: a ramp started when its
// breaker closes after half-open probes, the adaptive limit, and a ramp from the adaptive limit
// when that limit drops — and on the manager's word that a raise follows an incident it saw
// (Config.RampRaise: a ramp from the permits held before). The pod's lifecycle starts no ramp: a
// downstream's first permits (a new pod, flagged or not), an unflagged raise, and permits restored by a renewal or a newer assignment after a lapsed lease
// apply at once — the lapse is the control plane's failure, and the breaker and the adaptive
// limit keep judging the downstream through it. The recovery controller works within the
// permits granted; the safe limit is applied outside it, so a lapse leaves a ramp in progress and
// the adaptive estimate untouched. The limit in force (reported as Limit) is min(base, the
// recovery limit); the recovery controller widens it back up to the base on its own, so the
// manager counts the base.
//
// Readiness: Ready is true once an Assignment or the bootstrap was applied, until SetDraining.
package enforce

import (
	"bytes"
	cryptorand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/utils/clock"

	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/agent/upstreamtls"
	"github.com/apportion/apportion/internal/assignment"
)

// Options configure an Enforcer.
type Options struct {
	// Clock times the lease and reads "now" for the agent (the data plane reads the Enforcer's);
	// nil means the real clock. Tests pass k8s.io/utils/clock/testing's FakeClock.
	Clock clock.WithDelayedExecution
	// Metrics receives per-downstream children; nil creates a private set.
	Metrics *metrics.Metrics
	// Logger; nil means slog.Default().
	Logger *slog.Logger
}

// Enforcer applies Assignments and publishes the Table.
type Enforcer struct {
	clock   clock.WithDelayedExecution
	metrics *metrics.Metrics
	log     *slog.Logger

	instance string    // random per process; see assignment.State.Instance
	started  time.Time // see assignment.State.Uptime

	table atomic.Pointer[Table]
	// leaseDeadline is leaseExpiresAt in Unix nanoseconds while a lease holds, 0 otherwise: Table
	// reads it on every call to catch a lease that passed while its timer has not fired yet.
	leaseDeadline atomic.Int64
	ready         atomic.Bool
	draining      atomic.Bool

	mu             sync.Mutex // serialises Apply, the lease and State
	epoch, gen     int64
	configured     bool
	bootstrap      bool
	leaseTTL       time.Duration
	leaseExpiresAt time.Time
	leaseExpired   bool
	leaseTimer     clock.Timer
	leaseSeq       uint64
	held           []byte // the JSON of the assignment held
	// upstreams are the TLS of the https downstreams held, by settings (resolveTLS).
	upstreams map[upstreamtls.Settings]*upstreamtls.Upstream
}

// New returns an Enforcer holding an empty table: every call is to an unknown downstream.
func New(o Options) *Enforcer {
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	if o.Metrics == nil {
		o.Metrics = metrics.New()
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	e := &Enforcer{clock: o.Clock, metrics: o.Metrics, log: o.Logger, instance: newInstanceID(), started: o.Clock.Now()}
	e.table.Store(&Table{byName: map[string]*Downstream{}})
	o.Metrics.SetSource(e)
	o.Metrics.SetLaneSource(e)
	return e
}

// Clock is the Enforcer's clock.
func (e *Enforcer) Clock() clock.WithDelayedExecution { return e.clock }

// Table is the configuration in force now. It is never nil.
//
// When the lease has passed but its timer has not fired yet — the process was frozen (SIGSTOP,
// a paused VM) or starved, and on resuming the data plane may run before the timer does — the
// lease is expired here first: no call is admitted on a lapsed lease, whatever order the runtime
// wakes goroutines in.
func (e *Enforcer) Table() *Table {
	if d := e.leaseDeadline.Load(); d != 0 && e.clock.Now().UnixNano() >= d {
		e.mu.Lock()
		e.expireLocked(e.leaseSeq)
		e.mu.Unlock()
	}
	return e.table.Load()
}

// Ready reports whether a configuration was applied and shutdown has not started.
func (e *Enforcer) Ready() bool { return e.ready.Load() && !e.draining.Load() }

// SetDraining makes Ready false for good (shutdown started).
func (e *Enforcer) SetDraining() { e.draining.Store(true) }

// Instance is this process's random id (assignment.State.Instance).
func (e *Enforcer) Instance() string { return e.instance }

// Apply applies a, signed at signed (zero: unsigned, the lease counts from acceptance), and
// returns the State after it (see the package doc).
func (e *Enforcer) Apply(a *assignment.Assignment, signed time.Time) (assignment.State, error) {
	if err := a.Validate(); err != nil {
		return e.State(), err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	now := e.clock.Now()
	if a.Instance != "" && a.Instance != e.instance {
		return e.stateLocked(now), fmt.Errorf("%w: pushed for agent instance %q, this is instance %q (the agent restarted)",
			assignment.ErrStale, a.Instance, e.instance)
	}
	// The instance only addresses this push; what is held and compared on renewal is the content.
	plain := *a
	plain.Instance = ""
	a = &plain
	if e.configured && !e.bootstrap {
		switch assignment.ComparePair(a.Epoch, a.Generation, e.epoch, e.gen) {
		case -1:
			return e.stateLocked(now), fmt.Errorf("%w: pushed epoch %d generation %d, held epoch %d generation %d",
				assignment.ErrStale, a.Epoch, a.Generation, e.epoch, e.gen)
		case 0:
			e.renewLocked(a, now, leaseEnd(a, signed, now))
			return e.stateLocked(now), nil
		}
	}
	if err := e.replaceLocked(a, now, leaseEnd(a, signed, now), false); err != nil {
		return e.stateLocked(now), err
	}
	return e.stateLocked(now), nil
}

// ApplyBootstrap applies a bootstrap configuration (from assignment.DecodeBootstrap) as epoch 0,
// generation 0, on safe defaults. It is meant for startup, before any push.
func (e *Enforcer) ApplyBootstrap(a *assignment.Assignment) error {
	b := *a
	b.Epoch, b.Generation = 0, 0
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.configured {
		return fmt.Errorf("bootstrap after a configuration was applied")
	}
	return e.replaceLocked(&b, e.clock.Now(), time.Time{}, true)
}

// leaseEnd is when a lease started by a, signed at signed and accepted at now, ends.
func leaseEnd(a *assignment.Assignment, signed, now time.Time) time.Time {
	start := now
	if !signed.IsZero() && signed.Before(now) {
		start = signed
	}
	return start.Add(a.LeaseTTL.D())
}

func (e *Enforcer) renewLocked(a *assignment.Assignment, now, end time.Time) {
	if b, err := json.Marshal(a); err == nil && !bytes.Equal(b, e.held) {
		e.log.Warn("assignment with the pair held but a different content: treated as a lease renewal only",
			"epoch", a.Epoch, "generation", a.Generation)
	}
	if !end.After(now) || (!e.leaseExpired && !end.After(e.leaseExpiresAt)) {
		// Signed too long ago to extend anything: a replay, or a push that took longer than its
		// lease to arrive. It renews nothing and revives nothing.
		if !end.After(now) {
			e.log.Warn("renewal ignored: its lease (from the signed time) has already passed",
				"epoch", a.Epoch, "generation", a.Generation, "leaseEnd", end)
		}
		return
	}
	e.leaseTTL = a.LeaseTTL.D()
	if e.leaseExpired {
		e.leaseExpired = false
		for _, ds := range e.table.Load().byName {
			// At once: the lapse was the control plane's, not the downstream's (the package doc).
			ds.setBase(ds.Config().Permits, ds.Config().Permits)
		}
		e.log.Info("lease renewed after it had expired; permits restored", "epoch", e.epoch, "generation", e.gen)
	}
	e.armLeaseLocked(now, end)
}

func (e *Enforcer) replaceLocked(a *assignment.Assignment, now, end time.Time, bootstrap bool) error {
	old := e.table.Load()
	// Build everything that can fail first: nothing is half-applied.
	nt, cfgs, err := buildTable(a)
	if err != nil {
		return err
	}
	upstreams, err := e.resolveTLS(cfgs)
	if err != nil {
		return err
	}
	held, _ := json.Marshal(a)
	// From here on nothing fails.
	var created []string
	for i, d := range a.Downstreams {
		cfg := cfgs[i]
		ds := old.byName[d.Name]
		from := -1 // the permits held before, for a raise that follows an incident
		if ds == nil {
			// A downstream new to the agent (a new pod's first permits) never ramps: the pod is
			// new, not the downstream (the package doc).
			ds = newDownstream(d.Name, cfg, e.metrics, e.clock, now)
			created = append(created, d.Name)
		} else {
			if cfg.RampRaise {
				from = ds.Config().Permits
			}
			ds.reconfigure(cfg, now)
		}
		// A newer assignment that ends a lapsed lease restores the permits as a renewal does: at
		// once — unless it also raises them after an incident (Config.RampRaise).
		if bootstrap || !end.After(now) {
			ds.setBase(cfg.SafeLimit(), cfg.Permits)
		} else {
			ds.setBaseFrom(cfg.Permits, cfg.Permits, from)
		}
		nt.byName[d.Name] = ds
	}
	e.table.Store(nt)
	var removed []string
	for name := range old.byName {
		if nt.byName[name] == nil {
			removed = append(removed, name)
			e.metrics.Forget(name)
			e.metrics.ForgetLanes(name)
		}
	}
	e.epoch, e.gen = a.Epoch, a.Generation
	e.upstreams = upstreams
	e.configured, e.bootstrap = true, bootstrap
	e.held = held
	if bootstrap {
		e.leaseTTL, e.leaseExpiresAt, e.leaseExpired = 0, time.Time{}, true
		e.leaseDeadline.Store(0)
		if e.leaseTimer != nil {
			e.leaseTimer.Stop()
		}
	} else if !end.After(now) {
		// Its lease from the signed time has passed already: applied, on its fallbacks.
		e.leaseTTL, e.leaseExpiresAt, e.leaseExpired = a.LeaseTTL.D(), end, true
		e.leaseDeadline.Store(0)
		if e.leaseTimer != nil {
			e.leaseTimer.Stop()
		}
		e.leaseSeq++
		e.log.Warn("assignment applied with its lease already passed (signed more than leaseTTL ago): running on safe defaults",
			"epoch", a.Epoch, "generation", a.Generation, "leaseEnd", end)
	} else {
		e.leaseTTL = a.LeaseTTL.D()
		e.leaseExpired = false
		e.armLeaseLocked(now, end)
	}
	e.ready.Store(true)
	e.log.Info("configuration applied", "epoch", a.Epoch, "generation", a.Generation, "bootstrap", bootstrap,
		"downstreams", len(a.Downstreams), "switches", len(a.Switches), "added", created, "removed", removed)
	return nil
}

func (e *Enforcer) armLeaseLocked(now, end time.Time) {
	if e.leaseTimer != nil {
		e.leaseTimer.Stop()
	}
	e.leaseSeq++
	seq := e.leaseSeq
	e.leaseExpiresAt = end
	e.leaseDeadline.Store(e.leaseExpiresAt.UnixNano())
	// The expiry runs on its own goroutine: a fake clock calls the function while it holds its
	// own lock, and e.mu may be held by a caller waiting for that lock (Apply arming the next
	// timer). Table, State and MetricsSnapshot expire a lease that passed before its timer
	// ran, so nothing reads a lapsed lease as held meanwhile.
	e.leaseTimer = e.clock.AfterFunc(end.Sub(now), func() { go e.expire(seq) })
}

func (e *Enforcer) expire(seq uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.expireLocked(seq)
}

func (e *Enforcer) expireLocked(seq uint64) {
	if seq != e.leaseSeq || e.leaseExpired {
		return // renewed or replaced since
	}
	e.leaseExpired = true
	t := e.table.Load()
	for _, ds := range t.byName {
		ds.setBase(ds.Config().SafeLimit(), ds.Config().Permits)
	}
	// Cleared only now: Table reads the deadline without the lock and, while it is set, takes the
	// lock to expire it, so a reader that races the lease's timer waits for the safe limits to be
	// in force rather than seeing the deadline gone and the permits still in force.
	e.leaseDeadline.Store(0)
	e.log.Warn("lease expired without renewal: running on safe defaults",
		"epoch", e.epoch, "generation", e.gen, "leaseTTL", e.leaseTTL.String())
}

// State is the agent's State (the answer of every control call).
func (e *Enforcer) State() assignment.State {
	now := e.clock.Now()
	e.mu.Lock()
	defer e.mu.Unlock()
	e.expirePassedLocked(now)
	return e.stateLocked(now)
}

// expirePassedLocked expires the lease when it passed at now but its timer has not run yet.
func (e *Enforcer) expirePassedLocked(now time.Time) {
	if d := e.leaseDeadline.Load(); d != 0 && now.UnixNano() >= d {
		e.expireLocked(e.leaseSeq)
	}
}

func (e *Enforcer) stateLocked(now time.Time) assignment.State {
	t := e.table.Load()
	st := assignment.State{
		Instance: e.instance,
		Uptime:   assignment.Duration(max(now.Sub(e.started), time.Millisecond)),
		Epoch:    e.epoch, Generation: e.gen, Configured: e.configured,
		LeaseExpired: e.leaseExpired,
		Downstreams:  []assignment.DownstreamState{},
	}
	if !e.bootstrap {
		st.LeaseExpiresAt = e.leaseExpiresAt
	}
	for _, name := range t.names {
		st.Downstreams = append(st.Downstreams, t.byName[name].state(now))
	}
	for _, sw := range t.switchStates {
		st.Switches = append(st.Switches, assignment.SwitchState{Name: sw.Name, ExpiresAt: sw.ExpiresAt, Active: now.Before(sw.ExpiresAt)})
	}
	return st
}

// MetricsSnapshot implements metrics.Source.
func (e *Enforcer) MetricsSnapshot() metrics.Snapshot {
	now := e.clock.Now()
	e.mu.Lock()
	e.expirePassedLocked(now)
	gen, expired := e.gen, e.leaseExpired
	e.mu.Unlock()
	t := e.table.Load()
	s := metrics.Snapshot{Generation: gen, LeaseExpired: expired}
	for _, name := range t.names {
		ds := t.byName[name]
		st := ds.Sem.Stats()
		if ls := ds.Lanes(); ls != nil {
			st.Waiting += ls.Sem.Stats().Waiting // calls queue in the lanes, not in Sem
		}
		bs := -1
		if b := ds.Breaker(); b != nil {
			bs = breakerGauge(b, now)
		}
		s.Downstreams = append(s.Downstreams, metrics.DownstreamSnapshot{
			Name: name, InFlight: st.InFlight, Waiting: st.Waiting, Permits: st.Limit,
			Breaker: bs, PeakRPS: ds.Metrics.Peak.Max(now),
		})
	}
	for _, sw := range t.switchStates {
		s.Switches = append(s.Switches, metrics.SwitchSnapshot{Downstream: sw.Downstream, Name: sw.Name, Active: now.Before(sw.ExpiresAt)})
	}
	return s
}

// newInstanceID is 64 random bits in hex, unique per agent process.
func newInstanceID() string {
	var b [8]byte
	_, _ = cryptorand.Read(b[:])
	return hex.EncodeToString(b[:])
}
