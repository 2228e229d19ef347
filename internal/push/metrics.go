package push

import (
	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"

	"github.com/apportion/apportion/internal/promreg"
)

// Results of a control request, the result label of apportion_manager_pushes_total.
const (
	resultOK          = "ok"          // the agent answered with its State
	resultStale       = "stale"       // 409: the agent holds a newer (epoch, generation)
	resultRefused     = "refused"     // another 4xx: not accepted (authentication, validation)
	resultError       = "error"       // 5xx or a transport error: may have been accepted
	resultTimeout     = "timeout"     // no answer within PushTimeout: may have been accepted
	resultUnavailable = "unavailable" // the request could not be made (engine stopping)
)

type metrics struct {
	pushes      *prometheus.CounterVec
	states      *prometheus.CounterVec
	duration    prometheus.Histogram
	ledger      *prometheus.GaugeVec
	limit       *prometheus.GaugeVec
	unreachable *prometheus.GaugeVec
	// quietRenewals counts renewals whose answer changed nothing the ledger uses (no replan).
	quietRenewals prometheus.Counter
	// renewalDelay is how long after it was due each renewal started (the fair queue's wait).
	renewalDelay prometheus.Histogram
	// epochClaims counts answers claiming an epoch above the engine's; epochRefuted the claims
	// the epoch record refuted; recordReads the reads of the record, by result.
	epochClaims  prometheus.Counter
	epochRefuted prometheus.Counter
	recordReads  *prometheus.CounterVec
}

// Results of a read of the epoch record, the result label of
// apportion_manager_epoch_record_reads_total.
const (
	recordNewer    = "newer"     // above the engine's epoch: fenced
	recordNotNewer = "not-newer" // the claims read for were false
	recordError    = "error"     // nothing decided
)

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		pushes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "apportion_manager_pushes_total",
			Help: "Assignments pushed to agents (PUT /v1/assignment), by result: ok, stale, refused, error, timeout.",
		}, []string{"result"}),
		states: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "apportion_manager_state_requests_total",
			Help: "State requests to agents (GET /v1/state: probes of new pods, polls of draining ones), by result.",
		}, []string{"result"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "apportion_manager_push_duration_seconds",
			Help:    "Duration of assignment pushes to agents, answered or not.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}),
		ledger: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "apportion_manager_ledger_permits",
			Help: "Permits the ledger counts for a quota (namespace/name): what its live or recently deleted pods may be using.",
		}, []string{"quota"}),
		limit: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "apportion_manager_limit",
			Help: "A quota's global in-flight limit (maxInFlight).",
		}, []string{"quota"}),
		unreachable: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "apportion_manager_unreachable_pods",
			Help: "Pods of a quota whose agent failed its last requests.",
		}, []string{"quota"}),
		quietRenewals: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "apportion_manager_quiet_renewals_total",
			Help: "Lease renewals whose answer changed nothing the ledger uses, so that no quota was replanned for them (docs/protocol.md §4).",
		}),
		renewalDelay: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "apportion_manager_renewal_delay_seconds",
			Help:    "How long after it was due each lease renewal started: its wait for a push worker (docs/protocol.md §6).",
			Buckets: []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}),
		epochClaims: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "apportion_manager_epoch_claims_total",
			Help: "Agent answers claiming an epoch above the manager's, each checked against the epoch record before anything is believed (docs/protocol.md §9).",
		}),
		epochRefuted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "apportion_manager_epoch_claims_refuted_total",
			Help: "Claims of a newer epoch that the epoch record refuted: a misbehaving pod, treated as unreachable.",
		}),
		recordReads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "apportion_manager_epoch_record_reads_total",
			Help: "Reads of the epoch record to check agents' claims of a newer epoch, by result: newer (fenced), not-newer, error.",
		}, []string{"result"}),
	}
	if reg == nil {
		return m, nil
	}
	var err error
	if m.pushes, err = promreg.Register(reg, m.pushes); err != nil {
		return nil, err
	}
	if m.states, err = promreg.Register(reg, m.states); err != nil {
		return nil, err
	}
	if m.duration, err = promreg.Register(reg, m.duration); err != nil {
		return nil, err
	}
	if m.ledger, err = promreg.Register(reg, m.ledger); err != nil {
		return nil, err
	}
	if m.limit, err = promreg.Register(reg, m.limit); err != nil {
		return nil, err
	}
	if m.unreachable, err = promreg.Register(reg, m.unreachable); err != nil {
		return nil, err
	}
	if m.quietRenewals, err = promreg.Register(reg, m.quietRenewals); err != nil {
		return nil, err
	}
	if m.renewalDelay, err = promreg.Register(reg, m.renewalDelay); err != nil {
		return nil, err
	}
	if m.epochClaims, err = promreg.Register(reg, m.epochClaims); err != nil {
		return nil, err
	}
	if m.epochRefuted, err = promreg.Register(reg, m.epochRefuted); err != nil {
		return nil, err
	}
	if m.recordReads, err = promreg.Register(reg, m.recordReads); err != nil {
		return nil, err
	}
	return m, nil
}

// signCounter is a client that counts its signatures (keys.SigningClient).
type signCounter interface {
	SignStats() (requests, signatures int64)
}

// registerSignStats exports a signing client's counts: how many requests each signature covers
// on average is what batch signing saves (docs/protocol.md §10).
func registerSignStats(reg prometheus.Registerer, s signCounter) error {
	for _, c := range []prometheus.Collector{
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "apportion_manager_signed_requests_total",
			Help: "Control requests signed.",
		}, func() float64 { r, _ := s.SignStats(); return float64(r) }),
		prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "apportion_manager_signatures_total",
			Help: "Ed25519 signatures made for control requests: fewer than the requests signed when requests ready together are signed in one batch.",
		}, func() float64 { _, n := s.SignStats(); return float64(n) }),
	} {
		if _, err := promreg.Register(reg, c); err != nil {
			return err
		}
	}
	return nil
}

func (m *metrics) request(kind workKind, result string, seconds float64) {
	if kind == kindPush {
		m.pushes.WithLabelValues(result).Inc()
		m.duration.Observe(seconds)
		return
	}
	m.states.WithLabelValues(result).Inc()
}

func (m *metrics) observe(key types.NamespacedName, ledger, limit int64, unreachable int) {
	q := key.String()
	m.ledger.WithLabelValues(q).Set(float64(ledger))
	m.limit.WithLabelValues(q).Set(float64(limit))
	m.unreachable.WithLabelValues(q).Set(float64(unreachable))
}

func (m *metrics) forget(key types.NamespacedName) {
	q := key.String()
	m.ledger.DeleteLabelValues(q)
	m.limit.DeleteLabelValues(q)
	m.unreachable.DeleteLabelValues(q)
}
