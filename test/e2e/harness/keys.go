package harness

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/apportion/apportion/internal/assignment"
)

// AgentKeySecret is the Secret the manager keeps the agents' control keys in.
const AgentKeySecret = "apportion-agent-key"

// KeyDir plays the kubelet's secret volume: it copies the manager's Secret into a directory,
// one file per key id, which agents read with --key-dir.
type KeyDir struct {
	Dir string
	cp  *ControlPlane
	// Namespace whose copy of the Secret is preferred; the Secret is looked up in every namespace.
	Namespace string
}

// NewKeyDir creates dir.
func NewKeyDir(cp *ControlPlane, dir, namespace string) (*KeyDir, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	return &KeyDir{Dir: dir, cp: cp, Namespace: namespace}, nil
}

// Sync copies the Secret's current keys into the directory (atomically per file, removing keys
// no longer in the Secret). It returns false when no Secret exists yet.
func (k *KeyDir) Sync(ctx context.Context) (bool, error) {
	var list corev1.SecretList
	if err := k.cp.Client.List(ctx, &list); err != nil {
		return false, err
	}
	// The copy in the pods' namespace is what their volume would mount; else the manager's.
	var sec *corev1.Secret
	for i := range list.Items {
		s := &list.Items[i]
		if s.Name == AgentKeySecret && len(s.Data) > 0 && (sec == nil || s.Namespace == k.Namespace) {
			sec = s
		}
	}
	if sec == nil {
		return false, nil
	}
	want := map[string]bool{}
	for id, secret := range sec.Data {
		if !assignment.ValidKeyID(id) {
			continue
		}
		want[id] = true
		path := filepath.Join(k.Dir, id)
		if old, err := os.ReadFile(path); err == nil && string(old) == string(secret) {
			continue
		}
		tmp := filepath.Join(k.Dir, ".tmp-"+id)
		if err := os.WriteFile(tmp, secret, 0o600); err != nil {
			return false, err
		}
		if err := os.Rename(tmp, path); err != nil {
			return false, err
		}
	}
	entries, err := os.ReadDir(k.Dir)
	if err != nil {
		return false, err
	}
	for _, e := range entries {
		if !strings.HasPrefix(e.Name(), ".") && !want[e.Name()] {
			_ = os.Remove(filepath.Join(k.Dir, e.Name()))
		}
	}
	return true, nil
}

// Wait syncs until the Secret exists, up to timeout.
func (k *KeyDir) Wait(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		ok, err := k.Sync(ctx)
		if err != nil {
			return err
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no Secret %s after %s: the manager did not create the agents' keys", AgentKeySecret, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Run keeps the directory in sync every period until ctx ends (key rotation).
func (k *KeyDir) Run(ctx context.Context, period time.Duration) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			_, _ = k.Sync(ctx)
		}
	}
}

// Key is the key a signer uses now (the id sorting last).
func (k *KeyDir) Key() (assignment.Key, error) {
	ks, err := assignment.LoadKeyDir(k.Dir)
	if err != nil {
		return assignment.Key{}, err
	}
	key, ok := ks.Current()
	if !ok {
		return assignment.Key{}, fmt.Errorf("key directory %s is empty", k.Dir)
	}
	return key, nil
}

// CreateSecret writes a Secret with one random key, for a manager that does not create its own.
func CreateSecret(ctx context.Context, cp *ControlPlane, namespace string) error {
	secret := make([]byte, 48)
	if _, err := randRead(secret); err != nil {
		return err
	}
	id := "k" + time.Now().UTC().Format("20060102150405")
	s := &corev1.Secret{}
	s.Name, s.Namespace = AgentKeySecret, namespace
	s.Data = map[string][]byte{id: []byte(fmt.Sprintf("%x", secret))}
	return cp.Client.Create(ctx, s)
}

// sortedKeys returns m's keys, sorted.
func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}
