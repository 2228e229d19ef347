// Package hubsync is the I/O half of one quota across clusters (docs/protocol.md §16; the pure
// half is internal/hub): HubReconciler, run by the manager of the hub cluster (--hub), keeps each
// GlobalQuota's allocation and publishes the grants in ClusterSlices; Member, run by a member
// cluster's manager for a DownstreamQuota with spec.global, reads its grant from the hub, holds
// its lease, records the grant in its own cluster and acknowledges it; Members, run by every
// manager (on the leader), starts a Member per such quota from the hub kubeconfig Secret the
// quota names, stops it when the quota goes, and tells the DownstreamQuota controller each
// quota's local limit (controller.GlobalSlices).
//
// Writes happen only on change. The hub writes a GlobalQuota's status when a plan changes a
// grant or the Ready condition, and a ClusterSlice's spec when a grant is to be published; a
// member writes its ClusterSlice's status when its drain bound, its acknowledgement or its
// demand (beyond a dead band) changes, and its DownstreamQuota's status.global and SliceLeased
// condition when it reads a new grant, when the condition's reason changes, and — so that
// leaseUntil stays a date in the future — once the lease moved half a lease past the leaseUntil
// written (its own cluster, at most every second read). A member renews its lease by reading,
// every third of the lease: an idle global quota costs the hub reads only. Members also follows
// each hub Secret's resourceVersion and hands a running Member a client of the rotated
// kubeconfig (Member.SetHub) without restarting it.
package hubsync
