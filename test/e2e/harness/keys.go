package harness

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/keys"
)

// Names of the manager's key objects, from where the manager takes them.
const (
	SigningKeySecret = keys.DefaultSigningKeySecret
	TrustConfigMap   = apportionv1.TrustConfigMap
)

// TrustDir plays the kubelet's ConfigMap volume: it copies the trust ConfigMap of the pods'
// namespace into a directory, one "<key id>.pem" file per key, which agents read with
// --trust-dir. The manager must have created the ConfigMap there: Wait fails otherwise.
type TrustDir struct {
	Dir string
	cp  *ControlPlane
	// Namespace of the pods, whose ConfigMap is copied.
	Namespace string
	// Static, when set, is the signing key (a test without a manager); the directory is then
	// written once by WriteStatic and never synced.
	Static *assignment.SigningKey
}

// NewTrustDir creates dir.
func NewTrustDir(cp *ControlPlane, dir, namespace string) (*TrustDir, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	return &TrustDir{Dir: dir, cp: cp, Namespace: namespace}, nil
}

// NewStaticTrustDir writes key's public half into dir, for agents run without a manager.
func NewStaticTrustDir(dir string, key assignment.SigningKey) (*TrustDir, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	pem, err := assignment.MarshalPublicKey(key.Public().Key)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, key.ID+assignment.TrustFileSuffix), pem, 0o644); err != nil {
		return nil, err
	}
	return &TrustDir{Dir: dir, Static: &key}, nil
}

// Sync copies the ConfigMap's current keys into the directory (atomically per file, removing
// keys no longer in it). It returns false when the ConfigMap does not exist yet.
func (k *TrustDir) Sync(ctx context.Context) (bool, error) {
	if k.Static != nil {
		return true, nil
	}
	var cm corev1.ConfigMap
	if err := k.cp.Client.Get(ctx, types.NamespacedName{Namespace: k.Namespace, Name: TrustConfigMap}, &cm); err != nil {
		if strings.Contains(err.Error(), "not found") {
			return false, nil
		}
		return false, err
	}
	if len(cm.Data) == 0 {
		return false, nil
	}
	for name, content := range cm.Data {
		path := filepath.Join(k.Dir, name)
		if old, err := os.ReadFile(path); err == nil && string(old) == content {
			continue
		}
		tmp := filepath.Join(k.Dir, ".tmp-"+name)
		if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
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
		if _, ok := cm.Data[e.Name()]; !ok && !strings.HasPrefix(e.Name(), ".") {
			_ = os.Remove(filepath.Join(k.Dir, e.Name()))
		}
	}
	return true, nil
}

// Wait syncs until the ConfigMap exists in the pods' namespace, up to timeout.
func (k *TrustDir) Wait(ctx context.Context, timeout time.Duration) error {
	return poll(ctx, timeout, 100*time.Millisecond, func() error {
		switch ok, err := k.Sync(ctx); {
		case err != nil:
			return fatal(err)
		case !ok:
			return fmt.Errorf("no ConfigMap %s/%s after %s: the manager did not publish its keys there", k.Namespace, TrustConfigMap, timeout)
		}
		return nil
	})
}

// Run keeps the directory in sync every period until ctx ends (key rotation).
func (k *TrustDir) Run(ctx context.Context, period time.Duration) {
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

// Key is a private key the agents trust now, for the test's own control calls: the newest key
// of the manager's Secret (read with the test's admin client) that the directory holds.
func (k *TrustDir) Key() (assignment.SigningKey, error) {
	if k.Static != nil {
		return *k.Static, nil
	}
	trust, err := assignment.LoadTrustDir(k.Dir)
	if err != nil {
		return assignment.SigningKey{}, err
	}
	var list corev1.SecretList
	if err := k.cp.Client.List(context.Background(), &list); err != nil {
		return assignment.SigningKey{}, err
	}
	for _, s := range list.Items {
		if s.Name != SigningKeySecret {
			continue
		}
		ids := sortedKeys(s.Data)
		slices.Reverse(ids)
		for _, id := range ids {
			if !slices.Contains(trust.IDs(), id) {
				continue
			}
			priv, err := assignment.ParsePrivateKey(s.Data[id])
			if err != nil {
				return assignment.SigningKey{}, fmt.Errorf("secret %s/%s key %s: %w", s.Namespace, s.Name, id, err)
			}
			return assignment.SigningKey{ID: id, Private: priv}, nil
		}
	}
	return assignment.SigningKey{}, errors.New("no key of the manager's Secret " + SigningKeySecret + " is in the trust directory")
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
