// Package hub is the pure logic of one global quota shared by several clusters
// (docs/protocol.md §16): the hub's ledger of the slices it granted to member clusters
// (Ledger), a member's lease on its slice (Lease), and the demand-aware split of the global limit
// between members (Slices). Like the push engine's ledger and package apportion it does no I/O
// and reads no clock: every method takes the time, and the callers (the hub reconciler and the
// member's slice client) do the reads and writes on the hub's Kubernetes API.
//
// # The two levels
//
// A member cluster is to the hub what a pod is to its cluster's manager. The hub grants each
// member a slice; the member's manager apportions only its slice among its pods (the slice is its
// local limit: docs/protocol.md §11 holds inside it, and a new slice is just a lowered or raised
// limit there). The factor (safetyFactorPercent) is applied once, by the member, to its slice;
// the hub splits the whole global limit.
//
// # Invariants
//
// The Ledger keeps, for every member, counted = max(its current grant, every superseded grant it
// may still hold: that grant's slice until its bound, then that grant's reserved slice), and
// guarantees:
//
//   - Σ counted ≤ global after every Plan that raised a grant (Plan raises only into
//     global − Σ counted, lowering first), and Σ counted only falls between plans (a bound
//     passing, an acknowledgement retiring a superseded grant).
//   - A grant is never below the reserved slice of any grant the member may still hold, so a
//     member's local limit is always at least the share its pods' safe defaults were split from.
//   - A superseded grant's bound is P + LeaseDuration + ClockMargin + the member's drain, where P
//     is when the hub saw a newer grant published (a write that returned, or a read that showed
//     it); there is no bound before that. A restored Ledger (a new hub manager) knows no publish
//     time and so bounds nothing until it sees one.
//   - A member is granted nothing before it reported its drain bound (SetDrain).
//   - Acknowledging a sequence number retires the superseded grants below it; it never touches the
//     current grant, and an acknowledgement of a grant the ledger does not know is ignored.
//
// The Lease (member side) keeps: the member uses the slice of the newest grant it read for
// LeaseDuration from the start of that read, then falls to min(reserved, slice) of that grant
// (decided in advance, never above it); a read of an older sequence number changes nothing
// (fencing); a member restarted from its record starts on that fallback. It may acknowledge a
// grant only when its own ledger is under the grant's slice and the grant is recorded in its own
// cluster.
//
// Together, with the assumptions of §16 (clock error ≤ ClockMargin/4, consistent reads, the
// member's drain bound), Σ over members of what their pods may use ≤ global at every instant.
// TestTwoLevelProperty checks it over random partitions, lost writes, hub and member restarts,
// stale hub managers and demand changes.
package hub
