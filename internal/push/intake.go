package push

import (
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// This file holds intake: what the DownstreamQuota controller wants (SetQuota, DeleteQuota)
// becoming the quotas' and pods' desired state, and pods leaving every quota.

// setQuota records what the controller wants for one quota and replans it.
func (c *core) setQuota(d DesiredQuota, now time.Time) {
	q := c.quotas[d.Key]
	if q == nil {
		q = &quotaState{key: d.Key, uid: d.UID, entries: map[types.UID]*entry{}, listedAt: now}
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
	q.maxRequestTimeout = max(q.maxRequestTimeout, rt)

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
				if p.endpointSince.IsZero() {
					p.endpointSince = now
					if !dp.Since.IsZero() && dp.Since.Before(now) {
						// The pod existed before this engine saw it: a previous manager (or this
						// one, under a quota since deleted) may have configured it.
						p.endpointSince = dp.Since
					}
				}
				p.failures, p.retryAt = 0, time.Time{} // a new address deserves a fresh try
			}
		}
		p.finalPush = false
		e := q.entries[dp.UID]
		if e == nil {
			e = &entry{quota: q, pod: p}
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
		e.safeDefault = max(dp.SafeDefault, 0)
		e.maxRequestTimeout = max(e.maxRequestTimeout, rt)
		c.marks.markDirty(p)
		c.updateGone(p, now)
	}
	for _, e := range q.entryList() {
		if !seen[e.pod.uid] && e.present {
			e.present = false
			changed = true
			c.marks.markDirty(e.pod)
			c.updateGone(e.pod, now)
		}
	}
	if changed {
		q.changeAt, q.rebalancing = now, true
	}
	c.marks.markQuota(q)
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
		c.marks.markQuota(e.quota)
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
			c.marks.markDirty(e.pod)
		}
	}
	for _, e := range q.entryList() {
		p := e.pod
		if !p.present() {
			p.finalPush, p.orphaned = true, true
		}
		c.updateGone(p, now)
	}
	c.marks.markQuota(q)
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
			c.marks.markQuota(pe.quota)
		}
	}
}

// forgetQuota drops a deleted quota once its ledger is empty.
func (c *core) forgetQuota(q *quotaState) {
	delete(c.quotas, q.key)
	delete(c.reports.changed, q.key)
	if c.metrics != nil {
		c.metrics.forget(q.key)
	}
}
