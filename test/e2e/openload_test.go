package e2e

import (
	"context"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/test/e2e/harness"
)

// TestOpenLoadAcrossAgentRestarts (agents only, no control plane): the soak's open-loop app
// must count a call that meets a crashed agent as lost with it, and send nothing to a restarted
// agent until it is up — not report "unanswered" calls the fault itself caused. The first
// 15-minute soak counted 31 such calls: connection refused by a restarted agent that did not
// listen yet (harness.Agent.Up is the fix; without it this test fails).
func TestOpenLoadAcrossAgentRestarts(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	ds, err := harness.StartDownstream(100, 20*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ds.Close() })
	d := assignment.Downstream{
		Name: "partner", Upstream: ds.URL, Permits: 20, SafeDefaultPermits: 20,
		AcquireTimeout: assignment.Duration(100 * time.Millisecond), RequestTimeout: assignment.Duration(time.Second),
		Fallback: assignment.Fallback{Action: assignment.ActionReject},
	}
	ags := bootAgents(t, ctx, 2, assignment.Assignment{Downstreams: []assignment.Downstream{d}})
	load := harness.StartOpenLoad(ctx, harness.OpenLoadConfig{Source: harness.StaticAgents(ags), Downstreams: []string{"partner"},
		Rate: 400, Logf: t.Logf})
	for range 5 {
		_ = sleep(ctx, 300*time.Millisecond)
		if err := ags[0].Kill(); err != nil {
			t.Fatal(err)
		}
		_ = sleep(ctx, 50*time.Millisecond)
		if err := ags[0].Start(ctx); err != nil {
			t.Fatal(err)
		}
	}
	_ = sleep(ctx, 300*time.Millisecond)
	st := load.Stop()
	t.Logf("open load across 5 restarts of one of 2 agents: %+v", st)
	if st.Unanswered > 0 {
		t.Errorf("%d calls counted unanswered: %v", st.Unanswered, load.Unanswered())
	}
	if st.Downstream == 0 || st.TooMany429 > 0 {
		t.Errorf("the partner answered %d calls and 429 %d times", st.Downstream, st.TooMany429)
	}
}
