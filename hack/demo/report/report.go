// Package report turns what `make demo` recorded — every app call, every call the partner
// admitted, and periodic samples of pods, permits and the partner's in-flight peak — into the
// comparison the demo prints and draws: one summary row per phase and run, time series on a
// fixed step, a CSV of both, and a self-contained HTML page with the charts (Render).
//
// Nothing here knows what a run should show: every figure is computed from the recording it
// is given. The functions are pure (no clock, no I/O except the writers passed in) so that
// tests can feed them constructed recordings and check each figure.
package report

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"time"
)

// Outcome is how an app call ended, as the app saw it.
type Outcome uint8

const (
	// OK: a 2xx from the partner.
	OK Outcome = iota
	// TooMany: the partner answered 429.
	TooMany
	// Fallback: refused before reaching the partner — the agent's fallback (503 with
	// X-Apportion-Fallback) or, without Apportion, the app's local semaphore gave no slot in
	// time.
	Fallback
	// Timeout: the app's own per-call timeout passed first.
	Timeout
	// Failed: anything else (transport error, other status).
	Failed
)

var outcomeNames = [...]string{"ok", "429", "fallback", "timeout", "failed"}

func (o Outcome) String() string {
	if int(o) < len(outcomeNames) {
		return outcomeNames[o]
	}
	return "outcome(" + strconv.Itoa(int(o)) + ")"
}

// Call is one app call; times are since the run's start.
type Call struct {
	Start, End time.Duration
	Outcome    Outcome
}

// PartnerCall is one call the partner admitted (not answered 429) and how long it held its slot.
type PartnerCall struct {
	At      time.Duration
	Latency time.Duration
}

// Sample is what the demo read at one instant of a run.
type Sample struct {
	At time.Duration
	// Pods is how many pods receive traffic (ready, not terminating).
	Pods int
	// PartnerPeak is the partner's highest in-flight count since the previous sample.
	PartnerPeak int
	// SumPermits is Σ over the pods of what each may hold in flight: effective permits with
	// Apportion, the local semaphore's size without.
	SumPermits int
	// PerPodMin and PerPodMax are the lowest and highest per-pod value of the same.
	PerPodMin, PerPodMax int
}

// Phase is a span of the timeline, the same in every run.
type Phase struct {
	Name       string
	Start, End time.Duration
}

// Recording is one run as the demo recorded it.
type Recording struct {
	Name    string
	Calls   []Call
	Partner []PartnerCall
	// PartnerTooMany is when the partner answered each of its 429s (an app that retries
	// sends it more calls than the app made).
	PartnerTooMany []time.Duration
	Samples        []Sample
}

// Point is one step of a run's time series; rates are per second over the step that ends at T.
type Point struct {
	T           float64 `json:"t"` // seconds since the run's start
	Pods        int     `json:"pods"`
	PartnerPeak int     `json:"partnerPeak"`
	SumPermits  int     `json:"sumPermits"`
	PerPodMin   int     `json:"perPodMin"`
	PerPodMax   int     `json:"perPodMax"`
	OK          float64 `json:"okPerSec"`
	TooMany     float64 `json:"tooManyPerSec"`
	Fallback    float64 `json:"fallbackPerSec"`
	Timeout     float64 `json:"timeoutPerSec"`
}

// Summary is one phase of one run.
type Summary struct {
	Phase string `json:"phase"`
	Calls int    `json:"calls"`
	// Offered is app calls started per second.
	Offered float64 `json:"offeredPerSec"`
	// TooManyShare, FallbackShare, TimeoutShare: fractions of the phase's calls (by how
	// each ended for the app: a call retried after a 429 counts by its retry's answer).
	TooManyShare  float64 `json:"tooManyShare"`
	FallbackShare float64 `json:"fallbackShare"`
	TimeoutShare  float64 `json:"timeoutShare"`
	// PartnerTooManyShare is the share of the calls the partner received in the phase (each
	// retry is one) that it answered 429.
	PartnerTooManyShare float64 `json:"partnerTooManyShare"`
	// PartnerPeak is the highest in-flight count the partner saw.
	PartnerPeak int `json:"partnerPeak"`
	// Goodput is 2xx answers per second.
	Goodput float64 `json:"goodputPerSec"`
	// RefusalP50 and RefusalP99: how long the app waited for a refusal (a 429 or a fallback);
	// zero when there was none (Refusals says how many).
	Refusals   int           `json:"refusals"`
	RefusalP50 time.Duration `json:"refusalP50"`
	RefusalP99 time.Duration `json:"refusalP99"`
	// AppP99 is the 99th percentile of every call's duration, as the app saw it.
	AppP99 time.Duration `json:"appP99"`
	// PartnerMean and PartnerP99 are how long the partner held its admitted calls: the
	// calibrated latency as this machine delivered it.
	PartnerMean time.Duration `json:"partnerMean"`
	PartnerP99  time.Duration `json:"partnerP99"`
}

// Run is one run, summarized.
type Run struct {
	Name    string    `json:"name"`
	Points  []Point   `json:"points"`
	Summary []Summary `json:"summary"`
}

// Report is what the demo writes and Render draws.
type Report struct {
	// Title, Date and Machine head the page; Notes are free lines under them (the demo's
	// settings, stated so that a reader can tell the figures' conditions).
	Title   string    `json:"title"`
	Date    time.Time `json:"date"`
	Machine string    `json:"machine"`
	Notes   []string  `json:"notes"`
	// Limit is the partner's concurrency limit, drawn as a line.
	Limit  int     `json:"limit"`
	Phases []Phase `json:"phases"`
	Runs   []Run   `json:"runs"`
}

// Build summarizes a recording: a time series with one point per sample, the rates over the
// span since the previous sample (by each call's end), and one summary per phase (by each
// call's start, so a call belongs to the phase in which it was made).
func Build(rec Recording, phases []Phase) Run {
	run := Run{Name: rec.Name}
	samples := slices.Clone(rec.Samples)
	slices.SortFunc(samples, func(a, b Sample) int { return cmpDuration(a.At, b.At) })
	ends := slices.Clone(rec.Calls)
	slices.SortFunc(ends, func(a, b Call) int { return cmpDuration(a.End, b.End) })
	i := 0
	var prev time.Duration
	for _, s := range samples {
		span := (s.At - prev).Seconds()
		var counts [len(outcomeNames)]int
		for ; i < len(ends) && ends[i].End <= s.At; i++ {
			if ends[i].End > prev {
				counts[ends[i].Outcome]++
			}
		}
		p := Point{T: s.At.Seconds(), Pods: s.Pods, PartnerPeak: s.PartnerPeak, SumPermits: s.SumPermits,
			PerPodMin: s.PerPodMin, PerPodMax: s.PerPodMax}
		if span > 0 {
			p.OK, p.TooMany = float64(counts[OK])/span, float64(counts[TooMany])/span
			p.Fallback, p.Timeout = float64(counts[Fallback])/span, float64(counts[Timeout])/span
		}
		run.Points = append(run.Points, p)
		prev = s.At
	}
	for _, ph := range phases {
		run.Summary = append(run.Summary, summarize(rec, ph))
	}
	return run
}

func summarize(rec Recording, ph Phase) Summary {
	sum := Summary{Phase: ph.Name}
	in := func(t time.Duration) bool { return t >= ph.Start && t < ph.End }
	var all, refusals []time.Duration
	var counts [len(outcomeNames)]int
	for _, c := range rec.Calls {
		if !in(c.Start) {
			continue
		}
		d := c.End - c.Start
		all = append(all, d)
		counts[c.Outcome]++
		if c.Outcome == TooMany || c.Outcome == Fallback {
			refusals = append(refusals, d)
		}
	}
	sum.Calls = len(all)
	secs := (ph.End - ph.Start).Seconds()
	if secs > 0 {
		sum.Offered = float64(sum.Calls) / secs
		sum.Goodput = float64(counts[OK]) / secs
	}
	if sum.Calls > 0 {
		n := float64(sum.Calls)
		sum.TooManyShare, sum.FallbackShare = float64(counts[TooMany])/n, float64(counts[Fallback])/n
		sum.TimeoutShare = float64(counts[Timeout]) / n
	}
	sum.AppP99 = Percentile(all, 0.99)
	sum.Refusals = len(refusals)
	sum.RefusalP50, sum.RefusalP99 = Percentile(refusals, 0.5), Percentile(refusals, 0.99)
	var lat []time.Duration
	var total time.Duration
	for _, pc := range rec.Partner {
		if in(pc.At) {
			lat = append(lat, pc.Latency)
			total += pc.Latency
		}
	}
	if len(lat) > 0 {
		sum.PartnerMean = total / time.Duration(len(lat))
	}
	sum.PartnerP99 = Percentile(lat, 0.99)
	var tooMany int
	for _, at := range rec.PartnerTooMany {
		if in(at) {
			tooMany++
		}
	}
	if received := len(lat) + tooMany; received > 0 {
		sum.PartnerTooManyShare = float64(tooMany) / float64(received)
	}
	for _, s := range rec.Samples {
		// A sample's peak covers the span before it; the first sample after the phase's end
		// still covers its last instants.
		if s.At > ph.Start && s.At <= ph.End {
			sum.PartnerPeak = max(sum.PartnerPeak, s.PartnerPeak)
		}
	}
	return sum
}

// Percentile is the nearest-rank q-quantile (0 < q ≤ 1) of ds, 0 for none. ds is not changed.
func Percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	k := int(math.Ceil(q*float64(len(s)))) - 1
	return s[min(max(k, 0), len(s)-1)]
}

func cmpDuration(a, b time.Duration) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// WriteCSV writes both runs' time series, one row per run and point, with the limit and the
// phase on each row so that the file stands on its own.
func (r *Report) WriteCSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"run", "t_s", "phase", "pods", "partner_inflight_peak", "limit", "sum_permits",
		"per_pod_min", "per_pod_max", "ok_per_s", "429_per_s", "fallback_per_s", "timeout_per_s"})
	f := func(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }
	for _, run := range r.Runs {
		for _, p := range run.Points {
			_ = cw.Write([]string{run.Name, strconv.FormatFloat(p.T, 'f', 3, 64), r.phaseAt(p.T), strconv.Itoa(p.Pods),
				strconv.Itoa(p.PartnerPeak), strconv.Itoa(r.Limit), strconv.Itoa(p.SumPermits), strconv.Itoa(p.PerPodMin),
				strconv.Itoa(p.PerPodMax), f(p.OK), f(p.TooMany), f(p.Fallback), f(p.Timeout)})
		}
	}
	cw.Flush()
	return cw.Error()
}

// WriteSummaryCSV writes the comparison table, one row per phase and run.
func (r *Report) WriteSummaryCSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"phase", "run", "calls", "offered_per_s", "partner_429_share", "app_429_share", "partner_peak", "limit",
		"goodput_per_s", "fallback_share", "timeout_share", "refusal_p50_ms", "refusal_p99_ms", "app_p99_ms",
		"partner_mean_ms", "partner_p99_ms"})
	ms := func(d time.Duration) string {
		return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', 1, 64)
	}
	f := func(v float64, prec int) string { return strconv.FormatFloat(v, 'f', prec, 64) }
	for _, row := range r.Rows() {
		s := row.Summary
		_ = cw.Write([]string{s.Phase, row.Run, strconv.Itoa(s.Calls), f(s.Offered, 1), f(s.PartnerTooManyShare, 4), f(s.TooManyShare, 4),
			strconv.Itoa(s.PartnerPeak), strconv.Itoa(r.Limit), f(s.Goodput, 1), f(s.FallbackShare, 4), f(s.TimeoutShare, 4),
			ms(s.RefusalP50), ms(s.RefusalP99), ms(s.AppP99), ms(s.PartnerMean), ms(s.PartnerP99)})
	}
	cw.Flush()
	return cw.Error()
}

// Row is one line of the comparison table.
type Row struct {
	Run     string
	Summary Summary
}

// Rows lists the comparison table's lines: phase by phase, every run within a phase.
func (r *Report) Rows() []Row {
	var rows []Row
	for i, ph := range r.Phases {
		for _, run := range r.Runs {
			if i < len(run.Summary) && run.Summary[i].Phase == ph.Name {
				rows = append(rows, Row{Run: run.Name, Summary: run.Summary[i]})
			}
		}
	}
	return rows
}

func (r *Report) phaseAt(t float64) string {
	for _, ph := range r.Phases {
		if t > ph.Start.Seconds() && t <= ph.End.Seconds() {
			return ph.Name
		}
	}
	return ""
}

// Load reads a report written by Save.
func Load(path string) (*Report, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var r Report
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &r, nil
}

// Save writes the report as JSON (the renderer's input; the test fixture is one).
func (r *Report) Save(path string) error {
	data, err := json.MarshalIndent(r, "", " ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(data, '\n'), 0o644)
}
