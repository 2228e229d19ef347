package main

import (
	"errors"
	"math"
	"runtime/debug"
	"strings"
	"testing"

	"github.com/KimMachineGun/automemlimit/memlimit"
)

func TestDecideSoftLimit(t *testing.T) {
	const mi = 1 << 20
	limit := func(n uint64, err error) func() (uint64, error) {
		return func() (uint64, error) { return n, err }
	}
	unread := func() (uint64, error) { t.Fatal("the container's limit was read"); return 0, nil }
	for _, tc := range []struct {
		name      string
		o         memoryOptions
		env       string
		container func() (uint64, error)
		want      int64
		from      string
		err       bool
	}{
		{"GOMEMLIMIT wins", memoryOptions{ratio: 0.9, limit: "1Gi"}, "300MiB", unread, 0, "GOMEMLIMIT=300MiB", false},
		{"ratio 0 sets none", memoryOptions{ratio: 0}, "", unread, 0, "--memory-limit-ratio=0", false},
		{"--memory-limit", memoryOptions{ratio: 0.9, limit: "512Mi"}, "", unread, 512 * mi * 9 / 10, "--memory-limit=512Mi", false},
		{"--memory-limit at ratio 1", memoryOptions{ratio: 1, limit: "400M"}, "", unread, 400_000_000, "--memory-limit=400M", false},
		{"the container's limit", memoryOptions{ratio: 0.9}, "", limit(256*mi, nil), 256 * mi * 9 / 10, "container's memory limit (256Mi)", false},
		{"no container limit", memoryOptions{ratio: 0.9}, "", limit(0, memlimit.ErrNoLimit), 0, "no memory limit", false},
		{"unreadable", memoryOptions{ratio: 0.9}, "", limit(0, errors.New("no cgroup")), 0, "could not be read", true},
		{"a huge limit", memoryOptions{ratio: 1}, "", limit(math.MaxUint64, nil), math.MaxInt64, "container's", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := decideSoftLimit(tc.o, tc.env, tc.container)
			if got.Bytes != tc.want || !strings.Contains(got.From, tc.from) || (got.Err != nil) != tc.err {
				t.Fatalf("decideSoftLimit = %+v, want %d bytes from %q (error %v)", got, tc.want, tc.from, tc.err)
			}
		})
	}
}

func TestMemoryFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		ok   bool
	}{
		{nil, true},
		{[]string{"--memory-limit=512Mi"}, true},
		{[]string{"--memory-limit-ratio=0"}, true},
		{[]string{"--memory-limit-ratio=1"}, true},
		{[]string{"--memory-limit-ratio=1.5"}, false},
		{[]string{"--memory-limit-ratio=-0.1"}, false},
		{[]string{"--memory-limit=lots"}, false},
		{[]string{"--memory-limit=0"}, false},
	} {
		o, _, err := parseFlags(append([]string{"--agent-image=registry.example/agent:v1"}, tc.args...))
		if (err == nil) != tc.ok {
			t.Errorf("parseFlags(%q): %v, want ok %v", tc.args, err, tc.ok)
		}
		if tc.args == nil && o.memory.ratio != DefaultMemoryLimitRatio {
			t.Errorf("default ratio %v, want %v", o.memory.ratio, DefaultMemoryLimitRatio)
		}
	}
}

func TestApplySoftLimit(t *testing.T) {
	prev := debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetMemoryLimit(prev) })
	if got := applySoftLimit(softLimit{Bytes: 123 << 20}); got != 123<<20 {
		t.Fatalf("applied %d, want %d", got, 123<<20)
	}
	if got := applySoftLimit(softLimit{}); got != 123<<20 {
		t.Fatalf("an empty decision changed the limit to %d", got)
	}
	if formatSoftLimit(math.MaxInt64) != "none" || formatSoftLimit(123<<20) != "123Mi" {
		t.Fatalf("formatSoftLimit: %q, %q", formatSoftLimit(math.MaxInt64), formatSoftLimit(123<<20))
	}
}
