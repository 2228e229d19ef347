package keys

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	testingclock "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/apportion/apportion/internal/agent/control"
	"github.com/apportion/apportion/internal/assignment"
)

func ids(keys []assignment.SigningKey) []string {
	out := make([]string, 0, len(keys))
	for _, k := range keys {
		out = append(out, k.ID)
	}
	return out
}

// TestKeySchedule walks a rotation: published at once, signing after the overlap, the previous
// key withdrawn an overlap later.
func TestKeySchedule(t *testing.T) {
	t0 := time.Date(2026, 7, 1, 12, 0, 0, 0, time.UTC)
	ov := 10 * time.Minute
	k := func(id string, created time.Time) RingKey {
		return RingKey{SigningKey: assignment.SigningKey{ID: id}, Created: created}
	}
	if _, ok := (KeyRing{}).Schedule(t0, ov); ok {
		t.Fatal("an empty ring has a schedule")
	}
	fresh := KeyRing{k("a", t0)}
	if s, _ := fresh.Schedule(t0, ov); s.Signing.ID != "a" || !slices.Equal(ids(s.Published), []string{"a"}) {
		t.Fatalf("a fresh ring's only key signs at once: %+v", s)
	}
	rotated := KeyRing{k("a", t0), k("b", t0.Add(time.Hour))}
	for _, tc := range []struct {
		at        time.Duration
		signing   string
		published []string
		withdraw  []string
	}{
		{time.Hour, "a", []string{"a", "b"}, nil},                      // just published
		{time.Hour + ov - time.Second, "a", []string{"a", "b"}, nil},   // still within the overlap
		{time.Hour + ov, "b", []string{"a", "b"}, nil},                 // b signs; a still trusted
		{time.Hour + 2*ov - time.Second, "b", []string{"a", "b"}, nil}, //
		{time.Hour + 2*ov, "b", []string{"b"}, []string{"a"}},          // a withdrawn
		{time.Hour - time.Minute, "a", []string{"a", "b"}, nil},        // clock behind b's creation
		{100 * time.Hour, "b", []string{"b"}, []string{"a"}},           // long after
	} {
		s, _ := rotated.Schedule(t0.Add(tc.at), ov)
		if s.Signing.ID != tc.signing || !slices.Equal(ids(s.Published), tc.published) || !slices.Equal(s.Withdraw, tc.withdraw) {
			t.Errorf("at +%s: signing %s published %v withdraw %v; want %s %v %v", tc.at, s.Signing.ID, ids(s.Published), s.Withdraw,
				tc.signing, tc.published, tc.withdraw)
		}
		if !slices.Contains(ids(s.Published), s.Signing.ID) {
			t.Errorf("at +%s: the signing key is not published", tc.at)
		}
	}
}

func TestSigningKeysEnsureRotateWithdraw(t *testing.T) {
	ctx := context.Background()
	c := fake.NewClientBuilder().Build()
	now := time.Date(2026, 7, 1, 12, 0, 0, 0, time.UTC)
	k := &SigningKeys{Reader: c, Writer: c, Namespace: "apportion-system", Clock: testingclock.NewFakePassiveClock(now)}

	ring, err := k.Ensure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ring) != 1 || ring[0].ID != "k20260701-120000" || !ring[0].Created.Equal(now) {
		t.Fatalf("ensured %+v", ring)
	}
	var s corev1.Secret
	if err := c.Get(ctx, types.NamespacedName{Namespace: "apportion-system", Name: DefaultSigningKeySecret}, &s); err != nil {
		t.Fatal(err)
	}
	if s.Type != corev1.SecretTypeOpaque || len(s.OwnerReferences) != 0 || s.Labels[managedByLabel] != managedByValue {
		t.Fatalf("secret type %q owners %v labels %v", s.Type, s.OwnerReferences, s.Labels)
	}
	again, err := k.Ensure(ctx)
	if err != nil || !again[0].Private.Equal(ring[0].Private) {
		t.Fatalf("Ensure replaced an existing key: %v", err)
	}
	// Rotate twice in the same second: ids keep sorting by creation.
	if _, err = k.Rotate(ctx); err != nil {
		t.Fatal(err)
	}
	if ring, err = k.Rotate(ctx); err != nil {
		t.Fatal(err)
	}
	if len(ring) != 3 || ring[1].ID != "k20260701-120000-1" || ring[2].ID != "k20260701-120000-1-1" {
		t.Fatalf("after rotations: %+v", ring)
	}
	loaded, err := k.Load(ctx)
	if err != nil || len(loaded) != 3 || !loaded[2].Private.Equal(ring[2].Private) || !loaded[2].Created.Equal(now) {
		t.Fatalf("Load = %+v, %v", loaded, err)
	}
	if ring, err = k.Withdraw(ctx, []string{ring[0].ID, ring[1].ID}); err != nil || len(ring) != 1 || ring[0].ID != "k20260701-120000-1-1" {
		t.Fatalf("Withdraw = %+v, %v", ring, err)
	}

	// What the trust ConfigMap holds, mounted, is what the agent verifies the signer with.
	sched, _ := ring.Schedule(now, DefaultKeyOverlap)
	data, err := sched.TrustData()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for name, v := range data {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(v), 0o444); err != nil {
			t.Fatal(err)
		}
	}
	trust, err := assignment.LoadTrustDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(control.New(control.Options{Backend: stateBackend{}, Trust: func() assignment.TrustSet { return trust }, Pod: "ns/p", Logger: quietLog}))
	defer srv.Close()
	if _, err := NewSigningClient(&http.Client{}, sched).State(ctx, assignment.Endpoint{URL: srv.URL, Pod: "ns/p"}, 1); err != nil {
		t.Fatalf("the agent refused the manager's signature: %v", err)
	}
	for _, v := range data {
		for _, rk := range ring {
			if pem, _ := assignment.MarshalPrivateKey(rk.Private); string(pem) == v {
				t.Fatal("the trust data holds a private key")
			}
		}
	}
}

// stateBackend is the least agent backend a signed GET /v1/state needs: it holds nothing.
// (The push package's tests have a full one; this package must not import push.)
type stateBackend struct{}

func (stateBackend) Apply(*assignment.Assignment, time.Time) (assignment.State, error) {
	return assignment.State{}, errors.New("stateBackend holds nothing")
}
func (stateBackend) Instance() string        { return "" }
func (stateBackend) State() assignment.State { return assignment.State{} }
func (stateBackend) Ready() bool             { return true }

var quietLog = slog.New(slog.DiscardHandler)
