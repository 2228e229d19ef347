package keys

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
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
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/apportion/apportion/internal/assignment"
)

// DefaultSigningKeySecret is the name of the Secret, in the manager's namespace, that holds the
// manager's Ed25519 private keys. It never leaves that namespace.
const DefaultSigningKeySecret = "apportion-signing-key"

// DefaultKeyOverlap is how long a new key is published before the manager signs with it, and how
// long the previous key stays published after that.
const DefaultKeyOverlap = 10 * time.Minute

// MinKeyOverlap is the shortest overlap: the kubelet refreshes a ConfigMap volume within about a
// minute and the agent re-reads its trust directory every 30 seconds.
const MinKeyOverlap = 2 * time.Minute

// createdHeader is the PEM header of a private key block that says when the key was made (RFC
// 3339); the key schedule is computed from it.
const createdHeader = "Created"

// Labels and annotations on the Secret.
const (
	managedByLabel = "app.kubernetes.io/managed-by"
	managedByValue = "apportion"
	purposeAnnot   = "apportion.io/purpose"
	secretPurpose  = "Ed25519 private keys that sign the apportion agents' control requests: one PEM block per key id. Never copy this Secret out of the manager's namespace."
)

// RingKey is one of the manager's keys and when it was made.
type RingKey struct {
	assignment.SigningKey
	Created time.Time
}

// KeyRing is the manager's keys, oldest first (ids sort by creation).
type KeyRing []RingKey

// Schedule is what a KeyRing means at one time (KeyRing.Schedule).
type Schedule struct {
	// Signing signs every request.
	Signing assignment.SigningKey
	// Published are the keys agents must trust now, by id (the signing key among them).
	Published []assignment.SigningKey
	// Withdraw are keys that are no longer published; the Secret drops them.
	Withdraw []string
}

// Schedule decides, at now, which key signs, which are published and which are withdrawn:
//
//   - the signing key is the newest key made at least overlap ago (published that long, so every
//     agent has picked it up); when there is none, the oldest key (a fresh ring's only key: no
//     agent could trust anything before it);
//   - keys older than the signing key are withdrawn once the signing key has signed for overlap
//     (created + 2×overlap ≤ now): nothing signed with them is still within MaxClockSkew, and an
//     agent that re-reads late only keeps trusting a key nobody signs with any more;
//   - every other key is published.
//
// An empty ring has no schedule (ok false).
func (r KeyRing) Schedule(now time.Time, overlap time.Duration) (s Schedule, ok bool) {
	if len(r) == 0 {
		return Schedule{}, false
	}
	si := 0
	for i, k := range r {
		if !k.Created.Add(overlap).After(now) {
			si = i
		}
	}
	withdrawOlder := !r[si].Created.Add(2 * overlap).After(now)
	s.Signing = r[si].SigningKey
	for i, k := range r {
		if i < si && withdrawOlder {
			s.Withdraw = append(s.Withdraw, k.ID)
			continue
		}
		s.Published = append(s.Published, k.SigningKey)
	}
	return s, true
}

// TrustData is the data of the trust ConfigMap for the published keys: "<id>.pem" → PEM public key.
func (s Schedule) TrustData() (map[string]string, error) {
	data := make(map[string]string, len(s.Published))
	for _, k := range s.Published {
		b, err := assignment.MarshalPublicKey(k.Public().Key)
		if err != nil {
			return nil, err
		}
		data[k.ID+assignment.TrustFileSuffix] = string(b)
	}
	return data, nil
}

// The manager reads and writes Secrets only in its own namespace (a Role there, not a
// ClusterRole): it never needs another namespace's Secrets.
// +kubebuilder:rbac:groups="",namespace=system,resources=secrets,verbs=get;create;update

// SigningKeys manages the Secret that holds the manager's Ed25519 private keys: one data key per
// key id, its value a PEM "PRIVATE KEY" (PKCS #8) block with a "Created" header. Key ids are "k" +
// the UTC creation time (k20260701-120000), so the newest sorts last. Only the manager's
// namespace holds the Secret; agents get the public halves (Schedule.TrustData).
type SigningKeys struct {
	// Reader should read from the API server (mgr.GetAPIReader(): the manager caches no Secret),
	// Writer writes (mgr.GetClient()).
	Reader client.Reader
	Writer client.Writer
	// Namespace is the manager's namespace; Name defaults to DefaultSigningKeySecret.
	Namespace, Name string
	// Clock names and dates new keys; nil means the real clock. Rand makes keys; nil means
	// crypto/rand.
	Clock clock.PassiveClock
	Rand  io.Reader
}

func (k *SigningKeys) key() types.NamespacedName {
	name := k.Name
	if name == "" {
		name = DefaultSigningKeySecret
	}
	return types.NamespacedName{Namespace: k.Namespace, Name: name}
}

func (k *SigningKeys) now() time.Time {
	if k.Clock != nil {
		return k.Clock.Now()
	}
	return time.Now()
}

// Ensure creates the Secret with one fresh key when it does not exist, adds one when it holds
// none, and returns the ring it holds.
func (k *SigningKeys) Ensure(ctx context.Context) (KeyRing, error) {
	return k.update(ctx, func(r KeyRing) (KeyRing, bool, error) {
		if len(r) > 0 {
			return r, false, nil
		}
		nk, err := k.newKey(nil)
		if err != nil {
			return nil, false, err
		}
		return KeyRing{nk}, true, nil
	})
}

// Load returns the ring the Secret holds.
func (k *SigningKeys) Load(ctx context.Context) (KeyRing, error) {
	var s corev1.Secret
	if err := k.Reader.Get(ctx, k.key(), &s); err != nil {
		return nil, fmt.Errorf("reading Secret %s: %w", k.key(), err)
	}
	r, err := ringOf(&s)
	if err == nil && len(r) == 0 {
		err = errors.New("Secret " + k.key().String() + " holds no key")
	}
	return r, err
}

// Rotate adds a new key (it is published at once and signs after the overlap, see
// KeyRing.Schedule) and returns the ring.
func (k *SigningKeys) Rotate(ctx context.Context) (KeyRing, error) {
	return k.update(ctx, func(r KeyRing) (KeyRing, bool, error) {
		nk, err := k.newKey(r)
		if err != nil {
			return nil, false, err
		}
		return append(r, nk), true, nil
	})
}

// Withdraw removes the keys with these ids from the Secret and returns the ring.
func (k *SigningKeys) Withdraw(ctx context.Context, ids []string) (KeyRing, error) {
	return k.update(ctx, func(r KeyRing) (KeyRing, bool, error) {
		out := slices.DeleteFunc(slices.Clone(r), func(rk RingKey) bool { return slices.Contains(ids, rk.ID) })
		return out, len(out) != len(r), nil
	})
}

// update reads the Secret (creating it when missing), applies change and writes the result when
// change says so, retrying on conflicts.
func (k *SigningKeys) update(ctx context.Context, change func(KeyRing) (KeyRing, bool, error)) (KeyRing, error) {
	key := k.key()
	for range 10 {
		var s corev1.Secret
		err := k.Reader.Get(ctx, key, &s)
		create := apierrors.IsNotFound(err)
		if err != nil && !create {
			return nil, fmt.Errorf("reading Secret %s: %w", key, err)
		}
		var ring KeyRing
		if !create {
			if ring, err = ringOf(&s); err != nil {
				return nil, err
			}
		}
		next, changed, err := change(ring)
		if err != nil {
			return nil, err
		}
		if !changed && !create {
			return ring, nil
		}
		data, err := secretData(next)
		if err != nil {
			return nil, err
		}
		if create {
			s = corev1.Secret{
				ObjectMeta: metav1.ObjectMeta{
					Namespace: key.Namespace, Name: key.Name,
					Labels:      map[string]string{managedByLabel: managedByValue},
					Annotations: map[string]string{purposeAnnot: secretPurpose},
				},
				Type: corev1.SecretTypeOpaque,
				Data: data,
			}
			if err := k.Writer.Create(ctx, &s); err != nil {
				if apierrors.IsAlreadyExists(err) {
					continue
				}
				return nil, fmt.Errorf("creating Secret %s: %w", key, err)
			}
			return next, nil
		}
		s.Data = data
		if err := k.Writer.Update(ctx, &s); err != nil {
			if apierrors.IsConflict(err) {
				continue
			}
			return nil, fmt.Errorf("updating Secret %s: %w", key, err)
		}
		return next, nil
	}
	return nil, fmt.Errorf("secret %s: too many conflicts", key)
}

// newKey makes a key whose id sorts after every key of r.
func (k *SigningKeys) newKey(r KeyRing) (RingKey, error) {
	now := k.now().UTC().Truncate(time.Second)
	id := "k" + now.Format("20060102-150405")
	if n := len(r); n > 0 && id <= r[n-1].ID {
		id = r[n-1].ID + "-1" // same second or a clock behind: extend the newest id
		if r[n-1].Created.After(now) {
			now = r[n-1].Created
		}
	}
	if !assignment.ValidKeyID(id) {
		return RingKey{}, fmt.Errorf("cannot make a valid key id after %q", r[len(r)-1].ID)
	}
	rd := k.Rand
	if rd == nil {
		rd = rand.Reader
	}
	_, priv, err := ed25519.GenerateKey(rd)
	if err != nil {
		return RingKey{}, fmt.Errorf("generating a key: %w", err)
	}
	return RingKey{SigningKey: assignment.SigningKey{ID: id, Private: priv}, Created: now}, nil
}

func secretData(r KeyRing) (map[string][]byte, error) {
	data := make(map[string][]byte, len(r))
	for _, rk := range r {
		b, err := assignment.MarshalPrivateKey(rk.Private)
		if err != nil {
			return nil, err
		}
		blk, _ := pem.Decode(b)
		blk.Headers = map[string]string{createdHeader: rk.Created.UTC().Format(time.RFC3339)}
		data[rk.ID] = pem.EncodeToMemory(blk)
	}
	return data, nil
}

func ringOf(s *corev1.Secret) (KeyRing, error) {
	var r KeyRing
	for _, id := range slices.Sorted(maps.Keys(s.Data)) {
		if !assignment.ValidKeyID(id) {
			return nil, fmt.Errorf("secret %s/%s: key id %q is not valid", s.Namespace, s.Name, id)
		}
		priv, err := assignment.ParsePrivateKey(s.Data[id])
		if err != nil {
			return nil, fmt.Errorf("secret %s/%s: key %q: %w", s.Namespace, s.Name, id, err)
		}
		blk, _ := pem.Decode(s.Data[id])
		created, err := time.Parse(time.RFC3339, blk.Headers[createdHeader])
		if err != nil {
			return nil, fmt.Errorf("secret %s/%s: key %q: PEM header %q: %w", s.Namespace, s.Name, id, createdHeader, err)
		}
		r = append(r, RingKey{SigningKey: assignment.SigningKey{ID: id, Private: priv}, Created: created})
	}
	return r, nil
}
