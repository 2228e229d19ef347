package assignment_test

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/apportion/apportion/internal/agent/breaker"
	"github.com/apportion/apportion/internal/agent/enforce"
	"github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/h1"
)

// maximalAssignment is a valid Assignment at every bound that makes its State longer:
// MaxDownstreams downstreams of MaxLanes lanes, names at their longest, MaxSwitches switches
// named with characters json.Marshal escapes.
func maximalAssignment(t *testing.T) *assignment.Assignment {
	label := func(prefix string, i int) string {
		s := fmt.Sprintf("%s%d-", prefix, i)
		return s + strings.Repeat("x", assignment.MaxDownstreamNameLength-len(s))
	}
	a := &assignment.Assignment{Epoch: assignment.MaxFence, Generation: assignment.MaxFence,
		LeaseTTL: assignment.Duration(assignment.MaxLeaseTTL)}
	for i := range assignment.MaxDownstreams {
		d := assignment.Downstream{Name: label("d", i), Upstream: "http://127.0.0.1:1", Permits: assignment.MaxPermits,
			SafeDefaultPermits: assignment.MaxPermits, AcquireTimeout: assignment.Duration(time.Second),
			RequestTimeout: assignment.Duration(time.Second), Fallback: assignment.Fallback{Action: assignment.ActionReject},
			Breaker: &assignment.Breaker{Window: assignment.Duration(time.Minute), FailureRatePercent: 50,
				SlowCallThreshold: assignment.Duration(time.Second), SlowCallRatePercent: 50, MinimumCalls: 10,
				OpenDuration: assignment.Duration(time.Minute), HalfOpenProbes: 1}}
		for j := range assignment.MaxLanes {
			d.Lanes = append(d.Lanes, assignment.Lane{Name: label("l", j), ReservePercent: 12, Methods: []string{"GET"}})
		}
		a.Downstreams = append(a.Downstreams, d)
	}
	for i := range assignment.MaxSwitches {
		name := fmt.Sprintf("%d/", i)
		a.Switches = append(a.Switches, assignment.Switch{Name: name + strings.Repeat("<", assignment.MaxSwitchNameLength-len(name)),
			Downstream: a.Downstreams[0].Name, ExpiresAt: time.Date(2030, 1, 2, 15, 4, 5, 123456789, time.UTC), Percent: 100,
			Action: assignment.Fallback{Action: assignment.ActionReject}})
	}
	if err := a.Validate(); err != nil {
		t.Fatalf("the maximal assignment is invalid: %v", err)
	}
	return a
}

// A real agent's State at its longest fits MaxStateBytes, and the client reads it: a real
// agent (package enforce) holding the maximal valid assignment, every counter at its maximum,
// every reason counted in the downstreams and their lanes, every breaker in its longest state,
// and the capabilities the control API advertises. The agent's own reasons, breaker states
// and instance keep within the State bounds the derivation assumes.
func TestRealAgentStateWithinBounds(t *testing.T) {
	token := regexp.MustCompile(`^[a-z0-9-]+$`)
	if len(metrics.Reasons) > assignment.MaxRejectedReasons {
		t.Fatalf("the agent has %d reasons, more than MaxRejectedReasons", len(metrics.Reasons))
	}
	for _, r := range metrics.Reasons {
		if len(r) > assignment.MaxReasonLength || !token.MatchString(r) {
			t.Fatalf("reason %q: not a token of at most %d", r, assignment.MaxReasonLength)
		}
	}
	longestBreaker := ""
	for _, s := range []breaker.State{breaker.Closed, breaker.Open, breaker.HalfOpen} {
		if len(s.String()) > len(longestBreaker) {
			longestBreaker = s.String()
		}
	}
	if len(longestBreaker) > assignment.MaxBreakerLength {
		t.Fatalf("breaker state %q longer than MaxBreakerLength", longestBreaker)
	}

	agent := enforce.New(enforce.Options{Logger: slog.New(slog.DiscardHandler)})
	st, err := agent.Apply(maximalAssignment(t), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Instance) > assignment.MaxInstanceLength || !regexp.MustCompile(`^[0-9a-f]+$`).MatchString(st.Instance) {
		t.Fatalf("instance %q", st.Instance)
	}
	st.Uptime = assignment.Duration(math.MaxInt64)
	st.Capabilities = []string{assignment.CapabilityBatchSignatures, assignment.CapabilityObserve, assignment.CapabilityRampRaise}
	for _, c := range st.Capabilities {
		if len(c) > assignment.MaxCapabilityLength || !token.MatchString(c) {
			t.Fatalf("capability %q: not a token of at most %d", c, assignment.MaxCapabilityLength)
		}
	}
	rejected := func() map[string]int64 {
		m := map[string]int64{}
		for _, r := range metrics.Reasons {
			m[r] = math.MaxInt64
		}
		return m
	}
	for i := range st.Downstreams {
		d := &st.Downstreams[i]
		if len(d.Lanes) != assignment.MaxLaneStates {
			t.Fatalf("%d lanes in the State, want MaxLaneStates", len(d.Lanes))
		}
		d.InFlight, d.Waiting, d.Limit = math.MaxInt32, math.MaxInt32, assignment.MaxPermits
		d.Breaker, d.Requests, d.Upstream429, d.Rejected = longestBreaker, math.MaxInt64, math.MaxInt64, rejected()
		d.Observe, d.WouldRefuse, d.SecondsEnd = true, rejected(), math.MaxInt64
		if len(d.Seconds) == 0 || len(d.Seconds) > assignment.MaxSecondCounts {
			t.Fatalf("the agent reports %d per-second counts, want 1..MaxSecondCounts", len(d.Seconds))
		}
		for k := range d.Seconds {
			d.Seconds[k] = math.MaxInt32
		}
		for j := range d.Lanes {
			l := &d.Lanes[j]
			l.Reserved, l.InFlight, l.Waiting, l.Borrowed, l.Rejected = math.MaxInt32, math.MaxInt32, math.MaxInt32, math.MaxInt32, rejected()
		}
	}
	body, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the longest State of a real agent: %d bytes, %.0f%% of MaxStateBytes (%d)", len(body), 100*float64(len(body))/float64(assignment.MaxStateBytes), assignment.MaxStateBytes)
	if len(body) > assignment.MaxStateBytes {
		t.Fatalf("a real agent's State of %d bytes is over MaxStateBytes (%d): the manager would refuse it", len(body), assignment.MaxStateBytes)
	}

	// The manager's client reads it, as 200 and as the State of a 409. (status is atomic: h1's
	// raw system calls are no synchronisation the race detector sees.)
	var status atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		status := int(status.Load())
		if status == http.StatusOK {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			_, _ = w.Write(body)
			return
		}
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(assignment.Problem{Title: "Stale assignment", Status: status,
			Code: assignment.CodeStaleAssignment, Detail: "the agent holds a newer (epoch, generation)", State: &st})
	}))
	defer srv.Close()
	key := assignment.SigningKey{ID: "k1", Private: ed25519.NewKeyFromSeed(make([]byte, ed25519.SeedSize))}
	hc := h1.NewClient()
	hc.SetMaxResponseHeaderBytes(assignment.MaxAnswerHeadBytes)
	c := &assignment.Client{HTTP: h1.HTTPClient{C: hc}, Key: key}
	to := assignment.Endpoint{URL: srv.URL, Pod: "ns/pod"}
	var want assignment.State
	if err := json.Unmarshal(body, &want); err != nil {
		t.Fatal(err)
	}
	status.Store(http.StatusOK)
	got, err := c.State(context.Background(), to, 1)
	if err != nil {
		t.Fatalf("the client refused a real agent's longest State: %v", err)
	}
	if diff := cmp.Diff(&want, got); diff != "" {
		t.Fatalf("State (-want +got):\n%s", diff)
	}
	status.Store(http.StatusConflict)
	_, err = c.State(context.Background(), to, 1)
	if se, ok := assignment.IsStale(err); !ok {
		t.Fatalf("the client refused a real agent's 409 with its longest State: %v", err)
	} else if diff := cmp.Diff(want, se.State); diff != "" {
		t.Fatalf("409 State (-want +got):\n%s", diff)
	}
}
