package main

import (
	"context"
	"strings"
	"sync"
	"time"

	"sigs.k8s.io/controller-runtime/pkg/log"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/push"
)

// keyReplicator copies the agents' key Secret into each namespace that has a DownstreamQuota,
// once per namespace and key set: a pod can mount Secrets of its own namespace only.
type keyReplicator struct {
	keys *push.AgentKeys

	mu   sync.Mutex
	ids  string            // the key set's ids, joined
	done map[string]string // namespace → ids replicated there
}

func newKeyReplicator(keys *push.AgentKeys, ks assignment.KeySet) *keyReplicator {
	return &keyReplicator{keys: keys, ids: strings.Join(ks.IDs(), ","), done: map[string]string{}}
}

// ensure replicates the keys into namespace unless that was done for the current key set.
func (r *keyReplicator) ensure(ctx context.Context, namespace string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done[namespace] == r.ids {
		return nil
	}
	if err := r.keys.Replicate(ctx, namespace); err != nil {
		return err
	}
	r.done[namespace] = r.ids
	return nil
}

// rotated records a new key set and replicates it into every namespace that had the old one.
func (r *keyReplicator) rotated(ctx context.Context, ks assignment.KeySet) {
	r.mu.Lock()
	r.ids = strings.Join(ks.IDs(), ",")
	namespaces := make([]string, 0, len(r.done))
	for ns := range r.done {
		namespaces = append(namespaces, ns)
	}
	r.mu.Unlock()
	for _, ns := range namespaces {
		if err := r.ensure(ctx, ns); err != nil {
			log.FromContext(ctx).Error(err, "replicating rotated agent keys", "namespace", ns)
		}
	}
}

// keyRotator rotates the agents' key every interval. The Secret keeps the previous key, so
// agents that have not reloaded their key directory yet still verify; the signing client falls
// back to it on 401/403.
type keyRotator struct {
	keys       *push.AgentKeys
	every      time.Duration
	signer     *push.SigningClient
	replicator *keyReplicator
}

// NeedLeaderElection: only the leader rotates.
func (k *keyRotator) NeedLeaderElection() bool { return true }

// Start implements manager.Runnable.
func (k *keyRotator) Start(ctx context.Context) error {
	t := time.NewTicker(k.every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			ks, err := k.keys.Rotate(ctx)
			if err != nil {
				log.FromContext(ctx).Error(err, "rotating agent keys")
				continue
			}
			k.signer.SetKeys(ks)
			k.replicator.rotated(ctx, ks)
			log.FromContext(ctx).Info("rotated agent keys", "ids", ks.IDs())
		}
	}
}
