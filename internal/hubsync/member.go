package hubsync

import (
	"context"
	"errors"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/hub"
)

// Member is a member cluster's hold on its slice of one GlobalQuota (docs/protocol.md §16, "A
// member's lease"), for the DownstreamQuota that names it. Sync reads the grant from the hub,
// records a new one in the DownstreamQuota's status.global, and tells the hub its drain bound,
// its acknowledgement and its demand; Limit is the local limit the member's ledger must keep
// under. It is not safe for concurrent use but for Limit.
type Member struct {
	// Hub reaches the hub's API server as this member, without a cache: every read of the
	// ClusterSlice is a consistent read.
	Hub client.Client
	// Local reaches this cluster's API server.
	Local client.Client
	Clock clock.Clock
	// Quota is the DownstreamQuota; Ref its spec.global.
	Quota types.NamespacedName
	Ref   apportionv1.GlobalRef
	// Drain is the member's drain bound (docs/protocol.md §16, "Drain bound").
	Drain time.Duration
	// Inner is what the member's own ledger counts for the quota, and whether every pod was
	// pushed the content of the current local limit.
	Inner func() (counted int64, synced bool)
	// Demand is the local limit the member would like (0 when nil).
	Demand func() int64
	// Notify, when set, is called once the local limit or the grant in force may have changed:
	// after a round that read a new grant, and when the lease ended (Start wakes for it). The
	// DownstreamQuota controller then plans on the new limit at once.
	Notify func()

	mu       sync.Mutex // guards lease, which Limit and Grant read from other goroutines
	lease    *hub.Lease
	recorded int64
	sliceUID types.UID     // the ClusterSlice the lease's grants come from
	rotated  client.Client // the hub client SetHub gave, replacing Hub

	hubErr    error     // the last read's failure (nil after a successful read)
	shown     bool      // publish wrote since the member started
	shownView sliceView // what it wrote
}

func (m *Member) lock() { m.mu.Lock() }

// SetHub replaces the client that reaches the hub (a rotated kubeconfig) from the next request
// on. The lease, the grant and the record stay: what a read means — a grant of this ClusterSlice
// (its UID) with its sequence number, counted from the start of the read — does not depend on
// the credential that made it (docs/protocol.md §16, "Rotating a member's kubeconfig").
func (m *Member) SetHub(c client.Client) {
	m.lock()
	defer m.unlock()
	m.rotated = c
}

// hubClient is the client of the next request: the latest SetHub's, else Hub.
func (m *Member) hubClient() client.Client {
	m.lock()
	defer m.unlock()
	if m.rotated != nil {
		return m.rotated
	}
	return m.Hub
}
func (m *Member) unlock() { m.mu.Unlock() }

// demandBand is the dead band of the demand a member writes: 10 % of what it wrote, at least 1.
func demandBand(written int32) int32 { return max(1, written/10) }

// Limit is the member's local limit now, and whether its lease holds (0 and false before Sync
// first ran).
func (m *Member) Limit() (int64, bool) {
	m.lock()
	defer m.unlock()
	if m.lease == nil {
		return 0, false
	}
	return m.lease.Limit(m.Clock.Now())
}

// Grant is the newest grant the member read (or restarted from).
func (m *Member) Grant() hub.Grant {
	m.lock()
	defer m.unlock()
	if m.lease == nil {
		return hub.Grant{}
	}
	return m.lease.Grant()
}

// Sync is one round: read, record, answer. A failed read leaves the lease to end on its own; the
// round still shows it (publish) before it returns the read's error.
func (m *Member) Sync(ctx context.Context) error {
	if m.lease == nil {
		if err := m.start(ctx); err != nil {
			return err
		}
	}
	cs, err := m.read(ctx)
	m.hubErr = err
	if perr := m.publish(ctx); err != nil {
		return err
	} else if perr != nil {
		return perr // not recorded: nothing to acknowledge this round
	}
	want := cs.Status
	if want.Drain == nil || want.Drain.Duration != m.Drain {
		want.Drain = &metav1.Duration{Duration: m.Drain}
	}
	if m.Inner != nil {
		counted, synced := m.Inner()
		m.lock()
		seq, ok := m.lease.Acknowledge(counted, m.recorded)
		m.unlock()
		if ok && synced && seq > want.AcknowledgedSeq && seq <= cs.Spec.Seq {
			want.AcknowledgedSeq = seq
		}
	}
	if m.Demand != nil {
		d := int32(min(max(m.Demand(), 0), 1_000_000))
		if diff := d - want.Demand; diff >= demandBand(want.Demand) || -diff >= demandBand(want.Demand) || (d == 0) != (want.Demand == 0) {
			want.Demand = d
		}
	}
	if want == cs.Status || (want.Drain != nil && cs.Status.Drain != nil && *want.Drain == *cs.Status.Drain &&
		want.AcknowledgedSeq == cs.Status.AcknowledgedSeq && want.Demand == cs.Status.Demand) {
		return nil // nothing to say: no write
	}
	cs.Status = want
	return m.hubClient().Status().Update(ctx, cs) // precondition: the resourceVersion just read
}

// read reads the member's ClusterSlice from the hub and takes its grant (the lease counts from
// the start of the read).
func (m *Member) read(ctx context.Context) (*apportionv1.ClusterSlice, error) {
	start := m.Clock.Now() // before the request: the lease counts from no later than the read
	var cs apportionv1.ClusterSlice
	if err := m.hubClient().Get(ctx, types.NamespacedName{Namespace: m.Ref.Namespace, Name: SliceName(m.Ref.Name, m.Ref.Cluster)}, &cs); err != nil {
		return nil, err
	}
	if cs.Spec.GlobalQuota != m.Ref.Name || cs.Spec.Cluster != m.Ref.Cluster {
		return nil, errors.New("hubsync: the ClusterSlice names another quota or cluster")
	}
	if err := m.sameSlice(cs.UID); err != nil {
		return nil, err
	}
	if cs.Spec.Seq > 0 {
		m.lock()
		_, err := m.lease.Read(hub.Grant{Seq: cs.Spec.Seq, Slice: int64(cs.Spec.Slice), Reserved: int64(cs.Spec.ReservedSlice)}, cs.Spec.LeaseDuration.Duration, start)
		m.unlock()
		if err != nil {
			return nil, err
		}
	}
	return &cs, nil
}

// sameSlice checks that uid is the ClusterSlice the lease's grants come from. A GlobalQuota is
// deleted only once every member was lowered to a grant whose fallback is 0 and whose lease ended
// (the hub's finalizer), so a new ClusterSlice — the quota created again, its grants numbered
// from 1 — is taken only when this member's lease has ended on a fallback of 0: it holds nothing
// then. Otherwise it is refused, and the lease ends on its own.
func (m *Member) sameSlice(uid types.UID) error {
	m.lock()
	defer m.unlock()
	if m.sliceUID == "" || m.sliceUID == uid {
		m.sliceUID = uid
		return nil
	}
	if lim, held := m.lease.Limit(m.Clock.Now()); held || lim > 0 {
		return errors.New("hubsync: the ClusterSlice was created again while this member may hold a slice of the old one")
	}
	m.lease, m.recorded, m.sliceUID = hub.NewLease(nil), 0, uid
	return nil
}

// start reads the member's record: it starts on that grant's fallback, with no lease.
func (m *Member) start(ctx context.Context) error {
	var dq apportionv1.DownstreamQuota
	if err := m.Local.Get(ctx, m.Quota, &dq); err != nil {
		return err
	}
	var rec *hub.Grant
	if g := dq.Status.Global; g != nil && g.Seq > 0 {
		rec = &hub.Grant{Seq: g.Seq, Slice: int64(g.Slice), Reserved: int64(g.ReservedSlice)}
		m.recorded, m.sliceUID = g.Seq, g.SliceUID
	}
	m.lock()
	m.lease = hub.NewLease(rec)
	m.unlock()
	return nil
}

// publish writes, in the DownstreamQuota's status, the newest grant (status.global, before
// anything acknowledges it: the record a restarted member starts from) with the lease's end, and
// the SliceLeased condition — when the grant is new, when the condition's reason changes (or,
// off the lease, its message), or, while the lease holds, once the lease's end moved half a lease
// past the leaseUntil written (so that it stays a date in the future: one write per two thirds
// of a lease at most; none on the hub). One patch, with the quota's resourceVersion as
// precondition (the DownstreamQuota controller keeps both as read).
func (m *Member) publish(ctx context.Context) error {
	now := m.Clock.Now()
	m.lock()
	g, until, d := m.lease.Grant(), m.lease.Until(), m.lease.Duration()
	_, held := m.lease.Limit(now)
	uid := m.sliceUID
	m.unlock()
	v := sliceLeased(m.Ref, g, held, until, d, m.hubErr)
	// While the lease holds, its end moves with each read's start (reads start at least a third
	// of a lease apart): rewritten once it moved half a lease past what was written, that is at
	// most every second read, however slow the reads.
	due := !m.shown || g.Seq > m.recorded || v.reason != m.shownView.reason ||
		(!held && v.message != m.shownView.message) || (held && v.until.Sub(m.shownView.until) >= d/2)
	if !due {
		return nil
	}
	var dq apportionv1.DownstreamQuota
	if err := m.Local.Get(ctx, m.Quota, &dq); err != nil {
		return err
	}
	base := dq.DeepCopy()
	if g.Seq > 0 {
		prev := dq.Status.Global
		dq.Status.Global = &apportionv1.GlobalSliceStatus{Seq: g.Seq, Slice: int32(g.Slice), ReservedSlice: int32(g.Reserved), SliceUID: uid}
		if prev != nil {
			dq.Status.Global.AcknowledgedSeq = prev.AcknowledgedSeq
			dq.Status.Global.LeaseUntil = prev.LeaseUntil
			if prev.Seq == g.Seq && dq.Status.Global.SliceUID == "" {
				dq.Status.Global.SliceUID = prev.SliceUID
			}
		}
		if !v.until.IsZero() {
			dq.Status.Global.LeaseUntil = &metav1.Time{Time: v.until}
		}
	}
	apportionv1.SetCondition(&dq.Status.Conditions, apportionv1.ConditionSliceLeased, v.ok, v.reason, v.message, dq.Generation, metav1.NewTime(now))
	if err := m.Local.Status().Patch(ctx, &dq, client.MergeFromWithOptions(base, client.MergeFromWithOptimisticLock{})); err != nil {
		return err
	}
	m.recorded = g.Seq
	m.shown, m.shownView = true, v
	return nil
}

// Start runs Sync every third of the lease (every second before the first grant) until ctx ends;
// each round gets that long at most (a read that takes longer renews nothing worth having, and
// client-go retries a read over a broken connection for seconds). Beside it, Start watches the
// lease's end, to Notify at once when the limit falls, whatever a round is waiting on.
func (m *Member) Start(ctx context.Context) error {
	log := logf.FromContext(ctx).WithValues("quota", m.Quota, "global", m.Ref.Namespace+"/"+m.Ref.Name)
	var mu sync.Mutex
	var told limitState
	tell := func() {
		mu.Lock()
		defer mu.Unlock()
		if now := m.state(); now != told && m.Notify != nil {
			told = now
			m.Notify()
		}
	}
	done := make(chan struct{})
	defer func() { <-done }()
	go func() {
		defer close(done)
		for {
			wait := time.Second
			m.lock()
			if m.lease != nil {
				if left := m.lease.Until().Sub(m.Clock.Now()); left > 0 {
					wait = min(wait, left)
				}
			}
			m.unlock()
			select {
			case <-ctx.Done():
				return
			case <-m.Clock.After(wait):
			}
			tell()
		}
	}()
	for {
		every := time.Second
		m.lock()
		if m.lease != nil && !m.lease.Until().IsZero() {
			every = m.lease.Duration() / 3
		}
		m.unlock()
		round, cancel := context.WithTimeout(ctx, every)
		if err := m.Sync(round); err != nil && ctx.Err() == nil {
			log.V(1).Info("slice sync failed", "err", err.Error())
		}
		cancel()
		tell()
		select {
		case <-ctx.Done():
			return nil
		case <-m.Clock.After(every):
		}
	}
}

// limitState is what the DownstreamQuota controller plans on.
type limitState struct {
	grant hub.Grant
	limit int64
	held  bool
}

func (m *Member) state() limitState {
	lim, held := m.Limit()
	return limitState{grant: m.Grant(), limit: lim, held: held}
}

// Started says whether the member read its record (Limit is meaningful from then on).
func (m *Member) Started() bool {
	m.lock()
	defer m.unlock()
	return m.lease != nil
}
