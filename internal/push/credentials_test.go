package push

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/apportion/apportion/internal/agent/control"
	"github.com/apportion/apportion/internal/assignment"
)

func TestAgentKeysEnsureRotateReplicate(t *testing.T) {
	ctx := context.Background()
	c := fake.NewClientBuilder().Build()
	now := time.Date(2026, 7, 1, 12, 0, 0, 0, time.UTC)
	k := &AgentKeys{Reader: c, Writer: c, Namespace: "apportion-system", Now: func() time.Time { return now }}

	ks, err := k.Ensure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cur, _ := ks.Current()
	if ks.Len() != 1 || cur.ID != "k20260701-120000" || len(cur.Secret) != AgentKeyBytes {
		t.Fatalf("ensured %v (%d bytes)", ks.IDs(), len(cur.Secret))
	}
	var s corev1.Secret
	if err := c.Get(ctx, types.NamespacedName{Namespace: "apportion-system", Name: DefaultAgentKeySecret}, &s); err != nil {
		t.Fatal(err)
	}
	if s.Type != corev1.SecretTypeOpaque || len(s.OwnerReferences) != 0 {
		t.Fatalf("secret type %q owners %v", s.Type, s.OwnerReferences)
	}
	// Ensure again: unchanged.
	ks2, err := k.Ensure(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if c2, _ := ks2.Current(); !bytes.Equal(c2.Secret, cur.Secret) {
		t.Fatal("Ensure replaced an existing key")
	}

	// Rotate twice in the same second: the new id sorts last, the previous is kept, older dropped.
	ks, err = k.Rotate(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ids := ks.IDs(); len(ids) != 2 || ids[0] != "k20260701-120000" || ids[1] != "k20260701-120000-1" {
		t.Fatalf("after rotation: %v", ids)
	}
	now = now.Add(time.Hour)
	ks, err = k.Rotate(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if ids := ks.IDs(); len(ids) != 2 || ids[0] != "k20260701-120000-1" || ids[1] != "k20260701-130000" {
		t.Fatalf("after the second rotation: %v", ids)
	}

	// The copy in a workload namespace follows the original.
	if err := k.Replicate(ctx, "shop"); err != nil {
		t.Fatal(err)
	}
	var cp corev1.Secret
	if err := c.Get(ctx, types.NamespacedName{Namespace: "shop", Name: DefaultAgentKeySecret}, &cp); err != nil {
		t.Fatal(err)
	}
	if len(cp.Data) != 2 || cp.Labels[managedByLabel] != managedByValue {
		t.Fatalf("copy %v %v", cp.Labels, len(cp.Data))
	}
	now = now.Add(time.Hour)
	if _, err := k.Rotate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := k.Replicate(ctx, "shop"); err != nil {
		t.Fatal(err)
	}
	_ = c.Get(ctx, types.NamespacedName{Namespace: "shop", Name: DefaultAgentKeySecret}, &cp)
	if _, ok := cp.Data["k20260701-140000"]; !ok {
		t.Fatalf("copy not updated: %v", cp.Data)
	}
	// Someone else's Secret of that name is not overwritten.
	other := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "other", Name: DefaultAgentKeySecret}, Data: map[string][]byte{"x": []byte("y")}}
	if err := c.Create(ctx, other); err != nil {
		t.Fatal(err)
	}
	if err := k.Replicate(ctx, "other"); err == nil {
		t.Fatal("overwrote a foreign Secret")
	}

	// What the Secret looks like mounted is what the agent loads.
	ks, err = k.Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for id, v := range cp.Data {
		if err := os.WriteFile(filepath.Join(dir, id), v, 0o400); err != nil {
			t.Fatal(err)
		}
	}
	mounted, err := assignment.LoadKeyDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := ks.Current()
	b, _ := mounted.Current()
	if a.ID != b.ID || !bytes.Equal(a.Secret, b.Secret) {
		t.Fatalf("manager signs with %s, agent's current is %s", a.ID, b.ID)
	}
}

// After a rotation, agents that still have only the previous key answer 403 to the new key's
// signature; the SigningClient falls back to the previous key.
func TestSigningClientFallsBackToThePreviousKey(t *testing.T) {
	old := assignment.Key{ID: "k1", Secret: bytes.Repeat([]byte{1}, 48)}
	nu := assignment.Key{ID: "k2", Secret: bytes.Repeat([]byte{2}, 48)}
	agentKeys, _ := assignment.NewKeySet(old)
	b := newTestBackend(time.Now)
	srv := httptest.NewServer(control.New(control.Options{Backend: b, Keys: func() assignment.KeySet { return agentKeys }, Logger: quietLog}))
	defer srv.Close()

	both, _ := assignment.NewKeySet(old, nu)
	c := NewSigningClient(&http.Client{}, both)
	st, err := c.State(context.Background(), srv.URL)
	if err != nil || st == nil {
		t.Fatalf("state with fallback: %v", err)
	}
	onlyNew, _ := assignment.NewKeySet(nu)
	c.SetKeys(onlyNew)
	if _, err := c.State(context.Background(), srv.URL); err == nil {
		t.Fatal("a key the agent does not know was accepted")
	}
}
