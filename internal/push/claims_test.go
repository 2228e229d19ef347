package push

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

const hugeEpoch = 1<<53 - 1 // 9007199254740991, the largest epoch an assignment may carry

// docs/protocol.md §9: an agent claiming an epoch no manager holds does not stop the engine. Until
// the record is read the pod gets nothing; once the record refutes the claim, the pod is
// misbehaving — unreachable, named in the report and in one Warning Event — and everyone else
// goes on; asked again after its backoff, a true answer makes it an ordinary pod again.
func TestFalseEpochClaimIsRefutedNotFenced(t *testing.T) {
	h := converged(t, quota(30, 3, 8, 2), nil)
	liar := h.agent("http://p0")
	liar.claim = hugeEpoch
	h.advance(4 * time.Second) // a renewal round: p0's renewal is answered with the claim
	h.settle()
	upTo, ok := h.c.claims.pendingClaim()
	if !ok || h.c.ledger.fenced {
		t.Fatalf("claim pending %v, fenced %v", ok, h.c.ledger.fenced)
	}
	r := h.report("ns", "q")
	if !slices.Contains(r.Unreachable, "p0") || len(r.Misbehaving) != 0 {
		t.Fatalf("before the record was read: unreachable %v misbehaving %v", r.Unreachable, r.Misbehaving)
	}
	// Nothing goes to p0 while its claim waits; the others are renewed.
	h.sent = nil
	h.runFor(5 * time.Second)
	if n := len(h.requestsTo("http://p0")); n != 0 {
		t.Fatalf("%d requests to p0 while its claim waited for the record", n)
	}
	if len(h.requestsTo("http://p1")) == 0 {
		t.Fatal("p1 was not renewed")
	}

	h.c.claims.recordRead(upTo, 1, nil, h.now)
	if h.c.ledger.fenced {
		t.Fatal("fenced by a claim the record refutes")
	}
	evs := h.c.reports.takeEvents()
	if len(evs) != 1 || evs[0].Reason != ReasonAgentClaimsNewerEpoch || !evs[0].Warning || evs[0].Quota != qKey {
		t.Fatalf("events %+v, want one AgentClaimsNewerEpoch", evs)
	}
	h.c.flush(h.now)
	r = h.report("ns", "q")
	if !slices.Equal(r.Misbehaving, []string{"p0"}) || !slices.Contains(r.Unreachable, "p0") {
		t.Fatalf("after the record: unreachable %v misbehaving %v", r.Unreachable, r.Misbehaving)
	}
	// Asked again (a probe, never a push) after its backoff; it lies again: decided by the next
	// read, without a second Event within claimEventEvery.
	h.sent = nil
	h.runFor(6 * time.Second)
	for _, w := range h.requestsTo("http://p0") {
		if w.kind != kindProbe {
			t.Fatalf("a %s to a misbehaving pod", w.kind)
		}
	}
	if len(h.requestsTo("http://p0")) != 1 {
		t.Fatalf("%d requests to p0, want one probe", len(h.requestsTo("http://p0")))
	}
	upTo, ok = h.c.claims.pendingClaim()
	if !ok {
		t.Fatal("the second claim is not pending")
	}
	h.c.claims.recordRead(upTo, 1, nil, h.now)
	if evs := h.c.reports.takeEvents(); len(evs) != 0 {
		t.Fatalf("a second Event within %s: %+v", claimEventEvery, evs)
	}
	// It tells the truth again: an ordinary pod.
	liar.claim = 0
	h.runFor(10 * time.Second)
	r = h.report("ns", "q")
	if len(r.Misbehaving) != 0 || len(r.Unreachable) != 0 || !r.Converged {
		t.Fatalf("after true answers: %+v", r)
	}
}

// A failed read of the record decides nothing: no fencing, the pod still gets nothing, and the
// next read decides. A claim made after a read started waits for the next one.
func TestEpochRecordReadErrorDecidesNothing(t *testing.T) {
	h := converged(t, quota(30, 3, 8, 2), nil)
	h.agent("http://p0").claim = 7
	h.advance(4 * time.Second)
	h.settle()
	upTo, ok := h.c.claims.pendingClaim()
	if !ok {
		t.Fatal("no claim pending")
	}
	h.c.claims.recordRead(upTo, 0, errors.New("the server is currently unable to handle the request"), h.now)
	if h.c.ledger.fenced {
		t.Fatal("fenced on a read error")
	}
	if _, ok := h.c.claims.pendingClaim(); !ok {
		t.Fatal("a read error decided the claim")
	}
	// p1 claims too, after the read that will refute p0's started (upTo).
	h.agent("http://p1").claim = 7
	h.runFor(4 * time.Second)
	if h.c.pods["uid-p1"].claimSeq <= upTo {
		t.Fatal("p1 made no claim")
	}
	h.c.claims.recordRead(upTo, 1, nil, h.now)
	if !h.c.pods["uid-p0"].misbehaving || h.c.pods["uid-p1"].misbehaving {
		t.Fatalf("misbehaving p0 %v p1 %v, want p0 only", h.c.pods["uid-p0"].misbehaving, h.c.pods["uid-p1"].misbehaving)
	}
	if upTo2, ok := h.c.claims.pendingClaim(); !ok || upTo2 <= upTo {
		t.Fatal("p1's claim was not left for the next read")
	}
}

// A genuinely newer manager: the record above the engine's epoch fences it, whatever epoch the
// agent claimed.
func TestNewerRecordFences(t *testing.T) {
	h := converged(t, quota(30, 3, 8, 2), nil)
	h.agent("http://p2").claim = hugeEpoch
	h.advance(4 * time.Second)
	h.settle()
	upTo, ok := h.c.claims.pendingClaim()
	if !ok {
		t.Fatal("no claim pending")
	}
	h.c.claims.recordRead(upTo, 2, nil, h.now)
	if !h.c.ledger.fenced || h.c.claims.fencedBy != 2 {
		t.Fatalf("fenced %v by %d, want by the record's 2", h.c.ledger.fenced, h.c.claims.fencedBy)
	}
}

// epochLiar answers every control request in one shape, each claiming epoch hugeEpoch (or
// carrying it in a body the client must not read as a State).
func epochLiar(t *testing.T, shape string) *httptest.Server {
	st := fmt.Sprintf(`{"instance":"liar","epoch":%d,"generation":%d,"configured":true,"downstreams":[{"name":"q","permits":1000,"effectivePermits":1000}]}`,
		int64(hugeEpoch), int64(hugeEpoch))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		problem := func(code int, ctype, body string) {
			w.Header().Set("Content-Type", ctype)
			w.WriteHeader(code)
			_, _ = w.Write([]byte(body))
		}
		switch shape {
		case "200 State":
			problem(http.StatusOK, "application/json", st)
		case "409 stale-assignment":
			problem(http.StatusConflict, "application/problem+json", `{"title":"Conflict","status":409,"code":"stale-assignment","state":`+st+`}`)
		case "409 as application/json":
			problem(http.StatusConflict, "application/json", `{"status":409,"state":`+st+`}`)
		case "403 wrong-instance":
			problem(http.StatusForbidden, "application/problem+json", `{"title":"Forbidden","status":403,"code":"forbidden","reason":"wrong-instance","state":`+st+`}`)
		case "403 other reason with a State":
			problem(http.StatusForbidden, "application/problem+json", `{"title":"Forbidden","status":403,"code":"forbidden","reason":"bad-signature","state":`+st+`}`)
		case "500 with a State":
			problem(http.StatusInternalServerError, "application/problem+json", `{"title":"Internal","status":500,"state":`+st+`}`)
		case "200 State as text/plain":
			problem(http.StatusOK, "text/plain", st)
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

// Every answer shape that carries a State — a 200, a 409 (as problem+json or plain JSON), a 403
// wrong-instance, and bodies the client must not take for one (a 403 of another reason, a 500)
// — claiming the largest epoch, over HTTP with the real signing client: the engine is never
// fenced; the pods whose answer the client reads as a State are named misbehaving (Report and a
// Warning Event each), the others unreachable; the honest pods converge; the record is read
// once per EpochCheckEvery at most. With a newer record, the same answer fences.
func TestEngineAgentClaimsOfANewerEpochInEveryShape(t *testing.T) {
	claims := []string{"200 State", "409 stale-assignment", "409 as application/json", "403 wrong-instance", "200 State as text/plain"}
	others := []string{"403 other reason with a State", "500 with a State"}
	var mu sync.Mutex
	var events []Event
	r := newRig(t, 3, nil, nil, 5, func(o *Options) {
		o.OnEvent = func(ev Event) {
			mu.Lock()
			events = append(events, ev)
			mu.Unlock()
		}
	})
	r.start()
	d := r.quota(4, 4, 4)
	d.Limit = 100
	for _, shape := range append(slices.Clone(claims), others...) {
		d.Pods = append(d.Pods, DesiredPod{Name: shape, UID: types.UID(shape), Target: "web",
			Endpoint: epochLiar(t, shape).URL, Permits: 4, SafeDefault: 1})
	}
	r.e.SetQuota(d)
	r.pastRecovery()
	start := r.clk.Now()
	r.waitFor("the claims refuted and the honest pods converged", func() bool {
		rep := r.e.Report(qKey)
		return len(rep.Misbehaving) == len(claims) && len(rep.Unreachable) == len(claims)+len(others) &&
			grants(rep)["p0"] == 4 && grants(rep)["p2"] == 4
	})
	for i := range 3 {
		if p, ep := r.holds(i); p != 4 || ep != 5 {
			t.Fatalf("honest agent %d holds %d at epoch %d", i, p, ep)
		}
	}
	// A while longer: the liars are asked again and lie again; nothing stops.
	for range 5 {
		r.clk.Step(2 * time.Second)
		time.Sleep(20 * time.Millisecond)
	}
	rep := r.e.Report(qKey)
	slices.Sort(claims)
	if !slices.Equal(rep.Misbehaving, claims) {
		t.Fatalf("misbehaving %v, want %v", rep.Misbehaving, claims)
	}
	select {
	case err := <-r.done:
		t.Fatalf("the engine stopped: %v", err)
	default:
	}
	elapsed := r.clk.Now().Sub(start)
	if reads, most := r.rec.reads.Load(), int64(elapsed/DefaultEpochCheckEvery)+1; reads > most || reads == 0 {
		t.Fatalf("%d reads of the record in %s, want 1 to %d", reads, elapsed, most)
	}
	mu.Lock()
	named := map[string]int{}
	for _, ev := range events {
		if ev.Reason == ReasonAgentClaimsNewerEpoch {
			for _, c := range claims {
				if strings.Contains(ev.Message, "pod "+c+" answered") {
					named[c]++
				}
			}
		}
	}
	mu.Unlock()
	for _, c := range claims {
		if named[c] != 1 {
			t.Errorf("%d AgentClaimsNewerEpoch Events name %q, want 1", named[c], c)
		}
	}
	if v := metricValue(r.e.metrics.recordReads.WithLabelValues(recordNotNewer)); v < 1 {
		t.Errorf("epoch_record_reads_total{result=not-newer} = %v", v)
	}

	// A newer manager took an epoch: the next claim fences.
	r.rec.set(6, nil)
	r.waitForStepping("fenced", 10*time.Millisecond, func() bool {
		select {
		case err := <-r.done:
			if !errors.Is(err, ErrFenced) {
				t.Fatalf("Start returned %v", err)
			}
			r.cancel = nil
			return true
		default:
			return false
		}
	})
}
