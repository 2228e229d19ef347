package enforce

import (
	"net/http"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/apportion/apportion/internal/agent/lanes"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/assignment"
)

// LaneSet is a downstream's priority lanes: the declared lanes in order, then "default", the
// rules that pick a call's lane, and the lane semaphore (package lanes) that divides the
// downstream's effective limit among them.
//
// A call with lanes holds two permits: first its lane's, then the downstream's semaphore's. Both
// have the effective limit, and the downstream semaphore is only taken by calls holding a lane
// permit, so the second is granted at once except for an instant while the limit is being
// lowered; it stays the one bound every call passes, so lanes can only divide a pod's permits,
// never add to them. Waiting, and so the lanes' priorities, happens in the lane semaphore.
//
// A LaneSet is kept across assignments that leave the lanes unchanged. An assignment that
// changes them installs a new one: calls in flight release on the set they took their permit
// from, so the new set does not see them, and for as long as they run the downstream semaphore
// alone bounds the total (lanes' priorities are approximate until they finish).
type LaneSet struct {
	Sem   *lanes.Semaphore
	specs []assignment.Lane
	names []string
	match []laneMatch

	rejected [][metrics.NumReasons]atomic.Int64
	counters [][metrics.NumReasons]prometheus.Counter
}

type laneMatch struct {
	headers  []assignment.HeaderMatch // canonical names
	methods  []string
	prefixes []string
}

// newLaneSet builds the set for specs at limit, or returns nil when there are no lanes.
func newLaneSet(downstream string, specs []assignment.Lane, limit int, m *metrics.Metrics) *LaneSet {
	if len(specs) == 0 {
		return nil
	}
	ls := &LaneSet{specs: slices.Clone(specs)}
	sp := make([]lanes.Spec, 0, len(specs)+1)
	for _, l := range specs {
		sp = append(sp, lanes.Spec{ReservePercent: int(l.ReservePercent), LendPercent: int(l.LendPercent)})
		lm := laneMatch{methods: slices.Clone(l.Methods), prefixes: slices.Clone(l.PathPrefixes)}
		for _, h := range l.Headers {
			lm.headers = append(lm.headers, assignment.HeaderMatch{Name: http.CanonicalHeaderKey(h.Name), Value: h.Value})
		}
		ls.match = append(ls.match, lm)
		ls.names = append(ls.names, l.Name)
	}
	sp = append(sp, lanes.Spec{})
	ls.names = append(ls.names, assignment.DefaultLane)
	ls.Sem = lanes.New(limit, sp)
	ls.rejected = make([][metrics.NumReasons]atomic.Int64, len(ls.names))
	for _, n := range ls.names {
		ls.counters = append(ls.counters, m.LaneRejected(downstream, n))
	}
	return ls
}

// sameLanes reports whether the set was built from specs.
func (ls *LaneSet) sameLanes(specs []assignment.Lane) bool {
	return ls != nil && slices.EqualFunc(ls.specs, specs, func(a, b assignment.Lane) bool {
		return a.Name == b.Name && a.ReservePercent == b.ReservePercent && a.LendPercent == b.LendPercent &&
			slices.Equal(a.Headers, b.Headers) && slices.Equal(a.Methods, b.Methods) && slices.Equal(a.PathPrefixes, b.PathPrefixes)
	})
}

// Match returns the lane of a call: the first declared lane whose every given part matches
// (headers exactly, the method one of methods, the escaped path below the downstream starting
// with one of the prefixes), else the default lane (the last).
func (ls *LaneSet) Match(method, path string, h http.Header) int {
	for i, m := range ls.match {
		if len(m.methods) > 0 && !slices.Contains(m.methods, method) {
			continue
		}
		if len(m.prefixes) > 0 && !slices.ContainsFunc(m.prefixes, func(p string) bool { return strings.HasPrefix(path, p) }) {
			continue
		}
		ok := true
		for _, hm := range m.headers {
			if h.Get(hm.Name) != hm.Value {
				ok = false
				break
			}
		}
		if ok {
			return i
		}
	}
	return len(ls.match)
}

// Name is lane l's name.
func (ls *LaneSet) Name(l int) string { return ls.names[l] }

// CountRejected counts a call of lane l not forwarded, by metrics.Reason*.
func (ls *LaneSet) CountRejected(l, reason int) {
	ls.rejected[l][reason].Add(1)
	ls.counters[l][reason].Inc()
}

// Lanes is the downstream's LaneSet, nil when it has no lanes.
func (d *Downstream) Lanes() *LaneSet { return d.lanes.Load() }

// reconfigureLanes installs cfg's lanes (keeping the set when they are unchanged).
func (d *Downstream) reconfigureLanes(cfg *Config, m *metrics.Metrics) {
	old := d.lanes.Load()
	if old.sameLanes(cfg.Lanes) || (old == nil && len(cfg.Lanes) == 0) {
		return
	}
	if old != nil {
		m.ForgetLanes(d.Name)
	}
	d.lanes.Store(newLaneSet(d.Name, cfg.Lanes, d.Effective(), m))
}

// laneStates is what State reports of the lanes.
func (ls *LaneSet) states() []assignment.LaneState {
	if ls == nil {
		return nil
	}
	st := ls.Sem.Stats()
	out := make([]assignment.LaneState, len(ls.names))
	for i, n := range ls.names {
		l := st.Lanes[i]
		out[i] = assignment.LaneState{Name: n, Reserved: int32(l.Reserve), InFlight: int32(l.InFlight), Waiting: int32(l.Waiting), Borrowed: int32(l.Borrowed)}
		for r, reason := range metrics.Reasons {
			if v := ls.rejected[i][r].Load(); v > 0 {
				if out[i].Rejected == nil {
					out[i].Rejected = map[string]int64{}
				}
				out[i].Rejected[reason] = v
			}
		}
	}
	return out
}

// LaneSnapshot implements metrics.LaneSource.
func (e *Enforcer) LaneSnapshot() []metrics.LaneSnapshot {
	t := e.table.Load()
	var out []metrics.LaneSnapshot
	for _, name := range t.names {
		ls := t.byName[name].Lanes()
		if ls == nil {
			continue
		}
		st := ls.Sem.Stats()
		for i, n := range ls.names {
			l := st.Lanes[i]
			out = append(out, metrics.LaneSnapshot{Downstream: name, Lane: n, InFlight: l.InFlight, Waiting: l.Waiting, Reserved: l.Reserve, Borrowed: l.Borrowed})
		}
	}
	return out
}
