package push

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/apportion/apportion/internal/agent/control"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/keys"
)

// An agent that has not picked up the signing key yet answers 403 unknown-key; the SigningClient
// then tries the other published keys.
func TestSigningClientFallsBackOnUnknownKey(t *testing.T) {
	clk := testingclock.NewFakePassiveClock(time.Date(2026, 7, 1, 12, 0, 0, 0, time.UTC))
	fc := fake.NewClientBuilder().Build()
	k := &keys.SigningKeys{Reader: fc, Writer: fc, Clock: clk}
	if _, err := k.Ensure(context.Background()); err != nil {
		t.Fatal(err)
	}
	clk.SetTime(clk.Now().Add(time.Hour))
	now := clk.Now()
	ring, err := k.Rotate(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	old := ring[0].SigningKey
	agentTrust, _ := assignment.NewTrustSet(old.Public())
	b := newTestBackend(time.Now)
	srv := httptest.NewServer(control.New(control.Options{Backend: b, Trust: func() assignment.TrustSet { return agentTrust }, Pod: "ns/p", Logger: quietLog}))
	defer srv.Close()
	to := assignment.Endpoint{URL: srv.URL, Pod: "ns/p"}

	sched, _ := ring.Schedule(now.Add(keys.DefaultKeyOverlap), keys.DefaultKeyOverlap) // the new key signs
	if sched.Signing.ID == old.ID {
		t.Fatal("the new key does not sign after the overlap")
	}
	c := keys.NewSigningClient(&http.Client{}, sched)
	if st, err := c.State(context.Background(), to, 1); err != nil || st == nil {
		t.Fatalf("state with fallback: %v", err)
	}
	onlyNew := keys.Schedule{Signing: sched.Signing, Published: []assignment.SigningKey{sched.Signing}}
	c.SetSchedule(onlyNew)
	if _, err := c.State(context.Background(), to, 1); err == nil {
		t.Fatal("a key the agent does not trust was accepted")
	}
}
