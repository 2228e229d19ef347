package push

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"

	"github.com/apportion/apportion/internal/assignment"
)

// Defaults of Options. See docs/protocol.md for how they bound the protocol's timings.
const (
	DefaultLeaseTTL         = 10 * time.Second
	DefaultRenewEvery       = 3 * time.Second
	DefaultPushTimeout      = time.Second
	DefaultAcceptGrace      = time.Second
	DefaultWorkers          = 32
	DefaultRetryBase        = 100 * time.Millisecond
	DefaultRetryMax         = 5 * time.Second
	DefaultDrainPoll        = 250 * time.Millisecond
	DefaultUnreachableAfter = 2
	DefaultEpochCheckEvery  = time.Second
)

// AgentClient is the manager's side of the agents' control API. *assignment.Client and
// *keys.SigningClient implement it.
//
// Push PUTs an Assignment and returns the agent's State on success, an error wrapping
// *assignment.StaleError (with the agent's State) when the agent holds a newer
// (Epoch, Generation), an *assignment.StatusError for any other answer, or the transport error.
// State GETs the agent's State with the same errors.
//
// Every request is addressed to one pod (assignment.Endpoint: its control URL and
// "namespace/name"), which a signing client binds its signature to, with the epoch (State) or
// the Assignment's epoch and instance (Push).
type AgentClient interface {
	Push(ctx context.Context, to assignment.Endpoint, a *assignment.Assignment) (*assignment.State, error)
	State(ctx context.Context, to assignment.Endpoint, epoch int64) (*assignment.State, error)
}

// EncodedPusher is an AgentClient that can send an assignment already validated and encoded
// (body is json.Marshal(a)); *assignment.Client and *keys.SigningClient implement it. The engine then
// validates and encodes each version once per agent process, and a renewal re-sends the same
// bytes, signed anew.
type EncodedPusher interface {
	PushEncoded(ctx context.Context, to assignment.Endpoint, a *assignment.Assignment, body []byte) (*assignment.State, error)
}

// BatchSigner is an EncodedPusher that can sign several pushes with one signature and then send
// each (*keys.SigningClient). The engine signs the renewals that are ready at the same moment
// together (docs/protocol.md §10, "Batch signatures"), each to an agent that advertised
// assignment.CapabilityBatchSignatures.
type BatchSigner interface {
	SignTogether(outs []*assignment.Outgoing)
	Send(ctx context.Context, o *assignment.Outgoing) (*assignment.State, error)
}

// EpochSource hands out the manager's fencing epoch. Every call must return a value greater
// than any value it (or any other manager of the cluster) returned before. ConfigMapEpoch is
// the implementation the manager uses.
type EpochSource interface {
	NextEpoch(ctx context.Context) (int64, error)
}

// EpochRecord reads the fencing epoch counter as it stands: the highest epoch any manager has
// taken. It is what decides fencing (docs/protocol.md §9): a newer manager writes it before any
// agent can hold its epoch, and no pod can write it. CurrentEpoch must read from the source of
// truth — for ConfigMapEpoch the API server, not a cache — so that a read made after an agent
// answered sees every epoch taken before that answer; an error decides nothing.
// ConfigMapEpoch implements it.
type EpochRecord interface {
	CurrentEpoch(ctx context.Context) (int64, error)
}

// EpochFunc adapts a function to EpochSource.
type EpochFunc func(ctx context.Context) (int64, error)

// NextEpoch calls f.
func (f EpochFunc) NextEpoch(ctx context.Context) (int64, error) { return f(ctx) }

// Options configure an Engine. Client and Epoch are required; zero durations and counts take
// the defaults above.
type Options struct {
	// Client talks to the agents.
	Client AgentClient
	// Epoch gives the fencing epoch once, when Start runs.
	Epoch EpochSource
	// Record is read when an agent answers with an epoch above the engine's: the engine is
	// fenced only if the record is above its epoch; otherwise the pod misbehaves and is treated
	// as unreachable. Nil means Epoch, if it implements EpochRecord; else no claim can be
	// checked, and the pods that make one get nothing while the engine goes on (never fenced).
	Record EpochRecord
	// EpochCheckEvery is the least time between two reads of Record, however many pods claim a
	// newer epoch (their claims wait and are decided together); reads that fail are retried
	// with doubling intervals up to RetryMax × 6.
	EpochCheckEvery time.Duration
	// Clock drives leases, renewals, retries and the ledger's timers; nil means the real clock.
	// Per-request timeouts (PushTimeout) always run on real time.
	Clock clock.Clock
	// LeaseTTL is how long an accepted assignment holds without renewal (Assignment.LeaseTTL).
	LeaseTTL time.Duration
	// RenewEvery is how often every pod's assignment is re-sent (a renewal), less a random
	// quarter at most so that renewals spread out; it must leave room for a retry before the
	// lease passes: RenewEvery + PushTimeout < LeaseTTL.
	RenewEvery time.Duration
	// PushTimeout bounds one control request.
	PushTimeout time.Duration
	// AcceptGrace is how long after its PushTimeout a request whose answer was lost may still be
	// accepted by an agent (a handler already running when the client gave up). The ledger
	// assumes an unanswered push may start a lease until sentAt + PushTimeout + AcceptGrace.
	AcceptGrace time.Duration
	// Workers bounds the requests in flight at once. One namespace may hold half of them, its
	// requests to agents that have not answered their last request a quarter, and every
	// namespace's such requests together half (the fair ready queue, docs/protocol.md §6).
	Workers int
	// RetryBase and RetryMax bound the exponential backoff (with jitter) after a failed request.
	RetryBase, RetryMax time.Duration
	// DrainPoll is how often a pod whose agent reported more calls in flight than its permits is
	// polled (GET /v1/state) until it drains.
	DrainPoll time.Duration
	// UnreachableAfter is the number of consecutive failed requests after which a pod counts as
	// unreachable: it is reported, and its next pushes carry only its fallback permits
	// (min(granted, safe default), 0 if fail-closed) so that its lease can lapse.
	UnreachableAfter int
	// Logger logs failures and state changes; the zero Logger discards.
	Logger logr.Logger
	// OnChange is called with a quota's key when what Report returns for it changed (acks,
	// failures, convergence, end of recovery). It runs on one goroutine of its own, with keys
	// coalesced while it is busy, so it may block (e.g. sending to the controllers' channels for
	// source.Channel); Start does not wait for it to return.
	OnChange func(types.NamespacedName)
	// OnEvent is called for each Event the engine raises about a quota (an inconsistency it
	// handled by itself, e.g. an agent holding a generation the engine had forgotten), on the
	// same goroutine as OnChange, in order. The manager turns them into Kubernetes Events.
	OnEvent func(Event)
	// Registry receives the engine's metrics; nil registers none.
	Registry prometheus.Registerer

	// jitter scales a backoff delay (tests make it deterministic); nil means a random factor in
	// [0.5, 1).
	jitter func(time.Duration) time.Duration
}

// landWindow is how long after it was sent a push may still be accepted by an agent: the client
// gives up after PushTimeout, and a handler already running then may accept it for AcceptGrace
// more (docs/protocol.md).
func (o *Options) landWindow() time.Duration { return o.PushTimeout + o.AcceptGrace }

// leaseWindow is how long after it was sent a push may hold its agent under lease: it may land
// until landWindow has passed, and the lease it starts then holds for LeaseTTL.
func (o *Options) leaseWindow() time.Duration { return o.landWindow() + o.LeaseTTL }

func (o *Options) setDefaults() error {
	if o.Client == nil {
		return errors.New("push: Options.Client is required")
	}
	if o.Epoch == nil {
		return errors.New("push: Options.Epoch is required")
	}
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&o.LeaseTTL, DefaultLeaseTTL)
	def(&o.RenewEvery, DefaultRenewEvery)
	def(&o.PushTimeout, DefaultPushTimeout)
	def(&o.AcceptGrace, DefaultAcceptGrace)
	def(&o.RetryBase, DefaultRetryBase)
	def(&o.RetryMax, DefaultRetryMax)
	def(&o.DrainPoll, DefaultDrainPoll)
	def(&o.EpochCheckEvery, DefaultEpochCheckEvery)
	if o.Record == nil {
		if r, ok := o.Epoch.(EpochRecord); ok {
			o.Record = r
		} else {
			o.Record = noRecord{}
		}
	}
	if o.Workers <= 0 {
		o.Workers = DefaultWorkers
	}
	if o.UnreachableAfter <= 0 {
		o.UnreachableAfter = DefaultUnreachableAfter
	}
	if o.LeaseTTL < assignment.MinLeaseTTL || o.LeaseTTL > assignment.MaxLeaseTTL {
		return fmt.Errorf("push: LeaseTTL %s must be between %s and %s", o.LeaseTTL, assignment.MinLeaseTTL, assignment.MaxLeaseTTL)
	}
	if o.RenewEvery+o.PushTimeout >= o.LeaseTTL {
		return fmt.Errorf("push: RenewEvery (%s) + PushTimeout (%s) must be shorter than LeaseTTL (%s)", o.RenewEvery, o.PushTimeout, o.LeaseTTL)
	}
	if o.RetryMax < o.RetryBase {
		o.RetryMax = o.RetryBase
	}
	if o.Logger.GetSink() == nil {
		o.Logger = logr.Discard()
	}
	return nil
}

// noRecord is the EpochRecord of an engine given none: every read fails, so no claim of a newer
// epoch is ever believed.
type noRecord struct{}

func (noRecord) CurrentEpoch(context.Context) (int64, error) {
	return 0, errors.New("no epoch record to check a claim of a newer epoch against (Options.Record)")
}
