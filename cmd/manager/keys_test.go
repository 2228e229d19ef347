package main

import (
	"context"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	testingclock "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/event"

	"github.com/apportion/apportion/internal/keys"
)

// TestKeyKeeperRotation drives the keeper through a rotation with an injected clock: a new key is
// published at once, signs after the overlap, and the previous one is withdrawn from the Secret
// and the trust data an overlap later.
func TestKeyKeeperRotation(t *testing.T) {
	ctx := context.Background()
	t0 := time.Date(2026, 7, 1, 12, 0, 0, 0, time.UTC)
	clk := testingclock.NewFakePassiveClock(t0)
	c := fake.NewClientBuilder().Build()
	signingKeys := &keys.SigningKeys{Reader: c, Writer: c, Namespace: "apportion-system", Clock: clk}
	changes := make(chan event.GenericEvent, 1)
	k := &keyKeeper{keys: signingKeys, signer: keys.NewSigningClient(nil, keys.Schedule{}), overlap: 10 * time.Minute,
		rotation: time.Hour, tick: time.Minute, clock: clk, log: logr.Discard(), changes: changes}

	step := func(at time.Duration, wantSigning int, wantTrust []int, wantSecret []int) {
		t.Helper()
		clk.SetTime(t0.Add(at))
		if err := k.sync(ctx); err != nil {
			t.Fatal(err)
		}
		var s corev1.Secret
		if err := c.Get(ctx, types.NamespacedName{Namespace: "apportion-system", Name: keys.DefaultSigningKeySecret}, &s); err != nil {
			t.Fatal(err)
		}
		secretIDs := slices.Sorted(maps.Keys(s.Data))
		idOf := func(i int) string { return []string{"k20260701-120000", "k20260701-130000", "k20260701-140000"}[i] }
		var want []string
		for _, i := range wantSecret {
			want = append(want, idOf(i))
		}
		if !slices.Equal(secretIDs, want) {
			t.Fatalf("at +%s: Secret holds %v, want %v", at, secretIDs, want)
		}
		if got := k.signer.SigningKeyID(); got != idOf(wantSigning) {
			t.Fatalf("at +%s: signing with %s, want %s", at, got, idOf(wantSigning))
		}
		var trust []string
		for _, i := range wantTrust {
			trust = append(trust, idOf(i)+".pem")
		}
		if got := slices.Sorted(maps.Keys(k.trustData())); !slices.Equal(got, trust) {
			t.Fatalf("at +%s: trust data %v, want %v", at, got, trust)
		}
	}
	drained := func() bool {
		select {
		case <-changes:
			return true
		default:
			return false
		}
	}

	step(0, 0, []int{0}, []int{0})
	if !drained() {
		t.Fatal("no trust change announced for the first key")
	}
	step(30*time.Minute, 0, []int{0}, []int{0})
	if drained() {
		t.Fatal("a trust change announced without a change")
	}
	step(time.Hour, 0, []int{0, 1}, []int{0, 1}) // rotation: published, not signing
	if !drained() {
		t.Fatal("the new key's publication was not announced")
	}
	step(time.Hour+9*time.Minute, 0, []int{0, 1}, []int{0, 1})
	step(time.Hour+10*time.Minute, 1, []int{0, 1}, []int{0, 1}) // signs after the overlap
	step(time.Hour+20*time.Minute, 1, []int{1}, []int{1})       // the previous key withdrawn
	if !drained() {
		t.Fatal("the withdrawal was not announced")
	}
	// A new leader (a new keeper, same Secret) continues the same schedule.
	k2 := &keyKeeper{keys: signingKeys, signer: keys.NewSigningClient(nil, keys.Schedule{}), overlap: 10 * time.Minute,
		rotation: time.Hour, tick: time.Minute, clock: clk, log: logr.Discard()}
	k = k2
	step(time.Hour+30*time.Minute, 1, []int{1}, []int{1})
	step(2*time.Hour, 1, []int{1, 2}, []int{1, 2})
}
