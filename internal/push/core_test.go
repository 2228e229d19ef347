package push

import (
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"k8s.io/apimachinery/pkg/types"

	"github.com/apportion/apportion/internal/assignment"
)

var qKey = types.NamespacedName{Namespace: "ns", Name: "q"}

// converged starts a harness, sets d and runs past the recovery window until every pod holds
// its permits.
func converged(t *testing.T, d DesiredQuota, mut func(*Options)) *harness {
	t.Helper()
	h := newHarness(t, mut)
	h.begin(1)
	h.set(d)
	h.runFor(hWin + hRT + 100*time.Millisecond)
	r := h.report("ns", "q")
	if !r.Converged || r.Recovering {
		t.Fatalf("not converged: %+v", r)
	}
	return h
}

func grants(r Report) map[string]int32 {
	m := map[string]int32{}
	for _, x := range r.Holdings {
		m[x.Pod] = x.Granted
	}
	return m
}

func TestScaleOutWithHeadroomGrantsNewPodsBeforeLoweringsAreAcked(t *testing.T) {
	h := converged(t, quota(100, 8, 10, 5), nil)
	if r := h.report("ns", "q"); r.Ledger != 80 {
		t.Fatalf("ledger %d, want 80", r.Ledger)
	}
	h.sent = nil
	h.set(quota(100, 10, 8, 4))
	ws := h.start()
	// Lowerings go first, then the probes of the new pods.
	var kinds []string
	for _, w := range ws {
		kinds = append(kinds, w.kind.String()+" "+w.to.URL)
	}
	want := []string{"push http://p0", "push http://p1", "push http://p2", "push http://p3", "push http://p4",
		"push http://p5", "push http://p6", "push http://p7", "probe http://p8", "probe http://p9"}
	slices.Sort(kinds[:8])
	if diff := cmp.Diff(want, kinds); diff != "" {
		t.Fatalf("first requests (-want +got):\n%s", diff)
	}
	// The new pods answer first: the old pods still count 10 each, the headroom (20) covers both.
	for _, w := range ws[8:] {
		h.finish(w, ok)
	}
	r := h.report("ns", "q")
	if g := grants(r); g["p8"] != 8 || g["p9"] != 8 {
		t.Fatalf("new pods not granted from the headroom: %v", g)
	}
	if r.Ledger != 96 {
		t.Fatalf("ledger %d, want 80 (old pods, unacknowledged) + 16", r.Ledger)
	}
	for _, w := range ws[:8] {
		h.finish(w, ok)
	}
	h.settle()
	r = h.report("ns", "q")
	if r.Ledger != 80 || !r.Converged {
		t.Fatalf("after acks: ledger %d converged %v", r.Ledger, r.Converged)
	}
}

func TestScaleOutWithoutHeadroomWaitsForAcknowledgedLowerings(t *testing.T) {
	h := converged(t, quota(80, 8, 10, 5), nil)
	h.sent = nil
	h.set(quota(80, 10, 8, 4))
	ws := h.start()
	var lowerings []*work
	for _, w := range ws {
		if w.kind == kindProbe {
			h.finish(w, ok)
		} else {
			lowerings = append(lowerings, w)
		}
	}
	if len(lowerings) != 8 {
		t.Fatalf("%d lowerings, want 8", len(lowerings))
	}
	// No room: the new pods hold nothing and get no assignment (their agents stay unready).
	if ws := h.start(); len(ws) != 0 {
		t.Fatalf("requests before any lowering was acknowledged: %v", ws)
	}
	if g := grants(h.report("ns", "q")); g["p8"] != 0 || g["p9"] != 0 {
		t.Fatalf("new pods granted without room: %v", g)
	}
	// Each acknowledged lowering frees 2 permits, which go to the new pods.
	h.finish(lowerings[0], ok)
	if g := grants(h.report("ns", "q")); g["p8"] != 2 || g["p9"] != 0 {
		t.Fatalf("after one ack: %v", g)
	}
	for _, w := range h.start() {
		h.finish(w, ok)
	}
	for _, w := range lowerings[1:] {
		h.finish(w, ok)
	}
	h.settle()
	r := h.report("ns", "q")
	if r.Ledger != 80 || !r.Converged {
		t.Fatalf("ledger %d converged %v: %+v", r.Ledger, r.Converged, r.Holdings)
	}
	if got := h.pushesTo("http://p8"); got[0] != 2 {
		t.Fatalf("p8's first assignment gave %v, want a partial grant of 2 first", got)
	}
}

func TestUnacknowledgedRaiseIsCounted(t *testing.T) {
	d := quota(20, 2, 5, 2)
	h := converged(t, d, nil)
	d.Pods[0].Permits = 15
	h.set(d)
	ws := h.start()
	if len(ws) != 1 || ws[0].to.URL != "http://p0" {
		t.Fatalf("requests %v", ws)
	}
	h.finish(ws[0], lost) // it landed, but no answer
	if c := h.holding(h.report("ns", "q"), "p0").Counted; c != 15 {
		t.Fatalf("p0 counted %d, want 15", c)
	}
	// The controller swaps the shares: p0 is lowered at once, but p1 must not be raised while the
	// lost push may hold.
	d.Pods[0].Permits, d.Pods[1].Permits = 5, 15
	h.set(d)
	r := h.report("ns", "q")
	if hp0, hp1 := h.holding(r, "p0"), h.holding(r, "p1"); hp0.Granted != 5 || hp0.Counted != 15 || hp1.Granted != 5 {
		t.Fatalf("p0 %+v p1 %+v", hp0, hp1)
	}
	h.advance(100 * time.Millisecond) // the retry, carrying 5
	h.settle()
	r = h.report("ns", "q")
	if g := grants(r); g["p0"] != 5 || g["p1"] != 15 || r.Ledger != 20 {
		t.Fatalf("after the ack: %v ledger %d", g, r.Ledger)
	}
}

func TestInFlightAboveLoweredLimitIsCountedUntilItDrains(t *testing.T) {
	d := quota(20, 2, 10, 2)
	h := converged(t, d, nil)
	a0 := h.agent("http://p0")
	a0.inflight["q"] = 9
	d.Pods[0].Permits, d.Pods[1].Permits = 4, 16
	h.set(d)
	h.settle()
	r := h.report("ns", "q")
	if hp0 := h.holding(r, "p0"); hp0.Counted != 9 || hp0.InFlight != 9 || grants(r)["p1"] != 11 {
		t.Fatalf("p0 %+v, grants %v", hp0, grants(r))
	}
	// Polled while it drains.
	a0.inflight["q"] = 6
	h.sent = nil
	h.advance(hPoll)
	h.settle()
	if len(h.sent) == 0 || h.sent[0].kind != kindPoll {
		t.Fatalf("no poll of the draining pod: %v", h.sent)
	}
	if g := grants(h.report("ns", "q")); g["p1"] != 14 {
		t.Fatalf("after draining to 6: %v", g)
	}
	a0.inflight["q"] = 3
	h.advance(hPoll)
	h.settle()
	r = h.report("ns", "q")
	if g := grants(r); g["p1"] != 16 || r.Ledger != 20 || h.holding(r, "p0").Counted != 4 {
		t.Fatalf("after draining to 3: %v ledger %d", g, r.Ledger)
	}
}

// lastSend is when the last push of a version carrying permits to endpoint was sent.
func (h *harness) lastSend(endpoint string, permits int32) time.Time {
	var t time.Time
	for _, w := range h.sent {
		if w.to.URL == endpoint && w.kind == kindPush && w.assignment.Downstreams[0].Permits == permits {
			t = w.sentAt
		}
	}
	return t
}

func TestUnreachablePodCountedUntilLeaseAndRequestTimeoutThenAtFallback(t *testing.T) {
	d := quota(100, 2, 10, 3)
	h := converged(t, d, nil)
	h.policy["http://p0"] = dropped
	h.runFor(5 * time.Second) // a renewal and its retry fail: p0 is unreachable
	// The controller wants to give p1 more; p0 still counts 10 until its lease surely lapsed.
	d.Pods[0].Permits, d.Pods[1].Permits = 3, 97
	h.set(d)
	h.settle()
	r := h.report("ns", "q")
	if !slices.Contains(r.Unreachable, "p0") {
		t.Fatalf("p0 not reported unreachable: %+v", r)
	}
	if hp0 := h.holding(r, "p0"); hp0.Counted != 10 || hp0.Granted != 3 {
		t.Fatalf("p0 %+v", hp0)
	}
	if g := grants(r); g["p1"] != 90 {
		t.Fatalf("p1 granted %d, want 90", g["p1"])
	}
	// The last push that could have renewed the 10-permit lease: the failed renewal/retries of it.
	end := h.leaseBound("http://p0", 10)
	if want := h.lastSend("http://p0", 10).Add(hWin + hRT); !end.Equal(want) {
		t.Fatalf("the last send of 10 was answered?")
	}
	h.runFor(end.Sub(h.now) - time.Millisecond)
	if c := h.holding(h.report("ns", "q"), "p0").Counted; c != 10 {
		t.Fatalf("p0 counted %d just before its lease + request timeout, want 10", c)
	}
	h.runFor(100 * time.Millisecond)
	r = h.report("ns", "q")
	if c := h.holding(r, "p0").Counted; c != 3 {
		t.Fatalf("p0 counted %d after its lease + request timeout, want min(granted, safe default) = 3", c)
	}
	if g := grants(r); g["p1"] != 97 {
		t.Fatalf("p1 granted %d, want 97", g["p1"])
	}
	// It comes back: raised again only once reachable.
	delete(h.policy, "http://p0")
	d.Pods[0].Permits, d.Pods[1].Permits = 10, 90
	h.set(d)
	h.runFor(10 * time.Second)
	r = h.report("ns", "q")
	if g := grants(r); g["p0"] != 10 || g["p1"] != 90 || !r.Converged || len(r.Unreachable) > 0 {
		t.Fatalf("after recovery: %v %+v", g, r)
	}
}

func TestDeletedUnreachablePodReleasedOnlyAfterLeaseAndRequestTimeout(t *testing.T) {
	d := quota(20, 2, 10, 3)
	h := converged(t, d, nil)
	h.policy["http://p0"] = dropped
	h.runFor(5 * time.Second)
	d.Pods = []DesiredPod{pod(1, 20, 3)}
	h.set(d)
	r := h.report("ns", "q")
	if hp0 := h.holding(r, "p0"); !hp0.Gone || hp0.Counted != 10 || grants(r)["p1"] != 10 {
		t.Fatalf("after deletion: %+v", r.Holdings)
	}
	h.runFor(h.leaseBound("http://p0", 10).Sub(h.now) - time.Millisecond)
	if hp0 := h.holding(h.report("ns", "q"), "p0"); hp0.Counted != 10 || grants(h.report("ns", "q"))["p1"] != 10 {
		t.Fatalf("p0 released before its lease + request timeout: %+v", h.report("ns", "q").Holdings)
	}
	// Once unreachable it was sent its fallback (3) too: that lease must lapse as well.
	end := h.leaseBound("http://p0", 3)
	h.runFor(end.Sub(h.now) - time.Millisecond)
	if hp0 := h.holding(h.report("ns", "q"), "p0"); hp0.Counted != 3 || grants(h.report("ns", "q"))["p1"] != 17 {
		t.Fatalf("before the fallback's lease lapsed: %+v", h.report("ns", "q").Holdings)
	}
	h.runFor(100 * time.Millisecond)
	r = h.report("ns", "q")
	if hasHolding(r, "p0") || grants(r)["p1"] != 20 {
		t.Fatalf("p0 not released: %+v", r.Holdings)
	}
	if _, ok := h.c.pods["uid-p0"]; ok {
		t.Fatal("the deleted pod is still tracked")
	}
}

func TestTerminatingPodIsLoweredToZeroAndReleasedOnceDrained(t *testing.T) {
	d := quota(20, 2, 10, 3)
	h := converged(t, d, nil)
	h.agent("http://p0").inflight["q"] = 2
	d.Pods[0].Terminating = true
	d.Pods[1].Permits = 20
	h.set(d)
	h.settle()
	r := h.report("ns", "q")
	if hp0 := h.holding(r, "p0"); hp0.Granted != 0 || hp0.Counted != 2 || grants(r)["p1"] != 18 {
		t.Fatalf("terminating: %+v", r.Holdings)
	}
	// The pod object goes away while a call is still running: still counted.
	d.Pods = d.Pods[1:]
	h.set(d)
	if hp0 := h.holding(h.report("ns", "q"), "p0"); hp0.Counted != 2 {
		t.Fatalf("gone: %+v", hp0)
	}
	h.agent("http://p0").inflight["q"] = 0
	h.advance(hPoll)
	h.settle()
	r = h.report("ns", "q")
	if hasHolding(r, "p0") || grants(r)["p1"] != 20 {
		t.Fatalf("drained p0 not released: %+v", r.Holdings)
	}
}

func TestRecoveryLearnsHoldingsAndForbidsRaises(t *testing.T) {
	h := newHarness(t, nil)
	// What the previous manager (epoch 4) left behind.
	old := newModelAgent()
	oldA := &assignment.Assignment{Epoch: 4, Generation: 7, LeaseTTL: assignment.Duration(hTTL),
		Downstreams: []assignment.Downstream{{Name: "q", Permits: 5, SafeDefaultPermits: 2}}}
	if _, err := old.put(oldA, h.now); err != nil {
		t.Fatal(err)
	}
	h.agents["http://p0"] = old
	h.policy["http://p2"] = dropped
	h.set(quota(30, 3, 8, 2))
	h.begin(5)
	h.settle()
	r := h.report("ns", "q")
	if !r.Recovering {
		t.Fatal("not recovering")
	}
	if g := grants(r); g["p0"] != 5 || g["p1"] != 0 || g["p2"] != 0 {
		t.Fatalf("grants during recovery: %v", g)
	}
	if got := h.pushesTo("http://p0"); len(got) != 1 || got[0] != 5 {
		t.Fatalf("p0 pushes %v, want one push of 5 (what it held)", got)
	}
	if got := h.pushesTo("http://p1"); len(got) != 0 {
		t.Fatalf("the new pod got an assignment during recovery: %v", got)
	}
	if a := h.agent("http://p0"); a.epoch != 5 {
		t.Fatalf("p0 still on epoch %d", a.epoch)
	}
	h.runFor(h.c.ledger.recoverUntil(h.c.quotas[qKey]).Sub(h.now) - time.Millisecond)
	if g := grants(h.report("ns", "q")); g["p0"] != 5 || g["p1"] != 0 {
		t.Fatalf("raised before the recovery window ended: %v", g)
	}
	h.runFor(100 * time.Millisecond)
	r = h.report("ns", "q")
	if g := grants(r); g["p0"] != 8 || g["p1"] != 8 || r.Recovering {
		t.Fatalf("after recovery: %v %+v", g, r)
	}
	// p2 never answered: counted at its safe default (a bootstrap file may run it).
	if c := h.holding(r, "p2").Counted; c != 2 {
		t.Fatalf("unknown pod counted %d", c)
	}
}

// A pod that existed when the engine started may have run an agent process that a previous
// manager configured. When the process that first answers this engine is younger than a request
// timeout, the earlier one's calls may still run: what the unknown pod was counted at is carried
// until the young process's start + RT. An old process needs no carry.
func TestFirstContactWithAYoungProcessCarriesItsPredecessor(t *testing.T) {
	for _, tc := range []struct {
		name      string
		age       time.Duration // of the process that first answers
		wantGrant int32         // right after the first contact
	}{
		{"young process", time.Second, 6}, // 24 - 8 - 8 - carry 2
		{"old process", time.Hour, 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, nil)
			h.policy["http://p0"] = dropped // unreachable from the start
			h.set(quota(24, 3, 8, 2))
			h.begin(1)
			h.runFor(h.c.ledger.recoverUntil(h.c.quotas[qKey]).Sub(h.now) + time.Second)
			r := h.report("ns", "q")
			if g := grants(r); g["p1"] != 8 || g["p2"] != 8 || h.holding(r, "p0").Counted != 2 {
				t.Fatalf("before p0 answers: %+v", r.Holdings)
			}
			a := newModelAgent()
			a.started = h.now.Add(-tc.age)
			h.agents["http://p0"] = a
			delete(h.policy, "http://p0")
			h.runFor(3 * time.Second)
			r = h.report("ns", "q")
			if r.Ledger > 24 {
				t.Fatalf("ledger %d > 24: %+v", r.Ledger, r.Holdings)
			}
			if hp0 := h.holding(r, "p0"); hp0.Granted != tc.wantGrant {
				t.Fatalf("p0 after its first answer: %+v, want granted %d", hp0, tc.wantGrant)
			}
			h.runFor(hRT)
			if hp0 := h.holding(h.report("ns", "q"), "p0"); hp0.Granted != 8 || hp0.Counted != 8 {
				t.Fatalf("p0 a request timeout later: %+v", hp0)
			}
		})
	}
}

// A pod that got its IP after the engine started and has not answered yet holds nothing, unless
// its agent runs a bootstrap file: then it may already call on its safe default.
func TestNewPodNotAnsweringIsCountedOnlyWithABootstrapFile(t *testing.T) {
	d := quota(30, 2, 8, 2)
	h := converged(t, d, nil)
	plain, boot := pod(2, 8, 2), pod(3, 8, 2)
	boot.Bootstrap = true
	d.Pods = append(d.Pods, plain, boot)
	h.policy["http://p2"], h.policy["http://p3"] = dropped, dropped
	h.set(d)
	h.runFor(2 * time.Second)
	r := h.report("ns", "q")
	if got := h.holding(r, "p2").Counted; got != 0 {
		t.Fatalf("new pod without a bootstrap file counted %d before it answered, want 0", got)
	}
	if got := h.holding(r, "p3").Counted; got != 2 {
		t.Fatalf("new pod with a bootstrap file counted %d before it answered, want its safe default 2", got)
	}
}

// docs/protocol.md §9: an agent holding a newer epoch fences the engine once the epoch record
// confirms that a newer manager took it; until the record is read the pod gets nothing.
func TestNewerEpochFencesTheEngine(t *testing.T) {
	h := newHarness(t, nil)
	a := newModelAgent()
	a.epoch, a.gen, a.configured = 9, 1, true
	h.agents["http://p0"] = a
	h.set(quota(30, 2, 8, 2))
	h.begin(3)
	h.settle()
	upTo, ok := h.c.claims.pendingClaim()
	if !ok || h.c.ledger.fenced {
		t.Fatalf("claim pending %v, fenced %v", ok, h.c.ledger.fenced)
	}
	h.runFor(time.Second)
	if n := len(h.requestsTo("http://p0")); n != 1 {
		t.Fatalf("%d requests to the claiming pod before the record was read, want the one probe", n)
	}
	h.c.claims.recordRead(upTo, 9, nil, h.now)
	if !h.c.ledger.fenced || h.c.claims.fencedBy != 9 {
		t.Fatalf("not fenced: %v %d", h.c.ledger.fenced, h.c.claims.fencedBy)
	}
	h.sent = nil
	h.runFor(time.Minute)
	if len(h.sent) != 0 {
		t.Fatalf("a fenced engine sent %d requests", len(h.sent))
	}
}

// A restarted agent's old process may still have calls running at the downstream for a request
// timeout. The engine carries its bound and grants the new process only from free room: the pod
// is never counted at the old calls plus a fresh grant above the limit.
func TestAgentRestartCarriesOldCalls(t *testing.T) {
	for _, tc := range []struct {
		name     string
		instance bool // the agents report an instance id (real agents do)
	}{{"by instance", true}, {"by counters", false}} {
		t.Run(tc.name, func(t *testing.T) {
			d := quota(20, 2, 10, 3)
			h := newHarness(t, nil)
			a0 := h.agent("http://p0")
			if !tc.instance {
				a0.instance = ""
			}
			h.begin(1)
			h.set(d)
			h.runFor(hWin + hRT + 100*time.Millisecond)
			a0.inflight["q"], a0.requests["q"] = 7, 100
			h.advance(3 * time.Second) // the renewal reports 7 in flight, 100 requests
			h.settle()
			fresh := newModelAgent()
			if tc.instance {
				fresh.requests["q"] = 500 // the counter went forward: only the instance tells
			} else {
				fresh.instance = "" // only the request counter going backwards tells
			}
			h.agents["http://p0"] = fresh
			h.advance(3 * time.Second)
			h.settle()
			r := h.report("ns", "q")
			if r.Ledger > 20 {
				t.Fatalf("ledger %d > limit 20 after the restart: %+v", r.Ledger, r.Holdings)
			}
			if hp0 := h.holding(r, "p0"); hp0.Counted != 10 {
				t.Fatalf("restarted p0 counted %d, want the old process's bound of 10", hp0.Counted)
			}
			if tc.instance {
				if got := fresh.limit("q", h.now); got != 0 {
					t.Fatalf("the new process holds %d while the old one's calls may run; want 0", got)
				}
			}
			// A request timeout later the old calls are over and the new process gets its share.
			h.runFor(hRT + time.Second)
			r = h.report("ns", "q")
			if hp0 := h.holding(r, "p0"); hp0.Counted != 10 || hp0.Granted != 10 || !hp0.Synced {
				t.Fatalf("p0 a request timeout after the restart: %+v", hp0)
			}
			if got := fresh.limit("q", h.now); got != 10 {
				t.Fatalf("the new process holds %d, want 10", got)
			}
			if r.Ledger > 20 {
				t.Fatalf("ledger %d > limit 20", r.Ledger)
			}
		})
	}
}

func TestSwitchApplied(t *testing.T) {
	d := quota(40, 2, 10, 3)
	d.Pods = append(d.Pods, DesiredPod{Name: "api0", UID: "uid-api0", Target: "api", Endpoint: "http://api0", Permits: 10, SafeDefault: 3})
	sw := assignment.Switch{Name: "ns/r1", ExpiresAt: time.Date(2026, 7, 2, 0, 0, 0, 0, time.UTC), Percent: 100,
		Action: assignment.Fallback{Action: assignment.ActionReject}}
	d.Switches = []TargetedSwitch{{Target: "web", Switch: sw}}
	h := converged(t, d, nil)
	if a, n := h.c.reports.switchApplied("ns/r1"); a != 2 || n != 2 {
		t.Fatalf("applied %d/%d, want 2/2", a, n)
	}
	if h.agent("http://api0").a.Switches != nil {
		t.Fatal("a switch for target web reached target api")
	}
	d.Switches[0].Switch.Percent = 50
	d.Switches[0].Switch.KeyHeader = "X-User"
	h.set(d)
	if a, n := h.c.reports.switchApplied("ns/r1"); a != 0 || n != 2 {
		t.Fatalf("applied %d/%d after a change, want 0/2", a, n)
	}
	h.settle()
	if a, n := h.c.reports.switchApplied("ns/r1"); a != 2 || n != 2 {
		t.Fatalf("applied %d/%d, want 2/2", a, n)
	}
	d.Switches = nil
	h.set(d)
	h.settle()
	if a, n := h.c.reports.switchApplied("ns/r1"); a != 0 || n != 0 {
		t.Fatalf("applied %d/%d after removal", a, n)
	}
}

func TestDeleteQuotaPushesAnEmptyAssignmentThenForgets(t *testing.T) {
	h := converged(t, quota(20, 2, 10, 3), nil)
	h.c.deleteQuota(qKey, h.now)
	h.settle()
	if n := len(h.agent("http://p0").a.Downstreams); n != 0 {
		t.Fatalf("agent still holds %d downstreams", n)
	}
	if len(h.c.pods) != 0 {
		t.Fatalf("pods still tracked: %d", len(h.c.pods))
	}
}

func TestMultipleQuotasShareOneAssignmentPerPod(t *testing.T) {
	h := newHarness(t, nil)
	h.begin(1)
	d1 := quota(20, 2, 10, 3)
	d2 := quota(6, 2, 3, 1)
	d2.Key.Name = "other"
	d2.Downstream = template("other")
	h.set(d1)
	h.set(d2)
	h.runFor(hWin + hRT + 100*time.Millisecond)
	a := h.agent("http://p1").a
	if len(a.Downstreams) != 2 || a.Downstreams[0].Name != "other" || a.Downstreams[0].Permits != 3 || a.Downstreams[1].Permits != 10 {
		t.Fatalf("assignment %+v", a.Downstreams)
	}
}

// Issue 20: deleting a quota and re-creating it (same name, same or another spec) must never
// fence the engine. The agents still hold this epoch's generations of the deleted quota; the
// re-created quota converges like a new one.
func TestDeleteAndRecreateQuotaNeverFences(t *testing.T) {
	for _, tc := range []struct {
		name    string
		gap     time.Duration // between deletion and re-creation
		respec  bool          // re-created with another limit and permits
		rounds  int
		settled bool // the deletion was pushed (empty assignments) before the re-creation
	}{
		{name: "at once", gap: 0, rounds: 1},
		{name: "100ms", gap: 100 * time.Millisecond, rounds: 3},
		{name: "1s settled", gap: time.Second, settled: true, rounds: 3},
		{name: "10s settled, other spec", gap: 10 * time.Second, settled: true, respec: true, rounds: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := converged(t, quota(20, 2, 10, 3), nil)
			for range tc.rounds {
				h.c.deleteQuota(qKey, h.now)
				h.check()
				if tc.settled {
					h.settle()
				}
				h.advance(tc.gap)
				d := quota(20, 2, 10, 3)
				if tc.respec {
					d = quota(12, 2, 6, 2)
				}
				h.set(d)
				h.runFor(2 * time.Second)
				if h.c.ledger.fenced {
					t.Fatalf("fenced by a re-created quota")
				}
				r := h.report("ns", "q")
				if !r.Converged {
					t.Fatalf("not converged after re-creation: %+v", r)
				}
				want := int32(10)
				if tc.respec {
					want = 6
				}
				for _, ep := range []string{"http://p0", "http://p1"} {
					if got := h.agent(ep).limit("q", h.now); got != want {
						t.Fatalf("%s holds %d, want %d", ep, got, want)
					}
				}
			}
		})
	}
}

// A pod that still runs calls of the deleted quota's downstream is counted by the re-created
// quota until they ended: the re-created quota grants new pods only from room the old calls left.
func TestRecreatedQuotaCountsCallsOfTheDeletedOne(t *testing.T) {
	h := converged(t, quota(20, 2, 10, 3), nil)
	p0 := h.agent("http://p0")
	p0.inflight["q"] = 10 // ten calls running, each may last RT
	h.c.deleteQuota(qKey, h.now)
	h.settle()
	// The agent still reports the calls; the deleted quota keeps p0 counted until they end, and
	// the re-created quota (three pods at 6) plans on top of them.
	h.set(quota(20, 3, 6, 3))
	h.runFor(time.Second)
	r := h.report("ns", "q")
	if got := r.Holdings[0].Counted; got < 10 {
		t.Fatalf("p0 counted %d while 10 calls run: %+v", got, r.Holdings)
	}
	if r.Ledger > 20 {
		t.Fatalf("ledger %d > 20: %+v", r.Ledger, r.Holdings)
	}
	if g := grants(r); g["p2"] > 20-10-6 {
		t.Fatalf("p2 granted %d beside 10 running calls and p1's 6: %v", g["p2"], g)
	}
	delete(p0.inflight, "q")
	h.runFor(time.Second)
	if r := h.report("ns", "q"); !r.Converged || h.c.ledger.fenced || grants(r)["p2"] != 6 {
		t.Fatalf("not converged once the calls ended: %+v", r)
	}
}

// An agent that holds a generation of this epoch the engine does not know (the engine forgot the
// pod) is re-learned, counted at what it holds, and pushed a higher generation: never fenced.
func TestSameEpochHigherGenerationIsRelearnedNotFenced(t *testing.T) {
	h := newHarness(t, nil)
	a := newModelAgent()
	h.agents["http://p0"] = a
	h.begin(3)
	// The agent holds generation 7 of this epoch with 9 permits: pushed by this engine to a pod it
	// has since forgotten.
	old := &assignment.Assignment{Epoch: 3, Generation: 7, LeaseTTL: assignment.Duration(hTTL), Downstreams: []assignment.Downstream{template("q")}}
	old.Downstreams[0].Permits, old.Downstreams[0].SafeDefaultPermits = 9, 3
	if _, err := a.put(old, h.now); err != nil {
		t.Fatal(err)
	}
	h.set(quota(12, 2, 6, 3))
	h.settle()
	if h.c.ledger.fenced {
		t.Fatalf("fenced by an agent of the same epoch")
	}
	if a.gen <= 7 || a.epoch != 3 {
		t.Fatalf("agent holds e%d g%d, want generation above 7", a.epoch, a.gen)
	}
	if evs := h.c.reports.takeEvents(); len(evs) != 1 || evs[0].Quota != qKey || evs[0].Reason != ReasonAgentRelearned || !evs[0].Warning ||
		!strings.Contains(evs[0].Message, "pod p0 held generation 7") {
		t.Fatalf("events %+v, want one AgentRelearned for p0", evs)
	}
	h.runFor(hWin + hRT + time.Second)
	r := h.report("ns", "q")
	if !r.Converged || h.agent("http://p0").limit("q", h.now) != 6 || h.agent("http://p1").limit("q", h.now) != 6 {
		t.Fatalf("not converged: %+v", r)
	}
}

// docs/protocol.md §4, renewals in steps: over random renewal periods and send times, a renewal
// is due on the grid, after its push was sent, and no later than RenewEvery after it; renewals
// due within one step fall on the same instant.
func TestNextRenewalOnTheGrid(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 5))
	for range 20000 {
		every := time.Duration(1 + rng.Int64N(int64(time.Minute)))
		o := Options{RenewEvery: every}
		if rng.IntN(2) == 0 {
			o.jitter = func(d time.Duration) time.Duration { return d }
		}
		s := &scheduler{opts: &o}
		sent := time.Unix(0, rng.Int64N(1<<62))
		at := s.nextRenewal(sent)
		step := renewGrid(every)
		if step <= 0 || step > 100*time.Millisecond || (every >= 16 && step > every/16) {
			t.Fatalf("every %s: step %s", every, step)
		}
		if !at.After(sent) || at.After(sent.Add(every)) || at.Before(sent.Add(every-every/4-step)) {
			t.Fatalf("every %s, sent %s: due at %s (+%s)", every, sent, at, at.Sub(sent))
		}
		if !at.Equal(at.Truncate(step)) {
			t.Fatalf("every %s: due at %s, off the %s grid", every, at, step)
		}
		if later := sent.Add(time.Duration(rng.Int64N(int64(step)))); o.jitter != nil &&
			sent.Add(every).Truncate(step).Equal(later.Add(every).Truncate(step)) && !s.nextRenewal(later).Equal(at) {
			t.Fatalf("every %s: pushes sent at %s and %s renew at different instants in one step", every, sent, later)
		}
	}
}

// Under Observe a pod's calls in flight beyond its grant are not counted: the ledger stays at
// Σ grants (the grant stays reserved) and another pod can still be raised into free room. Once
// the quota is Enforce they are counted at once, from the last report, until they drain.
func TestObserveInFlightIsNotCountedUntilEnforce(t *testing.T) {
	d := quota(20, 2, 5, 2) // 10 of 20 granted: room for a raise
	d.Downstream.Observe = true
	h := converged(t, d, nil)
	a0 := h.agent("http://p0")
	if !a0.batch {
		a0 = h.agent("http://p1") // the one that advertises Observe
	}
	ep := "p0"
	if a0 == h.agent("http://p1") {
		ep = "p1"
	}
	if !a0.a.Downstreams[0].Observe {
		t.Fatal("the agent that knows Observe was not sent it")
	}
	a0.inflight["q"] = 17
	h.advance(DefaultRenewEvery)
	h.settle()
	r := h.report("ns", "q")
	if hp := h.holding(r, ep); hp.InFlight != 17 || hp.Counted != 5 || r.Ledger != 10 {
		t.Fatalf("under Observe: %s %+v, ledger %d; want 17 in flight counted at its grant 5, ledger 10", ep, hp, r.Ledger)
	}
	// Enforce: Σ counted is above the limit while the Observe calls drain, as after a lowered
	// maxInFlight (docs/protocol.md §11 and §11b); the harness's ledger check does not apply.
	h.check = func() {}
	d.Downstream.Observe = false
	h.set(d)
	h.settle()
	r = h.report("ns", "q")
	if hp := h.holding(r, ep); hp.Counted != 17 || r.Ledger != 22 {
		t.Fatalf("under Enforce: %s %+v, ledger %d; want counted at its 17 calls in flight, ledger 22", ep, hp, r.Ledger)
	}
	a0.inflight["q"] = 3
	h.advance(hPoll)
	h.settle()
	if r = h.report("ns", "q"); r.Ledger != 10 {
		t.Fatalf("drained to 3: ledger %d, want 10", r.Ledger)
	}
}
