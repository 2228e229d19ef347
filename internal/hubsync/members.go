package hubsync

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/event"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/controller"
	"github.com/apportion/apportion/internal/hub"
	"github.com/apportion/apportion/internal/push"
)

// HubKubeconfigKey is the key of a hub Secret that holds the kubeconfig reaching the hub.
const HubKubeconfigKey = "kubeconfig"

// DefaultMembersResync is how often Members looks for quotas with spec.global that came or went.
const DefaultMembersResync = 2 * time.Second

// Ledger is what a member reads of its own push engine: the ledger of a quota (push.Engine).
type Ledger interface {
	Report(types.NamespacedName) push.Report
}

// Members runs, in a member cluster's manager (on the leader, whose engine pushes), one Member
// per DownstreamQuota with spec.global, reaching the hub through the kubeconfig Secret that
// spec.global.hub names in the manager's namespace; it stops a quota's Member when the quota
// goes. It is the DownstreamQuota controller's controller.GlobalSlices: the local limit of each
// such quota, and the assignments the engine took, from which the Member's acknowledgement
// follows (docs/protocol.md §16, "A member's lease").
type Members struct {
	// Local reads the DownstreamQuotas (the manager's cache) and writes their status.global.
	Local client.Client
	// Secrets reads the hub Secrets (uncached: the manager watches no Secrets).
	Secrets client.Reader
	// Namespace is the manager's namespace, where the hub Secrets are.
	Namespace string
	Scheme    *runtime.Scheme
	Clock     clock.Clock
	// Engine is the member's push engine.
	Engine Ledger
	// Window is the longest the engine takes to bring a pod it cannot reach under a lowered
	// grant, request timeout excluded: its pods' LeaseTTL + PushTimeout + AcceptGrace, plus the
	// manager's own reaction. A quota's drain bound is Window + its requestTimeout.
	Window time.Duration
	// Changes receives the keys of quotas whose grant or lease changed; may be nil.
	Changes chan<- event.GenericEvent
	// Resync is how often the quotas are listed (0: DefaultMembersResync).
	Resync time.Duration
	// NewHub makes the hub client from a kubeconfig (nil: a plain client of Scheme).
	NewHub func(kubeconfig []byte) (client.Client, error)

	mu      sync.Mutex
	running map[types.NamespacedName]*runningMember
}

type runningMember struct {
	uid      types.UID
	ref      apportionv1.GlobalRef
	drain    time.Duration
	m        *Member
	stop     context.CancelFunc
	done     chan struct{}
	assigned atomic.Int64 // the newest grant the engine was handed an assignment of
	// secretRV is the resourceVersion of the hub Secret the Member's client was made from (only
	// the resync loop reads and writes it).
	secretRV string
}

var _ controller.GlobalSlices = (*Members)(nil)

// Slice implements controller.GlobalSlices.
func (s *Members) Slice(key types.NamespacedName) (hub.Grant, int64, bool) {
	s.mu.Lock()
	r := s.running[key]
	s.mu.Unlock()
	if r == nil || !r.m.Started() {
		return hub.Grant{}, 0, false
	}
	lim, _ := r.m.Limit()
	return r.m.Grant(), lim, true
}

// Assigned implements controller.GlobalSlices.
func (s *Members) Assigned(key types.NamespacedName, seq int64) {
	s.mu.Lock()
	r := s.running[key]
	s.mu.Unlock()
	if r == nil {
		return
	}
	for {
		old := r.assigned.Load()
		if seq <= old || r.assigned.CompareAndSwap(old, seq) {
			return
		}
	}
}

// NeedLeaderElection: only the leader's engine pushes, and only it may acknowledge.
func (s *Members) NeedLeaderElection() bool { return true }

// Start lists the quotas every Resync, starting and stopping Members, until ctx ends.
func (s *Members) Start(ctx context.Context) error {
	every := s.Resync
	if every <= 0 {
		every = DefaultMembersResync
	}
	defer s.stopAll()
	for {
		if err := s.resync(ctx); err != nil && ctx.Err() == nil {
			logf.FromContext(ctx).Info("listing quotas with spec.global failed", "err", err.Error())
		}
		select {
		case <-ctx.Done():
			return nil
		case <-s.Clock.After(every):
		}
	}
}

// DrainBound is a quota's drain bound D_c: Window plus its requestTimeout.
func DrainBound(window time.Duration, dq *apportionv1.DownstreamQuota) time.Duration {
	rt := apportionv1.DefaultRequestTimeout
	if d := dq.Spec.Agent.RequestTimeout; d != nil && d.Duration > 0 {
		rt = d.Duration
	}
	return window + rt
}

func (s *Members) resync(ctx context.Context) error {
	var list apportionv1.DownstreamQuotaList
	if err := s.Local.List(ctx, &list); err != nil {
		return err
	}
	want := map[types.NamespacedName]*apportionv1.DownstreamQuota{}
	for i := range list.Items {
		dq := &list.Items[i]
		if dq.Spec.Global != nil && dq.DeletionTimestamp.IsZero() {
			want[client.ObjectKeyFromObject(dq)] = dq
		}
	}
	s.mu.Lock()
	if s.running == nil {
		s.running = map[types.NamespacedName]*runningMember{}
	}
	var stale []*runningMember
	for key, r := range s.running {
		dq := want[key]
		if dq == nil || dq.UID != r.uid || *dq.Spec.Global != r.ref || DrainBound(s.Window, dq) != r.drain {
			// Gone, or another quota, hub or drain bound: a new Member starts from the record,
			// on its fallback, with no lease (safe whatever changed).
			stale = append(stale, r)
			delete(s.running, key)
		}
	}
	s.mu.Unlock()
	for _, r := range stale {
		r.stop()
		<-r.done
	}
	var errs []error
	if err := s.rotate(ctx); err != nil {
		errs = append(errs, err)
	}
	for key, dq := range want {
		s.mu.Lock()
		_, ok := s.running[key]
		s.mu.Unlock()
		if ok {
			continue
		}
		if err := s.start(ctx, key, dq); err != nil {
			errs = append(errs, fmt.Errorf("quota %s: %w", key, err))
		}
	}
	return errors.Join(errs...)
}

// hubClient reads the hub Secret name and makes a client from its kubeconfig; rv is the
// Secret's resourceVersion.
func (s *Members) hubClient(ctx context.Context, name string) (c client.Client, rv string, err error) {
	var sec corev1.Secret
	if err := s.Secrets.Get(ctx, types.NamespacedName{Namespace: s.Namespace, Name: name}, &sec); err != nil {
		return nil, "", fmt.Errorf("the hub Secret %s/%s: %w", s.Namespace, name, err)
	}
	kc := sec.Data[HubKubeconfigKey]
	if len(kc) == 0 {
		return nil, "", fmt.Errorf("the hub Secret %s/%s has no %q", s.Namespace, name, HubKubeconfigKey)
	}
	newHub := s.NewHub
	if newHub == nil {
		newHub = func(b []byte) (client.Client, error) {
			cfg, err := clientcmd.RESTConfigFromKubeConfig(b)
			if err != nil {
				return nil, err
			}
			return client.New(cfg, client.Options{Scheme: s.Scheme})
		}
	}
	hc, err := newHub(kc)
	if err != nil {
		return nil, "", fmt.Errorf("the hub Secret %s/%s: %w", s.Namespace, name, err)
	}
	return hc, sec.ResourceVersion, nil
}

// rotate gives every running Member whose hub Secret changed (its resourceVersion) a client made
// from the new kubeconfig, without stopping it: its lease, grant and record stay (Member.SetHub).
// Each Secret is read once per round, however many quotas name it. A Secret that is gone or
// unusable leaves the Members on the client they have (logged).
func (s *Members) rotate(ctx context.Context) error {
	s.mu.Lock()
	bySecret := map[string][]*runningMember{}
	for _, r := range s.running {
		bySecret[r.ref.Hub] = append(bySecret[r.ref.Hub], r)
	}
	s.mu.Unlock()
	var errs []error
	for name, rs := range bySecret {
		var sec metav1.PartialObjectMetadata
		sec.SetGroupVersionKind(corev1.SchemeGroupVersion.WithKind("Secret"))
		if err := s.Secrets.Get(ctx, types.NamespacedName{Namespace: s.Namespace, Name: name}, &sec); err != nil {
			errs = append(errs, fmt.Errorf("the hub Secret %s/%s: %w", s.Namespace, name, err))
			continue
		}
		var stale []*runningMember
		for _, r := range rs {
			if r.secretRV != sec.ResourceVersion {
				stale = append(stale, r)
			}
		}
		if len(stale) == 0 {
			continue
		}
		hc, rv, err := s.hubClient(ctx, name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, r := range stale {
			r.m.SetHub(hc)
			r.secretRV = rv
		}
		logf.FromContext(ctx).Info("hub kubeconfig rotated", "secret", s.Namespace+"/"+name, "quotas", len(stale))
	}
	return errors.Join(errs...)
}

func (s *Members) start(ctx context.Context, key types.NamespacedName, dq *apportionv1.DownstreamQuota) error {
	hc, rv, err := s.hubClient(ctx, dq.Spec.Global.Hub)
	if err != nil {
		return err
	}
	r := &runningMember{uid: dq.UID, ref: *dq.Spec.Global, drain: DrainBound(s.Window, dq), done: make(chan struct{})}
	r.secretRV = rv
	m := &Member{Hub: hc, Local: s.Local, Clock: s.Clock, Quota: key, Ref: r.ref, Drain: r.drain}
	m.Inner = func() (int64, bool) {
		rep := s.Engine.Report(key)
		// Every pod pushed the content of the grant in force: the engine was handed an
		// assignment planned on it, and every pod acknowledged what it holds now.
		return int64(rep.Ledger), rep.Converged && !rep.Recovering && r.assigned.Load() >= m.Grant().Seq
	}
	m.Demand = func() int64 { return s.demand(ctx, key) }
	m.Notify = func() { s.notify(ctx, key) }
	r.m = m
	mctx, cancel := context.WithCancel(ctx)
	r.stop = cancel
	s.mu.Lock()
	s.running[key] = r
	s.mu.Unlock()
	go func() {
		defer close(r.done)
		_ = m.Start(logf.IntoContext(mctx, logf.FromContext(ctx).WithValues("quota", key)))
	}()
	return nil
}

// demand is the local limit the quota's pods would like: ⌈Σ (in flight + waiting) / factor⌉,
// capped at maxInFlight (docs/protocol.md §16, "Sharing between clusters").
func (s *Members) demand(ctx context.Context, key types.NamespacedName) int64 {
	var dq apportionv1.DownstreamQuota
	if err := s.Local.Get(ctx, key, &dq); err != nil {
		return 0
	}
	var sum int64
	for _, h := range s.Engine.Report(key).Holdings {
		if !h.Gone {
			sum += int64(h.InFlight) + int64(h.Waiting)
		}
	}
	f := int64(apportionv1.DefaultSafetyFactorPercent)
	if dq.Spec.SafetyFactorPercent > 0 {
		f = int64(dq.Spec.SafetyFactorPercent)
	}
	return min((sum*100+f-1)/f, int64(dq.Spec.MaxInFlight))
}

func (s *Members) notify(ctx context.Context, key types.NamespacedName) {
	if s.Changes == nil {
		return
	}
	ev := event.GenericEvent{Object: &apportionv1.DownstreamQuota{ObjectMeta: metav1.ObjectMeta{Namespace: key.Namespace, Name: key.Name}}}
	select {
	case s.Changes <- ev:
	case <-ctx.Done():
	}
}

func (s *Members) stopAll() {
	s.mu.Lock()
	rs := s.running
	s.running = nil
	s.mu.Unlock()
	for _, r := range rs {
		r.stop()
		<-r.done
	}
}
