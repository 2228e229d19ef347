package push

import (
	"errors"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// This file holds a request's lifecycle: startWork turns a ready pod into a request (reserving
// a push's version in the ledger first) and finishWork applies its outcome.

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
