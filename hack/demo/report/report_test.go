package report

import (
	"bytes"
	"encoding/csv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

const ms = time.Millisecond

func TestPercentile(t *testing.T) {
	for _, tc := range []struct {
		in   []time.Duration
		q    float64
		want time.Duration
	}{
		{nil, 0.99, 0},
		{[]time.Duration{7}, 0.5, 7},
		{[]time.Duration{4, 1, 3, 2}, 0.5, 2},
		{[]time.Duration{4, 1, 3, 2}, 0.75, 3},
		{[]time.Duration{4, 1, 3, 2}, 0.99, 4},
		{[]time.Duration{4, 1, 3, 2}, 1, 4},
	} {
		in := append([]time.Duration(nil), tc.in...)
		if got := Percentile(tc.in, tc.q); got != tc.want {
			t.Errorf("Percentile(%v, %v) = %v, want %v", tc.in, tc.q, got, tc.want)
		}
		if !cmp.Equal(in, tc.in) {
			t.Errorf("Percentile reordered its input: %v, was %v", tc.in, in)
		}
	}
}

// recording: two phases of 1 s; samples every 500 ms.
func recording() (Recording, []Phase) {
	phases := []Phase{{Name: "a", Start: 0, End: time.Second}, {Name: "b", Start: time.Second, End: 2 * time.Second}}
	rec := Recording{
		Name: "run",
		Calls: []Call{
			{Start: 0, End: 10 * ms, Outcome: OK},
			{Start: 100 * ms, End: 300 * ms, Outcome: OK},
			{Start: 200 * ms, End: 201 * ms, Outcome: TooMany},
			{Start: 400 * ms, End: 700 * ms, Outcome: Fallback},  // ends in the second step
			{Start: 900 * ms, End: 1200 * ms, Outcome: OK},       // made in a, ends in b
			{Start: 1100 * ms, End: 1105 * ms, Outcome: TooMany}, // b
			{Start: 1200 * ms, End: 1300 * ms, Outcome: Timeout}, // b
			{Start: 1300 * ms, End: 1900 * ms, Outcome: Failed},  // b
		},
		Partner: []PartnerCall{
			{At: 0, Latency: 10 * ms}, {At: 100 * ms, Latency: 200 * ms}, {At: 900 * ms, Latency: 300 * ms},
			{At: 1300 * ms, Latency: 600 * ms},
		},
		// The call made at 200 got a 429 and so did its retry; the one at 1100 was not retried.
		PartnerTooMany: []time.Duration{200 * ms, 201 * ms, 1100 * ms},
		Samples: []Sample{
			{At: 500 * ms, Pods: 8, PartnerPeak: 3, SumPermits: 40, PerPodMin: 5, PerPodMax: 5},
			{At: 1000 * ms, Pods: 8, PartnerPeak: 7, SumPermits: 40, PerPodMin: 5, PerPodMax: 5},
			{At: 1500 * ms, Pods: 12, PartnerPeak: 9, SumPermits: 36, PerPodMin: 3, PerPodMax: 5},
			{At: 2000 * ms, Pods: 12, PartnerPeak: 2, SumPermits: 36, PerPodMin: 3, PerPodMax: 3},
		},
	}
	return rec, phases
}

func TestBuildPoints(t *testing.T) {
	rec, phases := recording()
	run := Build(rec, phases)
	want := []Point{
		// (0, 0.5]: ends at 10, 201 (429), 300 → 2 OK, 1 429 over 0.5 s.
		{T: 0.5, Pods: 8, PartnerPeak: 3, SumPermits: 40, PerPodMin: 5, PerPodMax: 5, OK: 4, TooMany: 2},
		// (0.5, 1]: the fallback ending at 700.
		{T: 1, Pods: 8, PartnerPeak: 7, SumPermits: 40, PerPodMin: 5, PerPodMax: 5, Fallback: 2},
		// (1, 1.5]: 1105 (429), 1200 (OK), 1300 (timeout).
		{T: 1.5, Pods: 12, PartnerPeak: 9, SumPermits: 36, PerPodMin: 3, PerPodMax: 5, OK: 2, TooMany: 2, Timeout: 2},
		// (1.5, 2]: the failed call ending at 1900 is counted in no rate.
		{T: 2, Pods: 12, PartnerPeak: 2, SumPermits: 36, PerPodMin: 3, PerPodMax: 3},
	}
	if diff := cmp.Diff(want, run.Points); diff != "" {
		t.Errorf("points (-want +got):\n%s", diff)
	}
}

func TestBuildSummary(t *testing.T) {
	rec, phases := recording()
	run := Build(rec, phases)
	want := []Summary{{
		// a: calls started at 0, 100, 200, 400, 900: 3 OK, one 429, one fallback.
		Phase: "a", Calls: 5, Offered: 5, Goodput: 3, TooManyShare: 0.2, FallbackShare: 0.2,
		PartnerTooManyShare: 0.4, // the partner received 5: 3 admitted, 2 answered 429
		PartnerPeak:         7,   // samples at 500 and 1000
		Refusals:            2, RefusalP50: 1 * ms, RefusalP99: 300 * ms,
		AppP99:      300 * ms, // durations 10, 200, 1, 300, 300
		PartnerMean: 170 * ms, PartnerP99: 300 * ms,
	}, {
		// b: 1100 (429, 5 ms), 1200 (timeout, 100 ms), 1300 (failed, 600 ms).
		Phase: "b", Calls: 3, Offered: 3, TooManyShare: 1.0 / 3, TimeoutShare: 1.0 / 3,
		PartnerTooManyShare: 0.5, // 1300 admitted, 1100 answered 429
		PartnerPeak:         9, Refusals: 1, RefusalP50: 5 * ms, RefusalP99: 5 * ms, AppP99: 600 * ms,
		PartnerMean: 600 * ms, PartnerP99: 600 * ms,
	}}
	if diff := cmp.Diff(want, run.Summary); diff != "" {
		t.Errorf("summary (-want +got):\n%s", diff)
	}
}

func TestBuildEmptyPhase(t *testing.T) {
	run := Build(Recording{Name: "idle"}, []Phase{{Name: "p", Start: 0, End: time.Second}})
	if diff := cmp.Diff([]Summary{{Phase: "p"}}, run.Summary); diff != "" {
		t.Errorf("an empty phase shows nothing but zeros (-want +got):\n%s", diff)
	}
}

func testReport() *Report {
	rec, phases := recording()
	other := rec
	other.Name = "other"
	other.Calls = rec.Calls[:2]
	return &Report{Title: "t", Limit: 50, Phases: phases, Runs: []Run{Build(rec, phases), Build(other, phases)}}
}

func TestWriteCSV(t *testing.T) {
	var buf bytes.Buffer
	if err := testReport().WriteCSV(&buf); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&buf).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 1+2*4 {
		t.Fatalf("%d rows, want a header and 4 points per run:\n%s", len(rows), buf.String())
	}
	want := []string{"run", "1.500", "b", "12", "9", "50", "36", "3", "5", "2.0", "2.0", "0.0", "2.0"}
	if diff := cmp.Diff(want, rows[3]); diff != "" {
		t.Errorf("third point of the first run (-want +got):\n%s", diff)
	}
	if rows[5][0] != "other" {
		t.Errorf("the second run's rows follow the first's: %v", rows[5])
	}
}

func TestRowsAndTables(t *testing.T) {
	r := testReport()
	var got []string
	for _, row := range r.Rows() {
		got = append(got, row.Summary.Phase+"/"+row.Run)
	}
	if diff := cmp.Diff([]string{"a/run", "a/other", "b/run", "b/other"}, got); diff != "" {
		t.Errorf("rows are phase by phase, every run within (-want +got):\n%s", diff)
	}
	var md bytes.Buffer
	if err := r.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(md.String()), "\n")
	if len(lines) != 2+4 {
		t.Fatalf("markdown: %d lines, want header, rule and 4 rows:\n%s", len(lines), md.String())
	}
	if want := "| a | run | 5 | 40.0 % | 7 / 50 | 3 | 20.0 % | 1.0 ms / 300 ms | 300 ms | 170 ms / 300 ms |"; lines[2] != want {
		t.Errorf("first row\n got %s\nwant %s", lines[2], want)
	}
	var csvBuf bytes.Buffer
	if err := r.WriteSummaryCSV(&csvBuf); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&csvBuf).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 5 || rows[1][4] != "0.4000" || rows[1][5] != "0.2000" || rows[1][11] != "1.0" {
		t.Errorf("summary CSV: %v", rows)
	}
}
