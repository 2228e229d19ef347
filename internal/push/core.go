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
// Engine calls them under its mutex. Work for the agents comes out of popReady/startWork and
// goes back in through finishWork, which is how the tests drive it step by step.
type core struct {
	opts    *Options
	log     logr.Logger
	metrics *metrics // nil in pure tests

	epoch    int64
	fencedBy int64 // the epoch record that fenced it (claims.go; ledger.fenced says whether)

	// ledger is what every pod may be using and the grants that keep Σ ≤ limit (ledger.go).
	ledger ledger

	// Claims of a newer epoch waiting for the epoch record (claims.go): claimSeq numbers the
	// claims made, claimants are the pods whose claim waits.
	claimSeq  uint64
	claimants []*podState

	quotas map[types.NamespacedName]*quotaState
	pods   map[types.UID]*podState

	// sched decides which request goes next and when (schedule.go, fairqueue.go).
	sched scheduler

	dirty  []*podState   // pods whose content must be rebuilt
	dirtyQ []*quotaState // quotas that must be replanned
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
	c.reports = reports{ledger: &c.ledger, metrics: m, quotas: c.quotas, pods: c.pods, changed: map[types.NamespacedName]struct{}{}}
	c.sched = scheduler{opts: o, ledger: &c.ledger, ready: newReadyQueue(newFlowCaps(o.Workers))}
	return c
}

// begin fixes the epoch and starts recovery: every pod is probed before it is pushed to, and
// no quota raises anyone above what it is counted at until recoverUntil.
func (c *core) begin(epoch int64, now time.Time) {
	c.epoch = epoch
	c.ledger.begin(now)
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

// markQuota makes a quota replan at the next flush.
func (c *core) markQuota(q *quotaState) {
	if !q.dirty {
		q.dirty = true
		c.dirtyQ = append(c.dirtyQ, q)
	}
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
		c.sched.schedule(p, now)
	}
	c.dirty = c.dirty[:0]
}
