package controller

import (
	"context"
	"encoding/json"
	"strings"
	"sync"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/log"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
)

// quotaStatusUpdate is one reconcile's decision about a DownstreamQuota's status, handed to the
// status writer (or written at once when there is none).
type quotaStatusUpdate struct {
	// UID is the quota the status was computed for: a quota deleted and created again under the
	// same name is another quota, whose own reconcile decides its status.
	UID    types.UID
	Status apportionv1.DownstreamQuotaStatus
	// Events describe the change, from the status decided before; they are recorded once the
	// status is written or found already so, about the object as written.
	Events []statusEvent
}

// statusEvent is an Event to record about a quota.
type statusEvent struct{ Type, Reason, Action, Note string }

// mergeQuotaUpdates folds an update the writer did not write yet into the newer one that replaces
// it: the newer status, and the Events of both (the older's first), so that no change decided
// goes unreported. An older update of another quota (UID) is dropped whole.
func mergeQuotaUpdates(older, newer quotaStatusUpdate) quotaStatusUpdate {
	if older.UID != newer.UID {
		return newer
	}
	newer.Events = append(append([]statusEvent(nil), older.Events...), newer.Events...)
	return newer
}

// quotaStatusWriter writes DownstreamQuota statuses: the write function of the quotas'
// StatusWriter, and of a reconcile that has none.
type quotaStatusWriter struct {
	// Reader is the manager's cache; Client writes the status subresource.
	Reader   client.Reader
	Client   client.Client
	Recorder events.EventRecorder
	// written remembers, per quota, the status last written and the version of the quota the
	// cache held then (see write).
	written sync.Map // types.NamespacedName → writtenStatus
}

type writtenStatus struct {
	uid     types.UID
	cacheRV string
	status  apportionv1.DownstreamQuotaStatus
	// rv is the quota's resourceVersion the write returned.
	rv string
}

// write writes u's status to the quota key, unless the quota already has it, and records u's
// Events after; it is called for one quota at a time.
//
// What the quota "has" is the cache's version, or — while the cache still holds the version it
// held when this writer last wrote the quota's status — that status as the API server returned
// it: the cache lags behind a write just made, and a status that went back to what the lagging
// cache shows must still be written. The manager is the only writer of a quota's status.
//
// Outcomes: the quota is gone (NotFound), or its name belongs to another object (another UID, in
// the cache or — through the patch's test of metadata.uid — in the API server, which answers 422
// Invalid): dropped, nothing recorded. The API server refuses the status (Invalid): dropped and
// logged; a retry would send the same. Any other error is returned, for a retry.
func (s *quotaStatusWriter) write(ctx context.Context, key types.NamespacedName, u quotaStatusUpdate) (WriteOutcome, error) {
	var dq apportionv1.DownstreamQuota
	if err := s.Reader.Get(ctx, key, &dq); err != nil {
		if apierrors.IsNotFound(err) {
			s.forget(key)
			return StatusDropped, nil
		}
		return 0, err
	}
	if dq.UID != u.UID {
		return StatusDropped, nil
	}
	has, rv := dq.Status, dq.ResourceVersion
	if w, ok := s.written.Load(key); ok && w.(writtenStatus).uid == dq.UID && w.(writtenStatus).cacheRV == dq.ResourceVersion {
		has, rv = w.(writtenStatus).status, w.(writtenStatus).rv
	}
	// status.global is the member's record of its grant (hubsync.Member writes it, with an
	// optimistic lock): this writer keeps what it read there, and writes the rest of the status
	// only on that very version of the quota — a record written since makes the patch conflict,
	// and the retry reads it. An older record written back over a newer one would let a restarted
	// member start above its newest grant's fallback (docs/protocol.md §16). The member writes its
	// SliceLeased condition in the same patch: kept as read too.
	u.Status.Global = has.Global
	u.Status.Conditions = keepCondition(u.Status.Conditions, has.Conditions, apportionv1.ConditionSliceLeased)
	if equality.Semantic.DeepEqual(has, u.Status) {
		s.record(&dq, u.Events)
		return StatusUnchanged, nil
	}
	if dq.Spec.Global == nil && has.Global == nil && meta.FindStatusCondition(has.Conditions, apportionv1.ConditionSliceLeased) == nil {
		rv = "" // no record to keep: the whole status is this writer's
	}
	patch, err := statusPatch(dq.UID, rv, u.Status)
	if err != nil {
		return 0, err
	}
	obj := dq.DeepCopy()
	if err := s.Client.Status().Patch(ctx, obj, patch); err != nil {
		switch {
		case apierrors.IsNotFound(err):
			s.forget(key)
			return StatusDropped, nil
		case apierrors.IsInvalid(err):
			log.FromContext(ctx).Info("status not written: the quota was replaced, or its status was refused", "quota", key, "error", err.Error())
			return StatusDropped, nil
		}
		return 0, err
	}
	s.written.Store(key, writtenStatus{uid: dq.UID, cacheRV: dq.ResourceVersion, status: obj.Status, rv: obj.ResourceVersion})
	// The Events regard the quota as just written. The Event recorder folds Events of the same
	// type, reason and action about the same object version into one series and keeps only the
	// first note, so two rebalances recorded on one cached version would report the first one
	// twice and lose the second; the version the status patch returned is new each time.
	s.record(obj, u.Events)
	log.FromContext(ctx).V(1).Info("status updated", "quota", key, "pods", u.Status.Pods, "perPod", u.Status.PerPod, "assigned", u.Status.Assigned)
	return StatusWritten, nil
}

// keepCondition is conds with the condition typ as has holds it (or without it, when has has
// none): a condition another writer owns — SliceLeased, which the member writes with its record
// — goes back as read, in place.
func keepCondition(conds, has []metav1.Condition, typ string) []metav1.Condition {
	out := make([]metav1.Condition, 0, len(conds)+1)
	theirs := meta.FindStatusCondition(has, typ)
	placed := false
	for _, c := range conds {
		if c.Type != typ {
			out = append(out, c)
		} else if theirs != nil && !placed {
			out, placed = append(out, *theirs), true
		}
	}
	if theirs != nil && !placed {
		out = append(out, *theirs)
	}
	if len(out) == 0 {
		return conds // nil stays nil, for the comparison with has
	}
	return out
}

// forget drops what the writer remembers of a quota that is gone.
func (s *quotaStatusWriter) forget(key types.NamespacedName) { s.written.Delete(key) }

func (s *quotaStatusWriter) record(dq *apportionv1.DownstreamQuota, evs []statusEvent) {
	if s.Recorder == nil {
		return
	}
	for _, e := range foldEvents(evs) {
		s.Recorder.Eventf(dq, nil, e.Type, e.Reason, e.Action, "%s", e.Note)
	}
}

// statusPatch is a JSON patch (RFC 6902) that sets the whole status of the object with this UID,
// and of no other: its test of metadata.uid fails — the API server answers 422 Invalid — once
// the name belongs to an object created again. ("add" replaces a member that exists.) A
// non-empty rv makes it a write of that version only: the API server answers 409 Conflict when
// the object has another (the resourceVersion of a patched object is a precondition).
func statusPatch(uid types.UID, rv string, status any) (client.Patch, error) {
	ops := []map[string]any{{"op": "test", "path": "/metadata/uid", "value": uid}}
	if rv != "" {
		ops = append(ops, map[string]any{"op": "replace", "path": "/metadata/resourceVersion", "value": rv})
	}
	b, err := json.Marshal(append(ops, map[string]any{"op": "add", "path": "/status", "value": status}))
	return client.RawPatch(types.JSONPatchType, b), err
}

// maxEventNote is the API server's bound on an Event's note (events.k8s.io/v1), in bytes.
const maxEventNote = 1024

// foldEvents turns the Events of updates written at once into one Event per type, reason and
// action (the recorder would fold them into one series about the written version and keep only
// the first note), in the order of their first appearance, their distinct notes joined by
// "; then " — or, when that is longer than an Event may say, the last note alone.
func foldEvents(evs []statusEvent) []statusEvent {
	if len(evs) < 2 {
		return evs
	}
	type key struct{ typ, reason, action string }
	var out []statusEvent
	notes := map[key][]string{}
	for _, e := range evs {
		k := key{e.Type, e.Reason, e.Action}
		n, seen := notes[k]
		if !seen {
			out = append(out, e)
		}
		if len(n) == 0 || n[len(n)-1] != e.Note {
			notes[k] = append(n, e.Note)
		}
	}
	for i, e := range out {
		n := notes[key{e.Type, e.Reason, e.Action}]
		out[i].Note = strings.Join(n, "; then ")
		if len(out[i].Note) > maxEventNote {
			out[i].Note = n[len(n)-1]
		}
	}
	return out
}
