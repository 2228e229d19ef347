package push

import (
	"context"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	testingclock "k8s.io/utils/clock/testing"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"
	"sigs.k8s.io/controller-runtime/pkg/client/interceptor"
)

func TestConfigMapEpoch(t *testing.T) {
	ctx := context.Background()
	now := time.UnixMilli(1_780_000_000_000)
	c := fake.NewClientBuilder().Build()
	s := &ConfigMapEpoch{Reader: c, Writer: c, Namespace: "apportion-system", Clock: testingclock.NewFakePassiveClock(now)}

	first, err := s.NextEpoch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if first != now.UnixMilli() {
		t.Fatalf("a new counter starts at %d, want the Unix time in ms %d", first, now.UnixMilli())
	}
	second, err := s.NextEpoch(ctx)
	if err != nil || second != first+1 {
		t.Fatalf("second epoch %d, %v", second, err)
	}
	var cm corev1.ConfigMap
	if err := c.Get(ctx, types.NamespacedName{Namespace: "apportion-system", Name: DefaultEpochConfigMap}, &cm); err != nil {
		t.Fatal(err)
	}
	if cm.Data[EpochKey] != "1780000000001" {
		t.Fatalf("stored %q", cm.Data[EpochKey])
	}

	// Two managers racing: every epoch handed out is distinct and they only grow.
	var mu sync.Mutex
	seen := map[int64]bool{}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			e, err := s.NextEpoch(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			if seen[e] {
				t.Errorf("epoch %d handed out twice", e)
			}
			seen[e] = true
		})
	}
	wg.Wait()
	for e := range seen {
		if e <= second {
			t.Errorf("epoch %d not above %d", e, second)
		}
	}
}

func TestConfigMapEpochRetriesConflicts(t *testing.T) {
	ctx := context.Background()
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "ep"}, Data: map[string]string{EpochKey: "41"}}
	conflicts := 2
	c := fake.NewClientBuilder().WithObjects(cm).WithInterceptorFuncs(interceptor.Funcs{
		Update: func(ctx context.Context, c client.WithWatch, obj client.Object, opts ...client.UpdateOption) error {
			if conflicts > 0 {
				conflicts--
				return apierrors.NewConflict(schema.GroupResource{Resource: "configmaps"}, obj.GetName(), nil)
			}
			return c.Update(ctx, obj, opts...)
		},
	}).Build()
	s := &ConfigMapEpoch{Reader: c, Writer: c, Namespace: "ns", Name: "ep"}
	e, err := s.NextEpoch(ctx)
	if err != nil || e != 42 {
		t.Fatalf("epoch %d, %v", e, err)
	}

	bad := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "bad"}, Data: map[string]string{EpochKey: "x"}}
	c2 := fake.NewClientBuilder().WithObjects(bad).Build()
	if _, err := (&ConfigMapEpoch{Reader: c2, Writer: c2, Namespace: "ns", Name: "bad"}).NextEpoch(ctx); err == nil {
		t.Fatal("a garbled counter was accepted")
	}
}
