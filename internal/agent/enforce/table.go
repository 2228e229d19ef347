package enforce

import (
	"fmt"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/agent/breaker"
	"github.com/apportion/apportion/internal/agent/degrade"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/agent/ratelimit"
	"github.com/apportion/apportion/internal/agent/semaphore"
	"github.com/apportion/apportion/internal/assignment"
)

// Table is one immutable configuration: the downstreams by name and the degrade switches.
type Table struct {
	byName map[string]*Downstream
	names  []string // sorted
	// Switches are the degrade switches, in the order of the Assignment.
	Switches     []degrade.Switch
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
}

// SafeLimit is the limit in force after the lease expired: min(Permits, SafeDefault), or 0
// with FailClosed.
func (c *Config) SafeLimit() int {
	if c.FailClosed {
		return 0
	}
	return min(c.Permits, c.SafeDefault)
}

// Downstream is one downstream's runtime objects. They survive reconfiguration (see the
// package doc).
type Downstream struct {
	Name    string
	Sem     *semaphore.Semaphore
	Metrics *metrics.Downstream

	cfg       atomic.Pointer[Config]
	limiter   atomic.Pointer[ratelimit.Limiter]
	breaker   atomic.Pointer[breaker.Breaker]
	lanes     atomic.Pointer[LaneSet] // lanes.go
	effective atomic.Int64

	metricsSet            *metrics.Metrics
	requests, upstream429 atomic.Int64
	rejected              [4]atomic.Int64 // by metrics.Reason*
}

// Config is the configuration in force.
func (d *Downstream) Config() *Config { return d.cfg.Load() }

// Limiter is the rate limiter, nil when the downstream has no rate limit.
func (d *Downstream) Limiter() *ratelimit.Limiter { return d.limiter.Load() }

// Breaker is the circuit breaker, nil when the downstream has none.
func (d *Downstream) Breaker() *breaker.Breaker { return d.breaker.Load() }

// Effective is the effective in-flight limit.
func (d *Downstream) Effective() int { return int(d.effective.Load()) }

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

// CountUpstream429 counts an upstream 429.
func (d *Downstream) CountUpstream429() {
	d.upstream429.Add(1)
	d.Metrics.Upstream429.Inc()
}

func (d *Downstream) setEffective(n int) {
	d.effective.Store(int64(n))
	if ls := d.Lanes(); ls != nil {
		// The lanes first when lowering, the downstream semaphore first when raising, so that
		// the lanes never grant beyond what the downstream semaphore admits at once.
		if n < ls.Sem.Stats().Limit {
			ls.Sem.SetLimit(n)
			d.Sem.SetLimit(n)
			return
		}
		d.Sem.SetLimit(n)
		ls.Sem.SetLimit(n)
		return
	}
	d.Sem.SetLimit(n)
}

func newDownstream(name string, cfg *Config, m *metrics.Metrics, now time.Time) *Downstream {
	d := &Downstream{Name: name, Sem: semaphore.New(0), Metrics: m.Downstream(name), metricsSet: m}
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
	d.cfg.Store(cfg)
}

func (d *Downstream) state(now time.Time) assignment.DownstreamState {
	cfg := d.Config()
	st := d.Sem.Stats()
	ds := assignment.DownstreamState{
		Name:             d.Name,
		Permits:          int32(cfg.Permits),
		EffectivePermits: int32(d.Effective()),
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
	}
	return ds
}

// buildTable converts a into a Table (without Downstreams yet) and one Config per downstream,
// in order.
func buildTable(a *assignment.Assignment) (*Table, []*Config, error) {
	t := &Table{byName: make(map[string]*Downstream, len(a.Downstreams))}
	staleBy := map[string]bool{}
	for _, s := range a.Switches {
		t.Switches = append(t.Switches, convertSwitch(s))
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
		cfgs[i] = c
		t.names = append(t.names, d.Name)
	}
	slices.Sort(t.names)
	return t, cfgs, nil
}
