package harness

import (
	"bufio"
	"context"
	"fmt"
	"math"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
)

// ProcResources is one process's resource figures: resident memory (/proc/<pid>/status), open
// file descriptors (/proc/<pid>/fd) and, when its /metrics was scraped, its goroutines.
type ProcResources struct {
	RSS        int64
	FDs        int
	Goroutines int // -1 when not scraped
}

// ReadProcResources reads pid's resident memory and open descriptors (Linux).
func ReadProcResources(pid int) (ProcResources, error) {
	mem, err := ReadProcMemory(pid)
	if err != nil {
		return ProcResources{}, err
	}
	fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		return ProcResources{}, err
	}
	return ProcResources{RSS: mem.RSS, FDs: len(fds), Goroutines: -1}, nil
}

var scrapeClient = &http.Client{Timeout: 2 * time.Second}

// ScrapeMetrics reads a Prometheus text exposition at url and sums every sample of each metric
// over its labels (go_goroutines, rest_client_requests_total, ...).
func ScrapeMetrics(ctx context.Context, url string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := scrapeClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s: %s", url, resp.Status)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest := line, ""
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name, rest = line[:i], line[i:]
		}
		if strings.HasPrefix(rest, "{") {
			j := strings.LastIndexByte(rest, '}')
			if j < 0 {
				continue
			}
			rest = rest[j+1:]
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(fields[0], 64)
		if err != nil || math.IsNaN(v) {
			continue
		}
		out[name] += v
	}
	return out, sc.Err()
}

// Slope is the least-squares slope of ys over xs (per unit of x); 0 with fewer than 2 points.
func Slope(xs, ys []float64) float64 {
	n := float64(len(xs))
	if len(xs) < 2 || len(xs) != len(ys) {
		return 0
	}
	var sx, sy, sxx, sxy float64
	for i := range xs {
		sx, sy, sxx, sxy = sx+xs[i], sy+ys[i], sxx+xs[i]*xs[i], sxy+xs[i]*ys[i]
	}
	d := n*sxx - sx*sx
	if d == 0 {
		return 0
	}
	return (n*sxy - sx*sy) / d
}
