package hubsync

import (
	"errors"
	"strings"
	"testing"
	"time"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	"github.com/apportion/apportion/internal/hub"
)

// TestSliceLeased: the condition of each state of a member's hold on its slice, and that the
// message says the slice and until when.
func TestSliceLeased(t *testing.T) {
	ref := apportionv1.GlobalRef{Namespace: "partners", Name: "partner", Cluster: "eu-1"}
	until := time.Date(2026, 12, 2, 9, 0, 30, 0, time.UTC)
	g := hub.Grant{Seq: 4, Slice: 37, Reserved: 5}
	down := errors.New("connection refused")
	for _, tc := range []struct {
		name   string
		g      hub.Grant
		held   bool
		until  time.Time
		err    error
		ok     bool
		reason string
		says   []string
	}{
		{"no grant", hub.Grant{}, false, time.Time{}, nil, false, apportionv1.ReasonNoGrant, []string{"partners/partner", "local limit is 0"}},
		{"no grant, no hub", hub.Grant{}, false, time.Time{}, down, false, apportionv1.ReasonNoGrant, []string{"connection refused"}},
		{"held", g, true, until, nil, true, apportionv1.ReasonLeaseHeld, []string{"slice 37", "grant 4", "until 2026-12-02T09:00:30Z", "falls to 5"}},
		{"held, a read failed", g, true, until, down, true, apportionv1.ReasonLeaseHeld, []string{"until 2026-12-02T09:00:30Z"}},
		{"lapsed, hub unreachable", g, false, until, down, false, apportionv1.ReasonHubUnreachable, []string{"slice 37", "ended at 2026-12-02T09:00:30Z", "reserved slice 5", "connection refused"}},
		{"lapsed", g, false, until, nil, false, apportionv1.ReasonLeaseLapsed, []string{"ended at 2026-12-02T09:00:30Z", "reserved slice 5"}},
		{"restarted", g, false, time.Time{}, nil, false, apportionv1.ReasonLeaseLapsed, []string{"restarted", "reserved slice 5"}},
		{"restarted, hub unreachable", g, false, time.Time{}, down, false, apportionv1.ReasonHubUnreachable, []string{"restarted", "connection refused"}},
	} {
		v := sliceLeased(ref, tc.g, tc.held, tc.until, 30*time.Second, tc.err)
		if v.ok != tc.ok || v.reason != tc.reason {
			t.Errorf("%s: %v %s, want %v %s", tc.name, v.ok, v.reason, tc.ok, tc.reason)
		}
		for _, s := range tc.says {
			if !strings.Contains(v.message, s) {
				t.Errorf("%s: %q does not say %q", tc.name, v.message, s)
			}
		}
	}
}
