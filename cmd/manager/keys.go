package main

import (
	"context"
	"maps"
	"sync"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/manager"

	"github.com/apportion/apportion/internal/keys"
)

// keyKeeper runs the manager's key schedule (keys.KeyRing.Schedule): every tick it reads the
// signing key Secret, adds a key when the newest is older than the rotation interval, withdraws
// the keys the schedule retired, hands the signing key to the signing client and publishes the
// public keys to the trust reconciler. Every decision is computed from the keys' creation times
// in the Secret, so a restarted or new leader continues the same schedule.
type keyKeeper struct {
	keys     *keys.SigningKeys
	signer   *keys.SigningClient
	overlap  time.Duration
	rotation time.Duration // 0: never rotate
	tick     time.Duration
	clock    clock.PassiveClock
	log      logr.Logger
	changes  chan<- event.GenericEvent

	mu    sync.Mutex
	trust map[string]string // the trust ConfigMap's data; nil until the first sync
}

// The manager finds NeedLeaderElection by a type assertion at run time: without it every replica
// would rotate keys. These make a changed signature a compile error.
var (
	_ manager.Runnable               = (*keyKeeper)(nil)
	_ manager.LeaderElectionRunnable = (*keyKeeper)(nil)
)

// NeedLeaderElection: only the leader rotates and publishes.
func (k *keyKeeper) NeedLeaderElection() bool { return true }

// trustData is the trust ConfigMap's data (TrustReconciler.Data).
func (k *keyKeeper) trustData() map[string]string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.trust
}

// Start implements manager.Runnable.
func (k *keyKeeper) Start(ctx context.Context) error {
	t := time.NewTicker(k.tick)
	defer t.Stop()
	for {
		if err := k.sync(ctx); err != nil {
			k.log.Error(err, "agent key schedule")
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

func (k *keyKeeper) sync(ctx context.Context) error {
	now := k.clock.Now()
	ring, err := k.keys.Ensure(ctx)
	if err != nil {
		return err
	}
	if k.rotation > 0 && !ring[len(ring)-1].Created.Add(k.rotation).After(now) {
		if ring, err = k.keys.Rotate(ctx); err != nil {
			return err
		}
		k.log.Info("new agent key published; it signs after the overlap", "id", ring[len(ring)-1].ID, "overlap", k.overlap)
	}
	s, _ := ring.Schedule(now, k.overlap)
	if len(s.Withdraw) > 0 {
		if ring, err = k.keys.Withdraw(ctx, s.Withdraw); err != nil {
			return err
		}
		k.log.Info("agent keys withdrawn", "ids", s.Withdraw)
		s, _ = ring.Schedule(now, k.overlap)
	}
	if prev := k.signer.SigningKeyID(); prev != s.Signing.ID {
		k.log.Info("signing agent requests with a new key", "id", s.Signing.ID, "previous", prev)
	}
	k.signer.SetSchedule(s)
	data, err := s.TrustData()
	if err != nil {
		return err
	}
	k.mu.Lock()
	changed := !maps.Equal(k.trust, data)
	k.trust = data
	k.mu.Unlock()
	if changed && k.changes != nil {
		// One pending event stands for any number: each reconciles every namespace.
		select {
		case k.changes <- event.GenericEvent{Object: &corev1.Namespace{}}:
		default:
		}
	}
	return nil
}
