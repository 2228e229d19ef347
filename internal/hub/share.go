package hub

import (
	"errors"
	"fmt"
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
// gets the remainder.
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
	}
	out = make([]int64, n)
	for i, m := range members {
		out[i] = m.Reserved + next[i]
	}
	return out, damped, nil
}
