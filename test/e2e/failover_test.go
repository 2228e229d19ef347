package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/apportion/apportion/test/e2e/harness"
)

// failoverArgs makes the manager log with sub-second timestamps, so that the time it became
// leader (its push engine started) can be read from its log.
var failoverArgs = []string{"--zap-time-encoding=rfc3339nano"}

// engineStarts is when each run of the manager logging to path started its push engine (the
// line "push engine starting"): for a manager under leader election, when it became leader and
// took its epoch.
func engineStarts(path string) ([]time.Time, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []time.Time
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if !strings.Contains(string(line), "push engine starting") {
			continue
		}
		var rec struct {
			TS string `json:"ts"`
		}
		if err := json.Unmarshal(line, &rec); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		at, err := time.Parse(time.RFC3339Nano, rec.TS)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		out = append(out, at)
	}
	return out, sc.Err()
}

// failoverFigures is what the monitor's history says of a failover: from the new leader's start
// until Σ effective permits first reached 75 % of the budget, and for each pod that was not
// there before (before: the pods then), from its first permit to its full share (the floor of
// budget/pods, the split's smallest share).
type failoverFigures struct {
	toThreeQuarters time.Duration // -1: never
	sumAt           int32
	firstToFull     []time.Duration
}

func measureFailover(samples []harness.Sample, leaderAt time.Time, budget, fullShare int32, before map[string]bool) failoverFigures {
	f := failoverFigures{toThreeQuarters: -1}
	want := (3*budget + 3) / 4
	first := map[string]time.Time{}
	full := map[string]time.Time{}
	for _, s := range samples {
		if f.toThreeQuarters < 0 && !s.At.Before(leaderAt) && s.SumPermits >= want {
			f.toThreeQuarters, f.sumAt = s.At.Sub(leaderAt), s.SumPermits
		}
		for pod, a := range s.Agents {
			if before[pod] || !a.Reachable {
				continue
			}
			if _, ok := first[pod]; !ok && a.Effective > 0 {
				first[pod] = s.At
			}
			if _, ok := full[pod]; !ok && a.Effective >= fullShare {
				full[pod] = s.At
			}
		}
	}
	for pod, at := range full {
		if f0, ok := first[pod]; ok {
			f.firstToFull = append(f.firstToFull, at.Sub(f0))
		}
	}
	slices.Sort(f.firstToFull)
	return f
}

func (f failoverFigures) String() string {
	var b strings.Builder
	if f.toThreeQuarters < 0 {
		b.WriteString("Σ permits never reached 75 % of the budget after the new leader started")
	} else {
		fmt.Fprintf(&b, "new leader → ≥ 75 %% of the budget: %s (Σ %d)", f.toThreeQuarters.Round(time.Millisecond), f.sumAt)
	}
	if n := len(f.firstToFull); n > 0 {
		fmt.Fprintf(&b, "; new pods, first permit → full share: median %s, max %s (%d pods)",
			f.firstToFull[n/2].Round(time.Millisecond), f.firstToFull[n-1].Round(time.Millisecond), n)
	}
	return b.String()
}
