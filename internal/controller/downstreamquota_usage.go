package controller

import (
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/promreg"
	"github.com/apportion/apportion/internal/push"
)

// This file is a quota's usage as its agents report it: the calls in flight across its pods,
// their utilization of the permits, the warning threshold (NearLimit) and the busiest second of
// the last minute; in status, an Event and metrics. Pure but for the metrics' registration.

const (
	// usageStatusPeriod is how often a quota with an engine is reconciled to refresh its usage
	// (the agents report on every renewal; the engine does not mark a quota changed for calls
	// in flight alone). At most one status write per quota per period, when its usage changed.
	usageStatusPeriod = 10 * time.Second
	// peakWindow is the window of the busiest second, in seconds.
	peakWindow = 60
	// NearLimitEventQuiet: a NearLimit Warning is recorded when the condition turns true, unless
	// it receded less than this long before (apportionv1.ReasonNearLimit).
	NearLimitEventQuiet = 5 * time.Minute
)

// quotaUsage is what the agents' last reports say of a quota's use.
type quotaUsage struct {
	// InFlight is Σ the calls in flight the agents last reported (pods gone but still counted
	// included: their calls may still run); Granted Σ the permits granted to listed pods.
	InFlight, Granted int64
	// WarnAt is the in-flight count at which NearLimit turns true: warnAtPercent of the budget,
	// rounded up, at least 1.
	WarnAt int64
	// Peak is the busiest second of the last peakWindow (nil when none is known).
	Peak *apportionv1.PeakSecond
}

// usageOf sums the report's holdings: the budget is maxInFlight × factor.
func usageOf(dq *apportionv1.DownstreamQuota, budget int64, report *push.Report, now time.Time) quotaUsage {
	warn := int64(int32Or(dq.Spec.WarnAtPercent, apportionv1.DefaultWarnAtPercent))
	u := quotaUsage{WarnAt: max((budget*warn+99)/100, 1)}
	series := make([]assignment.SecondCounts, 0, len(report.Holdings))
	for _, h := range report.Holdings {
		u.InFlight += int64(h.InFlight)
		if !h.Gone {
			u.Granted += int64(h.Granted)
		}
		if len(h.Seconds) > 0 {
			series = append(series, assignment.SecondCounts{End: h.SecondsEnd, Counts: h.Seconds})
		}
	}
	if sec, calls, ok := assignment.BusiestSecond(series, now.Unix(), peakWindow); ok && calls > 0 {
		u.Peak = &apportionv1.PeakSecond{Calls: calls, At: metav1.NewTime(time.Unix(sec, 0).UTC())}
	}
	return u
}

// near says whether the calls in flight reached the warning threshold.
func (u quotaUsage) near() bool { return u.InFlight >= u.WarnAt }

// utilizationPercent is InFlight ÷ Granted in percent, rounded down; 0 with nothing granted.
func (u quotaUsage) utilizationPercent() int32 {
	if u.Granted <= 0 {
		return 0
	}
	return int32(min(u.InFlight*100/u.Granted, 1<<31-1))
}

// setUsage puts u in st: the usage fields and the NearLimit condition (its reason says whether
// it receded, see apportionv1.ReasonReceded).
func setUsage(st *apportionv1.DownstreamQuotaStatus, u quotaUsage, budget int64, warnPercent int32, now metav1.Time) {
	st.InFlight = int32(min(u.InFlight, 1<<31-1))
	st.UtilizationPercent = u.utilizationPercent()
	st.PeakSecond = u.Peak
	if u.near() {
		st.SetCondition(apportionv1.ConditionNearLimit, true, apportionv1.ReasonAtWarnThreshold, fmt.Sprintf(
			"%d calls in flight across the pods, at or above %d%% of the budget of %d (%d)", u.InFlight, warnPercent, budget, u.WarnAt), now)
		return
	}
	reason := apportionv1.ReasonBelowWarnThreshold
	if c := meta.FindStatusCondition(st.Conditions, apportionv1.ConditionNearLimit); c != nil &&
		(c.Status == metav1.ConditionTrue || c.Reason == apportionv1.ReasonReceded) {
		reason = apportionv1.ReasonReceded
	}
	st.SetCondition(apportionv1.ConditionNearLimit, false, reason, fmt.Sprintf(
		"%d calls in flight across the pods, below %d%% of the budget of %d (%d)", u.InFlight, warnPercent, budget, u.WarnAt), now)
}

// nearLimitEvent: a Warning when NearLimit turns true, unless it receded less than
// NearLimitEventQuiet before.
func nearLimitEvent(c *eventContext) (statusEvent, bool) {
	now := meta.FindStatusCondition(c.After.Conditions, apportionv1.ConditionNearLimit)
	if now == nil || now.Status != metav1.ConditionTrue {
		return statusEvent{}, false
	}
	if old := meta.FindStatusCondition(c.Before.Conditions, apportionv1.ConditionNearLimit); old != nil {
		if old.Status == metav1.ConditionTrue {
			return statusEvent{}, false
		}
		if old.Reason == apportionv1.ReasonReceded && c.Now.Sub(old.LastTransitionTime.Time) < NearLimitEventQuiet {
			return statusEvent{}, false
		}
	}
	return statusEvent{corev1.EventTypeWarning, apportionv1.ReasonNearLimit, "Usage", now.Message + "; nothing is refused yet"}, true
}

// usageMetrics are the quotas' usage gauges, labelled quota (namespace/name).
type usageMetrics struct {
	inflight, utilization, limitUtilization, near, peak *prometheus.GaugeVec
}

// newUsageMetrics makes the usage gauges and registers them in reg (nil: unregistered).
func newUsageMetrics(reg prometheus.Registerer) (*usageMetrics, error) {
	g := func(name, help string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: name, Help: help}, []string{"quota"})
	}
	m := &usageMetrics{
		inflight:         g("apportion_manager_quota_inflight_calls", "Calls in flight across a quota's pods, as their agents last reported."),
		utilization:      g("apportion_manager_quota_utilization_ratio", "Calls in flight across a quota's pods ÷ the permits granted to them (above 1 only under Observe, or while lowered pods drain)."),
		limitUtilization: g("apportion_manager_quota_limit_utilization_ratio", "Calls in flight across a quota's pods ÷ its maxInFlight."),
		near:             g("apportion_manager_quota_near_limit", "1 while a quota's calls in flight are at or above its warnAtPercent of the budget (the NearLimit condition)."),
		peak:             g("apportion_manager_quota_peak_second_calls", "Calls in the busiest whole second of the last 60 across a quota's pods (the agents' per-second counts, summed)."),
	}
	if reg == nil {
		return m, nil
	}
	for _, v := range []**prometheus.GaugeVec{&m.inflight, &m.utilization, &m.limitUtilization, &m.near, &m.peak} {
		var err error
		if *v, err = promreg.Register(reg, *v); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// observe sets a quota's gauges from its status.
func (m *usageMetrics) observe(key types.NamespacedName, dq *apportionv1.DownstreamQuota, st *apportionv1.DownstreamQuotaStatus) {
	if m == nil {
		return
	}
	q := key.String()
	m.inflight.WithLabelValues(q).Set(float64(st.InFlight))
	m.utilization.WithLabelValues(q).Set(float64(st.UtilizationPercent) / 100)
	var lim float64
	if dq.Spec.MaxInFlight > 0 {
		lim = float64(st.InFlight) / float64(dq.Spec.MaxInFlight)
	}
	m.limitUtilization.WithLabelValues(q).Set(lim)
	near := 0.0
	if meta.IsStatusConditionTrue(st.Conditions, apportionv1.ConditionNearLimit) {
		near = 1
	}
	m.near.WithLabelValues(q).Set(near)
	var peak float64
	if st.PeakSecond != nil {
		peak = float64(st.PeakSecond.Calls)
	}
	m.peak.WithLabelValues(q).Set(peak)
}

// forget deletes a quota's gauges.
func (m *usageMetrics) forget(key types.NamespacedName) {
	if m == nil {
		return
	}
	q := key.String()
	for _, v := range []*prometheus.GaugeVec{m.inflight, m.utilization, m.limitUtilization, m.near, m.peak} {
		v.DeleteLabelValues(q)
	}
}

// RegisterUsageMetrics registers the quotas' usage gauges in reg, as SetupWithManager does (for
// checks of what the manager exports, test/monitoring).
func RegisterUsageMetrics(reg prometheus.Registerer) error {
	_, err := newUsageMetrics(reg)
	return err
}
