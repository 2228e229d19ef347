package hubsync

import (
	"fmt"
	"time"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/hub"
)

// sliceView is what a member's DownstreamQuota says of its slice: the SliceLeased condition and
// status.global.leaseUntil. The Member writes it in the same patch as its record.
type sliceView struct {
	ok      bool
	reason  string
	message string
	// until is the lease's end to write in status.global.leaseUntil (zero: keep what is there).
	until time.Time
}

// sliceLeased is the SliceLeased condition of a member's quota (docs/protocol.md §16, "What a
// member shows"): ref is its spec.global; g the newest grant read or restored; held whether its
// lease holds; until its end (zero before the first read since the manager started); d the
// lease duration; hubErr the last read's failure (nil after a successful read).
func sliceLeased(ref apportionv1.GlobalRef, g hub.Grant, held bool, until time.Time, d time.Duration, hubErr error) sliceView {
	quota := ref.Namespace + "/" + ref.Name
	switch {
	case g.Seq == 0:
		msg := fmt.Sprintf("no grant of %s read from the hub yet: the local limit is 0", quota)
		if hubErr != nil {
			msg += "; the hub: " + hubErr.Error()
		}
		return sliceView{reason: apportionv1.ReasonNoGrant, message: msg}
	case held:
		return sliceView{ok: true, reason: apportionv1.ReasonLeaseHeld, until: until, message: fmt.Sprintf(
			"slice %d of %s (grant %d) leased until %s, renewed by reading the hub every %s; falls to %d if the hub stops answering",
			g.Slice, quota, g.Seq, stamp(until), (d / 3).Round(time.Millisecond), g.Fallback())}
	case until.IsZero():
		// Restarted from the record: no lease until the hub answers.
		msg := fmt.Sprintf("restarted from the record of grant %d of %s: on its reserved slice %d until the hub answers", g.Seq, quota, g.Fallback())
		if hubErr != nil {
			return sliceView{reason: apportionv1.ReasonHubUnreachable, message: msg + "; the hub: " + hubErr.Error()}
		}
		return sliceView{reason: apportionv1.ReasonLeaseLapsed, message: msg}
	default:
		msg := fmt.Sprintf("the lease of slice %d of %s (grant %d) ended at %s: on the reserved slice %d", g.Slice, quota, g.Seq, stamp(until), g.Fallback())
		if hubErr != nil {
			return sliceView{reason: apportionv1.ReasonHubUnreachable, until: until, message: msg + " until the hub answers; the hub: " + hubErr.Error()}
		}
		return sliceView{reason: apportionv1.ReasonLeaseLapsed, until: until, message: msg}
	}
}

func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339) }
