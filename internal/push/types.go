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
	// UID is the DownstreamQuota object's UID: a new UID under a known Key is a quota deleted and
	// created again (logged; the ledger of the old object goes on, see Engine.DeleteQuota).
	UID types.UID
	// Generation is the DownstreamQuota's metadata.generation, for status.
	Generation int64
	// Limit is the global in-flight limit: no pod is raised unless Σ ledger ≤ Limit after it.
	Limit int32
	// Downstream is the per-pod enforcement template; Name is set to Key.Name, and Permits,
	// SafeDefaultPermits and Rate are set per pod from Pods (a non-nil Rate only gives the Mode;
	// TokenBucket when nil).
	Downstream assignment.Downstream
	// Pods are every pod that may be calling, terminating ones included. A pod left out is
	// lowered to 0 and released once it counts nothing; a pod left out of every quota is taken as
	// gone: its permits stay counted until its lease lapsed plus a request timeout (its fallback
	// until a request timeout after it went), then it is released entirely. So a pod that still
	// exists and may still call must stay listed (with Permits 0 if it should not call any more).
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
	// Permits is the pod's desired in-flight limit, SafeDefault what it falls back to when its
	// lease lapses. The engine grants Permits only as far as the ledger has room, and 0 while the
	// pod is terminating.
	Permits     int32
	SafeDefault int32
	// RatePerSecond and RateBurst are the pod's share of the rate contract
	// (internal/apportion.SplitRate). RatePerSecond 0 means no rate limit; RateBurst 0 means no
	// share of the burst: the agent paces the pod.
	RatePerSecond float64
	RateBurst     int32
	// Terminating is true once the pod has a deletionTimestamp.
	Terminating bool
	// Since is when the pod came to exist (its creationTimestamp); zero if unknown. A pod that
	// existed before this engine started may hold what a previous manager gave it, even when the
	// engine first hears of it later (its quota was deleted while the manager restarted, then
	// created again): until its agent answers it is counted at its safe default.
	Since time.Time
	// Bootstrap is true when the pod's agent runs with a --bootstrap file: it may call on its
	// safe default before it ever answered, so it is counted at that until it does.
	Bootstrap bool
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
	// Unreachable lists pods whose last Options.UnreachableAfter requests failed, sorted. A pod
	// whose agent answered with an epoch above the engine's is unreachable at once.
	Unreachable []string
	// Misbehaving lists the pods (of Unreachable) whose agent answered with an epoch no manager
	// holds (above the manager's epoch record), sorted: their answers are not believed until
	// one is not above the engine's epoch (docs/protocol.md §9).
	Misbehaving []string
	// LastRebalanceDuration is from the last change of desired permits until every reachable pod
	// acknowledged it; zero while one is still under way.
	LastRebalanceDuration time.Duration
	// Converged is true when every listed pod with an endpoint acknowledged its desired permits
	// (0 for terminating pods).
	Converged bool
	// Recovering is true while a new manager's recovery window is open (docs/protocol.md §8):
	// it raises nobody above what it surely holds until it has waited out the previous manager's
	// leases, or until its ledger knows every holding that manager may have left (closing early).
	Recovering bool
}

// Holding is one pod's line in the ledger.
type Holding struct {
	Pod    string
	Target string
	// Granted is the permits decided for the pod, pushed or being pushed.
	Granted int32
	// Counted is what the ledger counts for the pod (docs/protocol.md §4): at least Granted,
	// every push it may hold until its lease and a request timeout passed, its fallback after
	// that, the calls it reported in flight, and bounds for what it may hold unseen.
	Counted int32
	// InFlight is what the agent last reported in flight.
	InFlight int32
	// Waiting, RefusedNoPermit (since the agent started) and Lanes are what the agent last
	// reported queued for a permit, refused for lack of one, and per lane: the demand that
	// demand-aware sharing reads, and the lanes' status. Never counted in the ledger.
	Waiting         int32
	RefusedNoPermit int64
	Lanes           []assignment.LaneState
	// SecondsEnd and Seconds are the per-second call counts the agent last reported
	// (assignment.DownstreamState's): for the quota's busiest second; never counted.
	SecondsEnd int64
	Seconds    []int32
	// Synced is true when the agent acknowledged holding the pod's desired permits (0 for a
	// terminating pod) and that is also what is granted.
	Synced bool
	// Gone is true for a pod no longer listed in the quota that is still counted.
	Gone bool
}

// Event is something about one quota that a person should see (the manager records it as a
// Kubernetes Event on the DownstreamQuota): an inconsistency the engine handled by itself.
type Event struct {
	Quota types.NamespacedName
	// UID is the DownstreamQuota's UID as last set ("" if never given).
	UID types.UID
	// Warning is true for a Warning Event, false for a Normal one.
	Warning bool
	Reason  string // CamelCase, e.g. ReasonAgentRelearned
	Message string
}

// Event reasons.
const (
	// ReasonAgentRelearned: an agent held a generation of this manager's epoch that the engine
	// had forgotten (its pod left every quota, e.g. the quota was deleted, and came back). The
	// engine counted what it held and pushed it again; nothing stopped.
	ReasonAgentRelearned = "AgentRelearned"
	// ReasonAgentClaimsNewerEpoch: a pod's agent answered with an epoch above any a manager
	// holds (the manager's epoch record): a false answer, from a hostile or broken pod. The
	// engine treats the pod as unreachable and goes on for everyone else; nothing stopped.
	ReasonAgentClaimsNewerEpoch = "AgentClaimsNewerEpoch"
)
