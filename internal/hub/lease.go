package hub

import (
	"errors"
	"time"
)

// Lease is a member's hold on its slice (docs/protocol.md §16, "A member's lease"): the slice
// of the newest grant it read, for LeaseDuration from the start of that read (member clock),
// then that grant's fallback, min(Reserved, Slice), until a read succeeds again. It is not safe
// for concurrent use.
type Lease struct {
	grant    Grant
	until    time.Time
	duration time.Duration
}

// NewLease starts a member's lease after its manager started. record is the newest grant the
// member recorded in its own cluster (nil: none): it starts on that grant's fallback (0 with no
// record) and holds no lease until its first read.
func NewLease(record *Grant) *Lease {
	l := &Lease{}
	if record != nil {
		l.grant = *record
	}
	return l
}

// Read applies a successful consistent read of the member's grant, g, which the hub published
// with lease duration d; startedAt is the member's clock when the request was about to be sent
// (before, never after). A read of an older grant than one read before changes nothing (the hub
// never publishes a lower sequence number, so it is a stale answer). It reports whether the grant
// was taken.
func (l *Lease) Read(g Grant, d time.Duration, startedAt time.Time) (bool, error) {
	if g.Seq < 0 || g.Slice < 0 || g.Reserved < 0 {
		return false, errors.New("hub: a grant with negative values")
	}
	if d <= 0 {
		return false, errors.New("hub: a grant with a lease duration that is not positive")
	}
	if g.Seq < l.grant.Seq || g.Seq == 0 {
		return false, nil
	}
	if g.Seq == l.grant.Seq && g != l.grant {
		return false, errors.New("hub: two different grants with one sequence number")
	}
	l.grant, l.duration = g, d
	if u := startedAt.Add(d); u.After(l.until) {
		l.until = u
	}
	return true, nil
}

// Limit is the member's local limit at now (its clock) and whether its lease holds: the newest
// grant's slice until the lease ends, then its fallback.
func (l *Lease) Limit(now time.Time) (limit int64, held bool) {
	if now.Before(l.until) {
		return l.grant.Slice, true
	}
	return l.grant.Fallback(), false
}

// Until is when the lease ends (member clock; zero before the first read).
func (l *Lease) Until() time.Time { return l.until }

// Grant is the newest grant read (or restored from the record).
func (l *Lease) Grant() Grant { return l.grant }

// Acknowledge says which sequence number the member may acknowledge: the newest grant's, when
// its own ledger counts at most that grant's slice (counted: Σ counted over its pods, once every
// pod was pushed the content of that grant) and the grant is recorded in its own cluster
// (recorded: the sequence number of the record). ok is false otherwise.
func (l *Lease) Acknowledge(counted, recorded int64) (seq int64, ok bool) {
	if l.grant.Seq == 0 || recorded < l.grant.Seq || counted > l.grant.Slice {
		return 0, false
	}
	return l.grant.Seq, true
}

// Duration is the lease duration of the newest grant read (0 before the first read).
func (l *Lease) Duration() time.Duration { return l.duration }
