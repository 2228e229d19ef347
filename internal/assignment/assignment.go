// Package assignment holds the messages the manager and the agents exchange on the agent's
// control port: the desired configuration the manager pushes to one pod (Assignment) and the
// state the agent answers with (State). The wire format is JSON; durations are Go duration
// strings ("200ms") and times are RFC 3339.
//
// Fencing: an agent accepts an Assignment only if (Epoch, Generation) is not lower than the pair
// it holds, comparing Epoch first. Epoch identifies a manager incarnation and only grows across
// manager restarts and leader changes; Generation grows with every change the manager makes for
// that pod within one epoch. A push with the same pair as the one held is a lease renewal.
// A stale pair is refused with 409 Conflict and the agent's current State (in the "state" member
// of the application/problem+json answer, see Problem).
//
// Besides the types, the package holds what both ends of the control API share: strict decoding
// and validation (Decode, Validate), request signing (Sign, Verify, LoadTrustDir) and the
// manager's client (Client).
package assignment

import (
	"slices"
	"time"
)

// Assignment is the whole desired configuration of one agent. It replaces the previous one
// entirely: a downstream or switch that is absent is removed.
type Assignment struct {
	// Epoch is the manager incarnation that wrote this assignment (fencing token).
	Epoch int64 `json:"epoch"`
	// Generation orders this pod's assignments within one epoch.
	Generation int64 `json:"generation"`
	// Instance, when set, is the agent process (State.Instance) the manager believes it is
	// talking to; the signature names the same instance (Target.Instance). An agent with another
	// instance id refuses the push (403 wrong-instance with its State, which Client reports as a
	// StaleError; 409 without authentication): it restarted, and the manager must learn that —
	// the old process's calls may still be running at the downstream — before it grants the new
	// process anything.
	Instance string `json:"instance,omitempty"`
	// LeaseTTL is how long the assignment holds from the moment the agent accepts it (or from its
	// signed time, when that is earlier: see package enforce). When it passes without renewal every
	// downstream drops to its LapsedLimit: min(Permits, SafeDefaultPermits), or 0 with FailClosed.
	LeaseTTL Duration `json:"leaseTTL"`
	// Downstreams the pod may call, by name.
	Downstreams []Downstream `json:"downstreams"`
	// Switches are the degrade switches in force for this pod.
	Switches []Switch `json:"switches,omitempty"`
}

// Downstream is one downstream's enforcement in this pod.
type Downstream struct {
	// Name addresses the downstream: the app calls http://127.0.0.1:PORT/<Name>/<path>.
	// It is the DownstreamQuota's name; [a-z0-9]([-a-z0-9]*[a-z0-9])?, at most 63 characters.
	Name string `json:"name"`
	// Upstream is the absolute http(s) URL calls are forwarded to; the request path is appended
	// to its path.
	Upstream string `json:"upstream"`
	// Permits is the pod's in-flight limit for this downstream (>= 0).
	Permits int32 `json:"permits"`
	// SafeDefaultPermits is what the pod falls back to when the lease expires (>= 0). The agent
	// uses min(Permits, SafeDefaultPermits), so a pod never holds more than it was granted.
	SafeDefaultPermits int32 `json:"safeDefaultPermits"`
	// FailClosed makes the agent answer every call with the fallback when the lease expired,
	// instead of using SafeDefaultPermits.
	FailClosed bool `json:"failClosed,omitempty"`
	// AcquireTimeout bounds the wait for a permit (and for a rate token); 1ms..5s.
	AcquireTimeout Duration `json:"acquireTimeout"`
	// RequestTimeout bounds one call to the upstream; 10ms..10m.
	RequestTimeout Duration `json:"requestTimeout"`
	// Rate is the pod's share of the rate contract; nil means no rate limit.
	Rate *Rate `json:"rate,omitempty"`
	// Breaker configures the circuit breaker; nil means none.
	Breaker *Breaker `json:"breaker,omitempty"`
	// Fallback is the answer when no permit, no token or an open breaker stops a call.
	Fallback Fallback `json:"fallback"`
	// Recovery narrows the effective limit inside Permits after an incident (a ramp) and,
	// optionally, when the downstream's latency rises (adaptive concurrency); nil: neither,
	// permits apply in one step.
	Recovery *Recovery `json:"recovery,omitempty"`
	// MaxWaiting bounds the calls waiting for a permit; a call beyond it is refused at once
	// (reason queue-full). nil: 10 per permit, at least 10 (the agent's enforce.DefaultMaxWaiting).
	MaxWaiting *int32 `json:"maxWaiting,omitempty"`
	// DeadlineHeader, when set, names the header in which the upstream is told what is left of
	// the call's time (grpc-timeout's form for grpc-timeout, a Go duration otherwise).
	DeadlineHeader string `json:"deadlineHeader,omitempty"`
	// AbandonedHold is how long a call that timed out keeps its permit after its upstream
	// connection was closed, because the downstream may still be working on it. nil: the
	// RequestTimeout; 0: no hold.
	AbandonedHold *Duration `json:"abandonedHold,omitempty"`
	// Lanes are the downstream's priority lanes (lanes.go); none: one FIFO for every call.
	Lanes []Lane `json:"lanes,omitempty"`
	// TLS is how the agent verifies an https upstream and authenticates to it (tls.go); nil:
	// the system roots, the URL's host as the server name, TLS 1.2 at least. Only with an https
	// Upstream.
	TLS *UpstreamTLS `json:"tls,omitempty"`
	// Observe makes the agent forward every call at once and only count, by reason, what it
	// would have refused (DownstreamState.WouldRefuse). The calls it forwards hold the permits
	// as any call does, beyond them if need be, so they count against the permits until they
	// end (docs/protocol.md §11b). Sent only to agents with CapabilityObserve (an older agent's
	// strict decoding refuses the member).
	Observe bool `json:"observe,omitempty"`
	// RampRaise says that a raise of Permits in this assignment follows an incident the manager
	// saw (the quota's budget was lowered within the last few minutes, docs/agent.md): the agent
	// then climbs from the permits it held before through its recovery ramp (Recovery.Ramp)
	// instead of applying the raise at once. It changes nothing else: not a lowering, not a
	// downstream new to the agent (a new pod's first permits), not a renewal. Sent only to agents
	// with CapabilityRampRaise (an older agent's strict decoding refuses the member).
	RampRaise bool `json:"rampRaise,omitempty"`
}

// CapabilityRampRaise is the State capability of an agent that knows Downstream.RampRaise.
const CapabilityRampRaise = "ramp-raise"

// CapabilityObserve is the State capability of an agent that knows Downstream.Observe,
// Switch.DryRun, and reports DownstreamState.WouldRefuse and the per-second counts.
const CapabilityObserve = "observe"

// Ramp shapes as they travel.
const (
	ShapeLinear      = "Linear"
	ShapeExponential = "Exponential"
)

// Recovery configures the agent's gradual recovery and adaptive concurrency (package
// internal/agent/recovery has the model).
type Recovery struct {
	// Window is the length of the windows calls are judged in.
	Window Duration `json:"window"`
	// Ramp, when set, ramps the effective limit up after the breaker closes, after the adaptive
	// limit dropped, and on a raise flagged RampRaise (not for first permits nor a renewal).
	Ramp *Ramp `json:"ramp,omitempty"`
	// Adaptive, when set, shrinks the effective limit toward what the downstream takes when
	// its latency rises.
	Adaptive *Adaptive `json:"adaptive,omitempty"`
}

// Ramp is the recovery ramp.
type Ramp struct {
	// Shape is "Linear" or "Exponential".
	Shape string `json:"shape"`
	// InitialPercent of the permits is where a ramp starts (1..100).
	InitialPercent int32 `json:"initialPercent"`
	// StepPercent of the permits is one Linear step (1..100).
	StepPercent int32 `json:"stepPercent"`
	// HealthyWindows in a row widen the limit by one step (1..100).
	HealthyWindows int32 `json:"healthyWindows"`
	// LatencyTarget, when set, is a mean latency a healthy window stays below.
	LatencyTarget Duration `json:"latencyTarget,omitempty"`
}

// Adaptive is adaptive concurrency.
type Adaptive struct {
	// TolerancePercent of the baseline latency is where the limit starts shrinking (101..1000).
	TolerancePercent int32 `json:"tolerancePercent"`
	// BaselineWindows is the baseline's averaging length, in windows (2..10000).
	BaselineWindows int32 `json:"baselineWindows"`
	// MinLimit is the least the adaptive limit shrinks to (1..MaxPermits).
	MinLimit int32 `json:"minLimit"`
}

// LapsedLimit is the in-flight limit a downstream falls back to once its lease lapsed without
// renewal: min(permits, safeDefault), or 0 when failClosed (every call then gets the
// fallback). It is never above permits, so a pod whose lease lapses never holds more than it
// was granted, and never below 0. The agent enforces it (package enforce) and the manager's
// ledger counts it (package push): both call this one function, so they cannot disagree.
func LapsedLimit[T ~int | ~int32 | ~int64](permits, safeDefault T, failClosed bool) T {
	if failClosed {
		return 0
	}
	return max(min(permits, safeDefault), 0)
}

// LapsedLimit is d's limit once its lease lapsed: LapsedLimit(d.Permits, d.SafeDefaultPermits,
// d.FailClosed).
func (d *Downstream) LapsedLimit() int32 {
	return LapsedLimit(d.Permits, d.SafeDefaultPermits, d.FailClosed)
}

// Rate is a per-pod rate limit.
type Rate struct {
	// PerSecond is the steady rate (> 0).
	PerSecond float64 `json:"perSecond"`
	// Burst is the bucket size for TokenBucket (>= 0); Pacing ignores it. 0 is the pod's share
	// when the pods outnumber the contract's burst: the agent keeps a bucket of one token, so
	// the pod is paced (one call per 1/PerSecond, never two at once), not refused.
	Burst int32 `json:"burst"`
	// Mode is "TokenBucket" or "Pacing".
	Mode string `json:"mode"`
}

// Breaker configures a circuit breaker.
type Breaker struct {
	Window              Duration `json:"window"`
	FailureRatePercent  int32    `json:"failureRatePercent"`
	SlowCallThreshold   Duration `json:"slowCallThreshold"`
	SlowCallRatePercent int32    `json:"slowCallRatePercent"`
	MinimumCalls        int32    `json:"minimumCalls"`
	OpenDuration        Duration `json:"openDuration"`
	HalfOpenProbes      int32    `json:"halfOpenProbes"`
}

// Fallback is a fallback action and its parameters.
type Fallback struct {
	// Action is "Reject", "Static" or "ServeStale".
	Action string `json:"action"`
	// Static is the canned answer of the Static action.
	Static *StaticResponse `json:"static,omitempty"`
	// MaxStaleness bounds the age of a response ServeStale may serve.
	MaxStaleness Duration `json:"maxStaleness,omitempty"`
	// AllowedMethods may be answered with success by Static and ServeStale; empty means GET,
	// HEAD and OPTIONS.
	AllowedMethods []string `json:"allowedMethods,omitempty"`
}

// StaticResponse is a canned answer.
type StaticResponse struct {
	Status  int32             `json:"status"`
	Headers map[string]string `json:"headers,omitempty"`
	Body    string            `json:"body,omitempty"`
}

// Switch is a degrade switch: calls to Downstream that match the scope are answered with Action
// until ExpiresAt, when the agent turns the switch off by itself.
type Switch struct {
	// Name identifies the switch, "<namespace>/<DegradeRule name>".
	Name string `json:"name"`
	// Downstream is the Downstream.Name it degrades.
	Downstream string `json:"downstream"`
	// ExpiresAt is when the switch turns itself off.
	ExpiresAt time.Time `json:"expiresAt"`
	// Percent of traffic (1..100), picked per value of KeyHeader when below 100.
	Percent int32 `json:"percent"`
	// KeyHeader names the header whose value picks the share.
	KeyHeader string `json:"keyHeader,omitempty"`
	// Headers must all match exactly.
	Headers []HeaderMatch `json:"headers,omitempty"`
	// Methods limits the switch to these methods; empty means all.
	Methods []string `json:"methods,omitempty"`
	// Action is the answer given instead of calling the downstream.
	Action Fallback `json:"action"`
	// DryRun makes the switch observe only: the calls it matches pass on as if it were off, and
	// are counted as would-refuse "degraded". Sent only to agents with CapabilityObserve.
	DryRun bool `json:"dryRun,omitempty"`
}

// HeaderMatch matches a header by exact value.
type HeaderMatch struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

// State is an agent's answer to every control call: what it holds and uses now.
type State struct {
	// Instance identifies the agent process (random at start): a different value means the agent
	// restarted, and calls of the old process may still be running at the downstream.
	Instance string `json:"instance,omitempty"`
	// Uptime is how long the agent process had run when it answered. A manager that meets the
	// process for the first time learns from it whether a predecessor in the same pod may have
	// stopped less than a request timeout ago, with calls still running at the downstream.
	Uptime Duration `json:"uptime,omitempty"`
	// Epoch and Generation of the assignment held (0, 0 before the first).
	Epoch      int64 `json:"epoch"`
	Generation int64 `json:"generation"`
	// Configured is true once an assignment (or the bootstrap configuration) was applied.
	Configured bool `json:"configured"`
	// LeaseExpiresAt is when the held lease passes without renewal; zero when none.
	LeaseExpiresAt time.Time `json:"leaseExpiresAt,omitzero"`
	// LeaseExpired is true when the agent runs on safe defaults because the lease passed.
	LeaseExpired bool `json:"leaseExpired"`
	// Downstreams, sorted by name.
	Downstreams []DownstreamState `json:"downstreams"`
	// Switches held, sorted by name, with whether each is in force now.
	Switches []SwitchState `json:"switches,omitempty"`
	// Capabilities the agent's control API has beyond the first release's, so that a newer
	// manager uses them only with agents that have them (CapabilityBatchSignatures).
	Capabilities []string `json:"capabilities,omitempty"`
}

// Has reports whether the agent advertised capability c.
func (s *State) Has(c string) bool { return slices.Contains(s.Capabilities, c) }

// DownstreamState is one downstream's enforcement state in the agent.
type DownstreamState struct {
	Name string `json:"name"`
	// Permits is the assigned in-flight limit; EffectivePermits is the limit in force now
	// (lower after the lease expired).
	Permits          int32 `json:"permits"`
	EffectivePermits int32 `json:"effectivePermits"`
	// Limit is the in-flight limit in force now: EffectivePermits, narrowed while the recovery
	// ramp or the adaptive limit holds it lower. The agent widens it back up to
	// EffectivePermits on its own, so what the manager counts is EffectivePermits, never Limit.
	Limit int32 `json:"limit"`
	// InFlight is the number of calls holding a permit now; Waiting is queued for one.
	InFlight int32 `json:"inFlight"`
	Waiting  int32 `json:"waiting"`
	// Breaker is "closed", "open", "half-open" or "" when there is none.
	Breaker string `json:"breaker,omitempty"`
	// Counters since the agent started.
	Requests    int64            `json:"requests"`
	Upstream429 int64            `json:"upstream429"`
	Rejected    map[string]int64 `json:"rejected,omitempty"`
	// Lanes, when the downstream has lanes: the declared ones in order, then "default" (lanes.go).
	Lanes []LaneState `json:"lanes,omitempty"`
	// Observe is true when the downstream is under Observe (Downstream.Observe) in the
	// assignment the agent holds: every call is forwarded, and InFlight may exceed Permits.
	Observe bool `json:"observe,omitempty"`
	// WouldRefuse counts, since the agent started and by reason (Rejected's), the calls forwarded
	// under Observe or past a dry-run switch that enforcing would have refused.
	WouldRefuse map[string]int64 `json:"wouldRefuse,omitempty"`
	// SecondsEnd and Seconds are the calls addressed to the downstream in each of the last
	// whole seconds (Unix seconds, aligned to the wall clock's), oldest first: Seconds[i] counts
	// the second that starts at SecondsEnd − len(Seconds) + i, and SecondsEnd is the start of
	// the current, incomplete second, which is not reported. At most MaxSecondCounts.
	SecondsEnd int64   `json:"secondsEnd,omitempty"`
	Seconds    []int32 `json:"seconds,omitempty"`
}

// SwitchState is one switch as the agent holds it.
type SwitchState struct {
	Name      string    `json:"name"`
	Active    bool      `json:"active"`
	ExpiresAt time.Time `json:"expiresAt"`
}
