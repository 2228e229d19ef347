package proxy

import (
	"context"
	"net/http"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/agent/deadline"
	"github.com/apportion/apportion/internal/agent/degrade"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/assignment"
)

// The chain's order and its giving back, where the step tests above cannot tell.

// The breaker step comes before the rate step: a call refused by an open breaker takes no rate
// token. The limiter accrues one token per 100 s, so the probe 30 s later finds the token only if
// the refused call left it.
func TestAdmitBreakerBeforeRate(t *testing.T) {
	d := withBreaker(admitDownstream(4), 2, 1, 30*time.Second)
	d.Rate = &assignment.Rate{PerSecond: 0.01, Burst: 1, Mode: assignment.ModeTokenBucket}
	r := newAdmitRig(t, nil, d)
	r.openBreaker(t, 2)
	wantRefused(t, r.admit(context.Background(), http.MethodGet), fallback.CircuitOpen, 30*time.Second)
	r.clk.Step(30 * time.Second)
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("probe = %+v, want admitted with the token the refused call did not take", ad)
	}
}

// A refusal after the lane permit was taken gives it back: the ticket step refuses (a half-open
// breaker's only probe slot is taken) with the lane's and the downstream's permits held.
func TestAdmitTicketRefusalGivesBackLanePermit(t *testing.T) {
	r := newAdmitRig(t, nil, withBreaker(lanedDownstream(8), 2, 1, 30*time.Second))
	r.openBreaker(t, 2)
	r.clk.Step(30 * time.Second)
	probe := r.admit(context.Background(), http.MethodGet)
	if probe.verdict != admitted || probe.lanes == nil {
		t.Fatalf("probe = %+v, want admitted holding a lane permit", probe)
	}
	wantRefused(t, r.admit(context.Background(), http.MethodGet), fallback.CircuitOpen, 0)
	if st := r.ds().Lanes().Sem.Stats(); st.InFlight != 1 || r.inFlight() != 1 {
		t.Fatalf("lanes hold %d, the downstream %d: want the probe's 1 each", st.InFlight, r.inFlight())
	}
	probe.ticket.Cancel()
	r.ds().Sem.Release()
	probe.releaseLane()
}

// A stalled call gives its breaker ticket back: the half-open breaker's only probe slot, which
// the ticket step gave it, goes to the next call.
func TestAdmitStalledGivesBackProbeSlot(t *testing.T) {
	r := newAdmitRig(t, nil, withBreaker(admitDownstream(1), 2, 1, 30*time.Second))
	r.openBreaker(t, 2)
	ds := r.ds()
	clk := &jumpingClock{FakeClock: clocktesting.NewFakeClock(t0.Add(30 * time.Second)), jump: 2*50*time.Millisecond + stallSlack + time.Millisecond}
	if ad := admit(context.Background(), clk, r.enf.Table(), ds, ds.Config(), degrade.RequestView{Method: http.MethodGet}, deadline.Budget{}); ad.verdict != stalled {
		t.Fatalf("admission = %+v, want stalled", ad)
	}
	r.clk.Step(40 * time.Second)
	if ad := r.admit(context.Background(), http.MethodGet); ad.verdict != admitted {
		t.Fatalf("next call = %+v, want admitted as the probe: the stalled call's slot was given back", ad)
	}
}
