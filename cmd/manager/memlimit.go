package main

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"runtime/debug"
	"strconv"

	"github.com/KimMachineGun/automemlimit/memlimit"
	"k8s.io/apimachinery/pkg/api/resource"
)

// DefaultMemoryLimitRatio is the share of the manager's memory limit that its Go runtime may
// fill before its collector works to stay below (the soft limit, GOMEMLIMIT). The soft limit
// bounds what the Go runtime maps (heap, goroutine stacks, its own metadata); the rest of the
// limit is for what the container's memory accounting counts besides: the binary's pages, the
// kernel's socket buffers of the agent connections, page cache. 0.9 is the usual choice
// (github.com/KimMachineGun/automemlimit's default).
const DefaultMemoryLimitRatio = 0.9

// memoryOptions set the Go runtime's soft memory limit from the container's memory limit. Without
// one the collector lets the heap grow to twice what is live (GOGC=100) whatever the container
// allows: at 10,000 pods that is hundreds of megabytes of garbage. With one it collects more
// often as the heap nears it. It is soft: a live heap above it is not refused, the collector
// then runs often (the runtime caps that at about half the CPU) and the container's own limit
// is what stops the process; so the container's limit must be sized for the live heap of the
// fleet (docs/install.md).
type memoryOptions struct {
	limit string  // --memory-limit: a quantity; "" reads the container's from its cgroup
	ratio float64 // --memory-limit-ratio
}

func (m *memoryOptions) bind(fs *flag.FlagSet) {
	fs.StringVar(&m.limit, "memory-limit", "",
		"the memory the manager may use, as a quantity (e.g. 512Mi); empty: its container's memory limit, read from its cgroup (none when unlimited)")
	fs.Float64Var(&m.ratio, "memory-limit-ratio", DefaultMemoryLimitRatio,
		"the share of --memory-limit set as the Go runtime's soft memory limit (GOMEMLIMIT), above 0 and at most 1; 0 sets none. GOMEMLIMIT in the environment wins over both flags")
}

func (m *memoryOptions) validate() error {
	var errs []error
	if math.IsNaN(m.ratio) || m.ratio < 0 || m.ratio > 1 {
		errs = append(errs, fmt.Errorf("--memory-limit-ratio must be between 0 and 1, got %v", m.ratio))
	}
	if m.limit != "" {
		if q, err := resource.ParseQuantity(m.limit); err != nil || q.Sign() <= 0 {
			errs = append(errs, fmt.Errorf("--memory-limit must be a positive quantity such as 512Mi, got %q", m.limit))
		}
	}
	return errors.Join(errs...)
}

// softLimit is the decision: the soft memory limit to set and where it came from.
type softLimit struct {
	// Bytes is the soft limit to set; 0 leaves the runtime's (none, or GOMEMLIMIT's).
	Bytes int64
	// From says what decided it, for the log.
	From string
	// Err is why the container's limit could not be read (then Bytes is 0).
	Err error
}

// decideSoftLimit decides the Go runtime's soft memory limit from the (validated) options, the
// GOMEMLIMIT environment variable (env) and the container's memory limit (container: as
// memlimit.FromCgroup, memlimit.ErrNoLimit when there is none). Every outcome:
//   - GOMEMLIMIT set: nothing to set (the runtime applied it at start);
//   - ratio 0: none;
//   - --memory-limit given: ratio × it (the container's is not read);
//   - the container has a limit: ratio × it;
//   - it has none: none;
//   - it cannot be read: none, with the error (the manager runs as it would without the flag).
func decideSoftLimit(o memoryOptions, env string, container func() (uint64, error)) softLimit {
	switch {
	case env != "":
		return softLimit{From: "GOMEMLIMIT=" + env}
	case o.ratio == 0:
		return softLimit{From: "--memory-limit-ratio=0"}
	case o.limit != "":
		q := resource.MustParse(o.limit)
		return softLimit{Bytes: scaled(q.Value(), o.ratio), From: fmt.Sprintf("%v × --memory-limit=%s", o.ratio, o.limit)}
	}
	n, err := container()
	switch {
	case errors.Is(err, memlimit.ErrNoLimit):
		return softLimit{From: "the container has no memory limit"}
	case err != nil:
		return softLimit{From: "the container's memory limit could not be read", Err: err}
	}
	return softLimit{Bytes: scaled(int64(min(n, math.MaxInt64)), o.ratio),
		From: fmt.Sprintf("%v × the container's memory limit (%s)", o.ratio, resource.NewQuantity(int64(min(n, math.MaxInt64)), resource.BinarySI))}
}

// scaled is ratio × n in bytes, at least 1 and at most math.MaxInt64 (no limit).
func scaled(n int64, ratio float64) int64 {
	f := float64(n) * ratio
	if f >= math.MaxInt64 {
		return math.MaxInt64
	}
	return max(int64(f), 1)
}

// applySoftLimit sets the decided soft limit and returns the one in force.
func applySoftLimit(d softLimit) int64 {
	if d.Bytes > 0 {
		debug.SetMemoryLimit(d.Bytes)
	}
	return debug.SetMemoryLimit(-1)
}

// formatSoftLimit is a soft limit for the log: "none" (the runtime's default, no limit), or the
// whole mebibytes below it ("461Mi").
func formatSoftLimit(n int64) string {
	if n == math.MaxInt64 {
		return "none"
	}
	if n < 1<<20 {
		return strconv.FormatInt(n, 10)
	}
	return strconv.FormatInt(n>>20, 10) + "Mi"
}
