package push

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

func qpod(ns string, i int) *podState {
	return &podState{namespace: ns, name: fmt.Sprintf("%s-%d", ns, i)}
}

func TestReadyQueueBandsInOrder(t *testing.T) {
	q := newReadyQueue(newFlowCaps(32))
	q.push("a", bandUnproven, qpod("a", 0))
	q.push("b", bandRenew, qpod("b", 0))
	q.push("c", bandChange, qpod("c", 0))
	q.push("a", bandLower, qpod("a", 1))
	var got []string
	for p := q.pop(); p != nil; p = q.pop() {
		got = append(got, p.name)
	}
	if want := []string{"a-1", "c-0", "b-0", "a-0"}; !slices.Equal(got, want) {
		t.Fatalf("order %v, want %v", got, want)
	}
	if q.ready() || q.waiting != 0 || len(q.flows) != 0 {
		t.Fatalf("queue not empty: ready %v waiting %d flows %d", q.ready(), q.waiting, len(q.flows))
	}
}

// A flow whose requests are held (hanging) yields its turn to one that holds fewer; flows that
// hold as many take turns.
func TestReadyQueueLeastHeldFirstRoundRobin(t *testing.T) {
	q := newReadyQueue(newFlowCaps(32))
	for i := range 3 {
		q.push("hostile", bandRenew, qpod("hostile", i))
		q.push("x", bandRenew, qpod("x", i))
		q.push("y", bandRenew, qpod("y", i))
	}
	q.acquire("hostile", false)
	q.acquire("hostile", false)
	var got []string
	for range 6 {
		p := q.pop()
		got = append(got, p.name)
		q.acquire(p.namespace, false) // its request runs on
	}
	// x and y alternate while they hold fewer than hostile (2); then all three take turns.
	if want := []string{"x-0", "y-0", "x-1", "y-1", "hostile-0", "x-2"}; !slices.Equal(got, want) {
		t.Fatalf("order %v, want %v", got, want)
	}
}

func TestReadyQueueBounds(t *testing.T) {
	caps := newFlowCaps(8) // perFlow 4, perFlowUnproven 2, unproven 4
	if caps != (flowCaps{perFlow: 4, perFlowUnproven: 2, unproven: 4}) {
		t.Fatalf("caps %+v", caps)
	}
	q := newReadyQueue(caps)
	for i := range 10 {
		q.push("a", bandUnproven, qpod("a", i))
		q.push("b", bandUnproven, qpod("b", i))
		q.push("c", bandUnproven, qpod("c", i))
	}
	q.push("a", bandRenew, qpod("a", 100))
	held := map[string]int{}
	take := func() *podState {
		p := q.pop()
		if p != nil {
			unproven := p.name != "a-100" && p.name != "c-100"
			q.acquire(p.namespace, unproven)
			if unproven {
				held[p.namespace]++
			}
		}
		return p
	}
	// The renewal first, then unproven requests: two per flow at most, four in all.
	if p := take(); p == nil || p.name != "a-100" {
		t.Fatalf("first %v", p)
	}
	n := 0
	for take() != nil {
		n++
	}
	if n != 4 || held["a"] > 2 || held["b"] > 2 || held["c"] > 2 {
		t.Fatalf("started %d unproven requests: %v", n, held)
	}
	if q.ready() {
		t.Fatal("ready with every unproven slot held")
	}
	// A renewal of a flow still below its bound goes ahead of them all.
	q.push("c", bandRenew, qpod("c", 100))
	if p := take(); p == nil || p.name != "c-100" {
		t.Fatalf("renewal of c: %v", p)
	}
	// Releasing one unproven request lets one more start, from the flow holding the fewest.
	var from string
	for ns, h := range held {
		if h == 2 {
			from = ns
			break
		}
	}
	q.release(from, true)
	held[from]--
	p := take()
	if p == nil || q.ready() {
		t.Fatalf("after a release: %v, ready %v", p, q.ready())
	}
	// A flow at its bound in every band (perFlow) waits even for a lowering.
	q2 := newReadyQueue(caps)
	for range caps.perFlow {
		q2.acquire("a", false)
	}
	q2.push("a", bandLower, qpod("a", 0))
	if q2.ready() || q2.pop() != nil {
		t.Fatal("a flow at its bound was served")
	}
	q2.release("a", false)
	if p := q2.pop(); p == nil {
		t.Fatal("not served after a release")
	}
}

func TestReadyQueuePopRenewalKeepsOthersInOrder(t *testing.T) {
	q := newReadyQueue(newFlowCaps(32))
	for i := range 5 {
		q.push("a", bandRenew, qpod("a", i))
	}
	odd := func(p *podState) bool { return p.name == "a-1" || p.name == "a-3" }
	if p := q.popRenewal(odd); p == nil || p.name != "a-1" {
		t.Fatalf("got %v", p)
	}
	if p := q.popRenewal(odd); p == nil || p.name != "a-3" {
		t.Fatalf("got %v", p)
	}
	if p := q.popRenewal(odd); p != nil {
		t.Fatalf("got %v", p)
	}
	var got []string
	for p := q.pop(); p != nil; p = q.pop() {
		got = append(got, p.name)
	}
	if want := []string{"a-0", "a-2", "a-4"}; !slices.Equal(got, want) {
		t.Fatalf("left %v, want %v", got, want)
	}
}

// TestReadyQueueProperty checks the queue's guarantees (readyQueue's doc comment) after every
// step of random pushes, pops (with the request held for a random time) and releases, against a
// plain model of the flows.
func TestReadyQueueProperty(t *testing.T) {
	for seed := range 200 {
		rng := rand.New(rand.NewPCG(uint64(seed), 7))
		w := 1 + rng.IntN(40)
		caps := newFlowCaps(w)
		q := newReadyQueue(caps)
		flows := []string{"a", "b", "c", "d", "e"}[:1+rng.IntN(5)]
		type req struct {
			ns       string
			unproven bool
		}
		var running []req
		waiting := map[string][nBands][]*podState{}
		held := map[string]int{}
		heldU := map[string]int{}
		total := 0
		n := 0
		mayServe := func(ns string, b int) bool {
			if held[ns] >= caps.perFlow {
				return false
			}
			if b == bandUnproven {
				return heldU[ns] < caps.perFlowUnproven && total < caps.unproven
			}
			return true
		}
		for step := range 300 {
			switch r := rng.IntN(10); {
			case r < 4:
				ns, b := flows[rng.IntN(len(flows))], rng.IntN(nBands)
				p := qpod(ns, n)
				n++
				q.push(ns, b, p)
				wq := waiting[ns]
				wq[b] = append(wq[b], p)
				waiting[ns] = wq
			case r < 8:
				// The model's choice: the first band with a flow that may be served; among those
				// flows, the fewest held.
				best, bestBand := "", -1
				for b := range nBands {
					for _, ns := range flows {
						if len(waiting[ns][b]) > 0 && mayServe(ns, b) && (best == "" || held[ns] < held[best]) {
							best, bestBand = ns, b
						}
					}
					if best != "" {
						break
					}
				}
				if q.ready() != (best != "") {
					t.Fatalf("seed %d step %d: ready %v, model has %q", seed, step, q.ready(), best)
				}
				p := q.pop()
				if best == "" {
					if p != nil {
						t.Fatalf("seed %d step %d: popped %s with nothing servable", seed, step, p.name)
					}
					continue
				}
				if p == nil {
					t.Fatalf("seed %d step %d: nothing popped, model serves %s", seed, step, best)
				}
				ns := p.namespace
				wq := waiting[ns]
				if len(wq[bestBand]) == 0 || wq[bestBand][0] != p || held[ns] != held[best] {
					t.Fatalf("seed %d step %d: popped %s (held %d), model serves band %d of %s (held %d)",
						seed, step, p.name, held[ns], bestBand, best, held[best])
				}
				wq[bestBand] = wq[bestBand][1:]
				waiting[ns] = wq
				u := bestBand == bandUnproven
				q.acquire(ns, u)
				held[ns]++
				if u {
					heldU[ns]++
					total++
				}
				running = append(running, req{ns, u})
				if held[ns] > caps.perFlow || heldU[ns] > caps.perFlowUnproven || total > caps.unproven {
					t.Fatalf("seed %d step %d: bounds %+v exceeded: held %v unproven %v total %d", seed, step, caps, held, heldU, total)
				}
			default:
				if len(running) == 0 {
					continue
				}
				i := rng.IntN(len(running))
				r := running[i]
				running = slices.Delete(running, i, i+1)
				q.release(r.ns, r.unproven)
				held[r.ns]--
				if r.unproven {
					heldU[r.ns]--
					total--
				}
			}
		}
	}
}
