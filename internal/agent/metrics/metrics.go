// Package metrics holds the agent's Prometheus metrics, in a registry the agent owns (never the
// global default one).
//
// Model: counters and histograms are updated on the request path through per-downstream
// children that are looked up once, when a downstream is configured (Metrics.Downstream), so a
// request costs a few atomic adds and no label hashing. Gauges that mirror state (in flight,
// waiting, effective permits, breaker state, switch activity, lease, generation, peak rate) are
// not updated on the request path at all: a collector reads them from a Source when Prometheus
// scrapes.
//
// Every series has the prefix apportion_agent_ and, except the agent-wide ones, the label
// downstream:
//
//	inflight, waiting, permits                   gauges (permits: the effective limit)
//	requests_total                               every call addressed to a known downstream
//	rejected_total{reason}                       calls not forwarded: no-permit, rate-limited,
//	                                             circuit-open, degraded, queue-full,
//	                                             deadline-exceeded
//	would_refuse_total{reason}                   calls forwarded under Observe (or past a dry-run
//	                                             degrade switch) that enforcing would have refused,
//	                                             by the same reasons
//	utilization                                  gauge, inflight ÷ permits (0 when no permits)
//	fallback_total{action}                       answers given instead of the downstream's:
//	                                             reject, static, serve-stale
//	upstream_responses_total{class}              1xx..5xx, or "error" (no response: timeout,
//	                                             connection error)
//	upstream_tls_failures_total{reason}          calls whose TLS to the downstream failed:
//	                                             unknown-ca, wrong-name, expired,
//	                                             bad-certificate, client-cert-refused,
//	                                             handshake-failed, handshake-timeout, config
//	upstream_429_total                           upstream 429s passed through
//	abandoned_calls_total                        calls abandoned at their deadline whose permit
//	                                             was held for abandonedHold
//	upstream_duration_seconds                    histogram, to the response header (or error)
//	acquire_wait_seconds                         histogram, rate wait + permit wait of forwarded calls
//	h2_streams_open                              gauge, HTTP/2 streams forwarded now (each holds a
//	                                             permit until it ends)
//	h2_stream_duration_seconds                   histogram, how long a forwarded HTTP/2 stream held
//	                                             its permit (to the end of its body and trailers)
//	breaker_state                                gauge 0 closed, 1 open, 2 half-open
//	breaker_transitions_total{from,to}
//	degrade_switch_active{switch}                gauge 0/1
//	peak_rps_last_minute                         gauge, highest 1-second count of the last 60 s
//	lease_expired, config_generation             agent-wide gauges (no label)
//	rejected_pushes_total{reason}                agent-wide: control requests refused by
//	                                             authentication (assignment.Reason*: unknown-key,
//	                                             bad-signature, stale-timestamp, wrong-pod, ...)
//
// Nothing here is secret: label values are downstream names, switch names (namespace/rule) and
// fixed reason strings; no key id, URL, header or body is exported.
//
// Forget removes a downstream's series when it leaves the configuration; calls still in flight
// for it update orphaned children, which is harmless.
package metrics

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

const namespace = "apportion_agent"

// Reasons a call is not forwarded, as label values; the index is what Downstream.Rejected takes.
var Reasons = [NumReasons]string{"no-permit", "rate-limited", "circuit-open", "degraded", "queue-full", "deadline-exceeded"}

// Actions of a fallback answer, as label values; the index is what Downstream.Fallback takes.
var Actions = []string{"reject", "static", "serve-stale"}

// TLSReasons are the reasons of upstream_tls_failures_total, in the order of
// upstreamtls.Reason from UnknownCA on (the index is the Reason minus one).
var TLSReasons = [...]string{"unknown-ca", "wrong-name", "expired", "bad-certificate", "client-cert-refused",
	"handshake-failed", "handshake-timeout", "config"}

// Response classes; the index is what Downstream.Upstream takes (ClassError for no response).
var Classes = []string{"1xx", "2xx", "3xx", "4xx", "5xx", "error"}

// Indexes into Reasons, Actions and Classes.
const (
	ReasonNoPermit = iota
	ReasonRateLimited
	ReasonCircuitOpen
	ReasonDegraded
	ReasonQueueFull
	ReasonDeadline
	// NumReasons is len(Reasons): the size of every per-reason array.
	NumReasons
)

const (
	ActionReject = iota
	ActionStatic
	ActionServeStale
)

// ClassError is the Classes index of a call that got no response.
const ClassError = 5

// ClassOf returns the Classes index of an HTTP status.
func ClassOf(status int) int {
	if status < 100 || status > 599 {
		return ClassError
	}
	return status/100 - 1
}

// Snapshot is the state the gauges show, read at scrape time.
type Snapshot struct {
	Generation   int64
	LeaseExpired bool
	Downstreams  []DownstreamSnapshot
	Switches     []SwitchSnapshot
}

// DownstreamSnapshot is one downstream's gauges.
type DownstreamSnapshot struct {
	Name                       string
	InFlight, Waiting, Permits int
	// Breaker is 0 closed, 1 open, 2 half-open; -1 when the downstream has no breaker.
	Breaker int
	PeakRPS int64
}

// SwitchSnapshot is one degrade switch.
type SwitchSnapshot struct {
	Downstream, Name string
	Active           bool
}

// Source provides the snapshot; it is called once per scrape.
type Source interface {
	MetricsSnapshot() Snapshot
}

// Metrics is the agent's metrics.
type Metrics struct {
	Registry *prometheus.Registry

	requests, upstream429         *prometheus.CounterVec
	wouldRefuse                   *prometheus.CounterVec
	abandoned, tlsFailures        *prometheus.CounterVec
	rejected, fallback, upstream  *prometheus.CounterVec
	transitions                   *prometheus.CounterVec
	rejectedPushes                *prometheus.CounterVec
	upstreamDuration, acquireWait *prometheus.HistogramVec
	streamsOpen                   *prometheus.GaugeVec
	streamDuration                *prometheus.HistogramVec
	source                        atomic.Pointer[Source]
	inflightD, waitingD, permitsD *prometheus.Desc
	breakerD, switchD, peakD      *prometheus.Desc
	utilizationD                  *prometheus.Desc
	leaseExpiredD, generationD    *prometheus.Desc
	lane                          *laneMetrics // lanes.go
}

// New creates the metrics in a new registry, with the Go and process collectors. Gauges read
// from the Source set with SetSource.
func New() *Metrics {
	m := &Metrics{Registry: prometheus.NewRegistry()}
	cv := func(name, help string, labels ...string) *prometheus.CounterVec {
		v := prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: name, Help: help}, append([]string{"downstream"}, labels...))
		m.Registry.MustRegister(v)
		return v
	}
	m.requests = cv("requests_total", "Calls addressed to the downstream.")
	m.rejected = cv("rejected_total", "Calls not forwarded to the downstream, by reason.", "reason")
	m.wouldRefuse = cv("would_refuse_total", "Calls forwarded under Observe, or past a dry-run degrade switch, that enforcing would have refused, by reason.", "reason")
	m.fallback = cv("fallback_total", "Fallback answers given instead of the downstream's, by action.", "action")
	m.upstream = cv("upstream_responses_total", "Upstream responses by status class; error when none came.", "class")
	m.upstream429 = cv("upstream_429_total", "Upstream 429 answers, passed through unchanged and never retried.")
	m.tlsFailures = cv("upstream_tls_failures_total", "Calls whose TLS to the downstream failed, by what failed.", "reason")
	m.abandoned = cv("abandoned_calls_total", "Calls abandoned at their deadline whose permit was held for abandonedHold after the upstream connection closed.")
	m.transitions = cv("breaker_transitions_total", "Circuit breaker state transitions.", "from", "to")
	m.rejectedPushes = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "rejected_pushes_total",
		Help: "Control requests (pushes and state reads) refused by authentication, by reason."}, []string{"reason"})
	m.Registry.MustRegister(m.rejectedPushes)
	m.upstreamDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Name: "upstream_duration_seconds",
		Help:    "Time from forwarding a call to the upstream's response header, or to the error.",
		Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
	}, []string{"downstream"})
	m.acquireWait = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Name: "acquire_wait_seconds",
		Help:    "Time a forwarded call waited for a rate token and a permit.",
		Buckets: []float64{.0001, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
	}, []string{"downstream"})
	m.Registry.MustRegister(m.upstreamDuration, m.acquireWait)
	m.streamsOpen = prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: namespace, Name: "h2_streams_open",
		Help: "HTTP/2 streams (gRPC calls included) forwarded to the downstream now; each holds a permit until it ends."},
		[]string{"downstream"})
	m.streamDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: namespace, Name: "h2_stream_duration_seconds",
		Help:    "How long a forwarded HTTP/2 stream held its permit: from admission to the end of its body and trailers.",
		Buckets: []float64{.001, .005, .025, .1, .5, 1, 5, 30, 60, 300, 900, 3600},
	}, []string{"downstream"})
	m.Registry.MustRegister(m.streamsOpen, m.streamDuration)

	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(prometheus.BuildFQName(namespace, "", name), help, labels, nil)
	}
	m.inflightD = d("inflight", "Calls holding a permit.", "downstream")
	m.waitingD = d("waiting", "Calls waiting for a permit.", "downstream")
	m.permitsD = d("permits", "Effective in-flight limit (lower than assigned after the lease expired).", "downstream")
	m.breakerD = d("breaker_state", "Circuit breaker state: 0 closed, 1 open, 2 half-open.", "downstream")
	m.switchD = d("degrade_switch_active", "Whether a degrade switch is in force (1) or not (0).", "downstream", "switch")
	m.utilizationD = d("utilization", "Calls holding a permit ÷ the effective in-flight limit (0 when the limit is 0); above 1 only under Observe or while a lowered limit drains.", "downstream")
	m.peakD = d("peak_rps_last_minute", "Highest number of calls in one second within the last 60 seconds.", "downstream")
	m.leaseExpiredD = d("lease_expired", "1 when the agent runs on safe defaults because its lease passed.")
	m.generationD = d("config_generation", "Generation of the assignment in force (0 for bootstrap or none).")
	m.lane = newLaneMetrics(m)
	m.Registry.MustRegister(stateCollector{m},
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// RejectedPush counts a control request refused for reason (an assignment.Reason* constant).
func (m *Metrics) RejectedPush(reason string) { m.rejectedPushes.WithLabelValues(reason).Inc() }

// SetSource sets where the gauges are read from.
func (m *Metrics) SetSource(s Source) { m.source.Store(&s) }

// Downstream is one downstream's pre-resolved children.
type Downstream struct {
	Requests         prometheus.Counter
	Rejected         [NumReasons]prometheus.Counter // by Reason*
	WouldRefuse      [NumReasons]prometheus.Counter // by Reason*
	Fallback         [3]prometheus.Counter          // by Action*
	Upstream         [6]prometheus.Counter          // by ClassOf / ClassError
	Upstream429      prometheus.Counter
	TLSFailures      [len(TLSReasons)]prometheus.Counter // by TLSReasons
	Abandoned        prometheus.Counter
	UpstreamDuration prometheus.Observer
	AcquireWait      prometheus.Observer
	StreamsOpen      prometheus.Gauge
	StreamDuration   prometheus.Observer
	// Peak counts calls per second for peak_rps_last_minute.
	Peak Peak

	name string
	m    *Metrics
}

// Downstream resolves the children of one downstream. Call it when the downstream is
// configured, not per request.
func (m *Metrics) Downstream(name string) *Downstream {
	d := &Downstream{
		name:             name,
		m:                m,
		Requests:         m.requests.WithLabelValues(name),
		Upstream429:      m.upstream429.WithLabelValues(name),
		Abandoned:        m.abandoned.WithLabelValues(name),
		UpstreamDuration: m.upstreamDuration.WithLabelValues(name),
		AcquireWait:      m.acquireWait.WithLabelValues(name),
		StreamsOpen:      m.streamsOpen.WithLabelValues(name),
		StreamDuration:   m.streamDuration.WithLabelValues(name),
	}
	for i, r := range Reasons {
		d.Rejected[i] = m.rejected.WithLabelValues(name, r)
		d.WouldRefuse[i] = m.wouldRefuse.WithLabelValues(name, r)
	}
	for i, a := range Actions {
		d.Fallback[i] = m.fallback.WithLabelValues(name, a)
	}
	for i, c := range Classes {
		d.Upstream[i] = m.upstream.WithLabelValues(name, c)
	}
	for i, r := range TLSReasons {
		d.TLSFailures[i] = m.tlsFailures.WithLabelValues(name, r)
	}
	return d
}

// Transition counts a breaker transition of this downstream.
func (d *Downstream) Transition(from, to string) {
	d.m.transitions.WithLabelValues(d.name, from, to).Inc()
}

// Forget deletes every series of a downstream that left the configuration.
func (m *Metrics) Forget(name string) {
	l := prometheus.Labels{"downstream": name}
	for _, v := range []*prometheus.CounterVec{m.requests, m.rejected, m.wouldRefuse, m.fallback, m.upstream, m.upstream429, m.abandoned, m.transitions, m.tlsFailures} {
		v.DeletePartialMatch(l)
	}
	m.upstreamDuration.DeletePartialMatch(l)
	m.acquireWait.DeletePartialMatch(l)
	m.streamsOpen.DeletePartialMatch(l)
	m.streamDuration.DeletePartialMatch(l)
}

type stateCollector struct{ m *Metrics }

func (c stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.m.inflightD, c.m.waitingD, c.m.permitsD, c.m.breakerD, c.m.switchD, c.m.peakD, c.m.utilizationD, c.m.leaseExpiredD, c.m.generationD} {
		ch <- d
	}
}

func (c stateCollector) Collect(ch chan<- prometheus.Metric) {
	sp := c.m.source.Load()
	if sp == nil {
		return
	}
	s := (*sp).MetricsSnapshot()
	g := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	g(c.m.leaseExpiredD, b2f(s.LeaseExpired))
	g(c.m.generationD, float64(s.Generation))
	for _, d := range s.Downstreams {
		g(c.m.inflightD, float64(d.InFlight), d.Name)
		g(c.m.waitingD, float64(d.Waiting), d.Name)
		g(c.m.permitsD, float64(d.Permits), d.Name)
		g(c.m.peakD, float64(d.PeakRPS), d.Name)
		var util float64
		if d.Permits > 0 {
			util = float64(d.InFlight) / float64(d.Permits)
		}
		g(c.m.utilizationD, util, d.Name)
		if d.Breaker >= 0 {
			g(c.m.breakerD, float64(d.Breaker), d.Name)
		}
	}
	for _, sw := range s.Switches {
		g(c.m.switchD, b2f(sw.Active), sw.Downstream, sw.Name)
	}
}

// Peak is a ring of 60 one-second counters. Each slot packs the second it counts (its low 40
// bits) and the count (24 bits, saturating) into one word, so Add is a lock-free CAS loop and a
// slot left over from an older second is recognised and restarted.
type Peak struct {
	slots [60]atomic.Uint64
}

const (
	peakCountBits = 24
	peakCountMax  = 1<<peakCountBits - 1
	peakSecMask   = 1<<40 - 1
)

// Add counts one call at now.
func (p *Peak) Add(now time.Time) {
	sec := uint64(now.Unix())
	s := &p.slots[sec%60]
	tag := sec & peakSecMask
	for {
		v := s.Load()
		var nv uint64
		if v>>peakCountBits == tag {
			if v&peakCountMax == peakCountMax {
				return
			}
			nv = v + 1
		} else {
			nv = tag<<peakCountBits | 1
		}
		if s.CompareAndSwap(v, nv) {
			return
		}
	}
}

// Seconds returns the counts of the n whole seconds before now's second, oldest first, and the
// start of now's second (Unix seconds): counts[i] is the second end − len(counts) + i. A second
// with no call (or counted over a minute ago) is 0; a count that saturated is peakCountMax.
// n is at most 59: now's own slot is the one a minute before it too.
func (p *Peak) Seconds(now time.Time, n int) (end int64, counts []int32) {
	n = min(n, len(p.slots)-1)
	cur := uint64(now.Unix())
	counts = make([]int32, n)
	for i := range n {
		sec := cur - uint64(n-i)
		if v := p.slots[sec%60].Load(); v>>peakCountBits == sec&peakSecMask {
			counts[i] = int32(v & peakCountMax)
		}
	}
	return int64(cur), counts
}

// Max returns the highest count of the 60 seconds ending with now's second.
func (p *Peak) Max(now time.Time) int64 {
	sec := uint64(now.Unix())
	var best uint64
	for i := range p.slots {
		v := p.slots[i].Load()
		s := v >> peakCountBits
		cur := sec & peakSecMask
		if cur-s < 60 && s <= cur { // within the last 60 seconds
			if n := v & peakCountMax; n > best {
				best = n
			}
		}
	}
	return int64(best)
}
