package enforce

import (
	"fmt"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/agent/breaker"
	"github.com/apportion/apportion/internal/agent/degrade"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/agent/ratelimit"
	"github.com/apportion/apportion/internal/agent/recovery"
	"github.com/apportion/apportion/internal/agent/semaphore"
	"github.com/apportion/apportion/internal/agent/upstreamtls"
	"github.com/apportion/apportion/internal/assignment"
)

// Table is one immutable configuration: the downstreams by name and the degrade switches.
type Table struct {
	byName map[string]*Downstream
	names  []string // sorted
	// Switches are the degrade switches in force, in the order of the Assignment; DryRun the
	// dry-run ones (assignment.Switch.DryRun), which only count the calls they match.
	Switches     []degrade.Switch
	DryRun       []degrade.Switch
	switchStates []switchInfo // sorted by name
}

type switchInfo struct {
	Name, Downstream string
	ExpiresAt        time.Time
}

// Lookup returns the downstream called name, or nil.
func (t *Table) Lookup(name string) *Downstream { return t.byName[name] }

// Names returns the downstream names, sorted.
func (t *Table) Names() []string { return slices.Clone(t.names) }

// Config is one downstream's immutable configuration.
type Config struct {
	Name           string
	Upstream       *url.URL
	Permits        int
	SafeDefault    int
	FailClosed     bool
	AcquireTimeout time.Duration
	RequestTimeout time.Duration
	Fallback       fallback.Config
	Rate           *ratelimit.Config
	Breaker        *breaker.Config
	// Lanes are the downstream's priority lanes (lanes.go); none: one FIFO for every call.
	Lanes []assignment.Lane
	// CacheStale is true when the fallback or a switch of this downstream serves stale
	// responses: GET 2xx responses are then kept in the stale cache.
	CacheStale bool
	// Recovery is the ramp and adaptive limit inside the permits; nil: neither.
	Recovery *recovery.Config
	// MaxWaiting bounds the calls waiting for a permit (from the wire, or DefaultMaxWaiting).
	MaxWaiting int
	// DeadlineHeader names the header that tells the upstream what is left of the call's
	// time; "" for none.
	DeadlineHeader string
	// AbandonedHold is how long a call that timed out keeps its permit after its upstream
	// connection closed.
	AbandonedHold time.Duration
	// TLS is an https upstream's TLS (its settings in TLSSettings): one Upstream per settings,
	// kept across assignments while the settings stay (Enforcer.resolveTLS), so its session
	// cache and the lean client's pool of its connections survive a push. nil for http.
	TLS         *upstreamtls.Upstream
	TLSSettings *upstreamtls.Settings
	// Observe: every call is forwarded at once, holding a permit beyond the limit if need be,
	// and what enforcing would have refused is counted (CountWouldRefuse).
	Observe bool
	// RampRaise: a raise of Permits in this assignment follows an incident the manager saw
	// (assignment.Downstream.RampRaise): it climbs through the recovery ramp from the permits
	// held before instead of applying at once (setBase).
	RampRaise bool
}

// SafeLimit is the limit in force after the lease expired: min(Permits, SafeDefault), or 0
// with FailClosed (assignment.LapsedLimit, the function the manager's ledger counts with).
func (c *Config) SafeLimit() int {
	return assignment.LapsedLimit(c.Permits, c.SafeDefault, c.FailClosed)
}

// Downstream is one downstream's runtime objects. They survive reconfiguration (see the
// package doc).
type Downstream struct {
	Name string
	Sem  *semaphore.Semaphore
	// Shadow is Enforce's model under Observe: a semaphore with Sem's limit and waiters' bound
	// in which each call forwarded under Observe waits (beside it, never delaying it) and holds a
	// permit as Enforce would have made it; what it refuses is what Enforce would have refused
	// (package proxy, observe). Unused under Enforce.
	Shadow  *semaphore.Semaphore
	Metrics *metrics.Downstream

	cfg       atomic.Pointer[Config]
	limiter   atomic.Pointer[ratelimit.Limiter]
	breaker   atomic.Pointer[breaker.Breaker]
	lanes     atomic.Pointer[LaneSet] // lanes.go
	effective atomic.Int64

	// The effective limit is min(base, the recovery controller's limit): base is the permits, or
	// the safe limit after the lease passed; rc (nil: no recovery configured) narrows it while
	// ramping or adapting. limitMu orders the updates of effective and Sem's limit, so that two
	// goroutines refreshing at once cannot leave an older value in force.
	clk     recovery.Clock
	rc      atomic.Pointer[recovery.Controller]
	limitMu sync.Mutex
	base    int

	metricsSet *metrics.Metrics // the lanes' metrics are registered on it

	requests, upstream429, abandoned atomic.Int64
	rejected                         [metrics.NumReasons]atomic.Int64 // by metrics.Reason*
	wouldRefuse                      [metrics.NumReasons]atomic.Int64 // by metrics.Reason*
}

// Config is the configuration in force.
func (d *Downstream) Config() *Config { return d.cfg.Load() }

// Limiter is the rate limiter, nil when the downstream has no rate limit.
func (d *Downstream) Limiter() *ratelimit.Limiter { return d.limiter.Load() }

// Breaker is the circuit breaker, nil when the downstream has none.
func (d *Downstream) Breaker() *breaker.Breaker { return d.breaker.Load() }

// Effective is the in-flight limit in force: Base, narrowed by the recovery ramp or the adaptive
// limit.
func (d *Downstream) Effective() int { return int(d.effective.Load()) }

// Base is what the grant lets the pod use now: the permits, or the safe limit after the lease
// passed. The recovery controller only ever narrows it, and widens back up to it on its own: the
// manager must count Base, which State reports as EffectivePermits.
func (d *Downstream) Base() int {
	d.limitMu.Lock()
	defer d.limitMu.Unlock()
	return d.base
}

// CountRequest counts a call addressed to the downstream.
func (d *Downstream) CountRequest(now time.Time) {
	d.requests.Add(1)
	d.Metrics.Requests.Inc()
	d.Metrics.Peak.Add(now)
}

// CountRejected counts a call not forwarded, by metrics.Reason*.
func (d *Downstream) CountRejected(reason int) {
	d.rejected[reason].Add(1)
	d.Metrics.Rejected[reason].Inc()
}

// CountWouldRefuse counts a call forwarded under Observe, or past a dry-run switch, that
// enforcing would have refused, by metrics.Reason*.
func (d *Downstream) CountWouldRefuse(reason int) {
	d.wouldRefuse[reason].Add(1)
	d.Metrics.WouldRefuse[reason].Inc()
}

// CountAbandoned counts a call abandoned at its deadline whose permit is held for AbandonedHold.
func (d *Downstream) CountAbandoned() {
	d.abandoned.Add(1)
	d.Metrics.Abandoned.Inc()
}

// CountUpstream429 counts an upstream 429.
func (d *Downstream) CountUpstream429() {
	d.upstream429.Add(1)
	d.Metrics.Upstream429.Inc()
}

// setBase sets the base limit (the permits, or the safe limit after the lease passed) and the
// permits granted, which the recovery controller works within. It starts no ramp: a pod's first
// permits, a raise and permits restored after a lapsed lease are not the downstream recovering,
// and apply at once (see the package doc). The safe limit stays outside the recovery
// controller, so a lapse and its renewal leave its ramp and adaptive estimate as they were.
func (d *Downstream) setBase(base, granted int) { d.setBaseFrom(base, granted, -1) }

// setBaseFrom is setBase for a raise that follows an incident (Config.RampRaise): when granted is
// above from (the permits held before, >= 0) the recovery controller begins a ramp at from
// (recovery.Controller.RampFrom; nothing without a ramp configured). from < 0: no ramp, setBase.
// The new permits and the ramp are put in force together, under the limit's lock, so no call is
// admitted at the raised limit in between.
func (d *Downstream) setBaseFrom(base, granted, from int) {
	d.limitMu.Lock()
	d.base = base
	if rc := d.rc.Load(); rc != nil {
		rc.SetPermits(granted)
		if from >= 0 && granted > from {
			rc.RampFrom(from)
		}
	}
	d.refreshLocked()
	d.limitMu.Unlock()
}

// refreshLocked puts min(base, the recovery limit) in force.
func (d *Downstream) refreshLocked() {
	n := d.base
	if rc := d.rc.Load(); rc != nil {
		n = min(n, rc.Limit())
	}
	if int64(n) != d.effective.Load() {
		d.effective.Store(int64(n))
		d.setSemLimits(n)
	}
}

// setSemLimits sets the limit of the downstream semaphore and, with priority lanes, of the lane
// semaphore: the lanes first when lowering, the downstream semaphore first when raising, so that
// the lanes never grant beyond what the downstream semaphore admits at once.
func (d *Downstream) setSemLimits(n int) {
	d.Shadow.SetLimit(n)
	ls := d.Lanes()
	if ls == nil {
		d.Sem.SetLimit(n)
		return
	}
	if n < ls.Sem.Stats().Limit {
		ls.Sem.SetLimit(n)
		d.Sem.SetLimit(n)
		return
	}
	d.Sem.SetLimit(n)
	ls.Sem.SetLimit(n)
}

// Tick puts in force a recovery limit that changed because a window ended. The data plane calls
// it before admitting a call; it does nothing without recovery configured.
func (d *Downstream) Tick() {
	if d.rc.Load() == nil {
		return
	}
	d.limitMu.Lock()
	d.refreshLocked()
	d.limitMu.Unlock()
}

// Observe counts a finished call in the recovery windows (failed and took as the breaker gets
// them) and puts the resulting limit in force; without recovery configured it does nothing.
func (d *Downstream) Observe(took time.Duration, failed bool) {
	rc := d.rc.Load()
	if rc == nil {
		return
	}
	rc.Record(took, failed)
	d.limitMu.Lock()
	d.refreshLocked()
	d.limitMu.Unlock()
}

// StartRamp starts the recovery ramp: the breaker calls it when it closes after half-open
// probes, the one lifecycle-independent sign that the downstream is coming back from failure.
func (d *Downstream) StartRamp() {
	rc := d.rc.Load()
	if rc == nil {
		return
	}
	d.limitMu.Lock()
	rc.Start()
	d.refreshLocked()
	d.limitMu.Unlock()
}

// Recovery is the recovery controller's state; ok false without recovery configured.
func (d *Downstream) Recovery() (st recovery.Status, ok bool) {
	if rc := d.rc.Load(); rc != nil {
		return rc.Status(), true
	}
	return recovery.Status{}, false
}

func newDownstream(name string, cfg *Config, m *metrics.Metrics, clk recovery.Clock, now time.Time) *Downstream {
	d := &Downstream{Name: name, Sem: semaphore.New(0), Shadow: semaphore.New(0), Metrics: m.Downstream(name), clk: clk, metricsSet: m}
	d.reconfigure(cfg, now)
	return d
}

// reconfigure installs cfg, keeping the runtime objects that it still uses.
func (d *Downstream) reconfigure(cfg *Config, now time.Time) {
	if cfg.Rate == nil {
		d.limiter.Store(nil)
	} else if l := d.limiter.Load(); l != nil {
		l.Set(*cfg.Rate, now)
	} else {
		d.limiter.Store(ratelimit.New(*cfg.Rate, now))
	}
	if cfg.Breaker == nil {
		d.breaker.Store(nil)
	} else if b := d.breaker.Load(); b != nil {
		b.SetConfig(*cfg.Breaker)
	} else {
		d.breaker.Store(d.newBreaker(*cfg.Breaker))
	}
	d.reconfigureLanes(cfg, d.metricsSet)
	d.limitMu.Lock()
	if cfg.Recovery == nil {
		d.rc.Store(nil)
	} else if rc := d.rc.Load(); rc != nil {
		rc.SetConfig(*cfg.Recovery)
	} else {
		d.rc.Store(recovery.New(*cfg.Recovery, cfg.Permits, d.clk))
	}
	d.refreshLocked()
	d.limitMu.Unlock()
	d.Sem.SetMaxWaiting(cfg.MaxWaiting)
	d.Shadow.SetMaxWaiting(cfg.MaxWaiting)
	d.cfg.Store(cfg)
}

func (d *Downstream) state(now time.Time) assignment.DownstreamState {
	cfg := d.Config()
	st := d.Sem.Stats()
	ds := assignment.DownstreamState{
		Name:             d.Name,
		Permits:          int32(cfg.Permits),
		EffectivePermits: int32(d.Base()),
		Limit:            int32(d.Effective()),
		InFlight:         int32(st.InFlight),
		Waiting:          int32(st.Waiting),
		Requests:         d.requests.Load(),
		Upstream429:      d.upstream429.Load(),
		Lanes:            d.Lanes().states(),
	}
	if ls := d.Lanes(); ls != nil {
		ds.Waiting += int32(ls.Sem.Stats().Waiting) // calls queue in the lanes, not in Sem
	}
	if b := d.Breaker(); b != nil {
		ds.Breaker = b.State(now).String()
	}
	for i, r := range metrics.Reasons {
		if n := d.rejected[i].Load(); n > 0 {
			if ds.Rejected == nil {
				ds.Rejected = map[string]int64{}
			}
			ds.Rejected[r] = n
		}
		if n := d.wouldRefuse[i].Load(); n > 0 {
			if ds.WouldRefuse == nil {
				ds.WouldRefuse = map[string]int64{}
			}
			ds.WouldRefuse[r] = n
		}
	}
	ds.Observe = cfg.Observe
	ds.SecondsEnd, ds.Seconds = d.Metrics.Peak.Seconds(now, assignment.MaxSecondCounts)
	return ds
}

// buildTable converts a into a Table (without Downstreams yet) and one Config per downstream,
// in order.
func buildTable(a *assignment.Assignment) (*Table, []*Config, error) {
	t := &Table{byName: make(map[string]*Downstream, len(a.Downstreams))}
	staleBy := map[string]bool{}
	for _, s := range a.Switches {
		if s.DryRun {
			t.DryRun = append(t.DryRun, convertSwitch(s))
		} else {
			t.Switches = append(t.Switches, convertSwitch(s))
		}
		t.switchStates = append(t.switchStates, switchInfo{Name: s.Name, Downstream: s.Downstream, ExpiresAt: s.ExpiresAt})
		if s.Action.Action == assignment.ActionServeStale {
			staleBy[s.Downstream] = true
		}
	}
	slices.SortFunc(t.switchStates, func(x, y switchInfo) int { return strings.Compare(x.Name, y.Name) })
	cfgs := make([]*Config, len(a.Downstreams))
	for i, d := range a.Downstreams {
		u, err := url.Parse(d.Upstream)
		if err != nil {
			return nil, nil, fmt.Errorf("downstreams[%d].upstream: %w", i, err)
		}
		c := &Config{
			Name: d.Name, Upstream: u,
			Permits: int(d.Permits), SafeDefault: int(d.SafeDefaultPermits), FailClosed: d.FailClosed,
			AcquireTimeout: d.AcquireTimeout.D(), RequestTimeout: d.RequestTimeout.D(),
			Fallback:   ConvertFallback(d.Fallback),
			Lanes:      slices.Clone(d.Lanes),
			CacheStale: d.Fallback.Action == assignment.ActionServeStale || staleBy[d.Name],
		}
		if d.Rate != nil {
			rc := convertRate(*d.Rate)
			c.Rate = &rc
		}
		if d.Breaker != nil {
			bc := convertBreaker(*d.Breaker)
			c.Breaker = &bc
		}
		c.Recovery = convertRecovery(d.Recovery, c.Breaker)
		c.MaxWaiting = DefaultMaxWaiting(c.Permits)
		if d.MaxWaiting != nil {
			c.MaxWaiting = int(*d.MaxWaiting)
		}
		c.DeadlineHeader = d.DeadlineHeader
		c.TLSSettings = tlsSettings(u, d.TLS)
		c.Observe = d.Observe
		c.RampRaise = d.RampRaise
		c.AbandonedHold = c.RequestTimeout
		if d.AbandonedHold != nil {
			c.AbandonedHold = d.AbandonedHold.D()
		}
		cfgs[i] = c
		t.names = append(t.names, d.Name)
	}
	slices.Sort(t.names)
	return t, cfgs, nil
}

// WaitingPerPermit is how many calls may wait per permit by default (DefaultMaxWaiting).
const WaitingPerPermit = 10

// DefaultMaxWaiting is the bound on the calls waiting for a permit when the assignment sets
// none: WaitingPerPermit × permits, at least WaitingPerPermit.
//
// Why ten: a permit turns over once per call, so the k-th call in line gets one after about
// k / permits calls' time, and ten calls per permit in line are served within ten calls' time —
// the sample's acquireTimeout of 200 ms for a downstream answering in 20 ms. The queue is for
// calls that a healthy downstream serves within acquireTimeout; a shorter one refuses them at
// once (queue-full) while permits free up every few milliseconds — `make demo`, 8 pods × 5
// permits with waiters bounded at the permits, refused 3.1 % of a healthy phase's calls that
// way, against 0.3 % with this bound (docs/agent.md). Beyond it a call could only wait out
// acquireTimeout while the downstream is slow, so it is refused at once instead.
func DefaultMaxWaiting(permits int) int { return WaitingPerPermit * max(permits, 1) }
