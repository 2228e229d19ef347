package e2e

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/test/e2e/harness"
)

// The offline checker (harness.CheckHistory) on made-up histories: it must find each kind of
// violation the record can show — above all one that happened between two samples, which the
// live monitor's sample rule cannot see — and must not report what the protocol allows. No
// processes: it runs in -short.

var t0 = time.Date(2026, 12, 2, 6, 0, 0, 0, time.UTC)

func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

// reading is an agent reading of gen g holding eff permits with its lease ending at lease ms.
func reading(ms int, pod string, pid int, gen int64, eff int32, lease int) harness.HistReading {
	return harness.HistReading{At: at(ms), Sent: at(ms).Add(-time.Millisecond), Pod: pod, Pid: pid, Found: true, Epoch: 1, Gen: gen,
		Effective: eff, Permits: eff, LeaseExpiresAt: at(lease)}
}

// steady is pod's process pid read every 40 ms over [from, to) ms at gen g holding eff, its
// lease always 1.5 s ahead (renewed).
func steady(pod string, pid int, gen int64, eff int32, from, to int) []harness.HistReading {
	var out []harness.HistReading
	for ms := from; ms < to; ms += 40 {
		out = append(out, reading(ms, pod, pid, gen, eff, ms+1500))
	}
	return out
}

// sample is a monitor sample with every pod's effective permits.
func sample(ms int, permits map[string]int32) harness.Sample {
	s := harness.Sample{At: at(ms), Agents: map[string]harness.AgentSample{}}
	for pod, p := range permits {
		s.Agents[pod] = harness.AgentSample{Effective: p, Permits: p, Reachable: true}
		s.SumPermits += p
	}
	return s
}

// cleanHistory: limit 10, pods a and b at 5 each for 3 s, read at 25 Hz, sampled, the ledger
// at 10, every call answered.
func cleanHistory() *harness.History {
	h := &harness.History{Limit: 10, LeaseTTL: 2 * time.Second, RequestTimeout: time.Second, Start: at(0), End: at(3000)}
	h.Readings = append(steady("a", 1, 1, 5, 0, 3000), steady("b", 2, 1, 5, 20, 3000)...)
	for ms := 0; ms < 3000; ms += 40 {
		h.Samples = append(h.Samples, sample(ms, map[string]int32{"a": 5, "b": 5}))
	}
	for ms := 0; ms < 3000; ms += 200 {
		h.Ledger = append(h.Ledger, harness.HistLedger{At: at(ms), Sum: 10})
	}
	h.Downstream = harness.DownstreamStats{Limit: 10, Peak: 10, Total: 300, OK: 300}
	h.Load = harness.LoadStats{Requests: 400, OK: 300, Fallback: 100}
	return h
}

func kinds(fs []harness.Finding) []string {
	var out []string
	for _, f := range fs {
		out = append(out, f.Kind)
	}
	return out
}

func TestCheckHistoryCleanRun(t *testing.T) {
	if fs := harness.CheckHistory(cleanHistory()); len(fs) != 0 {
		t.Fatalf("a clean history has findings: %v", fs)
	}
}

// frozenThenRaised: a holds 6 (lease until 1000 ms), is read at 300 ms and frozen at 310 ms; b
// holds 4 and is raised to 6 at raiseAt ms (read then and 10 ms later), then lowered back to 4
// (read 20 ms after the raise), a generation each. The samples (every 40 ms, each with the
// latest readings) never see b at 6.
func frozenThenRaised(raiseAt int) *harness.History {
	h := &harness.History{Limit: 10, LeaseTTL: 2 * time.Second, RequestTimeout: time.Second, Start: at(0), End: at(2000)}
	for ms := 0; ms <= 300; ms += 40 {
		h.Readings = append(h.Readings, reading(ms, "a", 1, 1, 6, 1000))
	}
	h.Readings = append(h.Readings, reading(300, "a", 1, 1, 6, 1000))
	h.Events = append(h.Events, harness.HistEvent{At: at(310), Pod: "a", Pid: 1, Kind: harness.EventFrozen})
	for ms := 20; ms < raiseAt-5; ms += 40 {
		h.Readings = append(h.Readings, reading(ms, "b", 2, 1, 4, ms+1500))
	}
	h.Readings = append(h.Readings, reading(raiseAt, "b", 2, 2, 6, raiseAt+1500), reading(raiseAt+10, "b", 2, 2, 6, raiseAt+1510))
	for ms := raiseAt + 20; ms < 2000; ms += 40 {
		h.Readings = append(h.Readings, reading(ms, "b", 2, 3, 4, ms+1500))
	}
	for ms := 0; ms < 2000; ms += 40 {
		h.Samples = append(h.Samples, sample(ms, map[string]int32{"a": 6, "b": 4}))
	}
	h.Downstream = harness.DownstreamStats{Limit: 10, Peak: 8}
	h.Events = append(h.Events, harness.HistEvent{At: at(1900), Pod: "a", Pid: 1, Kind: harness.EventKilled})
	return h
}

// TestCheckHistoryLeaseLemma: b raised while frozen a's lease still held its permits is caught
// from the readings although no two samples show it; once a's lease has ended, the same raise is
// allowed.
func TestCheckHistoryLeaseLemma(t *testing.T) {
	fs := harness.CheckHistory(frozenThenRaised(525))
	if len(fs) != 1 || fs[0].Kind != harness.FindLease || !fs[0].At.Equal(at(525)) {
		t.Fatalf("want one %q finding at +525ms, got %v", harness.FindLease, fs)
	}
	t.Logf("found: %s", fs[0])
	if !strings.Contains(fs[0].Detail, "a=6 (frozen") || !strings.Contains(fs[0].Detail, "b=6") {
		t.Errorf("the finding does not name the frozen pod and the raised one: %s", fs[0].Detail)
	}
	// The live rule over the same samples sees nothing: the record is what catches it.
	h := frozenThenRaised(525)
	h.Readings = nil
	if fs := harness.CheckHistory(h); len(fs) != 0 {
		t.Fatalf("the samples alone should show nothing here, got %v", fs)
	}
	// After a's lease ended (1000 ms) the raise is what the protocol does.
	if fs := harness.CheckHistory(frozenThenRaised(1125)); len(fs) != 0 {
		t.Fatalf("a raise after the frozen pod's lease ended is allowed, got %v", fs)
	}
	// A frozen pod killed before the raise holds nothing any more.
	h = frozenThenRaised(525)
	h.Events[1].At = at(500)
	if fs := harness.CheckHistory(h); len(fs) != 0 {
		t.Fatalf("a killed pod holds nothing, got %v", fs)
	}
}

// TestCheckHistorySweepBetweenReadings: readings of two live agents show Σ over the limit at an
// instant between samples (FindSum); a gap in one agent's readings longer than its lease claims
// nothing past the lease end (it may have lapsed), and readings more than one generation apart
// claim nothing between them.
func TestCheckHistorySweepBetweenReadings(t *testing.T) {
	h := cleanHistory()
	// b raised to 7 (seen by the readings at 1020 and 1060 ms), lowered to 5 at the next: a
	// still at 5.
	for i, r := range h.Readings {
		switch {
		case r.Pod != "b" || r.At.Before(at(1020)):
		case r.At.Before(at(1100)):
			h.Readings[i].Effective, h.Readings[i].Gen = 7, 2
		default:
			h.Readings[i].Gen = 3
		}
	}
	fs := harness.CheckHistory(h)
	if len(fs) != 1 || fs[0].Kind != harness.FindSum || !fs[0].At.Equal(at(1020)) {
		t.Fatalf("want one %q finding at +1020ms, got %v", harness.FindSum, fs)
	}

	// a holds 6 with its lease until 500 ms, then is not read until 900 ms (6 again, renewed);
	// b at 6 read at 700 and 740 ms: a may have lapsed in between, nothing is claimed.
	h = &harness.History{Limit: 10}
	h.Readings = []harness.HistReading{reading(0, "a", 1, 1, 6, 500), reading(900, "a", 1, 1, 6, 2400),
		reading(700, "b", 2, 1, 6, 2200), reading(740, "b", 2, 1, 6, 2240)}
	if fs := harness.CheckHistory(h); len(fs) != 0 {
		t.Fatalf("a lease that may have lapsed between readings claims nothing after its end, got %v", fs)
	}
	// The same with a's second reading before its lease end: held throughout.
	h.Readings[0].LeaseExpiresAt = at(1000)
	if fs := harness.CheckHistory(h); len(fs) != 1 {
		t.Fatalf("a lease that held between the readings claims the smaller value: want 1 finding, got %v", fs)
	}
	// Generations 1 and 3: two pushes between the readings, nothing claimed.
	h.Readings[1].Gen = 3
	if fs := harness.CheckHistory(h); len(fs) != 0 {
		t.Fatalf("two generations apart claims nothing between the readings, got %v", fs)
	}
}

func TestCheckHistoryOtherPromises(t *testing.T) {
	for _, c := range []struct {
		name   string
		doctor func(h *harness.History)
		want   string
	}{
		{"ledger over the limit", func(h *harness.History) { h.Ledger[3].Sum = 11 }, harness.FindLedger},
		{"two samples over the limit", func(h *harness.History) {
			h.Samples[10].Agents["b"] = harness.AgentSample{Effective: 6}
			h.Samples[11].Agents["b"] = harness.AgentSample{Effective: 6}
		}, harness.FindSamples},
		{"in flight over the limit", func(h *harness.History) {
			h.Samples[10].Agents["b"] = harness.AgentSample{Effective: 5, InFlight: 11}
			h.Samples[11].Agents["b"] = harness.AgentSample{Effective: 5, InFlight: 11}
		}, harness.FindInFlight},
		{"downstream peak", func(h *harness.History) { h.Downstream.Peak = 11 }, harness.FindPeak},
		{"a 429", func(h *harness.History) { h.Downstream.TooMany429 = 1 }, harness.Find429},
		{"an unknown status", func(h *harness.History) { h.Load.Other, h.Load.OtherCodes = 1, map[int]int64{502: 1} }, harness.FindUnanswered},
		{"an error at a healthy agent", func(h *harness.History) { h.Load.Errors, h.Load.ErrorsByPod = 1, map[string]int64{"a": 1} }, harness.FindUnanswered},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := cleanHistory()
			c.doctor(h)
			if got := kinds(harness.CheckHistory(h)); !slices.Equal(got, []string{c.want}) {
				t.Fatalf("want [%s], got %v", c.want, got)
			}
		})
	}
	// Allowed: the ledger over the limit while the manager recovers, and errors at an agent the
	// scenario killed.
	h := cleanHistory()
	h.Ledger[3].Sum, h.Ledger[3].Recovering = 11, true
	h.Load.Errors, h.Load.ErrorsByPod = 3, map[string]int64{"a": 3}
	h.Events = []harness.HistEvent{{At: at(1000), Pod: "a", Pid: 1, Kind: harness.EventKilled}}
	if fs := harness.CheckHistory(h); len(fs) != 0 {
		t.Fatalf("findings for what is allowed: %v", fs)
	}
}

// TestHistorySaveLoad: the saved file checks as the history did.
func TestHistorySaveLoad(t *testing.T) {
	h := frozenThenRaised(525)
	h.Seed, h.Schedule = 42, []string{"scale to 9"}
	path := filepath.Join(t.TempDir(), "h.json")
	if err := h.Save(path); err != nil {
		t.Fatal(err)
	}
	back, err := harness.LoadHistory(path)
	if err != nil {
		t.Fatal(err)
	}
	if back.Seed != 42 || len(back.Readings) != len(h.Readings) || back.Readings[3] != h.Readings[3] {
		t.Fatalf("round trip lost data: seed %d, %d readings (want %d)", back.Seed, len(back.Readings), len(h.Readings))
	}
	if a, b := harness.CheckHistory(h), harness.CheckHistory(back); len(a) != 1 || len(b) != 1 || a[0] != b[0] {
		t.Fatalf("findings differ after the round trip: %v vs %v", a, b)
	}
}
