package push

import (
	"context"
	"fmt"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
)

// DefaultEpochConfigMap is the name of the ConfigMap that holds the epoch counter.
const DefaultEpochConfigMap = "apportion-epoch"

// EpochKey is the ConfigMap data key of the counter.
const EpochKey = "epoch"

// ConfigMapEpoch is an EpochSource backed by a counter in a ConfigMap. NextEpoch reads the
// counter and writes counter+1 with an optimistic-concurrency Update (the read's
// resourceVersion), retrying on conflict, so two managers never get the same epoch and epochs
// only grow.
//
// When the ConfigMap does not exist (first start, or someone deleted it) it is created with the
// current Unix time in milliseconds rather than 1: agents may still hold epochs from before the
// deletion, and a counter that restarted low would have every push refused as stale. Each
// restart adds 1, so the counter never catches up with the clock.
type ConfigMapEpoch struct {
	// Reader should read from the API server, not a cache (mgr.GetAPIReader()): a stale read
	// only costs a conflict and a retry, but a cache would make the manager watch ConfigMaps.
	Reader client.Reader
	// Writer creates and updates the ConfigMap (mgr.GetClient()).
	Writer client.Writer
	// Namespace is the manager's namespace; Name defaults to DefaultEpochConfigMap.
	Namespace, Name string
	// Clock starts a new counter; nil means the real clock.
	Clock clock.PassiveClock
}

// NextEpoch implements EpochSource.
func (s *ConfigMapEpoch) NextEpoch(ctx context.Context) (int64, error) {
	key, err := s.key()
	if err != nil {
		return 0, err
	}
	now := time.Now
	if s.Clock != nil {
		now = s.Clock.Now
	}
	var lastErr error
	for attempt := 0; attempt < 20; attempt++ {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		var cm corev1.ConfigMap
		err := s.Reader.Get(ctx, key, &cm)
		if apierrors.IsNotFound(err) {
			epoch := max(now().UnixMilli(), 1)
			cm = corev1.ConfigMap{
				ObjectMeta: metav1.ObjectMeta{
					Namespace: key.Namespace, Name: key.Name,
					Labels:      map[string]string{"app.kubernetes.io/managed-by": "apportion"},
					Annotations: map[string]string{"apportion.io/purpose": "fencing epoch of the apportion manager; only ever increase it"},
				},
				Data: map[string]string{EpochKey: strconv.FormatInt(epoch, 10)},
			}
			err = s.Writer.Create(ctx, &cm)
			if err == nil {
				return epoch, nil
			}
			if apierrors.IsAlreadyExists(err) {
				lastErr = err
				continue
			}
			return 0, fmt.Errorf("creating epoch ConfigMap %s: %w", key, err)
		}
		if err != nil {
			return 0, fmt.Errorf("reading epoch ConfigMap %s: %w", key, err)
		}
		cur, err := strconv.ParseInt(cm.Data[EpochKey], 10, 64)
		if err != nil || cur < 0 {
			return 0, fmt.Errorf("epoch ConfigMap %s: data[%q] = %q is not a non-negative integer", key, EpochKey, cm.Data[EpochKey])
		}
		next := cur + 1
		if cm.Data == nil {
			cm.Data = map[string]string{}
		}
		cm.Data[EpochKey] = strconv.FormatInt(next, 10)
		err = s.Writer.Update(ctx, &cm) // carries the read's resourceVersion: optimistic concurrency
		if err == nil {
			return next, nil
		}
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
			lastErr = err
			continue
		}
		return 0, fmt.Errorf("updating epoch ConfigMap %s: %w", key, err)
	}
	return 0, fmt.Errorf("epoch ConfigMap %s: too many conflicts: %w", key, lastErr)
}

// CurrentEpoch implements EpochRecord: the counter as the API server has it now. Reader must read
// from the API server (mgr.GetAPIReader()): a Get without a resourceVersion is a quorum read, so
// it sees every epoch a manager took before the read began — in particular that of any manager
// whose pushes an agent accepted before it answered. A missing ConfigMap is an error (nothing is
// decided): every manager writes it before it pushes anything.
func (s *ConfigMapEpoch) CurrentEpoch(ctx context.Context) (int64, error) {
	key, err := s.key()
	if err != nil {
		return 0, err
	}
	var cm corev1.ConfigMap
	if err := s.Reader.Get(ctx, key, &cm); err != nil {
		return 0, fmt.Errorf("reading epoch ConfigMap %s: %w", key, err)
	}
	cur, err := strconv.ParseInt(cm.Data[EpochKey], 10, 64)
	if err != nil || cur < 0 {
		return 0, fmt.Errorf("epoch ConfigMap %s: data[%q] = %q is not a non-negative integer", key, EpochKey, cm.Data[EpochKey])
	}
	return cur, nil
}

// key names the epoch ConfigMap: Name (DefaultEpochConfigMap when empty) in Namespace, which is
// required.
func (s *ConfigMapEpoch) key() (types.NamespacedName, error) {
	name := s.Name
	if name == "" {
		name = DefaultEpochConfigMap
	}
	if s.Namespace == "" {
		return types.NamespacedName{}, fmt.Errorf("epoch ConfigMap: namespace is required")
	}
	return types.NamespacedName{Namespace: s.Namespace, Name: name}, nil
}
