package push

import (
	"cmp"
	"container/heap"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"reflect"
	"slices"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/types"

	"github.com/apportion/apportion/internal/assignment"
)

// core is the engine's state machine: the desired quotas, every pod's agent and the ledgers.
// It does no I/O, starts no goroutine and reads no clock: every method takes now, and the
// Engine calls them under its mutex. Work for the agents comes out of popReady/startWork and
// goes back in through finishWork, which is how the tests drive it step by step.
type core struct {
	o   *Options
	log logr.Logger
	m   *metrics // nil in pure tests

	epoch    int64
	started  bool
	start    time.Time
	fenced   bool
	fencedBy int64

	quotas map[types.NamespacedName]*quotaState
	pods   map[types.UID]*podState

	timers timerHeap
	ready  [3][]*podState // by priority: 0 lowerings, 1 probes and other changes, 2 renewals and polls
	dirty  []*podState    // pods whose content must be rebuilt
	dirtyQ []*quotaState  // quotas that must be replanned
	// changed collects quotas whose Report changed, for OnChange.
	changed map[types.NamespacedName]struct{}
	// events collects Events for OnEvent, in order.
	events []Event

	// afterPlan, when set (tests), sees every plan: its input and the grants it decided.
	afterPlan func(key types.NamespacedName, limit int32, recovering bool, in []planEntry, grants []int32)
}

type workKind int

const (
	kindNone  workKind = iota
	kindProbe          // GET /v1/state of a pod the engine does not know yet
	kindPush           // PUT /v1/assignment: a change, a retry or a renewal
	kindPoll           // GET /v1/state of a pod that is draining calls above its permits
)

func (k workKind) String() string {
	switch k {
	case kindProbe:
		return "probe"
	case kindPush:
		return "push"
	case kindPoll:
		return "poll"
	}
	return "none"
}

// work is one request to one agent.
type work struct {
	pod      *podState
	kind     workKind
	endpoint string
	a        *assignment.Assignment // kindPush: the snapshot sent
	v        *version               // kindPush
	sentAt   time.Time
}

func newCore(o *Options, m *metrics) *core {
	return &core{
		o:       o,
		log:     o.Logger,
		m:       m,
		quotas:  map[types.NamespacedName]*quotaState{},
		pods:    map[types.UID]*podState{},
		changed: map[types.NamespacedName]struct{}{},
	}
}

// begin fixes the epoch and starts recovery: every pod is probed before it is pushed to, and
// no quota raises anyone above what it is counted at until recoverUntil.
func (c *core) begin(epoch int64, now time.Time) {
	c.epoch, c.started, c.start = epoch, true, now
	keys := slices.SortedFunc(maps.Keys(c.quotas), func(a, b types.NamespacedName) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})
	for _, k := range keys {
		c.markQuota(c.quotas[k])
	}
	for _, p := range c.podList() {
		c.markDirty(p)
	}
	c.flush(now)
}

// podList is every pod, by namespace and name (a deterministic order).
func (c *core) podList() []*podState {
	ps := make([]*podState, 0, len(c.pods))
	for _, p := range c.pods {
		ps = append(ps, p)
	}
	slices.SortFunc(ps, func(a, b *podState) int {
		return cmp.Or(cmp.Compare(a.namespace, b.namespace), cmp.Compare(a.name, b.name), cmp.Compare(a.uid, b.uid))
	})
	return ps
}

// entryList is the pod's entries by quota name.
func (p *podState) entryList() []*entry {
	es := make([]*entry, 0, len(p.entries))
	for _, e := range p.entries {
		es = append(es, e)
	}
	slices.SortFunc(es, func(a, b *entry) int { return cmp.Compare(a.q.key.Name, b.q.key.Name) })
	return es
}

// recoverUntil is when a quota's recovery window ends: a lease the previous manager started
// just before this one started has lapsed and its calls have ended.
func (c *core) recoverUntil(q *quotaState) time.Time {
	return c.start.Add(c.o.PushTimeout + c.o.AcceptGrace + c.o.LeaseTTL + q.maxRT)
}

func (c *core) recovering(q *quotaState, now time.Time) bool {
	return !c.started || now.Before(c.recoverUntil(q))
}

// setQuota records what the controller wants for one quota and replans it.
func (c *core) setQuota(d DesiredQuota, now time.Time) {
	q := c.quotas[d.Key]
	if q == nil {
		q = &quotaState{key: d.Key, uid: d.UID, entries: map[types.UID]*entry{}}
		c.quotas[d.Key] = q
	}
	if q.deleted || (d.UID != "" && q.uid != "" && d.UID != q.uid) {
		// Deleted and created again (or replaced between two reconciles: a new UID under the same
		// name). The agents know a downstream by the quota's name only, so the ledger of the old
		// object goes on: pods that still hold its grants or run its calls stay counted until they
		// drained or their lease passed, and the new object is planned on top, like a new quota.
		c.log.Info("quota created again under the same name; its ledger carries what pods may still hold",
			"quota", d.Key.String(), "uid", d.UID, "previousUID", q.uid, "wasDeleted", q.deleted)
		if q.deleted {
			c.reviveQuota(q, d, now)
		}
	}
	if d.UID != "" {
		q.uid = d.UID
	}
	q.desired = DesiredQuota{
		Key:        d.Key,
		Generation: d.Generation,
		Limit:      max(d.Limit, 0),
		Downstream: cloneJSON(d.Downstream),
		Switches:   cloneJSON(d.Switches),
	}
	q.desired.Downstream.Name = d.Key.Name
	rt := d.Downstream.RequestTimeout.D()
	q.maxRT = max(q.maxRT, rt)

	changed := false
	seen := make(map[types.UID]bool, len(d.Pods))
	for _, dp := range d.Pods {
		if dp.UID == "" || seen[dp.UID] {
			continue
		}
		seen[dp.UID] = true
		p := c.pods[dp.UID]
		if p == nil {
			p = &podState{uid: dp.UID, namespace: d.Key.Namespace, entries: map[types.NamespacedName]*entry{}}
			c.pods[dp.UID] = p
		}
		p.name = dp.Name
		p.bootstrap = dp.Bootstrap
		p.orphaned = false
		if dp.Endpoint != p.endpoint {
			p.endpoint = dp.Endpoint
			if dp.Endpoint != "" {
				if p.ipAt.IsZero() {
					p.ipAt = now
					if !dp.Since.IsZero() && dp.Since.Before(now) {
						// The pod existed before this engine saw it: a previous manager (or this
						// one, under a quota since deleted) may have configured it.
						p.ipAt = dp.Since
					}
				}
				p.failures, p.retryAt = 0, time.Time{} // a new address deserves a fresh try
			}
		}
		p.finalPush = false
		e := q.entries[dp.UID]
		if e == nil {
			e = &entry{q: q, pod: p}
			q.entries[dp.UID] = e
			p.entries[q.key] = e
			q.resort = true
			changed = true
		}
		if !e.present || e.terminating != dp.Terminating || e.desired.Permits != dp.Permits {
			changed = true
		}
		e.present = true
		e.desired = dp
		e.target = dp.Target
		e.terminating = dp.Terminating
		e.sd = max(dp.SafeDefault, 0)
		e.rt = max(e.rt, rt)
		c.markDirty(p)
		c.updateGone(p, now)
	}
	for _, e := range q.entryList() {
		if !seen[e.pod.uid] && e.present {
			e.present = false
			changed = true
			c.markDirty(e.pod)
			c.updateGone(e.pod, now)
		}
	}
	if changed {
		q.changeAt, q.rebalancing = now, true
	}
	c.markQuota(q)
	c.flush(now)
}

// updateGone tracks when a pod stopped being listed by every quota; a pod that is gone counts
// nothing once its leases lapsed, so the pod's other quotas are replanned when that flips.
func (c *core) updateGone(p *podState, now time.Time) {
	present := p.present()
	switch {
	case present && !p.goneAt.IsZero():
		p.goneAt = time.Time{}
	case !present && p.goneAt.IsZero():
		p.goneAt = now
	default:
		return
	}
	for _, e := range p.entryList() {
		c.markQuota(e.q)
	}
}

// deleteQuota takes a quota out of service: every pod of it is lowered to 0 permits, like a pod
// the quota no longer lists, and its downstream stays in the pod's assignment until the ledger
// counts nothing for it (the agent acknowledged 0 and its calls ended, or its lease and a request
// timeout passed), then leaves it. Until then the quota's ledger lives on, so that a quota created
// again under the same name (the agents know the downstream by that name) counts what the pods
// may still hold of the deleted one. A pod left without any quota gets one last, empty
// assignment and is then forgotten.
func (c *core) deleteQuota(key types.NamespacedName, now time.Time) {
	q := c.quotas[key]
	if q == nil || q.deleted {
		return
	}
	q.deleted = true
	for _, e := range q.entryList() {
		if e.present {
			e.present = false
			c.markDirty(e.pod)
		}
	}
	for _, e := range q.entryList() {
		p := e.pod
		if !p.present() {
			p.finalPush, p.orphaned = true, true
		}
		c.updateGone(p, now)
	}
	c.markQuota(q)
	c.flush(now)
}

// reviveQuota brings a deleted quota back into service (d is its new desired state). Its pods
// that d does not list any more are now known to have left it: they are taken as gone from now
// (they may have called until now, so their calls are counted for a request timeout from here).
func (c *core) reviveQuota(q *quotaState, d DesiredQuota, now time.Time) {
	q.deleted = false
	listed := make(map[types.UID]bool, len(d.Pods))
	for _, dp := range d.Pods {
		listed[dp.UID] = true
	}
	for _, e := range q.entryList() {
		p := e.pod
		if listed[p.uid] || !p.orphaned {
			continue
		}
		p.orphaned = false
		if !p.present() {
			p.goneAt = now
		}
		for _, pe := range p.entryList() {
			c.markQuota(pe.q)
		}
	}
}

// forgetQuota drops a deleted quota once its ledger is empty.
func (c *core) forgetQuota(q *quotaState) {
	delete(c.quotas, q.key)
	delete(c.changed, q.key)
	if c.m != nil {
		c.m.forget(q.key)
	}
}

func (c *core) unreachable(p *podState) bool { return p.failures >= c.o.UnreachableAfter }

// target is what the planner steers an entry to.
func (c *core) target(e *entry) int32 {
	p := e.pod
	if !e.present || e.terminating || !p.known || p.endpoint == "" {
		return 0
	}
	if c.unreachable(p) {
		if e.q.desired.Downstream.FailClosed {
			return 0
		}
		return min(e.grant, e.sd)
	}
	return max(e.desired.Permits, 0)
}

func (c *core) canRaise(e *entry) bool {
	p := e.pod
	return c.started && !c.fenced && e.present && !e.terminating && p.known && p.endpoint != "" && !c.unreachable(p)
}

// replan recomputes one quota's grants from its ledger, releases the entries of pods that left
// the quota and count nothing any more, arms the timer for the ledger's next change and notes
// whether what Report shows changed. It is O(pods of the quota); the core batches it (markQuota,
// flush) so that many answers arriving together cost one replan.
func (c *core) replan(q *quotaState, now time.Time) {
	if c.quotas[q.key] != q {
		return
	}
	entries := q.entryList()
	var next time.Time
	counts := make([]int32, len(entries)) // what each entry counts after planning; -1 if released
	if c.started {
		pe := make([]planEntry, len(entries))
		for i, e := range entries {
			h, ph, carry, nx := c.held(e, now)
			next = minTime(next, nx)
			pe[i] = planEntry{Name: e.pod.name, Grant: e.grant, Target: c.target(e), Held: h, Phantom: ph, Carry: carry, CanRaise: c.canRaise(e)}
		}
		recovering := c.recovering(q, now)
		if recovering {
			next = minTime(next, c.recoverUntil(q))
		}
		grants := plan(q.desired.Limit, recovering, pe)
		if c.afterPlan != nil {
			c.afterPlan(q.key, q.desired.Limit, recovering, slices.Clone(pe), grants)
		}
		released := false
		for i, e := range entries {
			if grants[i] != e.grant {
				e.grant = grants[i]
				c.markDirty(e.pod)
			}
			pe[i].Grant = e.grant
			counts[i] = pe[i].counted()
			if !e.present && counts[i] == 0 {
				delete(q.entries, e.pod.uid)
				delete(e.pod.entries, q.key)
				c.markDirty(e.pod)
				counts[i] = -1
				released = true
			}
		}
		if released {
			q.resort = true
		}
		if q.deleted && len(q.entries) == 0 {
			c.forgetQuota(q)
			return
		}
	}
	if !next.IsZero() && !next.Equal(q.wakeAt) {
		heap.Push(&c.timers, timerItem{at: next, q: q})
	}
	q.wakeAt = next
	if q.rebalancing && c.started && c.rebalanceDone(q) {
		q.rebalancing = false
		q.lastRebalance = now.Sub(q.changeAt)
	}
	c.noteReport(q, now, entries, counts)
}

// markQuota makes a quota replan at the next flush.
func (c *core) markQuota(q *quotaState) {
	if !q.dirty {
		q.dirty = true
		c.dirtyQ = append(c.dirtyQ, q)
	}
}

// desiredTarget is what the controller wants the pod to hold.
func desiredTarget(e *entry) int32 {
	if !e.present || e.terminating {
		return 0
	}
	return max(e.desired.Permits, 0)
}

// ackedPermits is what the agent confirmed holding for the entry's downstream, or -1.
func ackedPermits(e *entry) int32 {
	p := e.pod
	if p.ackedGen == 0 {
		return -1
	}
	v := p.version(p.ackedGen)
	if v == nil {
		return -1
	}
	return v.holds[e.q.key.Name].permits
}

func synced(e *entry) bool {
	want := desiredTarget(e)
	if e.grant != want {
		return false
	}
	if a := ackedPermits(e); a >= 0 {
		return a == want
	}
	// An agent that holds nothing (and was sent nothing) is where a pod that should hold 0 is.
	p := e.pod
	return want == 0 && p.known && !p.configured && len(p.versions) == 0
}

func (c *core) rebalanceDone(q *quotaState) bool {
	for _, e := range q.entries {
		if e.present && e.pod.endpoint != "" && !c.unreachable(e.pod) && !synced(e) {
			return false
		}
	}
	return true
}

func (c *core) markDirty(p *podState) {
	if !p.dirty && !p.removed {
		p.dirty = true
		c.dirty = append(c.dirty, p)
	}
}

// needsFlush says whether quotas wait to be replanned or pods to be rebuilt.
func (c *core) needsFlush() bool { return len(c.dirtyQ) > 0 || len(c.dirty) > 0 }

// flush replans every marked quota, then rebuilds the content of every dirty pod and schedules
// its work.
func (c *core) flush(now time.Time) {
	if len(c.dirtyQ) > 0 {
		qs := c.dirtyQ
		c.dirtyQ = nil
		slices.SortFunc(qs, func(a, b *quotaState) int {
			return cmp.Or(cmp.Compare(a.key.Namespace, b.key.Namespace), cmp.Compare(a.key.Name, b.key.Name))
		})
		for _, q := range qs {
			q.dirty = false
			c.replan(q, now)
		}
	}
	for len(c.dirty) > 0 {
		p := c.dirty[0]
		c.dirty = c.dirty[1:]
		p.dirty = false
		c.rebuild(p)
		c.schedule(p, now)
	}
	c.dirty = c.dirty[:0]
}

// rebuild assembles a pod's assignment from every quota it belongs to and bumps its generation
// when anything changed.
func (c *core) rebuild(p *podState) {
	if p.removed {
		return
	}
	if len(p.entries) == 0 {
		if !p.finalPush || p.endpoint == "" || (!p.configured && len(p.versions) == 0) || c.fenced {
			c.removePod(p)
			return
		}
	}
	if !c.started {
		return
	}
	a := &assignment.Assignment{
		Epoch:       c.epoch,
		LeaseTTL:    assignment.Duration(c.o.LeaseTTL),
		Downstreams: []assignment.Downstream{},
	}
	keys := make([]types.NamespacedName, 0, len(p.entries))
	for k := range p.entries {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b types.NamespacedName) int { return cmp.Compare(a.Name, b.Name) })
	for _, k := range keys {
		e := p.entries[k]
		d := cloneJSON(e.q.desired.Downstream)
		d.Permits = e.grant
		d.SafeDefaultPermits = min(e.sd, e.grant)
		d.Rate = nil
		if e.desired.RatePerSecond > 0 {
			mode := assignment.ModeTokenBucket
			if r := e.q.desired.Downstream.Rate; r != nil && r.Mode != "" {
				mode = r.Mode
			}
			// Burst 0 is the pod's share when the pods outnumber the burst: the agent paces it.
			d.Rate = &assignment.Rate{PerSecond: e.desired.RatePerSecond, Burst: max(e.desired.RateBurst, 0), Mode: mode}
		}
		e.rt = max(e.rt, d.RequestTimeout.D())
		a.Downstreams = append(a.Downstreams, d)
		if !e.present {
			continue
		}
		for _, ts := range e.q.desired.Switches {
			if ts.Target != "" && ts.Target != e.target {
				continue
			}
			sw := ts.Switch
			sw.Downstream = d.Name
			if !slices.ContainsFunc(a.Switches, func(s assignment.Switch) bool { return s.Name == sw.Name }) {
				a.Switches = append(a.Switches, sw)
			}
		}
	}
	slices.SortFunc(a.Switches, func(x, y assignment.Switch) int { return cmp.Compare(x.Name, y.Name) })
	if p.content != nil {
		a.Generation = p.content.Generation
		if reflect.DeepEqual(p.content, a) {
			return
		}
	}
	a.Generation = p.gen + 1
	if err := a.Validate(); err != nil && len(a.Switches) > 0 {
		// A switch the agents would refuse must not hold up the permits: push without switches.
		c.log.Error(err, "dropping degrade switches from an invalid assignment", "pod", p.namespace+"/"+p.name)
		a.Switches = nil
	}
	if err := a.Validate(); err != nil {
		// The controller handed over something the agents would refuse; keep the last content.
		// The ledger still counts the new grants, which only errs on the safe side.
		c.log.Error(err, "not pushing an invalid assignment", "pod", p.namespace+"/"+p.name)
		return
	}
	if p.content != nil {
		a.Generation = p.content.Generation
		if reflect.DeepEqual(p.content, a) {
			return
		}
	}
	p.gen++
	a.Generation = p.gen
	p.content = a
}

func (c *core) removePod(p *podState) {
	p.removed = true
	if c.pods[p.uid] == p {
		delete(c.pods, p.uid)
	}
}

// pushWanted says whether the pod's content should be sent. An agent that holds nothing gets
// its first assignment only once each downstream it should call has a permit (until then its
// /readyz is false and it gets no traffic), and nothing at all if it is only leaving.
func (c *core) pushWanted(p *podState) bool {
	if p.content == nil {
		return false
	}
	if p.configured || len(p.versions) > 0 {
		return true
	}
	if len(p.entries) == 0 {
		return false
	}
	live := false
	for _, e := range p.entries {
		if !e.present || e.terminating {
			continue
		}
		live = true
		if c.target(e) > 0 && e.grant == 0 {
			return false
		}
	}
	return live
}

func draining(p *podState) bool {
	for _, e := range p.entries {
		if e.inflight > e.grant {
			return true
		}
	}
	return false
}

// due is the pod's next request and when it is due; kindNone when there is nothing to do.
func (c *core) due(p *podState, now time.Time) (time.Time, workKind) {
	if p.removed || p.busy != nil || !c.started || c.fenced || p.endpoint == "" {
		return time.Time{}, kindNone
	}
	if !p.known {
		return maxTime(now, p.retryAt), kindProbe
	}
	var at time.Time
	kind := kindNone
	if c.pushWanted(p) {
		kind = kindPush
		switch {
		case p.failures > 0:
			at = p.retryAt
		case p.content.Generation != p.okGen:
			at = now
		default:
			at = p.renewAt
		}
	}
	if draining(p) {
		pt := p.pollAt
		if p.failures > 0 {
			pt = maxTime(pt, p.retryAt)
		}
		if kind == kindNone || pt.Before(at) {
			at, kind = pt, kindPoll
		}
	}
	if kind == kindNone && c.mayHoldLateForeign(p) {
		// Ask again once no push of the previous manager can land any more.
		at, kind = maxTime(c.start.Add(c.o.PushTimeout+c.o.AcceptGrace), p.retryAt), kindProbe
	}
	return maxTime(at, now), kind
}

// priority orders ready work: lowerings first (they free room for everyone), then probes and
// other changes, then renewals and polls.
func (c *core) priority(p *podState, kind workKind) int {
	if kind != kindPush || p.content.Generation == p.okGen {
		if kind == kindProbe {
			return 1
		}
		return 2
	}
	if n := len(p.versions); n > 0 {
		last := p.versions[n-1]
		for _, e := range p.entries {
			if h, ok := last.holds[e.q.key.Name]; ok && e.grant < h.permits {
				return 0
			}
		}
	}
	return 1
}

func (c *core) schedule(p *podState, now time.Time) {
	if p.queued || p.busy != nil || p.removed {
		return
	}
	at, kind := c.due(p, now)
	if kind == kindNone {
		p.wakeAt = time.Time{}
		return
	}
	if !at.After(now) {
		p.queued = true
		pr := c.priority(p, kind)
		c.ready[pr] = append(c.ready[pr], p)
		return
	}
	if !p.wakeAt.Equal(at) {
		p.wakeAt = at
		heap.Push(&c.timers, timerItem{at: at, pod: p})
	}
}

// advance fires every timer that is due: pods whose request is due, quotas whose ledger
// changed by itself (a lease lapsed, calls ended, recovery ended).
func (c *core) advance(now time.Time) {
	for c.timers.Len() > 0 && !c.timers[0].at.After(now) {
		it := heap.Pop(&c.timers).(timerItem)
		switch {
		case it.pod != nil:
			if it.pod.wakeAt.Equal(it.at) {
				it.pod.wakeAt = time.Time{}
				c.schedule(it.pod, now)
			}
		case it.q != nil:
			if it.q.wakeAt.Equal(it.at) {
				it.q.wakeAt = time.Time{}
				c.markQuota(it.q)
			}
		}
	}
	c.flush(now)
	if c.timers.Len() > 4*(len(c.pods)+len(c.quotas))+64 {
		c.compactTimers()
	}
}

func (c *core) compactTimers() {
	live := c.timers[:0]
	for _, it := range c.timers {
		if (it.pod != nil && it.pod.wakeAt.Equal(it.at) && !it.pod.removed) || (it.q != nil && it.q.wakeAt.Equal(it.at)) {
			live = append(live, it)
		}
	}
	c.timers = live
	heap.Init(&c.timers)
}

// nextWake is the time of the earliest timer; zero if none.
func (c *core) nextWake() time.Time {
	if c.timers.Len() == 0 {
		return time.Time{}
	}
	return c.timers[0].at
}

func (c *core) hasReady() bool {
	return len(c.ready[0])+len(c.ready[1])+len(c.ready[2]) > 0
}

func (c *core) popReady() *podState {
	for i := range c.ready {
		if len(c.ready[i]) > 0 {
			p := c.ready[i][0]
			c.ready[i][0] = nil
			c.ready[i] = c.ready[i][1:]
			return p
		}
	}
	return nil
}

// startWork turns a ready pod into a request. For a push it reserves the version in the
// ledger before anything is sent: from here on the agent may hold it.
func (c *core) startWork(p *podState, now time.Time) *work {
	p.queued = false
	at, kind := c.due(p, now)
	if kind == kindNone || at.After(now) {
		c.schedule(p, now)
		return nil
	}
	w := &work{pod: p, kind: kind, endpoint: p.endpoint, sentAt: now}
	if kind == kindPush {
		v := p.version(p.content.Generation)
		if v == nil {
			v = newVersion(p.content)
			p.versions = append(p.versions, v)
		}
		v.sendEnd = now.Add(c.o.PushTimeout + c.o.AcceptGrace + c.o.LeaseTTL)
		// Address the push to the agent process last seen, so that a restarted one refuses it
		// (409) and reports itself before it is granted anything; see assignment.Assignment.Instance.
		a := *p.content
		a.Instance = p.instance
		w.a, w.v = &a, v
	}
	p.busy = w
	return w
}

// landed says whether a failed request may still have been accepted by the agent: only a
// definite refusal (a 4xx answer, or an assignment the client refused to send) may not.
func landed(err error) bool {
	var se *assignment.StatusError
	if errors.As(err, &se) && se.StatusCode >= 400 && se.StatusCode < 500 {
		return false
	}
	return len(assignment.FieldErrors(err)) == 0
}

// finishWork applies a request's outcome: st on success, err otherwise. The pod's quotas are
// replanned at the next flush.
func (c *core) finishWork(w *work, st *assignment.State, err error, now time.Time) {
	p := w.pod
	p.busy = nil
	if w.v != nil {
		w.v.sendEnd = time.Time{}
	}
	if p.removed || c.fenced {
		return
	}
	var stale *assignment.StaleError
	switch {
	case err == nil && st != nil:
		if w.kind == kindPush {
			w.v.okEnd = maxTime(w.v.okEnd, now.Add(c.o.LeaseTTL))
			p.renewAt = w.sentAt.Add(c.renewDelay())
			if st.Epoch == c.epoch && st.Generation == w.v.gen {
				p.okGen = w.v.gen
			}
		}
		p.failures, p.retryAt = 0, time.Time{}
		c.applyState(p, st, now)
		if w.kind == kindPush && len(p.entries) == 0 && p.finalPush && p.okGen == p.gen {
			c.removePod(p)
			return
		}
	case errors.As(err, &stale):
		p.failures, p.retryAt = 0, time.Time{}
		c.applyState(p, &stale.State, now)
	default:
		if w.v != nil && landed(err) {
			w.v.failEnd = maxTime(w.v.failEnd, w.sentAt.Add(c.o.PushTimeout+c.o.AcceptGrace+c.o.LeaseTTL))
		}
		p.failures++
		p.retryAt = now.Add(c.backoff(p.failures))
		lvl := 1
		if p.failures == c.o.UnreachableAfter {
			lvl = 0
		}
		c.log.V(lvl).Info("agent request failed", "pod", p.namespace+"/"+p.name, "endpoint", w.endpoint,
			"request", w.kind.String(), "failures", p.failures, "error", err.Error())
		if len(p.entries) == 0 && c.unreachable(p) {
			c.removePod(p)
			return
		}
	}
	if c.fenced {
		return
	}
	for _, e := range p.entries {
		c.markQuota(e.q)
	}
	c.markDirty(p)
}

// applyState learns from an agent's State what it holds and has in flight.
func (c *core) applyState(p *podState, st *assignment.State, now time.Time) {
	if p.known && c.restarted(p, st) {
		c.forgetProcess(p, st, now)
	} else if !p.known {
		c.carryPredecessor(p, st, now)
	}
	p.known = true
	p.reportAt = now
	p.lastEpoch, p.lastGen = st.Epoch, st.Generation
	if st.Instance != "" {
		p.instance = st.Instance
	}
	p.configured = st.Configured
	p.pollAt = now.Add(c.o.DrainPoll)
	switch {
	case st.Epoch > c.epoch:
		// Another manager has pushed to this agent since this one started: this engine is
		// stale and must stop pushing anything anywhere. A higher epoch is the only evidence of
		// that: epochs come from a counter that only grows (docs/protocol.md §9).
		c.fenced, c.fencedBy = true, st.Epoch
		c.log.Error(nil, "fenced: an agent holds a newer epoch; stopping", "pod", p.namespace+"/"+p.name,
			"agentEpoch", st.Epoch, "agentGeneration", st.Generation, "epoch", c.epoch)
		return
	case st.Epoch == c.epoch && st.Generation > p.gen:
		// A generation of this epoch the engine does not know: it forgot the pod after pushing to
		// it (every quota of the pod was deleted, or the pod was given up as unreachable) and met
		// it again. Only this engine pushes this epoch, so nobody else is involved: re-learn what
		// the agent holds, count it like another manager's holding, and go on above it.
		c.relearn(p, st, now)
	case st.Epoch == c.epoch:
		keep := p.versions[:0]
		for _, v := range p.versions {
			if v.gen >= st.Generation {
				keep = append(keep, v)
			}
		}
		clear(p.versions[len(keep):])
		p.versions = keep
		p.ackedGen = st.Generation
		p.foreign = nil
	default:
		// The agent holds nothing of this epoch (it restarted, or this engine has not reached
		// it yet): our content must be pushed again; what it holds is someone else's.
		p.ackedGen, p.okGen = 0, 0
		p.foreign = nil
		if st.Configured {
			f := &foreignHold{
				epoch:     st.Epoch,
				bootstrap: st.Epoch == 0,
				leaseEnd:  c.start.Add(c.o.PushTimeout + c.o.AcceptGrace + c.o.LeaseTTL),
				holds:     make(map[string]foreignDS, len(st.Downstreams)),
			}
			for _, d := range st.Downstreams {
				f.holds[d.Name] = foreignDS{permits: d.Permits, effective: d.EffectivePermits}
			}
			p.foreign = f
		}
	}
	for k, e := range p.entries {
		e.inflight, e.inflightAt, e.requests = 0, now, 0
		for _, d := range st.Downstreams {
			if d.Name == k.Name {
				e.inflight, e.requests = max(d.InFlight, 0), d.Requests
				break
			}
		}
	}
}

// relearn handles an agent that holds a generation of this epoch above every one the engine
// has for the pod (see applyState). Nothing the engine has for the pod can land any more (the
// agent refuses a lower generation), so its versions go. What the agent holds is counted like a
// previous manager's holding: what it enforces surely and its permits as a bound until a lease
// window from now has passed (a push this engine sent before it forgot the pod was sent before
// now, so its lease ends by then) plus a request timeout, then its fallback. The pod's next
// content is numbered above the agent's generation, so the agent accepts it; once it
// acknowledges it the holding is replaced by what it reports.
func (c *core) relearn(p *podState, st *assignment.State, now time.Time) {
	c.log.Info("an agent holds a generation of this epoch the engine forgot; re-learning what it holds",
		"pod", p.namespace+"/"+p.name, "agentGeneration", st.Generation, "generation", p.gen, "epoch", c.epoch)
	for _, e := range p.entryList() {
		c.events = append(c.events, Event{Quota: e.q.key, UID: e.q.uid, Warning: true, Reason: ReasonAgentRelearned,
			Message: fmt.Sprintf("the agent of pod %s held generation %d of this manager's epoch, which the manager had forgotten "+
				"(the pod left every quota, e.g. the quota was deleted, and came back); counted at what it holds and pushed again",
				p.name, st.Generation)})
	}
	clear(p.versions)
	p.versions = p.versions[:0]
	p.gen, p.content = st.Generation, nil
	p.ackedGen, p.okGen = 0, 0
	p.foreign = nil
	if st.Configured {
		f := &foreignHold{
			epoch:    st.Epoch,
			leaseEnd: now.Add(c.o.PushTimeout + c.o.AcceptGrace + c.o.LeaseTTL),
			holds:    make(map[string]foreignDS, len(st.Downstreams)),
		}
		for _, d := range st.Downstreams {
			f.holds[d.Name] = foreignDS{permits: d.Permits, effective: d.EffectivePermits}
		}
		p.foreign = f
	}
	c.markDirty(p)
}

// forgetProcess handles an agent that restarted (st comes from a new process). The old process's
// calls may still run at the downstream for a request timeout: what it may have held is carried
// on top of whatever the new process gets. The new process holds nothing of ours, so its grant
// starts again from 0 and it is raised only from room the ledger shows free; re-pushing the old
// grant would count the pod twice (carry + grant), above what it was counted at before.
//
// The versions the old process held are now stood for by the carry and are dropped: left in
// place, their fallbacks would count for as long as the pod exists, since the new process never
// reports a generation that retires them. Only a push that may still land at the new process is
// kept: none when the restart was told by the instance id (every push was addressed to the old
// instance, which the new process refuses); for an agent without one, a push in flight or one
// that failed without a definite refusal.
func (c *core) forgetProcess(p *podState, st *assignment.State, now time.Time) {
	c.log.Info("agent restarted", "pod", p.namespace+"/"+p.name)
	byInstance := p.instance != "" && st.Instance != "" && st.Instance != p.instance
	for _, e := range p.entries {
		c.carryCounted(e, now, now.Add(e.rt))
		e.grant = 0
	}
	keep := p.versions[:0]
	for _, v := range p.versions {
		if !byInstance && (!v.sendEnd.IsZero() || now.Before(v.failEnd)) {
			keep = append(keep, v)
		}
	}
	clear(p.versions[len(keep):])
	p.versions = keep
	c.markDirty(p)
}

// carryPredecessor handles the first answer of an agent to this engine. When the pod already had
// an endpoint while a previous manager may still have been pushing (this engine's recovery
// window) and the agent process that answers is younger than a request timeout, an earlier
// process of the same pod may have held a previous manager's permits and may still have calls
// running at the downstream until the new process's start + RT. What the ledger counted for the
// unknown pod until now is carried until then. A pod this engine saw from its first endpoint on
// needs no carry: nobody but this engine configures it, and it never pushes an unknown pod.
func (c *core) carryPredecessor(p *podState, st *assignment.State, now time.Time) {
	if st.Uptime <= 0 || !c.started || !p.everIP() || !c.mayPredate(p) {
		return
	}
	began := now.Add(-st.Uptime.D())
	for _, e := range p.entries {
		until := began.Add(e.rt)
		if !now.Before(until) {
			continue
		}
		c.carryCounted(e, now, until)
	}
}

// carryCounted adds what the entry is counted at now, its grant aside (the bound of what the
// pod's previous process may still run), to its carry, kept until at least until.
func (c *core) carryCounted(e *entry, now, until time.Time) {
	h, ph, carry, _ := c.held(e, now)
	e.carry, e.carryUntil = carry+max(h, ph), maxTime(until, e.carryUntil)
	c.markQuota(e.q)
}

// restarted says whether st comes from a new agent process: its state went backwards (a lower
// (epoch, generation), no longer configured), a request counter, which only grows within a
// process, dropped, or — the direct signal — the agent's instance id changed. The other signals
// cover agents that do not report an instance.
func (c *core) restarted(p *podState, st *assignment.State) bool {
	if p.instance != "" && st.Instance != "" && st.Instance != p.instance {
		return true // a new process, whatever it accepted since
	}
	if st.Epoch < p.lastEpoch || (st.Epoch == p.lastEpoch && st.Generation < p.lastGen) || (p.configured && !st.Configured) {
		return true
	}
	for k, e := range p.entries {
		for _, d := range st.Downstreams {
			if d.Name == k.Name && d.Requests < e.requests {
				return true
			}
		}
	}
	return false
}

// renewDelay is the time to the next renewal: RenewEvery less up to a quarter, at random, so
// that pods pushed together (a rebalance) do not renew in one burst forever. Renewing early is
// always safe.
func (c *core) renewDelay() time.Duration {
	if c.o.jitter != nil {
		return c.o.RenewEvery // deterministic tests
	}
	return c.o.RenewEvery - rand.N(c.o.RenewEvery/4+1)
}

func (c *core) backoff(failures int) time.Duration {
	d := c.o.RetryBase
	for i := 1; i < failures && d < c.o.RetryMax; i++ {
		d *= 2
	}
	d = min(d, c.o.RetryMax)
	if c.o.jitter != nil {
		return c.o.jitter(d)
	}
	return d/2 + rand.N(d/2+1)
}

// report is what Report returns for one quota.
func (c *core) report(key types.NamespacedName, now time.Time) Report {
	q := c.quotas[key]
	r := Report{Recovering: true}
	if q == nil {
		return r
	}
	r.Recovering = c.recovering(q, now)
	r.Converged = c.started && !c.fenced
	for _, e := range q.entryList() {
		counted := c.counted(e, now)
		if !c.started {
			counted = 0
		}
		r.Ledger += counted
		s := synced(e)
		r.Holdings = append(r.Holdings, Holding{
			Pod: e.pod.name, Target: e.target, Granted: e.grant, Counted: counted,
			InFlight: e.inflight, Synced: s, Gone: !e.present,
		})
		if c.unreachable(e.pod) {
			r.Unreachable = append(r.Unreachable, e.pod.name)
		}
		if e.present && e.pod.endpoint != "" && !s {
			r.Converged = false
		}
	}
	slices.Sort(r.Unreachable)
	if !q.rebalancing {
		r.LastRebalanceDuration = q.lastRebalance
	}
	return r
}

// noteReport marks the quota changed when what Report shows (in-flight counts aside) changed,
// and refreshes its metrics. counts[i] is what entries[i] counts now, -1 if it was released.
func (c *core) noteReport(q *quotaState, now time.Time, entries []*entry, counts []int32) {
	var sum uint64 = 14695981039346656037
	mix := func(v uint64) {
		sum ^= v
		sum *= 1099511628211
		sum ^= sum >> 29
	}
	var ledger int64
	unreachable := 0
	for i, e := range entries {
		if counts[i] < 0 {
			continue
		}
		ledger += int64(counts[i])
		var flags uint64
		if synced(e) {
			flags |= 1
		}
		if c.unreachable(e.pod) {
			flags |= 2
			unreachable++
		}
		if !e.present {
			flags |= 4
		}
		mix(uint64(i))
		mix(uint64(uint32(e.grant))<<32 | uint64(uint32(counts[i])))
		mix(flags)
	}
	var flags uint64
	if c.recovering(q, now) {
		flags |= 1
	}
	if q.rebalancing {
		flags |= 2
	}
	mix(uint64(len(entries)))
	mix(flags)
	mix(uint64(q.lastRebalance))
	if sum != q.summary {
		q.summary = sum
		c.changed[q.key] = struct{}{}
	}
	if c.m != nil {
		c.m.observe(q.key, ledger, int64(q.desired.Limit), unreachable)
	}
}

func (c *core) takeEvents() []Event {
	ev := c.events
	c.events = nil
	return ev
}

func (c *core) takeChanged() []types.NamespacedName {
	if len(c.changed) == 0 {
		return nil
	}
	out := make([]types.NamespacedName, 0, len(c.changed))
	for k := range c.changed {
		out = append(out, k)
	}
	clear(c.changed)
	return out
}

// switchApplied counts the pods whose content carries the switch and those whose agent
// acknowledged it in exactly that form.
func (c *core) switchApplied(name string) (applied, total int) {
	for _, p := range c.pods {
		if p.content == nil || p.endpoint == "" {
			continue
		}
		i := slices.IndexFunc(p.content.Switches, func(s assignment.Switch) bool { return s.Name == name })
		if i < 0 {
			continue
		}
		total++
		v := p.version(p.ackedGen)
		if p.ackedGen == 0 || v == nil {
			continue
		}
		j := slices.IndexFunc(v.a.Switches, func(s assignment.Switch) bool { return s.Name == name })
		if j >= 0 && reflect.DeepEqual(v.a.Switches[j], p.content.Switches[i]) {
			applied++
		}
	}
	return applied, total
}

func sortEntries(es []*entry) {
	slices.SortFunc(es, func(a, b *entry) int {
		if c := cmp.Compare(a.pod.name, b.pod.name); c != 0 {
			return c
		}
		return cmp.Compare(a.pod.uid, b.pod.uid)
	})
}

// cloneJSON deep-copies a wire value so that the controller may reuse what it handed over.
func cloneJSON[T any](v T) T {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	var out T
	if err := json.Unmarshal(b, &out); err != nil {
		panic(err)
	}
	return out
}

// timerHeap orders the engine's timers; entries are invalidated lazily (their at no longer
// matches the pod's or quota's wakeAt).
type timerItem struct {
	at  time.Time
	pod *podState
	q   *quotaState
}

type timerHeap []timerItem

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h timerHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *timerHeap) Push(x any)        { *h = append(*h, x.(timerItem)) }
func (h *timerHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	old[len(old)-1] = timerItem{}
	*h = old[:len(old)-1]
	return it
}
