package harness

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"time"
)

// History is the record of one run, checked offline after it (CheckHistory) and saved to a file
// when the check fails (Save): every agent reading the monitor took, every reading of the
// manager's ledger, the process events the scenario caused (an agent frozen or killed), the
// monitor's samples, and the downstream's and the app's counters at the end.
//
// The live monitor judges samples 40 ms apart; the record keeps each reading with its own time,
// so what happened between two samples — a pod raised while another's lease still held — is
// caught from it (CheckHistory's sweep).
type History struct {
	Limit int32 `json:"limit"`
	// LeaseTTL and RequestTimeout are the manager's --lease-ttl and the quota's requestTimeout.
	LeaseTTL       time.Duration `json:"leaseTTL"`
	RequestTimeout time.Duration `json:"requestTimeout"`
	// Seed and Schedule describe the run that made the history (the chaos scenario's).
	Seed     uint64   `json:"seed,omitempty"`
	Schedule []string `json:"schedule,omitempty"`
	// Start and End bound the run.
	Start time.Time `json:"start"`
	End   time.Time `json:"end"`

	Readings   []HistReading   `json:"readings"`
	Ledger     []HistLedger    `json:"ledger"`
	Events     []HistEvent     `json:"events"`
	Samples    []Sample        `json:"samples,omitempty"`
	Downstream DownstreamStats `json:"downstream"`
	Load       LoadStats       `json:"load"`
}

// HistReading is one answer of one agent process to GET /v1/state, for the scenario's
// downstream.
type HistReading struct {
	// At is when the answer had arrived, Sent when the request was sent: the State held at
	// some instant between them (a busy machine may stretch that interval either way).
	At   time.Time `json:"at"`
	Sent time.Time `json:"sent"`
	Pod  string    `json:"pod"`
	Pid  int       `json:"pid"`
	// Found is false when the agent held no assignment of the downstream (it enforces nothing
	// for it: 0 permits).
	Found          bool      `json:"found"`
	Epoch          int64     `json:"epoch"`
	Gen            int64     `json:"gen"`
	Effective      int32     `json:"effective"`
	Permits        int32     `json:"permits"`
	InFlight       int32     `json:"inFlight"`
	LeaseExpiresAt time.Time `json:"leaseExpiresAt,omitzero"`
	LeaseExpired   bool      `json:"leaseExpired,omitempty"`
}

func histReading(r *Reading, pod string) HistReading {
	return HistReading{At: r.At, Sent: r.Sent, Pod: pod, Pid: r.Pid, Found: r.Found, Epoch: r.State.Epoch, Gen: r.State.Generation,
		Effective: r.DS.EffectivePermits, Permits: r.DS.Permits, InFlight: r.DS.InFlight,
		LeaseExpiresAt: r.State.LeaseExpiresAt, LeaseExpired: r.State.LeaseExpired}
}

// HistLedger is one reading of the quota's status.ledger.
type HistLedger struct {
	At         time.Time `json:"at"`
	Sum        int32     `json:"sum"`
	Recovering bool      `json:"recovering,omitempty"`
	Detail     string    `json:"detail,omitempty"`
}

// Event kinds (HistEvent.Kind) the checker reads.
const (
	// EventFrozen: the agent process was SIGSTOPped. It holds what it last reported until its
	// lease ends: the manager may give its permits to another pod only after that.
	EventFrozen = "frozen"
	// EventKilled: the agent process was killed (SIGKILL): it holds nothing from then on.
	EventKilled = "killed"
)

// HistEvent is something the scenario did to an agent process.
type HistEvent struct {
	At   time.Time `json:"at"`
	Pod  string    `json:"pod"`
	Pid  int       `json:"pid"`
	Kind string    `json:"kind"`
}

// Finding is one thing the check found wrong.
type Finding struct {
	At     time.Time `json:"at"`
	Kind   string    `json:"kind"`
	Detail string    `json:"detail"`
}

func (f Finding) String() string {
	if f.At.IsZero() {
		return f.Kind + ": " + f.Detail
	}
	return f.At.Format("15:04:05.000000") + " " + f.Kind + ": " + f.Detail
}

// Finding kinds.
const (
	FindSum        = "Σ permits held"      // the sweep over the readings
	FindLease      = "lease lemma"         // the sweep, with a frozen agent's unexpired lease in the sum
	FindSamples    = "Σ permits sampled"   // two consecutive samples (the live monitor's rule)
	FindInFlight   = "Σ in-flight sampled" // the same for the calls in flight
	FindLedger     = "ledger"
	FindPeak       = "downstream peak"
	Find429        = "429"
	FindUnanswered = "unanswered call"
)

// span is a lower bound of what one agent process enforced over [from, to): the value it surely
// held at every instant of the span.
type span struct {
	from, to time.Time
	value    int32
	// frozen marks the span of a frozen process after its last reading (its lease holds).
	frozen bool
	pod    string
	lease  time.Time
}

// CheckHistory checks a run's record offline:
//
//   - the sweep: at every instant where a reading, a lease end or an event changes something,
//     Σ over the agent processes of what each surely held then (heldSpans) ≤ Limit. A process
//     frozen after its last reading counts what that reading showed until the reading's lease
//     end (or its kill): the permits of a pod whose lease has not ended may not be held elsewhere
//     — the lemma docs/protocol.md §11 rests on (Lemmas 2 and 4: no agent is raised from room
//     that an unexpired lease still holds). A sum over the limit with such a span in it is
//     reported as FindLease, otherwise as FindSum;
//   - the samples: two consecutive samples whose per-agent minimum sums over the limit (the
//     monitor's confirmed rule), for permits and calls in flight;
//   - the ledger: every reading ≤ Limit unless the manager said it was recovering;
//   - the downstream: peak ≤ Limit and no 429; the app saw no 429 either;
//   - every call answered: by the downstream (2xx) or by an explicit fallback (503); a transport
//     error counts as unanswered unless it came from an agent the scenario froze or killed (its
//     calls die with it), and any other status is unanswered.
//
// It returns the findings, the sweep's first ones and every other kind, in time order where
// they have one; none means the run kept every promise the record can show.
func CheckHistory(h *History) []Finding {
	var out []Finding
	out = append(out, sweep(h)...)
	out = append(out, checkSamples(h)...)
	for _, l := range h.Ledger {
		if l.Sum > h.Limit && !l.Recovering {
			out = append(out, Finding{At: l.At, Kind: FindLedger, Detail: fmt.Sprintf("status.ledger %d > limit %d: %s", l.Sum, h.Limit, l.Detail)})
		}
	}
	if h.Downstream.Peak > int64(h.Limit) {
		out = append(out, Finding{Kind: FindPeak, Detail: fmt.Sprintf("the downstream's peak concurrency %d > limit %d", h.Downstream.Peak, h.Limit)})
	}
	if h.Downstream.TooMany429 > 0 || h.Load.TooMany429 > 0 {
		out = append(out, Finding{Kind: Find429, Detail: fmt.Sprintf("the downstream answered 429 %d times, the app saw %d", h.Downstream.TooMany429, h.Load.TooMany429)})
	}
	if h.Load.Other > 0 {
		out = append(out, Finding{Kind: FindUnanswered, Detail: fmt.Sprintf("%d calls answered neither by the downstream nor by a fallback: %v", h.Load.Other, h.Load.OtherCodes)})
	}
	excused := map[string]bool{}
	for _, e := range h.Events {
		excused[e.Pod] = true
	}
	for _, pod := range sortedKeys(h.Load.ErrorsByPod) {
		if n := h.Load.ErrorsByPod[pod]; n > 0 && !excused[pod] {
			out = append(out, Finding{Kind: FindUnanswered, Detail: fmt.Sprintf("%d calls through %s (never frozen or killed) ended in a transport error", n, pod)})
		}
	}
	return out
}

// heldSpans turns one process's readings (sorted by arrival) into lower bounds of what it held
// (a reading's value is its effective permits, 0 when the downstream was not configured):
//
//   - from one reading's arrival to the next one's sending, when they are of one epoch at most
//     one generation apart: the smaller of the two values (one change, if any, happened at one
//     instant), until the first reading's lease end if that comes first (a lapse the readings
//     may not show); otherwise nothing is claimed. A reading alone claims nothing: its State
//     was taken at an unknown instant between its sending and its arrival, and a busy machine
//     can stretch that interval (a claim at the arrival could be stale);
//   - after the last reading, when the process was frozen (an EventFrozen of its pid) and the
//     reading's lease had not ended: that reading's value until its lease end or the process's
//     kill, whichever is first. (A lowering acknowledged between the reading and the SIGSTOP
//     would make this an over-estimate; the scenario takes a reading right before it.)
//
// A lease that ends inside a span ends its claim there: after a lease end the agent falls back
// to a limit the record does not show, and nothing is claimed.
func heldSpans(rs []HistReading, frozenAt, killedAt time.Time) []span {
	var out []span
	val := func(r HistReading) int32 {
		if !r.Found {
			return 0
		}
		return r.Effective
	}
	// until is the end of what reading r can vouch for: its lease end while it held one.
	until := func(r HistReading, to time.Time) time.Time {
		if r.Found && !r.LeaseExpired && !r.LeaseExpiresAt.IsZero() && r.LeaseExpiresAt.Before(to) {
			return r.LeaseExpiresAt
		}
		return to
	}
	for i, r := range rs[:len(rs)-1] {
		n := rs[i+1]
		if n.Epoch != r.Epoch || n.Gen-r.Gen > 1 || n.Gen < r.Gen {
			continue
		}
		// From r's arrival to n's sending: r's State was taken no later than the first, n's no
		// earlier than the second, and the value changed at most once between them.
		from, to := r.At, n.Sent
		if to.IsZero() {
			to = n.At
		}
		// r's lease ended before that: it lapsed then unless a renewal the readings did not show
		// came first, so r's value is claimed only until that lease end.
		to = until(r, to)
		if to.After(from) {
			out = append(out, span{from: from, to: to, value: min(val(r), val(n)), pod: r.Pod})
		}
	}
	if last := rs[len(rs)-1]; !frozenAt.IsZero() && frozenAt.After(last.At.Add(-200*time.Millisecond)) && last.Found && !last.LeaseExpired && !last.LeaseExpiresAt.IsZero() {
		end := last.LeaseExpiresAt
		if !killedAt.IsZero() && killedAt.Before(end) {
			end = killedAt
		}
		if end.After(last.At) {
			out = append(out, span{from: last.At, to: end, value: val(last), frozen: true, pod: last.Pod, lease: last.LeaseExpiresAt})
		}
	}
	return out
}

// sweep evaluates Σ of every process's lower bound at each span start (where the sum can rise),
// and reports each instant over the limit, once per run of consecutive excesses.
func sweep(h *History) []Finding {
	type proc struct {
		pod string
		pid int
	}
	byProc := map[proc][]HistReading{}
	for _, r := range h.Readings {
		byProc[proc{r.Pod, r.Pid}] = append(byProc[proc{r.Pod, r.Pid}], r)
	}
	var spans [][]span
	for p, rs := range byProc {
		sort.SliceStable(rs, func(i, j int) bool { return rs[i].At.Before(rs[j].At) })
		var frozen, killed time.Time
		for _, e := range h.Events {
			if e.Pod != p.pod || e.Pid != p.pid {
				continue
			}
			switch e.Kind {
			case EventFrozen:
				if frozen.IsZero() {
					frozen = e.At
				}
			case EventKilled:
				if killed.IsZero() {
					killed = e.At
				}
			}
		}
		spans = append(spans, heldSpans(rs, frozen, killed))
	}
	var instants []time.Time
	for _, ss := range spans {
		for _, s := range ss {
			instants = append(instants, s.from)
		}
	}
	slices.SortFunc(instants, func(a, b time.Time) int { return a.Compare(b) })
	instants = slices.Compact(instants)
	var out []Finding
	over := false
	for _, t := range instants {
		var sum int32
		var parts []string
		lease := ""
		for _, ss := range spans {
			// The span holding t, if any (spans of one process do not overlap).
			i := sort.Search(len(ss), func(i int) bool { return ss[i].to.After(t) })
			if i == len(ss) || ss[i].from.After(t) || ss[i].value == 0 {
				continue
			}
			s := ss[i]
			sum += s.value
			mark := ""
			if s.frozen {
				mark = fmt.Sprintf(" (frozen, lease until %s)", s.lease.Format("15:04:05.000"))
				if lease == "" {
					lease = s.pod
				}
			}
			parts = append(parts, fmt.Sprintf("%s=%d%s", s.pod, s.value, mark))
		}
		if sum <= h.Limit {
			over = false
			continue
		}
		if over {
			continue
		}
		over = true
		sort.Strings(parts)
		f := Finding{At: t, Kind: FindSum, Detail: fmt.Sprintf("Σ held %d > limit %d: %s", sum, h.Limit, strings.Join(parts, " "))}
		if lease != "" {
			f.Kind = FindLease
			f.Detail = fmt.Sprintf("permits granted while %s's lease still held them: ", lease) + f.Detail
		}
		out = append(out, f)
	}
	return out
}

// checkSamples re-applies the monitor's confirmed rule to the recorded samples.
func checkSamples(h *History) []Finding {
	var out []Finding
	for i := 1; i < len(h.Samples); i++ {
		prev, cur := &h.Samples[i-1], &h.Samples[i]
		var p, f int32
		for pod, c := range cur.Agents {
			if pr, ok := prev.Agents[pod]; ok {
				p += min(pr.Effective, c.Effective)
				f += min(pr.InFlight, c.InFlight)
			}
		}
		if p > h.Limit {
			out = append(out, Finding{At: cur.At, Kind: FindSamples, Detail: fmt.Sprintf("Σ %d > limit %d: %s", p, h.Limit, describe(prev, cur))})
		}
		if f > h.Limit {
			out = append(out, Finding{At: cur.At, Kind: FindInFlight, Detail: fmt.Sprintf("Σ %d > limit %d: %s", f, h.Limit, describe(prev, cur))})
		}
	}
	return out
}

// Save writes the history as JSON to path.
func (h *History) Save(path string) error {
	b, err := json.Marshal(h)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

// LoadHistory reads a history Save wrote.
func LoadHistory(path string) (*History, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var h History
	if err := json.Unmarshal(b, &h); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &h, nil
}
