package harness

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// MonitorConfig configures the invariant monitor.
type MonitorConfig struct {
	Source AgentSource
	// Downstream is the downstream's name in the agents' State.
	Downstream string
	// Limit is the global in-flight limit.
	Limit int32
	// LimitNow, when set, is the limit in force, read at every sample and ledger reading
	// instead of Limit (a soak edits the quota's limit: raised before the quota is, lowered once
	// the calls admitted under the old limit drained).
	LimitNow func() int32
	// Hz is the sampling rate (default 25; at least 20 is the point).
	Hz float64
	// Key signs the GET /v1/state calls; it is called again after a failure (key rotation).
	Key func() (assignment.SigningKey, error)
	// SafeDefault is what an agent falls back to when its lease passes (the quota's
	// status.safeDefaultPermits). The monitor models an unreachable agent with it (Modeled): it
	// holds what it last reported until its lease ends, then the agent's own lapsed limit,
	// assignment.LapsedLimit(permits, SafeDefault(), FailClosed()). nil keeps the last report
	// (conservative).
	SafeDefault func() int32
	// FailClosed reports whether the quota's failurePolicy is Closed (the lapsed limit is then
	// 0); nil is false, the default policy SafeDefault.
	FailClosed func() bool
	// RequestTimeout bounds how long an unreachable agent's reported calls may still be in flight.
	RequestTimeout time.Duration
	// DS is the test downstream, whose own peak and 429s the summary includes.
	DS *Downstream
	// Ledger reads the manager's ledger (status), sampled at 5 Hz; nil skips it.
	Ledger func(ctx context.Context) (LedgerReading, error)
	// KeepHistory keeps every sample (Samples()).
	KeepHistory bool
	// Record keeps every agent reading and every ledger reading for the offline check
	// (History, CheckHistory); Note adds the scenario's events to it.
	Record bool
	// LeaseTTL is the agents' lease length (the manager's --lease-ttl). With it the monitor also
	// sees a lapse that began and ended between two readings (LeaseStats); zero counts only the
	// lapses a reading caught.
	LeaseTTL time.Duration
}

// Reading is one agent's last answer.
type Reading struct {
	// At is when the answer had arrived; Sent, when the request was about to be sent: the
	// State describes the agent at some instant between the two.
	At, Sent time.Time
	// Pid is the agent process's pid at the time (a restarted agent's old readings are ignored).
	Pid   int
	State assignment.State
	DS    assignment.DownstreamState
	Found bool // the downstream is configured in the agent
}

// AgentSample is one agent's values in a sample.
type AgentSample struct {
	Effective, Permits, InFlight int32
	// Reachable is false when the values are modeled from the last reading.
	Reachable bool
	Epoch     int64
	Gen       int64
}

// Sample is one instant: every live agent's values.
type Sample struct {
	At          time.Time
	Agents      map[string]AgentSample
	SumPermits  int32 // Σ effective permits
	SumInFlight int32
	Unreachable int
}

// Violation is a sample (or pair of samples) over the limit.
type Violation struct {
	At        time.Time
	Kind      string
	Sum       int32
	Confirmed bool
	Detail    string
}

// MonitorStats is the summary.
type MonitorStats struct {
	Samples        int
	Elapsed        time.Duration
	Reads, Failed  int64
	MaxSumPermits  int32
	MaxSumInFlight int32
	// Raw: one sample over the limit (the agents are read at slightly different instants, so a
	// move of permits between two agents can show up as a raw excess). Confirmed: two
	// consecutive samples whose per-agent minimum sums over the limit, i.e. an instant between
	// them where the agents held more than the limit.
	RawPermitViolations, PermitViolations     int
	RawInFlightViolations, InFlightViolations int
	LedgerSamples, LedgerViolations           int
	LedgerOverRecovering                      int // samples over the limit while recovering (allowed)
	MaxLedger                                 int32
	Downstream                                DownstreamStats
	Violations                                []Violation
	// Leases is what the agents' States said of their leases.
	Leases LeaseStats
}

// LeaseStats is what the agents' States said of their leases, counted only while an agent's pod
// is not being shut down (a draining agent is renewed no more). An agent's lease ends its
// leaseTTL after the push that started or renewed it was signed (leaseExpiresAt); when it ends
// without a renewal the agent falls back to its safe default (leaseExpired) — a lapse.
type LeaseStats struct {
	// Agents is how many agent processes were seen holding a lease.
	Agents int
	// Renewals counts the extensions seen: a reading whose leaseExpiresAt moved later.
	Renewals int64
	// Lapses counts the lapses seen: a reading that says leaseExpired, or (with
	// MonitorConfig.LeaseTTL) an extension signed after the previous lease had ended, seen by
	// readings less than a second apart. Lapsed describes the first 20.
	Lapses int
	Lapsed []string
	// WorstGap is the longest time between two renewals of one agent's lease seen (the
	// difference of consecutive leaseExpiresAt: of the renewals' signing times), and WorstGapPod
	// its agent. A renewal missed between two readings makes it look longer, never shorter.
	WorstGap    time.Duration
	WorstGapPod string
	// MinLeft is the least lease left at a reading (leaseExpiresAt − the reading's time), and
	// MinLeftPod its agent; negative when a reading came after a lease's end.
	MinLeft    time.Duration
	MinLeftPod string
}

func (l LeaseStats) String() string {
	s := fmt.Sprintf("leases: %d agents, %d renewals seen, worst renewal gap %s (%s), least lease left %s (%s), %d lapses",
		l.Agents, l.Renewals, l.WorstGap.Round(time.Millisecond), l.WorstGapPod, l.MinLeft.Round(time.Millisecond), l.MinLeftPod, l.Lapses)
	if len(l.Lapsed) > 0 {
		s += ": " + strings.Join(l.Lapsed, "; ")
	}
	return s
}

// LeaseTracker follows one agent process's lease through its readings, in order.
type LeaseTracker struct {
	// TTL is the leases' length; zero infers no lapse between readings.
	TTL time.Duration

	pid     int
	exp     time.Time // leaseExpiresAt of the last reading (zero: none seen)
	readAt  time.Time // time of the last reading
	expired bool      // the last reading said leaseExpired
	leased  bool      // a lease was seen
}

// LeaseEvent is what one reading showed of a lease.
type LeaseEvent struct {
	// First: the first reading of this process that holds a lease.
	First bool
	// Leased: the reading holds a lease; Left is how much of it was left at the reading.
	Leased bool
	Left   time.Duration
	// Renewed: the lease was extended since the previous reading, by Gap (the time between the
	// renewals' signatures).
	Renewed bool
	Gap     time.Duration
	// Lapse describes a lapse this reading revealed ("" if none): the reading says
	// leaseExpired and the previous one did not, or the renewal it shows was signed after the
	// previous lease had ended while the readings were less than ReadGapForLapses apart (longer,
	// renewals between them may have gone unseen). One lapse is reported once.
	Lapse string
}

// ReadGapForLapses is the longest time between two readings across which a lapse is inferred
// from leaseExpiresAt alone.
const ReadGapForLapses = time.Second

// Observe takes the next reading of the agent; a reading of another process (pid) starts over.
func (lt *LeaseTracker) Observe(r Reading) LeaseEvent {
	if lt.pid != r.Pid {
		*lt = LeaseTracker{TTL: lt.TTL, pid: r.Pid}
	}
	st := &r.State
	exp := st.LeaseExpiresAt
	prevExp, prevRead, prevExpired := lt.exp, lt.readAt, lt.expired
	lt.readAt, lt.expired = r.At, st.LeaseExpired
	if exp.IsZero() {
		return LeaseEvent{} // no lease yet: the first assignment has not come
	}
	lt.exp = exp
	ev := LeaseEvent{First: !lt.leased, Leased: true, Left: exp.Sub(r.At)}
	lt.leased = true
	if !prevExp.IsZero() && exp.After(prevExp) {
		ev.Renewed, ev.Gap = true, exp.Sub(prevExp)
		// The renewal was signed at exp − TTL and arrived no earlier: signed after prevExp, the
		// agent had no lease in between (unless a reading already caught that lapse).
		signed := exp.Add(-lt.TTL)
		if lt.TTL > 0 && !prevExpired && r.At.Sub(prevRead) < ReadGapForLapses && signed.After(prevExp) {
			ev.Lapse = fmt.Sprintf("lease ended %s, renewal signed %s later", prevExp.Format("15:04:05.000"), signed.Sub(prevExp).Round(time.Millisecond))
		}
	}
	if st.LeaseExpired && !prevExpired && ev.Lapse == "" {
		ev.Lapse = fmt.Sprintf("on its safe default at %s (lease ended %s)", r.At.Format("15:04:05.000"), exp.Format("15:04:05.000"))
	}
	return ev
}

// Hz is the achieved sampling rate.
func (s MonitorStats) Hz() float64 {
	if s.Elapsed <= 0 {
		return 0
	}
	return float64(s.Samples) / s.Elapsed.Seconds()
}

// Ok reports zero violations: confirmed Σ permits and Σ in-flight, the ledger, and the
// downstream's own 429s and peak.
func (s MonitorStats) Ok() bool {
	return s.PermitViolations == 0 && s.InFlightViolations == 0 && s.LedgerViolations == 0 &&
		s.Downstream.TooMany429 == 0 && s.Downstream.Peak <= s.Downstream.Limit
}

// PhysicallyOk reports zero violations of what the downstream and the agents hold (Σ permits,
// Σ in-flight, the downstream's 429s and peak), whatever the manager's ledger says.
func (s MonitorStats) PhysicallyOk() bool {
	return s.PermitViolations == 0 && s.InFlightViolations == 0 &&
		s.Downstream.TooMany429 == 0 && s.Downstream.Peak <= s.Downstream.Limit
}

func (s MonitorStats) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "samples=%d over %s (%.1f Hz), state reads=%d failed=%d\n", s.Samples, s.Elapsed.Round(time.Millisecond), s.Hz(), s.Reads, s.Failed)
	fmt.Fprintf(&b, "max Σ permits=%d, max Σ in-flight=%d, limit=%d\n", s.MaxSumPermits, s.MaxSumInFlight, s.Downstream.Limit)
	fmt.Fprintf(&b, "violations: Σ permits %d confirmed (%d raw), Σ in-flight %d confirmed (%d raw), ledger %d of %d samples (max %d; %d over while recovering)\n",
		s.PermitViolations, s.RawPermitViolations, s.InFlightViolations, s.RawInFlightViolations, s.LedgerViolations, s.LedgerSamples, s.MaxLedger, s.LedgerOverRecovering)
	fmt.Fprintf(&b, "downstream: peak=%d/%d 429=%d calls=%d ok=%d", s.Downstream.Peak, s.Downstream.Limit, s.Downstream.TooMany429, s.Downstream.Total, s.Downstream.OK)
	if s.Leases.Agents > 0 {
		b.WriteString("\n" + s.Leases.String())
	}
	for i, v := range s.Violations {
		if i == 10 {
			fmt.Fprintf(&b, "\n  ... %d more", len(s.Violations)-10)
			break
		}
		fmt.Fprintf(&b, "\n  %s %s Σ=%d confirmed=%v %s", v.At.Format("15:04:05.000"), v.Kind, v.Sum, v.Confirmed, v.Detail)
	}
	return b.String()
}

// Monitor samples every agent's state.
type Monitor struct {
	cfg    MonitorConfig
	client atomic.Pointer[assignment.Client]
	hc     *http.Client
	cancel context.CancelFunc
	wg     sync.WaitGroup
	start  time.Time

	mu      sync.Mutex
	pollers map[*Agent]*poller
	last    map[string]Reading // last good reading per pod
	prev    *Sample
	history []Sample
	stats   MonitorStats
	// The record (MonitorConfig.Record).
	readings []HistReading
	ledgers  []HistLedger
	events   []HistEvent
	stopped  bool
	stopTime time.Time
}

type poller struct {
	cancel  context.CancelFunc
	mu      sync.Mutex
	reading *Reading
	// lease is touched by the poller's goroutine only.
	lease LeaseTracker
}

// StartMonitor starts sampling.
func StartMonitor(ctx context.Context, cfg MonitorConfig) (*Monitor, error) {
	if cfg.Hz <= 0 {
		cfg.Hz = 25
	}
	key, err := cfg.Key()
	if err != nil {
		return nil, err
	}
	m := &Monitor{
		cfg:     cfg,
		hc:      &http.Client{Timeout: 250 * time.Millisecond, Transport: &http.Transport{MaxIdleConnsPerHost: 2}},
		pollers: map[*Agent]*poller{},
		last:    map[string]Reading{},
		start:   time.Now(),
	}
	m.client.Store(&assignment.Client{HTTP: m.hc, Key: key})
	ctx, m.cancel = context.WithCancel(ctx)
	m.wg.Go(func() { m.sampleLoop(ctx) })
	if cfg.Ledger != nil {
		m.wg.Go(func() { m.ledgerLoop(ctx) })
	}
	return m, nil
}

// limit is the limit in force (LimitNow, else Limit).
func (m *Monitor) limit() int32 {
	if m.cfg.LimitNow != nil {
		return m.cfg.LimitNow()
	}
	return m.cfg.Limit
}

func (m *Monitor) period() time.Duration { return time.Duration(float64(time.Second) / m.cfg.Hz) }

func (m *Monitor) poll(ctx context.Context, a *Agent, p *poller) {
	t := time.NewTicker(m.period())
	defer t.Stop()
	for {
		r, err := m.read(ctx, a)
		if err == nil {
			p.mu.Lock()
			p.reading = r
			p.mu.Unlock()
			m.observeLease(a, p, r)
		} else if ctx.Err() == nil {
			var se *assignment.StatusError
			if errors.As(err, &se) && (se.StatusCode == 401 || se.StatusCode == 403) {
				if key, kerr := m.cfg.Key(); kerr == nil {
					m.client.Store(&assignment.Client{HTTP: m.hc, Key: key})
				}
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// read reads a's State once (counted, and recorded with MonitorConfig.Record).
func (m *Monitor) read(ctx context.Context, a *Agent) (*Reading, error) {
	pid := a.Pid()
	sent := time.Now()
	st, err := m.client.Load().State(ctx, a.Endpoint(), 0)
	m.mu.Lock()
	defer m.mu.Unlock()
	m.stats.Reads++
	if err != nil {
		m.stats.Failed++
		return nil, err
	}
	r := &Reading{At: time.Now(), Sent: sent, Pid: pid, State: *st}
	for _, d := range st.Downstreams {
		if d.Name == m.cfg.Downstream {
			r.DS, r.Found = d, true
		}
	}
	if m.cfg.Record {
		m.readings = append(m.readings, histReading(r, a.Pod))
	}
	return r, nil
}

// ReadNow reads a's State at once and records it (MonitorConfig.Record): a scenario calls it
// right before it freezes the agent, so that the record's last reading of the process is as
// close to the freeze as can be (heldSpans).
func (m *Monitor) ReadNow(ctx context.Context, a *Agent) error {
	ctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	_, err := m.read(ctx, a)
	return err
}

// Note records an event of a's current process (EventFrozen, EventKilled) at the time of the
// call: call it right after the signal (MonitorConfig.Record).
func (m *Monitor) Note(a *Agent, pid int, kind string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.events = append(m.events, HistEvent{At: time.Now(), Pod: a.Pod, Pid: pid, Kind: kind})
}

// History returns the record so far (MonitorConfig.Record; KeepHistory adds the samples), with
// the downstream's counters; the caller adds the load's, the seed and the schedule.
func (m *Monitor) History() *History {
	st := m.Stats()
	m.mu.Lock()
	defer m.mu.Unlock()
	end := time.Now()
	if m.stopped {
		end = m.stopTime
	}
	return &History{
		Limit: m.cfg.Limit, LeaseTTL: m.cfg.LeaseTTL, RequestTimeout: m.cfg.RequestTimeout,
		Start: m.start, End: end,
		Readings: slices.Clone(m.readings), Ledger: slices.Clone(m.ledgers), Events: slices.Clone(m.events),
		Samples: slices.Clone(m.history), Downstream: st.Downstream,
	}
}

// observeLease follows the lease of a's process through its readings (LeaseStats); a draining
// agent is renewed no more, and not followed.
func (m *Monitor) observeLease(a *Agent, p *poller, r *Reading) {
	if a.Draining() {
		return
	}
	p.lease.TTL = m.cfg.LeaseTTL
	ev := p.lease.Observe(*r)
	if !ev.Leased {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	ls := &m.stats.Leases
	if ev.First {
		ls.Agents++
	}
	if ls.MinLeftPod == "" || ev.Left < ls.MinLeft {
		ls.MinLeft, ls.MinLeftPod = ev.Left, a.Pod
	}
	if ev.Renewed {
		ls.Renewals++
		if ev.Gap > ls.WorstGap {
			ls.WorstGap, ls.WorstGapPod = ev.Gap, a.Pod
		}
	}
	if ev.Lapse != "" {
		ls.Lapses++
		if len(ls.Lapsed) < 20 {
			ls.Lapsed = append(ls.Lapsed, a.Pod+": "+ev.Lapse)
		}
	}
}

func (m *Monitor) sampleLoop(ctx context.Context) {
	t := time.NewTicker(m.period())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			m.mu.Lock()
			for _, p := range m.pollers {
				p.cancel()
			}
			m.mu.Unlock()
			return
		case <-t.C:
		}
		m.sample(ctx)
	}
}

// stale is how old a reading may be before the agent counts as unreachable.
func (m *Monitor) stale() time.Duration { return 3*m.period() + 100*time.Millisecond }

func (m *Monitor) sample(ctx context.Context) {
	now := time.Now()
	agents := m.cfg.Source.Agents()
	var safe int32 = -1
	if m.cfg.SafeDefault != nil {
		safe = m.cfg.SafeDefault()
	}
	failClosed := m.cfg.FailClosed != nil && m.cfg.FailClosed()
	m.mu.Lock()
	defer m.mu.Unlock()
	alive := map[*Agent]bool{}
	s := Sample{At: now, Agents: make(map[string]AgentSample, len(agents))}
	for _, a := range agents {
		alive[a] = true
		p, ok := m.pollers[a]
		if !ok {
			pctx, cancel := context.WithCancel(ctx)
			p = &poller{cancel: cancel}
			m.pollers[a] = p
			m.wg.Go(func() { m.poll(pctx, a, p) })
		}
		p.mu.Lock()
		r := p.reading
		p.mu.Unlock()
		pid := a.Pid()
		if r != nil && r.Pid != pid {
			r = nil // from before a restart: the new process holds nothing until it says otherwise
		}
		if last, ok := m.last[a.Pod]; ok && last.Pid != pid {
			delete(m.last, a.Pod)
		}
		var as AgentSample
		if r != nil && now.Sub(r.At) <= m.stale() {
			as = AgentSample{Effective: r.DS.EffectivePermits, Permits: r.DS.Permits, InFlight: r.DS.InFlight,
				Reachable: true, Epoch: r.State.Epoch, Gen: r.State.Generation}
			m.last[a.Pod] = *r
		} else if last, ok := m.last[a.Pod]; ok {
			as = Modeled(last, now, safe, failClosed, m.cfg.RequestTimeout)
			s.Unreachable++
		}
		s.Agents[a.Pod] = as
		s.SumPermits += as.Effective
		s.SumInFlight += as.InFlight
	}
	for a, p := range m.pollers {
		if !alive[a] {
			p.cancel()
			delete(m.pollers, a)
		}
	}
	limit := m.limit()
	st := &m.stats
	st.Samples++
	st.MaxSumPermits = max(st.MaxSumPermits, s.SumPermits)
	st.MaxSumInFlight = max(st.MaxSumInFlight, s.SumInFlight)
	if s.SumPermits > limit {
		st.RawPermitViolations++
	}
	if s.SumInFlight > limit {
		st.RawInFlightViolations++
	}
	if m.prev != nil {
		var minPermits, minInFlight int32
		for pod, cur := range s.Agents {
			if prev, ok := m.prev.Agents[pod]; ok {
				minPermits += min(prev.Effective, cur.Effective)
				minInFlight += min(prev.InFlight, cur.InFlight)
			}
		}
		if minPermits > limit {
			st.PermitViolations++
			m.addViolation(Violation{At: now, Kind: "Σ permits", Sum: minPermits, Confirmed: true, Detail: describe(m.prev, &s)})
		}
		if minInFlight > limit {
			st.InFlightViolations++
			m.addViolation(Violation{At: now, Kind: "Σ in-flight", Sum: minInFlight, Confirmed: true, Detail: describe(m.prev, &s)})
		}
	}
	m.prev = &s
	if m.cfg.KeepHistory {
		m.history = append(m.history, s)
	}
}

// Modeled is what an agent that stopped answering holds at now, from its last good reading:
//   - before its lease ends (or when it reported none): what it last reported;
//   - after: its effective permits lowered to the limit the agent itself falls back to,
//     assignment.LapsedLimit(permits, safe, failClosed) — the same function the agent enforces and
//     the manager's ledger counts, so the monitor cannot drift from either; never raised (a
//     reading taken after the lease already lapsed is at that limit or below);
//   - safe < 0 (unknown): its last report, never lowered (conservative);
//   - in-flight: its last report until requestTimeout after that reading, then 0 (every call
//     it had admitted has timed out by then).
func Modeled(last Reading, now time.Time, safe int32, failClosed bool, requestTimeout time.Duration) AgentSample {
	as := AgentSample{Effective: last.DS.EffectivePermits, Permits: last.DS.Permits, InFlight: last.DS.InFlight,
		Epoch: last.State.Epoch, Gen: last.State.Generation}
	if le := last.State.LeaseExpiresAt; !le.IsZero() && now.After(le) && safe >= 0 {
		as.Effective = min(as.Effective, assignment.LapsedLimit(last.DS.Permits, safe, failClosed))
	}
	if now.Sub(last.At) > requestTimeout {
		as.InFlight = 0
	}
	return as
}

func (m *Monitor) addViolation(v Violation) {
	if len(m.stats.Violations) < 100 {
		m.stats.Violations = append(m.stats.Violations, v)
	}
}

func describe(prev, cur *Sample) string {
	pods := sortedKeys(cur.Agents)
	parts := make([]string, 0, len(pods))
	for _, p := range pods {
		c := cur.Agents[p]
		mark := ""
		if !c.Reachable {
			mark = "?"
		}
		parts = append(parts, fmt.Sprintf("%s=%d→%d/%d%s(e%d.g%d)", p, prev.Agents[p].Effective, c.Effective, c.InFlight, mark, c.Epoch, c.Gen))
	}
	return strings.Join(parts, " ")
}

// LedgerReading is the manager's ledger as one status write shows it.
type LedgerReading struct {
	// Sum is status.ledger: Σ of what the manager counts every pod may use.
	Sum int32
	// Recovering is true while the manager waits out a previous manager's leases (the Ready
	// condition's reason). It raises nobody then, and counts what it cannot see yet at safe
	// defaults (docs/protocol.md §8), so the sum may exceed the limit without any call too many.
	Recovering bool
	// Detail describes the holdings, for the violation report.
	Detail string
}

// ledgerLoop checks Σ ledger ≤ limit outside recovery; samples over the limit while the manager
// recovers are counted apart (LedgerOverRecovering).
func (m *Monitor) ledgerLoop(ctx context.Context) {
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r, err := m.cfg.Ledger(ctx)
		if err != nil {
			continue
		}
		m.mu.Lock()
		if m.cfg.Record {
			l := HistLedger{At: time.Now(), Sum: r.Sum, Recovering: r.Recovering}
			if r.Sum > m.limit() {
				l.Detail = r.Detail // only where it explains a finding: it is long
			}
			m.ledgers = append(m.ledgers, l)
		}
		m.stats.LedgerSamples++
		m.stats.MaxLedger = max(m.stats.MaxLedger, r.Sum)
		switch {
		case r.Sum <= m.limit():
		case r.Recovering:
			m.stats.LedgerOverRecovering++
		default:
			m.stats.LedgerViolations++
			m.addViolation(Violation{At: time.Now(), Kind: "ledger", Sum: r.Sum, Confirmed: true, Detail: r.Detail})
		}
		m.mu.Unlock()
	}
}

// Stats returns the summary so far.
func (m *Monitor) Stats() MonitorStats {
	m.mu.Lock()
	defer m.mu.Unlock()
	s := m.stats
	s.Violations = append([]Violation(nil), s.Violations...)
	s.Leases.Lapsed = append([]string(nil), s.Leases.Lapsed...)
	end := time.Now()
	if m.stopped {
		end = m.stopTime
	}
	s.Elapsed = end.Sub(m.start)
	if m.cfg.DS != nil {
		s.Downstream = m.cfg.DS.Stats()
	} else {
		s.Downstream.Limit = int64(m.cfg.Limit)
	}
	return s
}

// Last returns the last good reading of pod's agent.
func (m *Monitor) Last(pod string) (Reading, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.last[pod]
	return r, ok
}

// Current returns the last sample.
func (m *Monitor) Current() (Sample, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.prev == nil {
		return Sample{}, false
	}
	return *m.prev, true
}

// Samples returns the history (KeepHistory).
func (m *Monitor) Samples() []Sample {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]Sample(nil), m.history...)
}

// Stop stops sampling and returns the summary.
func (m *Monitor) Stop() MonitorStats {
	m.cancel()
	m.wg.Wait()
	m.mu.Lock()
	if !m.stopped {
		m.stopped, m.stopTime = true, time.Now()
	}
	m.mu.Unlock()
	m.hc.CloseIdleConnections()
	return m.Stats()
}

// PerPod returns a sample's effective permits as "pod=n" sorted by pod.
func (s Sample) PerPod() string {
	pods := sortedKeys(s.Agents)
	sort.Strings(pods)
	parts := make([]string, len(pods))
	for i, p := range pods {
		parts[i] = fmt.Sprintf("%s=%d", p, s.Agents[p].Effective)
	}
	return strings.Join(parts, " ")
}
