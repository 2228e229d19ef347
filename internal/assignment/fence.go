package assignment

import "errors"

// ErrStale is the refusal of an Assignment whose (Epoch, Generation) is below the pair held
// (see the package doc). The control API answers it with 409 and the agent's State.
var ErrStale = errors.New("stale assignment: (epoch, generation) is below the pair held")

// ComparePair orders two (epoch, generation) pairs, epoch first: -1 when the first is lower,
// 0 when equal (a push of the pair held is a lease renewal), +1 when higher.
func ComparePair(epoch1, generation1, epoch2, generation2 int64) int {
	switch {
	case epoch1 < epoch2:
		return -1
	case epoch1 > epoch2:
		return 1
	case generation1 < generation2:
		return -1
	case generation1 > generation2:
		return 1
	}
	return 0
}
