package deadline

import (
	"net/http"
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	cases := []struct {
		h       http.Header
		want    time.Duration
		ok, err bool
	}{
		{http.Header{}, 0, false, false},
		{http.Header{Header: {"300ms"}}, 300 * time.Millisecond, true, false},
		{http.Header{Header: {"1m30s"}}, 90 * time.Second, true, false},
		{http.Header{GRPCHeader: {"250m"}}, 250 * time.Millisecond, true, false},
		{http.Header{GRPCHeader: {"2S"}}, 2 * time.Second, true, false},
		{http.Header{GRPCHeader: {"1H"}}, time.Hour, true, false},
		{http.Header{GRPCHeader: {"99999999n"}}, 99999999, true, false},
		{http.Header{Header: {"2s"}, GRPCHeader: {"500m"}}, 500 * time.Millisecond, true, false},
		{http.Header{Header: {"200ms"}, GRPCHeader: {"5S"}}, 200 * time.Millisecond, true, false},
		{http.Header{Header: {"0s"}}, 0, false, true},
		{http.Header{Header: {"-1s"}}, 0, false, true},
		{http.Header{Header: {"300"}}, 0, false, true},
		{http.Header{Header: {"2h"}}, 0, false, true},
		{http.Header{Header: {"1s", "2s"}}, 0, false, true},
		{http.Header{GRPCHeader: {"100"}}, 0, false, true},
		{http.Header{GRPCHeader: {"123456789m"}}, 0, false, true},
		{http.Header{GRPCHeader: {"+1S"}}, 0, false, true},
		{http.Header{GRPCHeader: {"1s"}}, 0, false, true},
		{http.Header{GRPCHeader: {"S"}}, 0, false, true},
		{http.Header{GRPCHeader: {"-1S"}}, 0, false, true},
	}
	for _, c := range cases {
		d, ok, err := Parse(c.h)
		if d != c.want || ok != c.ok || (err != nil) != c.err {
			t.Errorf("%v: %v %v %v, want %v %v err=%v", c.h, d, ok, err, c.want, c.ok, c.err)
		}
	}
}

func TestFormat(t *testing.T) {
	cases := []struct {
		name string
		d    time.Duration
		want string
	}{
		{"grpc-timeout", 250 * time.Millisecond, "250000u"}, {"grpc-timeout", 25 * time.Millisecond, "25000000n"},
		{"grpc-timeout", 2 * time.Second, "2000000u"},
		{"grpc-timeout", 3 * time.Minute, "180000m"},
		{"grpc-timeout", 0, "0n"},
		{"grpc-timeout", -time.Second, "0n"},
		{"X-Request-Timeout", 1234567 * time.Microsecond, "1.234s"},
		{"X-Request-Timeout", 999 * time.Microsecond, "0s"},
		{"X-Request-Timeout", -time.Second, "0s"},
	}
	for _, c := range cases {
		got := Format(c.name, c.d)
		if got != c.want {
			t.Errorf("Format(%q, %v) = %q, want %q", c.name, c.d, got, c.want)
		}
		if c.name == "grpc-timeout" && c.d > 0 {
			back, err := ParseGRPC(got)
			if err != nil || back > c.d {
				t.Errorf("%q parses back to %v (%v): more than %v", got, back, err, c.d)
			}
		}
	}
	// Huge values keep 8 digits and round down.
	if got := FormatGRPC(1<<63 - 1); len(got) > 9 {
		t.Errorf("FormatGRPC(max) = %q: more than 8 digits", got)
	}
}

func TestBudget(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	var none Budget
	if none.Set() || none.Left(t0, 200*time.Millisecond) != 200*time.Millisecond {
		t.Fatal("a budget without end bounds nothing")
	}
	if dl, bound := none.Upstream(t0, time.Second); !dl.Equal(t0.Add(time.Second)) || bound {
		t.Fatalf("upstream deadline without a budget: %v %v", dl, bound)
	}
	b := New(t0, 300*time.Millisecond, true)
	if got := b.Left(t0.Add(100*time.Millisecond), 200*time.Millisecond); got != 200*time.Millisecond {
		t.Fatalf("the acquire timeout is shorter: %v", got)
	}
	if got := b.Left(t0.Add(250*time.Millisecond), 200*time.Millisecond); got != 50*time.Millisecond {
		t.Fatalf("the budget is shorter: %v", got)
	}
	if got := b.Left(t0.Add(time.Second), 200*time.Millisecond); got >= 0 {
		t.Fatalf("an exhausted budget: %v, want negative", got)
	}
	if dl, bound := b.Upstream(t0.Add(100*time.Millisecond), time.Second); !dl.Equal(t0.Add(300*time.Millisecond)) || !bound {
		t.Fatalf("upstream deadline: %v %v, want the budget's end", dl, bound)
	}
	if dl, bound := b.Upstream(t0.Add(100*time.Millisecond), 100*time.Millisecond); !dl.Equal(t0.Add(200*time.Millisecond)) || bound {
		t.Fatalf("upstream deadline: %v %v, want requestTimeout's", dl, bound)
	}
}
