package metrics

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Lane metrics, for downstreams with priority lanes (labels downstream and lane; the lane of
// calls that match no declared lane is "default"):
//
//	lane_inflight, lane_waiting                  gauges: the lane's calls holding / queued for a permit
//	lane_reserved_permits                        gauge: the lane's reserve at the limit in force
//	lane_borrowed_permits                        gauge: permits of other lanes' reserves the lane
//	                                             holds (an upper bound when several lanes overflow)
//	lane_rejected_total{reason}                  the lane's calls not forwarded, by reason
//
// The gauges are read from a LaneSource at scrape time, like the other gauges.

// LaneSnapshot is one lane's gauges.
type LaneSnapshot struct {
	Downstream, Lane                      string
	InFlight, Waiting, Reserved, Borrowed int
}

// LaneSource provides the lanes' gauges; it is called once per scrape.
type LaneSource interface {
	LaneSnapshot() []LaneSnapshot
}

type laneMetrics struct {
	source                                    atomic.Pointer[LaneSource]
	rejected                                  *prometheus.CounterVec
	inflightD, waitingD, reservedD, borrowedD *prometheus.Desc
}

// newLaneMetrics creates and registers the lane metrics in m's registry (called by New).
func newLaneMetrics(m *Metrics) *laneMetrics {
	lm := &laneMetrics{}
	{
		lm.rejected = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "lane_rejected_total",
			Help: "Calls of a lane not forwarded to the downstream, by reason."}, []string{"downstream", "lane", "reason"})
		d := func(name, help string) *prometheus.Desc {
			return prometheus.NewDesc(prometheus.BuildFQName(namespace, "", name), help, []string{"downstream", "lane"}, nil)
		}
		lm.inflightD = d("lane_inflight", "Calls of the lane holding a permit.")
		lm.waitingD = d("lane_waiting", "Calls of the lane waiting for a permit.")
		lm.reservedD = d("lane_reserved_permits", "Permits reserved for the lane at the limit in force.")
		lm.borrowedD = d("lane_borrowed_permits", "Permits of other lanes' reserves the lane's calls hold (an upper bound when several lanes overflow).")
		m.Registry.MustRegister(lm.rejected, laneCollector{lm})
	}
	return lm
}

// SetLaneSource sets where the lane gauges are read from.
func (m *Metrics) SetLaneSource(s LaneSource) { m.lane.source.Store(&s) }

// LaneRejected returns the counters of one lane's rejections, by Reason*. Call it when the lane
// is configured, not per request.
func (m *Metrics) LaneRejected(downstream, lane string) [NumReasons]prometheus.Counter {
	lm := m.lane
	var out [NumReasons]prometheus.Counter
	for i, r := range Reasons {
		out[i] = lm.rejected.WithLabelValues(downstream, lane, r)
	}
	return out
}

// ForgetLanes deletes the lane series of a downstream that left the configuration or changed
// its lanes.
func (m *Metrics) ForgetLanes(downstream string) {
	m.lane.rejected.DeletePartialMatch(prometheus.Labels{"downstream": downstream})
}

type laneCollector struct{ lm *laneMetrics }

func (c laneCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.lm.inflightD, c.lm.waitingD, c.lm.reservedD, c.lm.borrowedD} {
		ch <- d
	}
}

func (c laneCollector) Collect(ch chan<- prometheus.Metric) {
	sp := c.lm.source.Load()
	if sp == nil {
		return
	}
	for _, l := range (*sp).LaneSnapshot() {
		for d, v := range map[*prometheus.Desc]int{c.lm.inflightD: l.InFlight, c.lm.waitingD: l.Waiting, c.lm.reservedD: l.Reserved, c.lm.borrowedD: l.Borrowed} {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), l.Downstream, l.Lane)
		}
	}
}
