// Package stall notices that the agent process did not run for a while: it was frozen (SIGSTOP,
// a paused container or VM) or starved of CPU. A push that reached the agent before or during
// such a stall may be read and applied only afterwards, later than the manager assumes any push
// can land (its send + PushTimeout + AcceptGrace, docs/protocol.md): applied, it would start a
// lease the manager no longer counts. The control API refuses pushes while Stalled says so.
//
// Model. Something calls Tick often (every Threshold/5 in cmd/agent). A gap of more than
// Threshold between two ticks is a stall. Stalled(now) is true
//   - while the last tick is more than Threshold ago: the process may be running again only
//     just now, before the ticking goroutine got to run; and
//   - for Hold after a tick that ended a stall: the requests that queued up in the kernel during
//     the stall are read in that time.
//
// Otherwise it is false. Threshold must be well below the manager's AcceptGrace (1 s by
// default); a stall shorter than Threshold delays a push by at most that much, which
// AcceptGrace covers. Times are time.Time readings of one clock (monotonic for the real one),
// passed in so that tests need no sleeping.
package stall

import (
	"sync"
	"time"
)

// Detector tells stalls from tick gaps. It is safe for concurrent use.
type Detector struct {
	threshold, hold time.Duration

	mu       sync.Mutex
	last     time.Time // the last tick
	stallEnd time.Time // the tick that ended the last stall; zero if none
}

// New returns a Detector whose first tick is now.
func New(threshold, hold time.Duration, now time.Time) *Detector {
	return &Detector{threshold: threshold, hold: hold, last: now}
}

// Tick records that the process ran at now.
func (d *Detector) Tick(now time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if now.Sub(d.last) > d.threshold {
		d.stallEnd = now
	}
	if now.After(d.last) {
		d.last = now
	}
}

// Stalled reports whether the process stalled just now or ended a stall less than Hold ago.
func (d *Detector) Stalled(now time.Time) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if now.Sub(d.last) > d.threshold {
		return true
	}
	return !d.stallEnd.IsZero() && now.Sub(d.stallEnd) < d.hold
}
