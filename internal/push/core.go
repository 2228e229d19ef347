package push

import (
	"cmp"
	"maps"
	"slices"
	"time"

	"github.com/go-logr/logr"
	"k8s.io/apimachinery/pkg/types"
)

// This file holds the core's state and its flush loop: changes mark quotas to replan and pods
// to rebuild, and flush does both, then schedules each rebuilt pod's next request. What each step
// does is in its own file (see the package doc).

// core is the engine's state machine: the desired quotas, every pod's agent and the ledgers.
// It does no I/O, starts no goroutine and reads no clock: every method takes now, and the
// Engine calls them under its mutex. Work for the agents comes out of sched.popReady/startWork
// and goes back in through finishWork, which is how the tests drive it step by step. core owns
// the records (quotas, pods) and composes the parts that decide: the ledger (what is counted
// and granted), the scheduler (which request next, and when), the claims (of a newer epoch),
// the reports and the flush marks; each part's invariants are in its doc comment.
type core struct {
	opts    *Options
	log     logr.Logger
	metrics *metrics // nil in pure tests

	// ledger is what every pod may be using and the grants that keep Σ ≤ limit (ledger.go).
	ledger ledger
	// claims are the answers claiming a newer epoch, waiting for the epoch record (claims.go).
	claims claims

	quotas map[types.NamespacedName]*quotaState
	pods   map[types.UID]*podState

	// sched decides which request goes next and when (schedule.go, fairqueue.go).
	sched scheduler

	// marks is what the next flush must do: quotas to replan, pods to rebuild.
	marks marks
	// reports is what the controllers read: Reports, changes for OnChange, Events (report.go).
	reports reports

	// onQuiet, when set (tests), sees every quiet renewal (requests.go): for each of the pod's
	// entries what it was counted at and would have been granted just before, and just after.
	onQuiet func(p *podState, before, after []int32)
	// onRenewal, when set (tests), sees every renewal started and how long after it was due.
	onRenewal func(p *podState, late time.Duration)
}

func newCore(o *Options, m *metrics) *core {
	c := &core{
		opts:    o,
		log:     o.Logger,
		metrics: m,
		ledger:  ledger{opts: o},
		quotas:  map[types.NamespacedName]*quotaState{},
		pods:    map[types.UID]*podState{},
	}
	c.claims = claims{opts: o, log: o.Logger, metrics: m, ledger: &c.ledger, sched: &c.sched, marks: &c.marks, reports: &c.reports}
	c.reports = reports{ledger: &c.ledger, metrics: m, quotas: c.quotas, pods: c.pods, changed: map[types.NamespacedName]struct{}{}}
	c.sched = scheduler{opts: o, ledger: &c.ledger, ready: newReadyQueue(newFlowCaps(o.Workers))}
	return c
}

// begin fixes the epoch and starts recovery: every pod is probed before it is pushed to, and
// no quota raises anyone above what it is counted at until recoverUntil.
func (c *core) begin(epoch int64, now time.Time) {
	c.ledger.begin(epoch, now)
	keys := slices.SortedFunc(maps.Keys(c.quotas), func(a, b types.NamespacedName) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
	})
	for _, k := range keys {
		c.marks.markQuota(c.quotas[k])
	}
	for _, p := range c.podList() {
		c.marks.markDirty(p)
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

// marks is the work changes leave for the next flush: the quotas to replan and the pods whose
// content to rebuild, each once (quotaState.dirty, podState.dirty), in the order marked; a
// removed pod is never marked. flush replans the quotas (sorted by key) before it rebuilds the
// pods, as a replan may change grants and so mark more pods.
type marks struct {
	dirty  []*podState   // pods whose content must be rebuilt
	dirtyQ []*quotaState // quotas that must be replanned
}

// markQuota makes a quota replan at the next flush.
func (m *marks) markQuota(q *quotaState) {
	if !q.dirty {
		q.dirty = true
		m.dirtyQ = append(m.dirtyQ, q)
	}
}

func (m *marks) markDirty(p *podState) {
	if !p.dirty && !p.removed {
		p.dirty = true
		m.dirty = append(m.dirty, p)
	}
}

// needsFlush says whether quotas wait to be replanned or pods to be rebuilt.
func (m *marks) needsFlush() bool { return len(m.dirtyQ) > 0 || len(m.dirty) > 0 }

// flush replans every marked quota, then rebuilds the content of every dirty pod and schedules
// its work.
func (c *core) flush(now time.Time) {
	if len(c.marks.dirtyQ) > 0 {
		qs := c.marks.dirtyQ
		c.marks.dirtyQ = nil
		slices.SortFunc(qs, func(a, b *quotaState) int {
			return cmp.Or(cmp.Compare(a.key.Namespace, b.key.Namespace), cmp.Compare(a.key.Name, b.key.Name))
		})
		for _, q := range qs {
			q.dirty = false
			c.replan(q, now)
		}
	}
	for len(c.marks.dirty) > 0 {
		p := c.marks.dirty[0]
		c.marks.dirty = c.marks.dirty[1:]
		p.dirty = false
		c.rebuild(p)
		c.sched.schedule(p, now)
	}
	c.marks.dirty = c.marks.dirty[:0]
}
