package push

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/apportion/apportion/internal/assignment"
)

// DefaultAgentKeySecret is the name of the Secret holding the control API's HMAC keys.
const DefaultAgentKeySecret = "apportion-agent-key"

// AgentKeyBytes is the length of a generated key's secret.
const AgentKeyBytes = 48

// Labels and annotations on the key Secrets.
const (
	managedByLabel   = "app.kubernetes.io/managed-by"
	managedByValue   = "apportion"
	copiedFromAnnot  = "apportion.io/copied-from"
	keyPurposeAnnot  = "apportion.io/purpose"
	keyPurposeString = "HMAC keys of the apportion agents' control API: one data key per key id; the id that sorts last signs"
)

// AgentKeys manages the Secret that holds the HMAC keys the manager signs control requests with
// and the agents verify. Each data key of the Secret is a key id, its value the secret (48
// random bytes). The manager signs with the id that sorts last (assignment.KeySet.Current);
// generated ids are "k" + the UTC time of creation (k20260701-120000), so the newest sorts last.
// An agent accepts any key in its --key-dir, where the Secret is mounted.
type AgentKeys struct {
	// Reader should read from the API server (mgr.GetAPIReader()), Writer writes (mgr.GetClient()).
	Reader client.Reader
	Writer client.Writer
	// Namespace is the manager's namespace; Name defaults to DefaultAgentKeySecret.
	Namespace, Name string
	// Now names new keys; nil means time.Now. Rand makes secrets; nil means crypto/rand.
	Now  func() time.Time
	Rand io.Reader
}

func (k *AgentKeys) key() types.NamespacedName {
	name := k.Name
	if name == "" {
		name = DefaultAgentKeySecret
	}
	return types.NamespacedName{Namespace: k.Namespace, Name: name}
}

// Ensure creates the Secret with one fresh key when it does not exist, adds one when it holds
// none, and returns the keys it holds.
func (k *AgentKeys) Ensure(ctx context.Context) (assignment.KeySet, error) {
	key := k.key()
	for attempt := 0; attempt < 10; attempt++ {
		var s corev1.Secret
		err := k.Reader.Get(ctx, key, &s)
		if apierrors.IsNotFound(err) {
			id, secret, err := k.newKey(nil)
			if err != nil {
				return assignment.KeySet{}, err
			}
			s = corev1.Secret{
				ObjectMeta: metav1.ObjectMeta{
					Namespace: key.Namespace, Name: key.Name,
					Labels:      map[string]string{managedByLabel: managedByValue},
					Annotations: map[string]string{keyPurposeAnnot: keyPurposeString},
				},
				Type: corev1.SecretTypeOpaque,
				Data: map[string][]byte{id: secret},
			}
			if err := k.Writer.Create(ctx, &s); err != nil {
				if apierrors.IsAlreadyExists(err) {
					continue
				}
				return assignment.KeySet{}, fmt.Errorf("creating Secret %s: %w", key, err)
			}
			return keySetOf(&s)
		}
		if err != nil {
			return assignment.KeySet{}, fmt.Errorf("reading Secret %s: %w", key, err)
		}
		if len(s.Data) > 0 {
			return keySetOf(&s)
		}
		id, secret, err := k.newKey(nil)
		if err != nil {
			return assignment.KeySet{}, err
		}
		s.Data = map[string][]byte{id: secret}
		if err := k.Writer.Update(ctx, &s); err != nil {
			if apierrors.IsConflict(err) {
				continue
			}
			return assignment.KeySet{}, fmt.Errorf("adding a key to Secret %s: %w", key, err)
		}
		return keySetOf(&s)
	}
	return assignment.KeySet{}, fmt.Errorf("secret %s: too many conflicts", key)
}

// Load returns the keys the Secret holds.
func (k *AgentKeys) Load(ctx context.Context) (assignment.KeySet, error) {
	var s corev1.Secret
	if err := k.Reader.Get(ctx, k.key(), &s); err != nil {
		return assignment.KeySet{}, fmt.Errorf("reading Secret %s: %w", k.key(), err)
	}
	return keySetOf(&s)
}

// Rotate adds a new key whose id sorts after every other, so the manager signs with it from now
// on, keeps the previous current key so that agents that have not reloaded their key directory
// still verify requests signed with it (SigningClient falls back to it when an agent answers
// 401/403), and drops every older key. Call it again only after the agents picked up the
// previous rotation (a mounted Secret is refreshed within a minute or two).
func (k *AgentKeys) Rotate(ctx context.Context) (assignment.KeySet, error) {
	key := k.key()
	for attempt := 0; attempt < 10; attempt++ {
		var s corev1.Secret
		if err := k.Reader.Get(ctx, key, &s); err != nil {
			return assignment.KeySet{}, fmt.Errorf("reading Secret %s: %w", key, err)
		}
		ids := slices.Sorted(maps.Keys(s.Data))
		id, secret, err := k.newKey(ids)
		if err != nil {
			return assignment.KeySet{}, err
		}
		data := map[string][]byte{id: secret}
		if len(ids) > 0 {
			prev := ids[len(ids)-1]
			data[prev] = s.Data[prev]
		}
		s.Data = data
		if err := k.Writer.Update(ctx, &s); err != nil {
			if apierrors.IsConflict(err) {
				continue
			}
			return assignment.KeySet{}, fmt.Errorf("rotating Secret %s: %w", key, err)
		}
		return keySetOf(&s)
	}
	return assignment.KeySet{}, fmt.Errorf("secret %s: too many conflicts", key)
}

// Replicate copies the Secret's keys into a Secret of the same name in namespace, where pods
// can mount it (a pod can only mount Secrets of its own namespace). It creates the copy or
// updates its data; it refuses to overwrite a Secret it did not create.
func (k *AgentKeys) Replicate(ctx context.Context, namespace string) error {
	src := k.key()
	if namespace == src.Namespace {
		return nil
	}
	var s corev1.Secret
	if err := k.Reader.Get(ctx, src, &s); err != nil {
		return fmt.Errorf("reading Secret %s: %w", src, err)
	}
	dst := types.NamespacedName{Namespace: namespace, Name: src.Name}
	for attempt := 0; attempt < 10; attempt++ {
		var cp corev1.Secret
		err := k.Reader.Get(ctx, dst, &cp)
		if apierrors.IsNotFound(err) {
			cp = corev1.Secret{
				ObjectMeta: metav1.ObjectMeta{
					Namespace: dst.Namespace, Name: dst.Name,
					Labels:      map[string]string{managedByLabel: managedByValue},
					Annotations: map[string]string{copiedFromAnnot: src.String(), keyPurposeAnnot: keyPurposeString},
				},
				Type: corev1.SecretTypeOpaque,
				Data: maps.Clone(s.Data),
			}
			if err := k.Writer.Create(ctx, &cp); err != nil {
				if apierrors.IsAlreadyExists(err) {
					continue
				}
				return fmt.Errorf("creating Secret %s: %w", dst, err)
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("reading Secret %s: %w", dst, err)
		}
		if cp.Labels[managedByLabel] != managedByValue || cp.Annotations[copiedFromAnnot] != src.String() {
			return fmt.Errorf("secret %s exists and is not a copy of %s; not overwriting it", dst, src)
		}
		if maps.EqualFunc(cp.Data, s.Data, bytes.Equal) {
			return nil
		}
		cp.Data = maps.Clone(s.Data)
		if err := k.Writer.Update(ctx, &cp); err != nil {
			if apierrors.IsConflict(err) {
				continue
			}
			return fmt.Errorf("updating Secret %s: %w", dst, err)
		}
		return nil
	}
	return fmt.Errorf("secret %s: too many conflicts", dst)
}

// newKey makes a key whose id sorts after every id in existing (sorted).
func (k *AgentKeys) newKey(existing []string) (string, []byte, error) {
	now := time.Now
	if k.Now != nil {
		now = k.Now
	}
	id := "k" + now().UTC().Format("20060102-150405")
	if n := len(existing); n > 0 && id <= existing[n-1] {
		id = existing[n-1] + "-1" // same second or a clock behind: extend the newest id
	}
	if !assignment.ValidKeyID(id) {
		return "", nil, fmt.Errorf("cannot make a valid key id after %q", existing[len(existing)-1])
	}
	r := k.Rand
	if r == nil {
		r = rand.Reader
	}
	secret := make([]byte, AgentKeyBytes)
	if _, err := io.ReadFull(r, secret); err != nil {
		return "", nil, fmt.Errorf("generating a key: %w", err)
	}
	return id, secret, nil
}

func keySetOf(s *corev1.Secret) (assignment.KeySet, error) {
	keys := make([]assignment.Key, 0, len(s.Data))
	for _, id := range slices.Sorted(maps.Keys(s.Data)) {
		keys = append(keys, assignment.Key{ID: id, Secret: s.Data[id]})
	}
	if len(keys) == 0 {
		return assignment.KeySet{}, errors.New("Secret " + s.Namespace + "/" + s.Name + " holds no key")
	}
	ks, err := assignment.NewKeySet(keys...)
	if err != nil {
		return assignment.KeySet{}, fmt.Errorf("secret %s/%s: %w", s.Namespace, s.Name, err)
	}
	return ks, nil
}
