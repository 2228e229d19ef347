// Package loadgen drives HTTP load for the agent's benchmarks: open loop (a fixed rate, whatever
// the answers do) and latency percentiles. Every call is a GET that must answer 200; any other
// outcome is returned as an error and its latency left out.
//
// It is for benchmarks and tests only (cmd/agent's and internal/agent/proxy's), which is why it
// lives under internal/testing and not beside the agent's product packages.
package loadgen

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"time"
)

// Latencies are call durations, in the order the calls were sent.
type Latencies []time.Duration

// Pct is the p-quantile (0..1) of the recorded latencies; 0 when there are none.
func (l Latencies) Pct(p float64) time.Duration {
	s := slices.Clone(l)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[min(len(s)-1, int(float64(len(s))*p))]
}

// Micros converts a duration to microseconds, the unit the benchmarks report.
func Micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// Get calls url once and returns how long the whole answer took.
func Get(c *http.Client, url string) (time.Duration, error) {
	start := time.Now()
	resp, err := c.Get(url)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("GET %s: status %d", url, resp.StatusCode)
	}
	return time.Since(start), nil
}

// OpenLoop sends GETs to url at rps for dur, each on its own goroutine at its scheduled time, and
// returns the latencies of the calls that answered 200 and the first error of the others.
func OpenLoop(c *http.Client, url string, rps int, dur time.Duration) (Latencies, error) {
	interval := time.Second / time.Duration(rps)
	n := int(dur / interval)
	lat := make(Latencies, n)
	ok := make([]bool, n)
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	start := time.Now()
	for k := range n {
		if d := time.Until(start.Add(time.Duration(k) * interval)); d > 0 {
			time.Sleep(d)
		}
		wg.Go(func() {
			d, err := Get(c, url)
			if err != nil {
				mu.Lock()
				if firstErr == nil {
					firstErr = err
				}
				mu.Unlock()
				return
			}
			lat[k], ok[k] = d, true
		})
	}
	wg.Wait()
	out := lat[:0]
	for k, d := range lat {
		if ok[k] {
			out = append(out, d)
		}
	}
	return out, firstErr
}
