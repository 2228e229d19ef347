package proxy

import (
	"context"
	"github.com/apportion/apportion/internal/agent/deadline"
	"net/http"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/agent/degrade"
	"github.com/apportion/apportion/internal/agent/fallback"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/assignment"
)

func lanedDownstream(permits int32) assignment.Downstream {
	d := admitDownstream(permits)
	d.AcquireTimeout = assignment.Duration(time.Millisecond)
	d.Lanes = []assignment.Lane{{Name: "core", ReservePercent: 50, LendPercent: 50, Methods: []string{"POST"}, PathPrefixes: []string{"/orders"}}}
	return d
}

// admitLane runs one call to the laned downstream. A call that waits for a permit waits on the
// fake clock: once it does, the clock is moved past the 1ms acquire timeout.
func (r *admitRig) admitLane(method, path string) admission {
	ds := r.ds()
	waiters := r.clk.Waiters()
	done := make(chan admission, 1)
	go func() {
		done <- admit(context.Background(), r.clk, r.enf.Table(), ds, ds.Config(),
			degrade.RequestView{Method: method, Path: path, Header: http.Header{}, Rand: func() uint32 { return 0 }}, deadline.Budget{})
	}()
	for {
		select {
		case ad := <-done:
			return ad
		case <-time.After(time.Millisecond):
			if r.clk.Waiters() > waiters {
				r.clk.Step(time.Millisecond)
			}
		}
	}
}

// Lanes in the pipeline: a flood of unmatched calls takes the shared permits and the lendable
// part of core's reserve and is then refused (no-permit, counted on the default lane), while
// core calls are still admitted from the rest of their reserve; both permits are held and
// returned together.
func TestAdmitLanes(t *testing.T) {
	r := newAdmitRig(t, nil, lanedDownstream(8)) // core reserve 4, lendable 2; shared 4
	var held []admission
	for range 6 {
		ad := r.admitLane("GET", "/orders/1")
		if ad.verdict != admitted {
			t.Fatalf("non-core call refused before the shared pool and the lendable reserve were used: %+v", ad)
		}
		held = append(held, ad)
	}
	wantRefused(t, r.admitLane("GET", "/orders/1"), fallback.NoPermit, 0)
	for range 2 {
		ad := r.admitLane("POST", "/orders")
		if ad.verdict != admitted {
			t.Fatalf("core call refused with its reserve free: %+v", ad)
		}
		held = append(held, ad)
	}
	if got := r.inFlight(); got != 8 {
		t.Fatalf("downstream semaphore holds %d, want 8", got)
	}
	wantRefused(t, r.admitLane("POST", "/orders"), fallback.NoPermit, 0)
	st := r.enf.State().Downstreams[0]
	if len(st.Lanes) != 2 || st.Lanes[0].Name != "core" || st.Lanes[1].Name != assignment.DefaultLane {
		t.Fatalf("lane states %+v", st.Lanes)
	}
	if st.Lanes[0].InFlight != 2 || st.Lanes[1].InFlight != 6 || st.Lanes[1].Borrowed != 2 || st.Lanes[0].Reserved != 4 ||
		st.Lanes[0].Rejected["no-permit"] != 1 || st.Lanes[1].Rejected["no-permit"] != 1 {
		t.Fatalf("lane states %+v", st.Lanes)
	}
	if got := metricValue(t, r.m, "apportion_agent_lane_rejected_total", "downstream", "d", "lane", "default", "reason", metrics.Reasons[metrics.ReasonNoPermit]); got != 1 {
		t.Fatalf("lane_rejected_total{default,no-permit} = %v", got)
	}
	for _, ad := range held {
		r.ds().Sem.Release()
		ad.releaseLane()
	}
	if st := r.ds().Lanes().Sem.Stats(); st.InFlight != 0 || r.inFlight() != 0 {
		t.Fatalf("leaked: lanes %+v, downstream %d", st, r.inFlight())
	}
}
