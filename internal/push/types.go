package push

import (
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/apportion/apportion/internal/assignment"
)

// DesiredQuota is what the DownstreamQuota controller wants every pod of one quota to hold.
// The engine owns how and when it gets there without the ledger ever exceeding Limit.
type DesiredQuota struct {
	// Key names the DownstreamQuota.
	Key types.NamespacedName
	// Generation is the DownstreamQuota's metadata.generation, for status.
	Generation int64
	// Limit is the global in-flight limit; Σ ledger ≤ Limit always.
	Limit int32
	// Downstream is the per-pod enforcement template; Permits and SafeDefaultPermits are set per
	// pod from Pods.
	Downstream assignment.Downstream
	// Pods are every pod that may be calling, terminating ones included.
	Pods []DesiredPod
	// Switches are the degrade switches of this downstream in force now.
	Switches []TargetedSwitch
}

// DesiredPod is one pod's desired share.
type DesiredPod struct {
	Name string
	UID  types.UID
	// Target is the name of the DownstreamQuota target (workload) the pod belongs to.
	Target string
	// Endpoint is the agent's control base URL, e.g. "http://10.1.2.3:15000"; empty when the pod
	// has no IP or no agent port yet (then it cannot be calling and is not pushed to).
	Endpoint string
	// Permits is the pod's desired in-flight limit, SafeDefault what it falls back to.
	Permits     int32
	SafeDefault int32
	// RatePerSecond and RateBurst are the pod's share of the rate contract (0: none).
	RatePerSecond float64
	RateBurst     int32
	// Terminating is true once the pod has a deletionTimestamp.
	Terminating bool
}

// TargetedSwitch is a degrade switch, for every target of the quota or only one.
type TargetedSwitch struct {
	// Target limits the switch to the pods of one target; empty means all.
	Target string
	Switch assignment.Switch
}

// Report is what the engine knows of one quota, for its status.
type Report struct {
	// Ledger is Σ counted permits over every pod the ledger tracks, deleted ones included.
	Ledger int32
	// Holdings per pod, sorted by name.
	Holdings []Holding
	// Unreachable lists pods whose last push failed.
	Unreachable []string
	// LastRebalanceDuration is from the last change of desired permits until every reachable pod
	// acknowledged it; zero while one is still under way.
	LastRebalanceDuration time.Duration
	// Converged is true when every pod with an endpoint acknowledged its desired permits.
	Converged bool
	// Recovering is true while a new manager waits out leases before raising anyone.
	Recovering bool
}

// Holding is one pod's line in the ledger.
type Holding struct {
	Pod      string
	Target   string
	Granted  int32
	Counted  int32
	InFlight int32
	Synced   bool
}
