package hub

import (
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/apportion/apportion/internal/apportion"
	"github.com/apportion/apportion/internal/apportion/demand"
)

// Policy is how the global limit above the reserved slices is split between members.
type Policy int

const (
	// Equal splits it equally, the remainder to the members a rotation ranks first.
	Equal Policy = iota
	// DemandAware splits it by the members' demand (internal/apportion/demand), damped.
	DemandAware
)

// Share is one member's input to Slices.
type Share struct {
	Cluster string
	// Reserved is the member's reserved slice: it always gets at least this.
	Reserved int64
	// Demand is the local limit the member would like, in slice units.
	Demand int64
	// Current is the slice it holds now (the ledger's current grant).
	Current int64
}

// Slices decides the slice each member should hold (in input order): its reserved slice, plus
// its part of global − Σ reserved — equal, or by demand above the reserved slice with the same
// dampers as between pods (demand.Step with damping(budget), demand.DefaultDamping when nil: a
// 20 % dead band, at most a quarter moved per round, a damped round at most every 10 s). last is
// the time of the previous damped round (zero: none); damped says whether this one was (the
// caller records now then). Σ result ≤ global. rotation is the slow counter that rotates who
// gets the remainder. Under DemandAware the budget no member holds (the dampers left it free:
// every member below its target by less than the dead band, or a raise the hub's room cut short)
// goes to the members below their target at once (fillFree): Σ result = global in steady state.
func Slices(global int64, policy Policy, members []Share, rotation uint64, damping func(budget int64) demand.Damping, now, last time.Time) (out []int64, damped bool, err error) {
	var reserved int64
	seen := map[string]bool{}
	for _, m := range members {
		if m.Cluster == "" || m.Reserved < 0 {
			return nil, false, fmt.Errorf("hub: invalid share %+v", m)
		}
		if seen[m.Cluster] {
			return nil, false, fmt.Errorf("hub: cluster %q named twice", m.Cluster)
		}
		seen[m.Cluster] = true
		reserved += m.Reserved
	}
	if reserved > global {
		return nil, false, errors.New("hub: the reserved slices sum above the global limit")
	}
	budget := global - reserved
	n := len(members)
	rank := make([]uint64, n)
	above := make([]int64, n)
	current := make([]int64, n)
	for i, m := range members {
		rank[i] = apportion.Rank(m.Cluster, rotation)
		if policy == DemandAware {
			above[i] = max(0, m.Demand-m.Reserved)
		}
		current[i] = max(0, m.Current-m.Reserved)
	}
	target := demand.Target(budget, 0, above, rank)
	next := target
	if policy == DemandAware {
		if damping == nil {
			damping = demand.DefaultDamping
		}
		next, damped = demand.Step(budget, 0, current, target, damping(budget), now, last)
		next = fillFree(budget, next, target, rank)
	}
	out = make([]int64, n)
	for i, m := range members {
		out[i] = m.Reserved + next[i]
	}
	return out, damped, nil
}

// fillFree hands the part of budget that next leaves unassigned to the members below their
// target, up to it, the largest shortfall first (ties: by rank). It only raises, and only from
// budget no member is given: the dampers exist to keep members from being lowered back and forth,
// not to keep budget idle that a member wants (its target is above what it holds). With Σ target =
// budget (demand.Target) the result sums to budget.
func fillFree(budget int64, next, target []int64, rank []uint64) []int64 {
	free := budget
	for _, v := range next {
		free -= v
	}
	if free <= 0 {
		return next
	}
	order := make([]int, 0, len(next))
	for i := range next {
		if next[i] < target[i] {
			order = append(order, i)
		}
	}
	sort.SliceStable(order, func(a, b int) bool {
		da, db := target[order[a]]-next[order[a]], target[order[b]]-next[order[b]]
		if da != db {
			return da > db
		}
		return rank[order[a]] > rank[order[b]]
	})
	out := append([]int64(nil), next...)
	for _, i := range order {
		give := min(target[i]-out[i], free)
		out[i] += give
		free -= give
		if free == 0 {
			break
		}
	}
	return out
}
