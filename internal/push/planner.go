package push

import (
	"cmp"
	"slices"
)

// planEntry is one pod's line of a quota's ledger as the planner sees it.
type planEntry struct {
	// Name orders raises deterministically.
	Name string
	// Grant is the permits currently decided for the pod (pushed or about to be).
	Grant int32
	// Target is what the pod should hold now: its desired permits, 0 while it is terminating,
	// gone or not yet known, its fallback while it is unreachable.
	Target int32
	// Held bounds what the pod may be using whatever Grant is: unacknowledged pushes, leases
	// that have not lapsed plus a request timeout, calls reported in flight, unknown holdings.
	// The ledger counts the pod at max(Held, Grant).
	Held int32
	// Phantom is counted like Held but is only an upper bound for holdings the engine cannot
	// see (a pod that never answered, a previous manager's push that may have landed unseen): the
	// pod may hold nothing at all. Raising within it is free except while recovering.
	Phantom int32
	// Carry is counted on top of everything else: calls a restarted agent's previous process
	// may still run. Whatever the pod is granted adds to it.
	Carry int32
	// CanRaise is false when the pod must not be raised: not known yet, unreachable,
	// terminating, gone or without an endpoint.
	CanRaise bool
}

// counted is what the ledger counts for the entry: Carry + max(Held, Phantom, Grant).
func (e planEntry) counted() int32 { return e.Carry + max(e.Held, e.Phantom, e.Grant) }

// plan decides every pod's next grant for one quota. It first lowers every pod whose target is
// below its grant (lowering never raises what the ledger counts), then raises pods towards
// their targets only from the room the ledger shows free, limit - Σ counted, pods holding
// nothing first (a new pod becomes ready as soon as it has a permit), then by name. Raises may
// be partial; raising within what a pod is already counted at costs nothing. While recovering,
// a pod is never raised above max(Held, Grant), what it surely holds: anything more could meet
// holdings the ledger cannot see yet.
//
// Postcondition: when Σ counted ≤ limit before, it still holds after; when it did not (the
// limit was lowered), no pod's counted value grows.
func plan(limit int32, recovering bool, entries []planEntry) []int32 {
	grants := make([]int32, len(entries))
	var total int64
	for i, e := range entries {
		g := e.Grant
		if e.Target < g {
			g = max(e.Target, 0)
		}
		grants[i] = g
		total += int64(e.Carry) + int64(max(e.Held, e.Phantom, g))
	}
	room := int64(limit) - total

	var order []int
	for i, e := range entries {
		if e.CanRaise && e.Target > grants[i] {
			order = append(order, i)
		}
	}
	slices.SortFunc(order, func(a, b int) int {
		za, zb := grants[a] == 0, grants[b] == 0
		if za != zb {
			if za {
				return -1
			}
			return 1
		}
		return cmp.Compare(entries[a].Name, entries[b].Name)
	})
	for _, i := range order {
		e := entries[i]
		held := int64(max(e.Held, e.Phantom, grants[i])) // what the pod is counted at, carry aside
		ceiling := int64(e.Target)
		if recovering {
			ceiling = min(ceiling, int64(max(e.Held, grants[i])))
		}
		ng := min(ceiling, held+max(room, 0))
		if ng <= int64(grants[i]) {
			continue
		}
		room -= max(0, ng-held)
		grants[i] = int32(ng)
	}
	return grants
}
