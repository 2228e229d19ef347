package hub

import (
	"errors"
	"fmt"
	"slices"
	"time"
)

// Options are the lease parameters shared by the hub and its members (GlobalQuota spec.lease).
type Options struct {
	// LeaseDuration is how long a member may use a grant after the start of the read that
	// returned it.
	LeaseDuration time.Duration
	// ClockMargin covers the clocks' disagreement and a member's timer lateness: at least 4×
	// the largest error of any clock against true time, plus that lateness.
	ClockMargin time.Duration
}

// Validate refuses options the argument cannot use.
func (o Options) Validate() error {
	if o.LeaseDuration <= 0 {
		return errors.New("hub: leaseDuration must be positive")
	}
	if o.ClockMargin < 0 {
		return errors.New("hub: clockMargin must not be negative")
	}
	return nil
}

// Grant is one version of a member's slice, as the hub writes it and the member reads it.
type Grant struct {
	// Seq numbers the member's grants: it grows with every new grant (0: none yet).
	Seq int64
	// Slice is the member's local limit under this grant.
	Slice int64
	// Reserved is the member's safe slice under this grant: what it falls to when its lease
	// ends, and what its pods' safe defaults are split from.
	Reserved int64
}

// Fallback is what a member holding g falls to when its lease ends: min(Reserved, Slice).
func (g Grant) Fallback() int64 { return max(0, min(g.Reserved, g.Slice)) }

// MemberSlice is one member's line of the persisted allocation (GlobalQuota status).
type MemberSlice struct {
	Cluster string
	// Grant is the member's current grant.
	Grant Grant
	// Former and FormerReserved are the highest slice and reserved slice of a superseded grant
	// the member may still hold (not known acknowledged past): 0 when none.
	Former, FormerReserved int64
	// Drain is the longest the member said its own ledger takes to get under a lowered limit.
	Drain time.Duration
}

// Allocation is what the hub persists, with a resourceVersion precondition, in one object per
// global quota: every member's line, sorted by cluster.
type Allocation struct {
	Members []MemberSlice
}

// Target is what Plan is asked to move one member towards.
type Target struct {
	Cluster string
	// Reserved is the member's reserved slice in the spec now (0 for a member no longer listed).
	Reserved int64
	// Want is the slice the member should hold (Slices; 0 for a member no longer listed).
	Want int64
}

// Change is a grant Plan decided: it is in the ledger (counted) and must be persisted in the
// allocation, then published to the member.
type Change struct {
	Cluster string
	Grant   Grant
	Raise   bool
}

type version struct {
	Grant
	bound time.Time // zero: no newer grant seen published yet
}

type member struct {
	cur        Grant
	superseded []version
	acked      int64
	drain      time.Duration
}

// Ledger is the hub's ledger of one global quota (see the package doc for its invariants).
// It is not safe for concurrent use.
type Ledger struct {
	opts    Options
	members map[string]*member
}

// NewLedger returns an empty ledger.
func NewLedger(opts Options) (*Ledger, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	return &Ledger{opts: opts, members: map[string]*member{}}, nil
}

// Restore returns a ledger holding what a persisted allocation says, and nothing it does not:
// a former grant is counted in full until a newer grant is seen published (Published) and its
// bound passes, and no acknowledgement is known until given (Acknowledged).
func Restore(opts Options, a Allocation) (*Ledger, error) {
	l, err := NewLedger(opts)
	if err != nil {
		return nil, err
	}
	for _, ms := range a.Members {
		if ms.Cluster == "" {
			return nil, errors.New("hub: allocation line without a cluster")
		}
		if _, dup := l.members[ms.Cluster]; dup {
			return nil, fmt.Errorf("hub: allocation names cluster %q twice", ms.Cluster)
		}
		if ms.Grant.Seq < 0 || ms.Grant.Slice < 0 || ms.Grant.Reserved < 0 || ms.Former < 0 || ms.FormerReserved < 0 {
			return nil, fmt.Errorf("hub: allocation line of %q has a negative value", ms.Cluster)
		}
		m := &member{cur: ms.Grant, drain: max(ms.Drain, 0)}
		if ms.Former > 0 || ms.FormerReserved > 0 {
			// Its true sequence number is forgotten; any below the current one is retired by an
			// acknowledgement of the current one, which is the latest it can be retired by.
			m.superseded = []version{{Grant: Grant{Seq: ms.Grant.Seq - 1, Slice: ms.Former, Reserved: ms.FormerReserved}}}
		}
		l.members[ms.Cluster] = m
	}
	return l, nil
}

// Allocation is the ledger's persisted form: what survives a hub manager's restart.
func (l *Ledger) Allocation() Allocation {
	var a Allocation
	for _, name := range l.names() {
		m := l.members[name]
		ms := MemberSlice{Cluster: name, Grant: m.cur, Drain: m.drain}
		for _, v := range m.superseded {
			ms.Former = max(ms.Former, v.Slice)
			ms.FormerReserved = max(ms.FormerReserved, v.Reserved)
		}
		a.Members = append(a.Members, ms)
	}
	return a
}

func (l *Ledger) names() []string {
	names := make([]string, 0, len(l.members))
	for n := range l.members {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// Current is the member's current grant (zero when the ledger does not know the member).
func (l *Ledger) Current(cluster string) Grant {
	if m := l.members[cluster]; m != nil {
		return m.cur
	}
	return Grant{}
}

// Published records that the member's grant seq was visible to members' reads at the hub's time
// at: a write of it returned then, or a read returned showing it. Every superseded grant below seq
// without a bound gets one: at + LeaseDuration + ClockMargin + the member's drain.
func (l *Ledger) Published(cluster string, seq int64, at time.Time) {
	m := l.members[cluster]
	if m == nil || seq > m.cur.Seq {
		return // not ours to bound anything with
	}
	for i := range m.superseded {
		if v := &m.superseded[i]; v.Seq < seq && v.bound.IsZero() {
			v.bound = at.Add(l.opts.LeaseDuration + l.opts.ClockMargin + m.drain)
		}
	}
}

// Acknowledged records the member's acknowledgement of seq: its own ledger was under that
// grant's slice, and it will hold nothing older. It retires the superseded grants below seq.
// An acknowledgement above the current grant is ignored (no grant it could prove anything of).
func (l *Ledger) Acknowledged(cluster string, seq int64) {
	m := l.members[cluster]
	if m == nil || seq > m.cur.Seq || seq <= m.acked {
		return
	}
	m.acked = seq
	m.superseded = slices.DeleteFunc(m.superseded, func(v version) bool { return v.Seq < seq })
}

// SetDrain records the member's drain bound; the ledger keeps the largest it was told. The
// bounds already set are not moved: a member raises its drain only after reporting it (§16).
func (l *Ledger) SetDrain(cluster string, d time.Duration) {
	m := l.members[cluster]
	if m == nil {
		m = &member{}
		l.members[cluster] = m
	}
	m.drain = max(m.drain, d)
}

// Counted is what the member may be using at now, as far as the hub can tell.
func (l *Ledger) Counted(cluster string, now time.Time) int64 {
	m := l.members[cluster]
	if m == nil {
		return 0
	}
	return m.counted(now)
}

func (m *member) counted(now time.Time) int64 {
	c := m.cur.Slice
	for _, v := range m.superseded {
		if v.bound.IsZero() || now.Before(v.bound) {
			c = max(c, v.Slice)
		} else {
			c = max(c, v.Fallback())
		}
	}
	return c
}

// floor is the least the member may be granted: the reserved slice of every grant it may hold.
func (m *member) floor(reserved int64) int64 {
	f := max(reserved, m.cur.Reserved)
	for _, v := range m.superseded {
		f = max(f, v.Reserved)
	}
	return f
}

// Sum is Σ counted over members at now.
func (l *Ledger) Sum(now time.Time) int64 {
	var s int64
	for _, m := range l.members {
		s += m.counted(now)
	}
	return s
}

// NextBound is the earliest bound after now (zero when none): when a plan may find more room.
func (l *Ledger) NextBound(now time.Time) time.Time {
	var next time.Time
	for _, m := range l.members {
		for _, v := range m.superseded {
			if v.bound.After(now) && (next.IsZero() || v.bound.Before(next)) {
				next = v.bound
			}
		}
	}
	return next
}

// ErrOverGlobal is returned by Plan when a raise would have left Σ counted above the global
// limit: a defect, never expected.
var ErrOverGlobal = errors.New("hub: a plan raised a grant above the global limit")

// Plan moves every member towards its target: first every lowering (and every change of the
// reserved slice that needs no room), then raises from global − Σ counted only, members holding
// nothing first, then by name. A member the targets do not name is moved towards 0. A member is
// never granted below the reserved slice of a grant it may still hold (floor), so a lowered
// reserved slice takes two grants: the new reserved slice first, the lower slice after the member
// acknowledged it. It returns the grants it changed, in cluster order; the caller persists the
// allocation (compare-and-swap) before it publishes any of them, and restores the ledger from the
// allocation it reads back if that write fails.
func (l *Ledger) Plan(now time.Time, global int64, targets []Target) ([]Change, error) {
	if global < 0 {
		return nil, errors.New("hub: negative global limit")
	}
	want := map[string]Target{}
	for _, t := range targets {
		if t.Cluster == "" || t.Reserved < 0 || t.Want < 0 {
			return nil, fmt.Errorf("hub: invalid target %+v", t)
		}
		if _, dup := want[t.Cluster]; dup {
			return nil, fmt.Errorf("hub: target names cluster %q twice", t.Cluster)
		}
		want[t.Cluster] = t
		if l.members[t.Cluster] == nil {
			l.members[t.Cluster] = &member{}
		}
	}
	names := l.names()
	goal := map[string]int64{}
	for _, n := range names {
		m, t := l.members[n], want[n]
		if m.drain <= 0 {
			// Without its drain bound no superseded grant of the member could ever be bounded
			// correctly: it is granted nothing until it reported one.
			t.Want, t.Reserved = 0, 0
			want[n] = t
		}
		goal[n] = max(t.Want, m.floor(t.Reserved))
	}
	changed := map[string]Change{}
	// Lower first: a lowering never raises what is counted (the old grant stays counted).
	for _, n := range names {
		m, t := l.members[n], want[n]
		if goal[n] < m.cur.Slice || (goal[n] <= m.cur.Slice && t.Reserved != m.cur.Reserved) {
			m.supersede(Grant{Seq: m.cur.Seq + 1, Slice: goal[n], Reserved: t.Reserved})
			changed[n] = Change{Cluster: n, Grant: m.cur}
		}
	}
	// Raise only from room.
	room := global - l.Sum(now)
	order := slices.Clone(names)
	slices.SortStableFunc(order, func(a, b string) int {
		za, zb := l.members[a].cur.Slice == 0, l.members[b].cur.Slice == 0
		switch {
		case za && !zb:
			return -1
		case zb && !za:
			return 1
		}
		return 0
	})
	raised := false
	for _, n := range order {
		m, t := l.members[n], want[n]
		if goal[n] <= m.cur.Slice || room <= 0 {
			continue
		}
		before := m.counted(now)
		s := min(goal[n], before+room)
		if s <= m.cur.Slice {
			continue
		}
		// A grant's reserved slice is never above its slice (its pods' safe defaults are split
		// from it, and must fit in any limit the member may have): a partial raise keeps the
		// reserved slice it had until the whole of the new one fits.
		r := t.Reserved
		if s < r {
			r = m.cur.Reserved
		}
		m.supersede(Grant{Seq: m.cur.Seq + 1, Slice: s, Reserved: r})
		room -= m.counted(now) - before
		changed[n] = Change{Cluster: n, Grant: m.cur, Raise: true}
		raised = true
	}
	if raised && l.Sum(now) > global {
		return nil, ErrOverGlobal
	}
	// Forget members no longer listed that hold nothing and can hold nothing.
	for _, n := range names {
		m := l.members[n]
		if _, listed := want[n]; !listed && m.cur.Slice == 0 && len(m.superseded) == 0 && m.acked >= m.cur.Seq {
			delete(l.members, n)
		}
	}
	out := make([]Change, 0, len(changed))
	for _, n := range names {
		if c, ok := changed[n]; ok {
			out = append(out, c)
		}
	}
	return out, nil
}

// supersede makes g the current grant and keeps the previous one as a grant the member may
// still hold (unless it is the zero grant: nothing to hold).
func (m *member) supersede(g Grant) {
	if m.cur.Seq > 0 && (m.cur.Slice > 0 || m.cur.Reserved > 0) {
		m.superseded = append(m.superseded, version{Grant: m.cur})
	}
	m.cur = g
}

// MinClockMargin is the least ClockMargin that covers clocks whose rates are off by at most rho
// (0.0001 for 100 ppm) and a member that notices its lease ended up to lateness late, for a
// member whose drain is drain (docs/protocol.md §16, "Clocks"): the member's lease and drain,
// timed by a clock running slow, end in true time by (LeaseDuration + drain)/(1 − rho) +
// lateness after the publish, and the hub's bound, timed by a clock running fast, comes no
// earlier than (LeaseDuration + ClockMargin + drain)/(1 + rho) after it. No offset between
// clocks enters: every interval is measured by the clock that started it.
func MinClockMargin(lease, drain time.Duration, rho float64, lateness time.Duration) time.Duration {
	if rho <= 0 {
		return lateness
	}
	if rho >= 1 {
		return time.Duration(1<<63 - 1)
	}
	need := (1+rho)*(float64(lease+drain)/(1-rho)+float64(lateness)) - float64(lease+drain)
	return time.Duration(need) + 1
}
