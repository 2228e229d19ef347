package push

import "container/list"

// This file holds the fair ready queue: the pods whose request is due, waiting for a worker, and
// the count of requests each flow has started and not finished. It knows nothing of the ledger;
// core decides what a pod needs next and in which band (schedule.go), and the queue decides
// whose turn it is.

// A band is a class of ready work; bands are served in order (docs/protocol.md §6).
const (
	// bandLower: a push that lowers a pod whose agent answered its last request: it frees room
	// for everyone, so it goes first.
	bandLower = iota
	// bandChange: any other change (a raise, new content) or a probe of such a pod.
	bandChange
	// bandRenew: renewals and drain polls of such pods.
	bandRenew
	// bandUnproven: any request to a pod whose agent has not answered its last request (never
	// answered, failed, timed out, or answered with an epoch no manager holds). Such requests
	// are the ones that hang until PushTimeout; they go last, and fewer of them may run at once.
	bandUnproven
	nBands
)

// flowCaps are the bounds of readyQueue, derived from the worker count by newFlowCaps.
type flowCaps struct {
	// perFlow bounds the requests one flow holds at once, in every band together.
	perFlow int
	// perFlowUnproven bounds one flow's requests of bandUnproven held at once.
	perFlowUnproven int
	// unproven bounds every flow's requests of bandUnproven held at once, together.
	unproven int
}

// newFlowCaps derives the bounds from the number of workers w: a flow may hold half the workers
// (max(1, w/2)), a quarter of them for unproven pods (max(1, w/4)), and all flows' unproven pods
// together half (max(1, w/2)), so that the other half always serves agents that answer.
func newFlowCaps(w int) flowCaps {
	return flowCaps{perFlow: max(1, w/2), perFlowUnproven: max(1, w/4), unproven: max(1, w/2)}
}

// readyQueue hands ready pods to workers fairly between flows, in the spirit of the API server's
// Priority and Fairness: a flow is a namespace (every quota and pod of one tenant), a band a
// priority level. Its guarantees:
//
//   - Bands in order: pop hands out a pod of band b only when no flow that may take a worker has
//     a pod waiting in a band before b.
//   - Max-min fairness within a band: of the flows that may take a worker, the one holding the
//     fewest requests now goes first, round robin among equals. A flow whose requests hang holds
//     many, so a flow whose requests finish quickly gets the next free worker.
//   - Bounds: a flow never holds more than caps.perFlow requests, nor more than
//     caps.perFlowUnproven of bandUnproven; all flows together never more than caps.unproven
//     of bandUnproven. A request is held from acquire until release (start to finish),
//     whether a worker is sending it or it waits, signed, for one.
//   - Order within a flow and band is first in, first out, and each queued pod comes out once.
//
// So however many pods of one namespace hang, they hold at most caps.perFlowUnproven workers
// (the first request to a pod that answered before at most caps.perFlow), and the agents that
// answer get every other worker before anything of bandUnproven runs. A flow is known only
// while it has pods waiting or requests held.
type readyQueue struct {
	caps  flowCaps
	flows map[string]*flow
	// bands[b].byHeld[h] lists the flows with pods waiting in band b that hold h requests;
	// h = caps.perFlow (a flow at its bound) is never served.
	bands [nBands]struct{ byHeld []*list.List }
	// unprovenHeld is the requests of bandUnproven held by every flow together.
	unprovenHeld int
	waiting      int // pods queued, every band
}

// flow is one namespace's part of the queue.
type flow struct {
	name         string
	waiting      [nBands]podFIFO
	held         int // requests started and not finished
	heldUnproven int // of which to unproven pods
	// elem[b] is the flow's element in bands[b].byHeld[at[b]] while it has pods waiting in b.
	elem [nBands]*list.Element
	at   [nBands]int
}

func newReadyQueue(c flowCaps) *readyQueue {
	q := &readyQueue{caps: c, flows: map[string]*flow{}}
	for b := range q.bands {
		q.bands[b].byHeld = make([]*list.List, c.perFlow+1)
		for h := range q.bands[b].byHeld {
			q.bands[b].byHeld[h] = list.New()
		}
	}
	return q
}

func (q *readyQueue) flow(name string) *flow {
	f := q.flows[name]
	if f == nil {
		f = &flow{name: name}
		q.flows[name] = f
	}
	return f
}

// push queues p, of flow name, in band b.
func (q *readyQueue) push(name string, b int, p *podState) {
	f := q.flow(name)
	f.waiting[b].push(p)
	q.waiting++
	if f.elem[b] == nil {
		q.list(f, b)
	}
}

// mayServe says whether flow f may take a worker for band b now.
func (q *readyQueue) mayServe(f *flow, b int) bool {
	if f.held >= q.caps.perFlow {
		return false
	}
	return b != bandUnproven || (f.heldUnproven < q.caps.perFlowUnproven && q.unprovenHeld < q.caps.unproven)
}

// next is the flow whose turn it is in band b, nil if none may take a worker. The flows are
// visited from the fewest requests held up; only flows at their perFlowUnproven bound are
// skipped over, and each of those holds a request, so the walk is bounded by the number of
// workers.
func (q *readyQueue) next(b int) *flow {
	if b == bandUnproven && q.unprovenHeld >= q.caps.unproven {
		return nil
	}
	for _, l := range q.bands[b].byHeld[:q.caps.perFlow] {
		for e := l.Front(); e != nil; e = e.Next() {
			if f := e.Value.(*flow); q.mayServe(f, b) {
				return f
			}
		}
	}
	return nil
}

// pop takes the next pod: from the first band in which a flow may take a worker, the one of the
// flow holding the fewest requests (round robin among equals). It returns nil when no flow may.
// The pod's request, if it starts one, is then acquired.
func (q *readyQueue) pop() *podState {
	for b := range nBands {
		if f := q.next(b); f != nil {
			return q.take(f, b, 0)
		}
	}
	return nil
}

// popRenewal is pop limited to bandRenew and to pods for which ok holds (startRenewals: the
// renewals that may be signed together): the first such pod of the flow whose turn it is among
// the flows that have one. Other pods keep their places.
func (q *readyQueue) popRenewal(ok func(*podState) bool) *podState {
	const b = bandRenew
	for _, l := range q.bands[b].byHeld[:q.caps.perFlow] {
		for e := l.Front(); e != nil; e = e.Next() {
			f := e.Value.(*flow)
			if !q.mayServe(f, b) {
				continue
			}
			if i := f.waiting[b].index(ok); i >= 0 {
				return q.take(f, b, i)
			}
		}
	}
	return nil
}

// take removes the i-th pod waiting in f's band b.
func (q *readyQueue) take(f *flow, b, i int) *podState {
	p := f.waiting[b].remove(i)
	q.waiting--
	if f.waiting[b].len() == 0 {
		q.unlist(f, b)
		q.forget(f)
	}
	return p
}

// ready says whether pop would hand out a pod; urgent whether one of a band before bandRenew.
func (q *readyQueue) ready() bool {
	for b := range nBands {
		if q.next(b) != nil {
			return true
		}
	}
	return false
}

func (q *readyQueue) urgent() bool {
	return q.next(bandLower) != nil || q.next(bandChange) != nil
}

// acquire counts a request started for flow name (unproven: to an unproven pod) until release.
func (q *readyQueue) acquire(name string, unproven bool) {
	f := q.flow(name)
	f.held++
	if unproven {
		f.heldUnproven++
		q.unprovenHeld++
	}
	q.relist(f)
}

// release ends what acquire counted.
func (q *readyQueue) release(name string, unproven bool) {
	f := q.flows[name]
	if f == nil || f.held == 0 {
		panic("push: readyQueue.release without acquire for flow " + name)
	}
	f.held--
	if unproven {
		f.heldUnproven--
		q.unprovenHeld--
	}
	q.relist(f)
	q.forget(f)
}

// relist moves f, after its held count changed, to the back of the list of its new count in
// every band it waits in.
func (q *readyQueue) relist(f *flow) {
	for b := range nBands {
		if f.elem[b] != nil {
			q.unlist(f, b)
			q.list(f, b)
		}
	}
}

// list appends f to the list of band b for the requests it holds.
func (q *readyQueue) list(f *flow, b int) {
	f.at[b] = min(f.held, q.caps.perFlow)
	f.elem[b] = q.bands[b].byHeld[f.at[b]].PushBack(f)
}

func (q *readyQueue) unlist(f *flow, b int) {
	q.bands[b].byHeld[f.at[b]].Remove(f.elem[b])
	f.elem[b] = nil
}

// forget drops a flow that holds nothing and has nothing waiting.
func (q *readyQueue) forget(f *flow) {
	if f.held > 0 {
		return
	}
	for b := range nBands {
		if f.waiting[b].len() > 0 {
			return
		}
	}
	delete(q.flows, f.name)
}

// podFIFO is a first-in, first-out list of pods.
type podFIFO struct {
	items []*podState
	head  int
}

func (l *podFIFO) len() int { return len(l.items) - l.head }

func (l *podFIFO) push(p *podState) {
	if l.head > 0 && l.head == len(l.items) {
		l.items, l.head = l.items[:0], 0
	}
	l.items = append(l.items, p)
}

// index is the position of the first pod for which ok holds, -1 if none.
func (l *podFIFO) index(ok func(*podState) bool) int {
	for i, p := range l.items[l.head:] {
		if ok(p) {
			return i
		}
	}
	return -1
}

// remove takes out the i-th pod (0 is the first).
func (l *podFIFO) remove(i int) *podState {
	j := l.head + i
	p := l.items[j]
	if i == 0 {
		l.items[j] = nil
		l.head++
		if l.head >= 64 && 2*l.head >= len(l.items) {
			n := copy(l.items, l.items[l.head:])
			clear(l.items[n:])
			l.items, l.head = l.items[:n], 0
		}
	} else {
		copy(l.items[j:], l.items[j+1:])
		l.items[len(l.items)-1] = nil
		l.items = l.items[:len(l.items)-1]
	}
	if l.head == len(l.items) {
		l.items, l.head = l.items[:0], 0
	}
	return p
}
