package main

import (
	"bytes"
	"encoding/csv"
	"slices"
	"testing"
	"time"

	"github.com/apportion/apportion/hack/demo/report"
)

// TestPodTrace checks pods.csv: a line per pod and sample in pod order, a Σ line per sample
// summing them, refusals counted from each pod's first sample, and the long calls at the
// partner counted at each instant (only calls held at least longCall, only while held).
func TestPodTrace(t *testing.T) {
	s := time.Second
	tr := &podTrace{longCall: 6 * s}
	// Added in the order the monitor's map gives them: not sorted.
	tr.add(podRow{At: s, Pod: "b", Permits: 4, InFlight: 4, Waiting: 3, NoPermit: 100})
	tr.add(podRow{At: s, Pod: "a", Permits: 3, InFlight: 1, NoPermit: 7})
	tr.add(podRow{At: 2 * s, Pod: "a", Permits: 3, InFlight: 3, Waiting: 1, NoPermit: 9})
	tr.add(podRow{At: 2 * s, Pod: "b", Permits: 4, InFlight: 2, NoPermit: 105})
	tr.partner = []report.PartnerCall{
		{At: 0, Latency: 7 * s},                        // long, held over both samples
		{At: 1500 * time.Millisecond, Latency: s},      // short
		{At: -5 * s, Latency: 6500 * time.Millisecond}, // long, ended at 1.5 s
	}
	var out bytes.Buffer
	if err := tr.write(&out, func(float64) string { return "p" }); err != nil {
		t.Fatal(err)
	}
	got, err := csv.NewReader(&out).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	want := [][]string{
		{"t_s", "phase", "pod", "permits", "in_flight", "waiting", "no_permit", "long_calls_at_partner"},
		{"1.000", "p", "a", "3", "1", "0", "0", ""},
		{"1.000", "p", "b", "4", "4", "3", "0", ""},
		{"1.000", "p", "Σ", "7", "5", "3", "0", "2"},
		{"2.000", "p", "a", "3", "3", "1", "2", ""},
		{"2.000", "p", "b", "4", "2", "0", "5", ""},
		{"2.000", "p", "Σ", "7", "5", "1", "7", "1"},
	}
	if !slices.EqualFunc(got, want, slices.Equal[[]string]) {
		t.Errorf("pods.csv:\n got %q\nwant %q", got, want)
	}
}
