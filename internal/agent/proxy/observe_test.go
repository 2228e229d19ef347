package proxy

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

// Observe on the admission chain alone: every call is admitted at once (no wait on the fake
// clock, which never moves here), holds a permit beyond the limit if need be, and what Enforce
// would have refused is counted by the first reason.

func (r *admitRig) wouldRefuse(t *testing.T, reason string) float64 {
	t.Helper()
	return metricValue(t, r.m, "apportion_agent_would_refuse_total", "downstream", "d", "reason", reason)
}

func observeDownstream(permits int32) assignment.Downstream {
	d := admitDownstream(permits)
	d.Observe = true
	return d
}

// eventually polls cond for up to 10 s (the shadow waiters run on goroutines of their own).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("not within 10 s: %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// shadowWaiting waits until n calls wait in the downstream's shadow semaphore.
func (r *admitRig) shadowWaiting(t *testing.T, n int) {
	t.Helper()
	eventually(t, fmt.Sprintf("%d shadow waiters", n), func() bool { return r.ds().Shadow.Stats().Waiting == n })
}

func TestObserveAdmitsBeyondThePermitsAndCounts(t *testing.T) {
	r := newAdmitRig(t, nil, observeDownstream(2))
	var held []admission
	for i := range 5 {
		ad := r.admit(context.Background(), http.MethodGet)
		if ad.verdict != admitted {
			t.Fatalf("call %d: verdict %v, want admitted (Observe never refuses)", i, ad.verdict)
		}
		held = append(held, ad)
	}
	if r.inFlight() != 5 {
		t.Fatalf("in flight %d, want 5: every Observe call holds a permit, beyond the 2 permits", r.inFlight())
	}
	// Enforce would make the 3 calls beyond the permits wait acquireTimeout: so do their shadows.
	r.shadowWaiting(t, 3)
	if n := r.wouldRefuse(t, "no-permit"); n != 0 {
		t.Fatalf("would_refuse{no-permit} = %v before the wait allowed passed", n)
	}
	r.clk.Step(50 * time.Millisecond)
	eventually(t, "3 would-refuse no-permit", func() bool { return r.wouldRefuse(t, "no-permit") == 3 })
	if n := r.rejected(t, "no-permit"); n != 0 {
		t.Fatalf("rejected{no-permit} = %v under Observe", n)
	}
	st := r.enf.State().Downstreams[0]
	if !st.Observe || st.InFlight != 5 || st.WouldRefuse["no-permit"] != 3 {
		t.Fatalf("State = %+v, want observe, 5 in flight, 3 would-refuse no-permit", st)
	}
	for i := range held {
		r.ds().Sem.Release()
		held[i].endShadow(r.clk)
	}
	if sh := r.ds().Shadow.Stats(); sh.InFlight != 0 || sh.Waiting != 0 {
		t.Fatalf("shadow after every call ended: %+v", sh)
	}
}

// The shadow plays Enforce's wait: a call that would have got a permit within the wait allowed
// is not counted; one that would not is (no-permit), and one beyond the waiters' bound at once
// (queue-full). A waiter granted after its call ended holds the shadow permit for the call's
// duration from the grant, as the call would have under Enforce.
func TestObserveShadowWaitsAsEnforceWould(t *testing.T) {
	d := observeDownstream(1)
	one := int32(1)
	d.MaxWaiting = &one
	r := newAdmitRig(t, nil, d)
	a := r.admit(context.Background(), http.MethodGet) // the shadow permit, free
	b := r.admit(context.Background(), http.MethodGet) // waits in the shadow
	r.shadowWaiting(t, 1)
	r.admit(context.Background(), http.MethodGet) // beyond the waiters' bound of 1: queue-full at once
	eventually(t, "would-refuse queue-full", func() bool { return r.wouldRefuse(t, "queue-full") == 1 })
	r.clk.Step(20 * time.Millisecond)
	a.endShadow(r.clk) // a ended after 20 ms: b gets the shadow permit within its wait
	// Granted, b's waiter stops its timer: until then a step past its wait could still cancel it
	// (a permit granted as the wait ends is given back, as under Enforce).
	<-b.shadowWait.waited
	r.clk.Step(100 * time.Millisecond) // past b's wait allowed: granted, it is not counted
	if n := r.wouldRefuse(t, "no-permit"); n != 0 {
		t.Fatalf("would_refuse{no-permit} = %v: a call Enforce would have served in its wait was counted", n)
	}
	// b ended 120 ms after it arrived, having been granted at 20 ms: its shadow permit is held
	// 20 ms more, until 20 + 120 ms, when it would have ended under Enforce.
	b.endShadow(r.clk)
	if sh := r.ds().Shadow.Stats(); sh.InFlight != 1 {
		t.Fatalf("shadow in flight %d right after b ended, want 1 (held for b's duration from its grant)", sh.InFlight)
	}
	r.clk.Step(20 * time.Millisecond)
	eventually(t, "b's shadow permit released", func() bool { return r.ds().Shadow.Stats().InFlight == 0 })
}

// The first step that would have refused names the reason: a switch before the breaker, the
// breaker before the rate, the rate before the permit.
func TestObserveCountsTheFirstReason(t *testing.T) {
	d := withBreaker(observeDownstream(1), 2, 1, 30*time.Second)
	d.Rate = &assignment.Rate{PerSecond: 1, Burst: 1, Mode: assignment.ModeTokenBucket}
	sw := []assignment.Switch{{Name: "ns/dry", Downstream: "d", ExpiresAt: t0.Add(time.Minute), Percent: 100,
		Methods: []string{"DELETE"}, Action: assignment.Fallback{Action: assignment.ActionReject}, DryRun: true}}
	r := newAdmitRig(t, sw, d)
	// 1: a token and the permit: nothing would be refused.
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("verdict %v", ad.verdict)
	}
	// 2: no token within 200 ms (1/s, burst 1), and no permit: rate-limited, the earlier step.
	r.admit(context.Background(), http.MethodGet)
	// 3: the dry-run switch matches DELETE: degraded, the first step.
	r.admit(context.Background(), http.MethodDelete)
	for reason, want := range map[string]float64{"rate-limited": 1, "degraded": 1, "no-permit": 0, "circuit-open": 0} {
		if n := r.wouldRefuse(t, reason); n != want {
			t.Errorf("would_refuse{%s} = %v, want %v", reason, n, want)
		}
	}
	r.openBreaker(t, 2)
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted || ad.ticket != (admission{}).ticket {
		t.Fatalf("with the breaker open: %+v, want admitted without a ticket", ad)
	}
	if n := r.wouldRefuse(t, "circuit-open"); n != 1 {
		t.Fatalf("would_refuse{circuit-open} = %v, want 1", n)
	}
	if r.inFlight() != 4 {
		t.Fatalf("in flight %d, want 4", r.inFlight())
	}
}

// Under Enforce, a dry-run switch counts what it matches and the chain goes on as if it were off.
func TestDryRunSwitchUnderEnforce(t *testing.T) {
	sw := []assignment.Switch{{Name: "ns/dry", Downstream: "d", ExpiresAt: t0.Add(time.Minute), Percent: 100,
		Action: assignment.Fallback{Action: assignment.ActionReject}, DryRun: true}}
	r := newAdmitRig(t, sw, admitDownstream(1))
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("verdict %v, want admitted: a dry-run switch refuses nothing", ad.verdict)
	}
	if n := r.wouldRefuse(t, "degraded"); n != 1 {
		t.Fatalf("would_refuse{degraded} = %v, want 1", n)
	}
	// Enforce still enforces the permit: the second call waits out the acquire timeout.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if ad := r.admit(ctx, http.MethodGet); ad.verdict == admitted {
		t.Fatal("a second call was admitted beyond 1 permit under Enforce")
	}
	r.ds().Sem.Release()
}

// Observe → Enforce is a lowering: the calls admitted under Observe keep their permits, and a
// new call under Enforce gets one only once they have drained below the limit.
func TestObserveThenEnforceDrains(t *testing.T) {
	r := newAdmitRig(t, nil, observeDownstream(2))
	for range 4 {
		r.admit(context.Background(), http.MethodGet)
	}
	d := admitDownstream(2) // the same downstream, enforced
	if _, err := r.enf.Apply(&assignment.Assignment{Epoch: 1, Generation: 2, LeaseTTL: assignment.Duration(10 * time.Minute),
		Downstreams: []assignment.Downstream{d}}, time.Time{}); err != nil {
		t.Fatal(err)
	}
	if st := r.enf.State().Downstreams[0]; st.Observe || st.InFlight != 4 {
		t.Fatalf("after Enforce: %+v, want enforced with the 4 Observe calls in flight", st)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // no wait: what TryAcquire does now
	for drained := 4; drained > 1; drained-- {
		if ad := r.admit(ctx, http.MethodGet); ad.verdict == admitted {
			t.Fatalf("a call admitted with %d in flight and 2 permits", r.inFlight())
		}
		r.ds().Sem.Release() // one Observe call ends
	}
	// 1 in flight of 2: the next call gets the permit.
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("verdict %v with 1 in flight of 2", ad.verdict)
	}
	if r.inFlight() != 2 {
		t.Fatalf("in flight %d, want 2", r.inFlight())
	}
}
