package hub

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"
)

// The model: one global quota, a hub API (the allocation and one ClusterSlice per member, each
// with a resourceVersion), hub managers (a second one with its own view may run beside the
// first, as during a leader change), and member managers with their own clocks. The inner level
// of each member is the worst docs/protocol.md §16's Lemma H1 allows: its pods use their whole
// local limit as soon as it rises, and fall to a lowered limit only when the member's drain bound
// (or any time before it) says they must. After every step the test sums what the members' pods
// use against the global limit.

const step = 100 * time.Millisecond

type modelSlice struct {
	spec   Grant
	rv     int64
	acked  int64
	demand int64
	drain  time.Duration
}

type modelAPI struct {
	down    bool
	alloc   Allocation
	allocRV int64
	slices  map[string]*modelSlice
}

type modelPub struct {
	cluster  string
	seq      int64
	returnAt time.Time // true time the write's answer arrives
	lost     bool
}

type modelHub struct {
	clock      modelClock
	ledger     *Ledger
	rv         int64 // the allocation resourceVersion the ledger stands on
	pubs       []modelPub
	lastDamped time.Time
	stopAt     time.Time // zero: runs on
	cas        *modelCAS // the allocation write in flight
}

// modelCAS is a write of the allocation planned on the resourceVersion baseRV, which reaches the
// API server at commitAt.
type modelCAS struct {
	alloc    Allocation
	baseRV   int64
	commitAt time.Time
	damped   bool
	hnow     time.Time
}

// noCAS, a mutation the test can be run with, writes the allocation without its precondition.
var noCAS = os.Getenv("APPORTION_HUB_MUTATE") == "no-cas"

type modelRead struct {
	startedAt  time.Time // member clock
	completeAt time.Time // true time
	served     *Grant    // the answer, when the API server served it at once (nil: at completion)
	failed     bool
}

type modelMember struct {
	name     string
	clock    modelClock
	reserved int64 // in the GlobalQuota spec
	drain    time.Duration
	innerMax time.Duration // the inner level's real drain time, ≤ drain

	up        bool
	upAt      time.Time
	lease     *Lease
	record    *Grant // in the member's own cluster
	downLimit int64  // what its pods fall to while its manager is down
	reads     []modelRead
	nextRead  time.Time
	cutUntil  time.Time // partitioned from the hub until
	// ownDownUntil: the member's own API server refuses writes until then
	ownDownUntil time.Time

	limit   int64
	use     int64
	drainAt time.Time
	demand  int64
}

type model struct {
	t        *testing.T
	rng      *rand.Rand
	opts     Options
	global   int64
	policy   Policy
	now      time.Time // true time
	api      *modelAPI
	hubs     []*modelHub
	members  []*modelMember
	hubDownT time.Time
	// figures
	steps, usedSum int64
	worst          int64
	raises         int
	rho            float64
}

func (m *model) jitter(max time.Duration) time.Duration {
	if max <= 0 {
		return 0
	}
	return time.Duration(m.rng.Int64N(int64(max) + 1))
}

func newModel(t *testing.T, seed uint64) *model {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	rho := rng.Float64() * 0.05 // the clocks' rates are off by up to 5 % (real ones: 10⁻⁴)
	m := &model{
		t:      t,
		rng:    rng,
		opts:   Options{LeaseDuration: time.Duration(2+rng.IntN(5)) * time.Second},
		global: int64(5 + rng.IntN(60)),
		policy: Policy(rng.IntN(2)),
		now:    time.Unix(1_800_000_000, 0),
		api:    &modelAPI{slices: map[string]*modelSlice{}},
		rho:    rho,
	}
	// The margin (§16) for the clocks' rates and a member's timer lateness: it notices its lease
	// ended at its next step.
	const maxDrain = 4 * time.Second
	m.opts.ClockMargin = MinClockMargin(m.opts.LeaseDuration, maxDrain, rho, step)
	if os.Getenv("APPORTION_HUB_MUTATE") == "no-drift-margin" {
		m.opts.ClockMargin = step + step/10
	}
	n := 2 + rng.IntN(3)
	var reservedSum int64
	for i := range n {
		mm := &modelMember{
			name:   fmt.Sprintf("c%d", i),
			clock:  newClock(rng, rho, time.Unix(1_800_000_000, 0)),
			drain:  time.Duration(1+rng.IntN(4)) * time.Second,
			up:     true,
			lease:  NewLease(nil),
			demand: int64(rng.IntN(int(m.global) + 1)),
		}
		mm.innerMax = mm.drain
		if rng.IntN(3) == 0 && reservedSum < m.global {
			mm.reserved = int64(rng.IntN(int(m.global-reservedSum)/n + 1))
			reservedSum += mm.reserved
		}
		m.members = append(m.members, mm)
		m.api.slices[mm.name] = &modelSlice{}
	}
	m.hubs = []*modelHub{m.startHub()}
	return m
}

func (m *model) startHub() *modelHub {
	return &modelHub{clock: newClock(m.rng, m.rho, m.now), rv: -1}
}

// modelClock is a clock whose rate is off by rate (and whose reading by an offset, which no
// interval the protocol measures depends on): at true time t it reads
// base + offset + (t − base)(1 + rate).
type modelClock struct {
	base   time.Time
	offset time.Duration
	rate   float64
}

// newClock is a clock started at base whose rate is off by up to ±rho, at either extreme two
// times in three, and whose reading is off by up to an hour.
func newClock(rng *rand.Rand, rho float64, base time.Time) modelClock {
	c := modelClock{base: base, offset: time.Duration(rng.Int64N(int64(2*time.Hour))) - time.Hour}
	switch rng.IntN(3) {
	case 0:
		c.rate = -rho
	case 1:
		c.rate = rho
	default:
		c.rate = (2*rng.Float64() - 1) * rho
	}
	return c
}

func (c modelClock) at(t time.Time) time.Time {
	d := t.Sub(c.base)
	return c.base.Add(c.offset + d + time.Duration(float64(d)*c.rate))
}

// hubStep is one reconcile of one hub manager.
func (m *model) hubStep(h *modelHub) {
	// Answers of publish writes arrive (or are lost).
	keep := h.pubs[:0]
	for _, p := range h.pubs {
		if m.now.Before(p.returnAt) {
			keep = append(keep, p)
			continue
		}
		if !p.lost && h.ledger != nil {
			h.ledger.Published(p.cluster, p.seq, h.clock.at(m.now))
		}
	}
	h.pubs = keep
	if m.api.down {
		if h.cas != nil && !m.now.Before(h.cas.commitAt) {
			h.cas, h.ledger = nil, nil // failed: read the allocation back
		}
		return
	}
	if c := h.cas; c != nil {
		if m.now.Before(c.commitAt) {
			return // publish nothing the allocation does not hold yet
		}
		h.cas = nil
		if m.api.allocRV != c.baseRV && !noCAS {
			h.ledger = nil // conflict: read it back next time
			return
		}
		m.api.alloc = c.alloc
		m.api.allocRV++
		if m.rng.IntN(20) == 0 {
			h.ledger = nil // committed, but the answer was lost: read it back next time
			return
		}
		h.rv = m.api.allocRV
		if c.damped {
			h.lastDamped = c.hnow
		}
	}
	if h.ledger == nil || (h.rv != m.api.allocRV && !noCAS) {
		// Start, or someone else wrote the allocation: read it back (forgetting every bound).
		l, err := Restore(m.opts, m.api.alloc)
		if err != nil {
			m.t.Fatalf("restore: %v", err)
		}
		h.ledger, h.rv = l, m.api.allocRV
	}
	hnow := h.clock.at(m.now)
	// Read the ClusterSlices: published grants, acknowledgements, drains, demand.
	shares := make([]Share, 0, len(m.members))
	for _, mm := range m.members {
		s := m.api.slices[mm.name]
		if s.drain > 0 {
			h.ledger.SetDrain(mm.name, s.drain)
		}
		if cur := h.ledger.Current(mm.name); cur.Seq > 0 && s.spec.Seq == cur.Seq {
			h.ledger.Published(mm.name, cur.Seq, hnow)
		}
		h.ledger.Acknowledged(mm.name, s.acked)
		shares = append(shares, Share{Cluster: mm.name, Reserved: mm.reserved, Demand: s.demand, Current: h.ledger.Current(mm.name).Slice})
	}
	want, damped, err := Slices(m.global, m.policy, shares, uint64(m.now.Unix()/300), nil, hnow, h.lastDamped)
	if err != nil {
		m.t.Fatalf("slices: %v", err)
	}
	targets := make([]Target, len(shares))
	for i, s := range shares {
		targets[i] = Target{Cluster: s.Cluster, Reserved: s.Reserved, Want: want[i]}
	}
	changes, err := h.ledger.Plan(hnow, m.global, targets)
	if err != nil {
		m.t.Fatalf("plan: %v", err)
	}
	for _, c := range changes {
		if c.Grant.Reserved > c.Grant.Slice {
			m.t.Fatalf("grant %+v of %s: reserved above slice", c.Grant, c.Cluster)
		}
		if c.Raise {
			m.raises++
		}
	}
	if len(changes) > 0 {
		// Compare-and-swap the allocation; it reaches the API server a little later.
		h.cas = &modelCAS{alloc: h.ledger.Allocation(), baseRV: h.rv, commitAt: m.now.Add(m.jitter(3 * step)), damped: damped, hnow: hnow}
		return
	}
	// Publish every grant the ClusterSlice does not show yet, never a lower one.
	for _, mm := range m.members {
		s, cur := m.api.slices[mm.name], h.ledger.Current(mm.name)
		if cur.Seq <= s.spec.Seq || slices.ContainsFunc(h.pubs, func(p modelPub) bool { return p.cluster == mm.name && p.seq == cur.Seq }) {
			continue
		}
		if m.rng.IntN(10) == 0 {
			continue // the write failed before it committed
		}
		s.spec, s.rv = cur, s.rv+1
		h.pubs = append(h.pubs, modelPub{cluster: mm.name, seq: cur.Seq, returnAt: m.now.Add(m.jitter(time.Second) * time.Duration(m.rng.IntN(2))), lost: m.rng.IntN(10) == 0})
	}
}

func (m *model) memberStep(mm *modelMember) {
	if !mm.up {
		mm.limit = mm.downLimit
		m.inner(mm)
		if m.now.After(mm.upAt) {
			mm.up, mm.lease, mm.nextRead = true, NewLease(mm.record), m.now
		}
		return
	}
	reachable := !m.api.down && !m.now.Before(mm.cutUntil)
	keep := mm.reads[:0]
	for _, r := range mm.reads {
		if m.now.Before(r.completeAt) {
			keep = append(keep, r)
			continue
		}
		g := r.served
		if g == nil && reachable && !r.failed {
			g = &m.api.slices[mm.name].spec
		}
		if g != nil && reachable && g.Seq > 0 {
			if _, err := mm.lease.Read(*g, m.opts.LeaseDuration, r.startedAt); err != nil {
				m.t.Fatalf("read: %v", err)
			}
		}
	}
	mm.reads = keep
	if !m.now.Before(mm.nextRead) {
		r := modelRead{startedAt: mm.clock.at(m.now), completeAt: m.now.Add(m.jitter(1500 * time.Millisecond)), failed: m.rng.IntN(4) == 0}
		if reachable && !r.failed && m.rng.IntN(2) == 0 {
			g := m.api.slices[mm.name].spec
			r.served = &g
		}
		mm.reads = append(mm.reads, r)
		mm.nextRead = m.now.Add(m.opts.LeaseDuration / 3)
	}
	mm.limit, _ = mm.lease.Limit(mm.clock.at(m.now))
	m.inner(mm)
	if !reachable {
		return
	}
	s := m.api.slices[mm.name]
	if s.drain == 0 {
		s.drain = mm.drain
	}
	if g := mm.lease.Grant(); g.Seq > 0 && (mm.record == nil || mm.record.Seq < g.Seq) && !m.now.Before(mm.ownDownUntil) {
		mm.record = &g // a write to the member's own API server
	}
	rec := int64(0)
	if mm.record != nil {
		rec = mm.record.Seq
	}
	if seq, ok := mm.lease.Acknowledge(mm.use, rec); ok && seq > s.acked {
		s.acked = seq
	}
	if d := mm.demand; d != s.demand && (d-s.demand > max(1, s.demand/10) || s.demand-d > max(1, s.demand/10)) {
		s.demand = d
	}
}

// inner is the member's pods under the worst Lemma H1 allows: use rises with the limit at once
// and falls to a lowered limit at some moment up to the inner drain time later.
func (m *model) inner(mm *modelMember) {
	switch {
	case mm.limit >= mm.use:
		mm.use, mm.drainAt = mm.limit, time.Time{}
	case mm.drainAt.IsZero():
		d := mm.innerMax
		if m.rng.IntN(2) == 0 {
			d = m.jitter(mm.innerMax)
		}
		// The drain bound is kept by the member's own timers: measured on its clock.
		mm.drainAt = m.now.Add(time.Duration(float64(d) / (1 + mm.clock.rate)))
	case !m.now.Before(mm.drainAt):
		mm.use, mm.drainAt = mm.limit, time.Time{}
	}
}

func (m *model) perturb() {
	r := m.rng
	switch k := r.IntN(1000); {
	case k < 12: // a partition between one member and the hub
		mm := m.members[r.IntN(len(m.members))]
		mm.cutUntil = m.now.Add(m.jitter(4 * m.opts.LeaseDuration))
	case k < 19: // a member's own API server refuses writes a while
		mm := m.members[r.IntN(len(m.members))]
		mm.ownDownUntil = m.now.Add(m.jitter(2 * m.opts.LeaseDuration))
	case k < 22: // a member's manager restarts (or is down a while)
		mm := m.members[r.IntN(len(m.members))]
		if mm.up {
			mm.up, mm.reads = false, nil
			mm.downLimit = mm.lease.Grant().Fallback()
			mm.upAt = m.now.Add(m.jitter(3 * m.opts.LeaseDuration))
		}
	case k < 27: // the hub's manager restarts: a new one starts from the allocation
		h := m.hubs[len(m.hubs)-1]
		h.stopAt = m.now
		m.hubs = append(m.hubs, m.startHub())
	case k < 31: // a second hub manager with its own view starts beside the running one
		m.hubs = append(m.hubs, m.startHub())
		m.hubs[0].stopAt = m.now.Add(m.jitter(2 * m.opts.LeaseDuration))
	case k < 34: // the hub's API server stops for a while
		if !m.api.down {
			m.api.down = true
			m.hubDownT = m.now.Add(m.jitter(3 * m.opts.LeaseDuration))
		}
	case k < 120: // demand moves (scale-out in one cluster, scale-in in another)
		mm := m.members[r.IntN(len(m.members))]
		if r.IntN(4) == 0 {
			mm.demand = int64(r.IntN(int(m.global) + 1))
		} else {
			mm.demand = max(0, mm.demand+int64(r.IntN(5))-2)
		}
	case k < 130: // a member's reserved slice changes in the spec (to 0 one time in two)
		mm := m.members[r.IntN(len(m.members))]
		var others int64
		for _, o := range m.members {
			if o != mm {
				others += o.reserved
			}
		}
		mm.reserved = int64(r.IntN(int(m.global-others)/2+1)) * int64(r.IntN(2))
	}
	if m.api.down && m.now.After(m.hubDownT) {
		m.api.down = false
	}
}

func (m *model) run(steps int) {
	for range steps {
		m.now = m.now.Add(step)
		m.perturb()
		live := m.hubs[:0]
		for _, h := range m.hubs {
			if h.stopAt.IsZero() || m.now.Before(h.stopAt) {
				live = append(live, h)
				continue
			}
			// A stopped manager's write in flight may still reach the API server.
			if c := h.cas; c != nil && !m.api.down && (m.api.allocRV == c.baseRV || noCAS) && m.rng.IntN(2) == 0 {
				m.api.alloc = c.alloc
				m.api.allocRV++
			}
		}
		m.hubs = live
		for _, i := range m.rng.Perm(len(m.hubs) + len(m.members)) {
			if i < len(m.hubs) {
				m.hubStep(m.hubs[i])
			} else {
				m.memberStep(m.members[i-len(m.hubs)])
			}
		}
		var sum int64
		for _, mm := range m.members {
			sum += mm.use
		}
		m.steps++
		m.usedSum += sum
		m.worst = max(m.worst, sum)
		if sum > m.global {
			var b []string
			for _, mm := range m.members {
				b = append(b, fmt.Sprintf("%s use %d limit %d grant %+v", mm.name, mm.use, mm.limit, mm.lease.Grant()))
			}
			m.t.Fatalf("at %v: Σ use %d > global %d: %v", m.now.Format(time.TimeOnly), sum, m.global, b)
		}
	}
}

// TestTwoLevelProperty is docs/protocol.md §16's theorem, checked: over random seeds, Σ of what
// every member's pods use never exceeds the global limit, through partitions, lost writes and
// answers, hub and member manager restarts, two hub managers at once, the hub's API server
// stopping, reserved-slice changes and demand changes. APPORTION_HUB_SEEDS runs more seeds.
func TestTwoLevelProperty(t *testing.T) {
	seeds := 100
	if s, err := strconv.Atoi(os.Getenv("APPORTION_HUB_SEEDS")); err == nil && s > 0 {
		seeds = s
	}
	var used, capacity float64
	var worst float64
	raises := 0
	for seed := range uint64(seeds) {
		m := newModel(t, seed)
		t.Run(strconv.FormatUint(seed, 10), func(t *testing.T) {
			m.t = t
			m.run(3000)
		})
		if t.Failed() {
			return
		}
		used += float64(m.usedSum)
		capacity += float64(m.steps * m.global)
		worst = max(worst, float64(m.worst)/float64(m.global))
		raises += m.raises
	}
	t.Logf("%d seeds × 3000 steps: Σ use / global %.1f %% on average, at most %.0f %%; %d raises", seeds, 100*used/capacity, 100*worst, raises)
	if raises == 0 {
		t.Fatal("no grant was ever raised: the model tests nothing")
	}
}
