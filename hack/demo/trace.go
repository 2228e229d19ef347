package main

import (
	"encoding/csv"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/apportion/apportion/hack/demo/report"
)

// podTrace is the run with Apportion seen pod by pod: at every sample, each agent's effective
// permits, calls in flight and waiting, and its no-permit refusals so far (from the monitor's
// last reading of it), and how many calls at the partner were long ones (held at least
// longCall). It answers what the table cannot: whether a pod refused while the others had
// permits free, and how many permits the slowdown's long calls still held.
type podTrace struct {
	longCall time.Duration
	rows     []podRow
	partner  []report.PartnerCall // the run's admitted calls, set once it ended
}

type podRow struct {
	At                         time.Duration
	Pod                        string
	Permits, InFlight, Waiting int32
	NoPermit                   int64
}

func (t *podTrace) add(r podRow) { t.rows = append(t.rows, r) }

// longAt counts the partner's calls in flight at at that it held for at least longCall.
func (t *podTrace) longAt(at time.Duration) int {
	n := 0
	for _, c := range t.partner {
		if c.Latency >= t.longCall && c.At <= at && at < c.At+c.Latency {
			n++
		}
	}
	return n
}

// write writes pods.csv: one line per sample and pod, the pod "Σ" summing them with the long
// calls at the partner. no_permit is counted from the run's first sample.
func (t *podTrace) write(w io.Writer, phaseAt func(float64) string) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"t_s", "phase", "pod", "permits", "in_flight", "waiting", "no_permit", "long_calls_at_partner"})
	base := map[string]int64{}
	itoa := func(v int64) string { return strconv.FormatInt(v, 10) }
	for i := 0; i < len(t.rows); {
		j := i
		for j < len(t.rows) && t.rows[j].At == t.rows[i].At {
			j++
		}
		group := slices.Clone(t.rows[i:j])
		slices.SortFunc(group, func(a, b podRow) int { return strings.Compare(a.Pod, b.Pod) })
		at := t.rows[i].At
		ts := strconv.FormatFloat(at.Seconds(), 'f', 3, 64)
		var sum podRow
		for _, r := range group {
			if _, ok := base[r.Pod]; !ok {
				base[r.Pod] = r.NoPermit
			}
			np := r.NoPermit - base[r.Pod]
			_ = cw.Write([]string{ts, phaseAt(at.Seconds()), r.Pod, itoa(int64(r.Permits)), itoa(int64(r.InFlight)), itoa(int64(r.Waiting)), itoa(np), ""})
			sum.Permits += r.Permits
			sum.InFlight += r.InFlight
			sum.Waiting += r.Waiting
			sum.NoPermit += np
		}
		_ = cw.Write([]string{ts, phaseAt(at.Seconds()), "Σ", itoa(int64(sum.Permits)), itoa(int64(sum.InFlight)), itoa(int64(sum.Waiting)),
			itoa(sum.NoPermit), strconv.Itoa(t.longAt(at))})
		i = j
	}
	cw.Flush()
	return cw.Error()
}
