package degrade

import (
	"fmt"
	"hash/fnv"
	"net/http"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/apportion/apportion/internal/agent/fallback"
)

var t0 = time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)

// noRand fails the test if a switch consults randomness it should not need.
func noRand(t *testing.T) func() uint32 {
	return func() uint32 {
		t.Helper()
		t.Error("Rand called")
		return 0
	}
}

// seq returns a Rand yielding vs in order (then repeating the last).
func seq(vs ...uint32) func() uint32 {
	return func() uint32 {
		v := vs[0]
		if len(vs) > 1 {
			vs = vs[1:]
		}
		return v
	}
}

func hdr(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i < len(kv); i += 2 {
		h.Add(kv[i], kv[i+1])
	}
	return h
}

// userIn and userOut are user ids whose bucket is below and at or above 10.
func users(t *testing.T) (in, out string) {
	t.Helper()
	for i := 0; in == "" || out == ""; i++ {
		u := fmt.Sprintf("user-%d", i)
		if Bucket(u) < 10 {
			in = u
		} else {
			out = u
		}
	}
	return in, out
}

func TestApplies(t *testing.T) {
	uIn, uOut := users(t)
	sw := Switch{Name: "ns/a", Downstream: "search", ExpiresAt: t0.Add(time.Hour), Percent: 100}
	with := func(f func(*Switch)) Switch { s := sw; f(&s); return s }
	get := RequestView{Method: "GET", Header: hdr()}

	tests := []struct {
		name string
		sw   Switch
		ds   string
		r    RequestView
		now  time.Time
		want bool
	}{
		{"applies", sw, "search", get, t0, true},
		{"one nanosecond before expiry", sw, "search", get, t0.Add(time.Hour - 1), true},
		{"at expiry it is off", sw, "search", get, t0.Add(time.Hour), false},
		{"after expiry", sw, "search", get, t0.Add(2 * time.Hour), false},
		{"zero ExpiresAt never applies", with(func(s *Switch) { s.ExpiresAt = time.Time{} }), "search", get, t0, false},
		{"other downstream", sw, "payments", get, t0, false},
		{"percent 0", with(func(s *Switch) { s.Percent = 0 }), "search", get, t0, false},

		{"methods: listed", with(func(s *Switch) { s.Methods = []string{"POST", "GET"} }), "search", get, t0, true},
		{"methods: not listed", with(func(s *Switch) { s.Methods = []string{"POST"} }), "search", get, t0, false},
		{"methods: case-sensitive", with(func(s *Switch) { s.Methods = []string{"get"} }), "search", get, t0, false},

		{"headers: all match",
			with(func(s *Switch) { s.HeaderMatches = []HeaderMatch{{"X-Tier", "free"}, {"X-Region", "eu"}} }),
			"search", RequestView{Method: "GET", Header: hdr("X-Tier", "free", "X-Region", "eu")}, t0, true},
		{"headers: one differs",
			with(func(s *Switch) { s.HeaderMatches = []HeaderMatch{{"X-Tier", "free"}, {"X-Region", "eu"}} }),
			"search", RequestView{Method: "GET", Header: hdr("X-Tier", "free", "X-Region", "us")}, t0, false},
		{"headers: missing",
			with(func(s *Switch) { s.HeaderMatches = []HeaderMatch{{"X-Tier", "free"}} }),
			"search", get, t0, false},
		{"headers: missing does not match an empty value",
			with(func(s *Switch) { s.HeaderMatches = []HeaderMatch{{"X-Tier", ""}} }),
			"search", get, t0, false},
		{"headers: exact, not prefix or case-folded",
			with(func(s *Switch) { s.HeaderMatches = []HeaderMatch{{"X-Tier", "free"}} }),
			"search", RequestView{Method: "GET", Header: hdr("X-Tier", "Free")}, t0, false},
		{"headers: any of several values",
			with(func(s *Switch) { s.HeaderMatches = []HeaderMatch{{"X-Tier", "free"}} }),
			"search", RequestView{Method: "GET", Header: hdr("X-Tier", "pro", "X-Tier", "free")}, t0, true},
		{"headers: name is case-insensitive",
			with(func(s *Switch) { s.HeaderMatches = []HeaderMatch{{"x-tier", "free"}} }),
			"search", RequestView{Method: "GET", Header: hdr("X-Tier", "free")}, t0, true},

		{"key header: user in the share",
			with(func(s *Switch) { s.Percent, s.KeyHeader = 10, "X-User-Id" }),
			"search", RequestView{Method: "GET", Header: hdr("X-User-Id", uIn), Rand: noRand(t)}, t0, true},
		{"key header: user outside the share",
			with(func(s *Switch) { s.Percent, s.KeyHeader = 10, "X-User-Id" }),
			"search", RequestView{Method: "GET", Header: hdr("X-User-Id", uOut), Rand: noRand(t)}, t0, false},
		{"key header: missing header is not degraded",
			with(func(s *Switch) { s.Percent, s.KeyHeader = 99, "X-User-Id" }),
			"search", RequestView{Method: "GET", Header: hdr(), Rand: noRand(t)}, t0, false},
		{"key header: empty value is not degraded",
			with(func(s *Switch) { s.Percent, s.KeyHeader = 99, "X-User-Id" }),
			"search", RequestView{Method: "GET", Header: hdr("X-User-Id", ""), Rand: noRand(t)}, t0, false},
		{"key header: missing header at 100% is degraded",
			with(func(s *Switch) { s.Percent, s.KeyHeader = 100, "X-User-Id" }),
			"search", RequestView{Method: "GET", Header: hdr(), Rand: noRand(t)}, t0, true},

		{"sampling: draw in the share",
			with(func(s *Switch) { s.Percent = 30 }),
			"search", RequestView{Method: "GET", Rand: seq(129)}, t0, true}, // 129 % 100 = 29
		{"sampling: draw at the share's edge",
			with(func(s *Switch) { s.Percent = 30 }),
			"search", RequestView{Method: "GET", Rand: seq(130)}, t0, false},
		{"sampling: no Rand selects nothing",
			with(func(s *Switch) { s.Percent = 99 }),
			"search", RequestView{Method: "GET"}, t0, false},
		{"sampling: 100% needs no Rand",
			sw, "search", RequestView{Method: "GET", Rand: noRand(t)}, t0, true},
		{"sampling: no draw when something else does not match",
			with(func(s *Switch) { s.Percent = 50; s.Methods = []string{"POST"} }),
			"search", RequestView{Method: "GET", Rand: noRand(t)}, t0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Applies(tt.sw, tt.ds, tt.r, tt.now); got != tt.want {
				t.Errorf("Applies = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestBucketIsFNV1a(t *testing.T) {
	for _, s := range []string{"", "a", "user-42", "f47ac10b-58cc-4372-a567-0e02b2c3d479", "ünïcode"} {
		h := fnv.New32a()
		h.Write([]byte(s))
		if got, want := Bucket(s), int(h.Sum32()%100); got != want {
			t.Errorf("Bucket(%q) = %d, want %d", s, got, want)
		}
	}
}

func TestStablePerUser(t *testing.T) {
	sw := Switch{Name: "a", Downstream: "d", ExpiresAt: t0.Add(time.Hour), Percent: 30, KeyHeader: "X-User-Id"}
	for i := range 200 {
		u := fmt.Sprintf("user-%d", i)
		r := RequestView{Method: "GET", Header: hdr("X-User-Id", u), Rand: seq(uint32(i), 0, 99)}
		first := Applies(sw, "d", r, t0)
		for j := range 20 {
			if got := Applies(sw, "d", r, t0.Add(time.Duration(j)*time.Minute)); got != first {
				t.Fatalf("%s: call %d = %v, first call = %v", u, j, got, first)
			}
		}
	}
}

// TestShareOfUsers checks that Percent% of distinct users are selected, and
// that raising Percent only adds users.
func TestShareOfUsers(t *testing.T) {
	const n = 10000
	selected := func(percent int) map[string]bool {
		sw := Switch{Name: "a", Downstream: "d", ExpiresAt: t0.Add(time.Hour), Percent: percent, KeyHeader: "X-User-Id"}
		out := map[string]bool{}
		for i := range n {
			u := fmt.Sprintf("user-%d", i)
			if Applies(sw, "d", RequestView{Method: "GET", Header: hdr("X-User-Id", u)}, t0) {
				out[u] = true
			}
		}
		return out
	}
	five, ten := selected(5), selected(10)
	for _, c := range []struct {
		got, want, tol int
	}{
		{len(five), n * 5 / 100, n * 15 / 1000}, // 5% ± 1.5%
		{len(ten), n * 10 / 100, n * 15 / 1000}, // 10% ± 1.5%
	} {
		if c.got < c.want-c.tol || c.got > c.want+c.tol {
			t.Errorf("%d of %d users selected, want %d ± %d", c.got, n, c.want, c.tol)
		}
	}
	for u := range five {
		if !ten[u] {
			t.Fatalf("%s selected at 5%% but not at 10%%", u)
		}
	}
}

func TestSelect(t *testing.T) {
	exp := t0.Add(time.Hour)
	sws := []Switch{
		{Name: "ns/zeta", Downstream: "search", ExpiresAt: exp, Percent: 100},
		{Name: "ns/beta", Downstream: "search", ExpiresAt: exp, Percent: 100, Methods: []string{"POST"}},
		{Name: "ns/alpha", Downstream: "search", ExpiresAt: t0, Percent: 100}, // expired
		{Name: "ns/gamma", Downstream: "search", ExpiresAt: exp, Percent: 100, Action: fallback.Config{Action: fallback.Static}},
		{Name: "ns/gamma", Downstream: "search", ExpiresAt: exp, Percent: 100, Action: fallback.Config{Action: fallback.ServeStale}},
		{Name: "ns/aaa", Downstream: "payments", ExpiresAt: exp, Percent: 100},
	}
	tests := []struct {
		name   string
		ds     string
		method string
		want   int // index into sws, -1 for nil
	}{
		{"smallest applicable name wins, ties go to the first", "search", "GET", 3},
		{"a method-scoped switch wins where it applies", "search", "POST", 1},
		{"other downstream", "payments", "GET", 5},
		{"nothing applies", "inventory", "GET", -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Select(sws, tt.ds, RequestView{Method: tt.method, Header: hdr()}, t0)
			if tt.want < 0 {
				if got != nil {
					t.Fatalf("Select = %q, want nil", got.Name)
				}
				return
			}
			if got != &sws[tt.want] {
				t.Fatalf("Select = %+v, want sws[%d] %+v", got, tt.want, sws[tt.want])
			}
		})
	}

	// The answer does not depend on the slice order.
	rev := make([]Switch, 0, len(sws))
	for i := len(sws) - 1; i >= 0; i-- {
		if i != 4 { // keep a single "ns/gamma" so the tie rule does not interfere
			rev = append(rev, sws[i])
		}
	}
	if got := Select(rev, "search", RequestView{Method: "GET"}, t0); got == nil || got.Name != "ns/gamma" {
		t.Fatalf("reversed: Select = %+v, want ns/gamma", got)
	}
	// Once the winner expires, the next name takes over by itself.
	if got := Select(sws, "search", RequestView{Method: "GET"}, exp); got != nil {
		t.Fatalf("after expiry: Select = %q, want nil", got.Name)
	}
}

func TestSelectDoesNotAllocate(t *testing.T) {
	sws := []Switch{
		{Name: "b", Downstream: "d", ExpiresAt: t0.Add(time.Hour), Percent: 50, KeyHeader: "X-User-Id",
			HeaderMatches: []HeaderMatch{{"X-Tier", "free"}}, Methods: []string{"GET"}},
		{Name: "a", Downstream: "d", ExpiresAt: t0.Add(time.Hour), Percent: 50},
	}
	r := RequestView{Method: "GET", Header: hdr("X-User-Id", "user-1", "X-Tier", "free"), Rand: seq(7)}
	var got *Switch
	if n := testing.AllocsPerRun(1000, func() { got = Select(sws, "d", r, t0) }); n != 0 {
		t.Errorf("Select: %v allocs, want 0", n)
	}
	if diff := cmp.Diff("a", got.Name); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}
