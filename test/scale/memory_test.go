package scale

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"sigs.k8s.io/yaml"

	"github.com/apportion/apportion/test/e2e/harness"
)

// managerManifest is the manager's Deployment as shipped (config/manager), relative to this
// package's directory, where `make bench-scale` runs the benchmark.
const managerManifest = "../../config/manager/manager.yaml"

// memoryLimit is the manager's memory limit in the benchmark: by default the one the shipped
// manifest gives its container, so that the manager's soft memory limit (its default ratio of
// it, cmd/manager/memlimit.go) is the one it would have in a cluster. SCALE_MEMORY_LIMIT
// overrides it: "off" runs the manager without a soft limit (--memory-limit-ratio=0), a quantity
// (e.g. 512Mi) gives that limit instead. It returns the manager's extra flags and a line saying
// what was chosen; no flags for a manager without --memory-limit (an older one).
func memoryLimit(bin *harness.Binaries) (args []string, say string, err error) {
	if !bin.ManagerHas("memory-limit") {
		return nil, "manager memory limit: none (this manager has no --memory-limit)", nil
	}
	switch v := os.Getenv("SCALE_MEMORY_LIMIT"); v {
	case "off":
		return []string{"--memory-limit-ratio=0"}, "manager memory limit: none (SCALE_MEMORY_LIMIT=off: no soft limit, the collector at GOGC=100)", nil
	case "":
		q, err := shippedMemoryLimit(managerManifest)
		if err != nil {
			return nil, "", err
		}
		return []string{"--memory-limit=" + q}, fmt.Sprintf("manager memory limit: %s, the limit %s gives the manager container; the manager's soft limit (GOMEMLIMIT) is its default share of it (see its log)", q, managerManifest), nil
	default:
		if _, err := resource.ParseQuantity(v); err != nil {
			return nil, "", fmt.Errorf("SCALE_MEMORY_LIMIT: %q is neither off nor a quantity", v)
		}
		return []string{"--memory-limit=" + v}, fmt.Sprintf("manager memory limit: %s (SCALE_MEMORY_LIMIT)", v), nil
	}
}

// shippedMemoryLimit reads limits.memory of the manager container of the manifest's Deployment.
func shippedMemoryLimit(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	for _, doc := range strings.Split(string(data), "\n---\n") {
		var d appsv1.Deployment
		if err := yaml.Unmarshal([]byte(doc), &d); err != nil || d.Kind != "Deployment" {
			continue
		}
		for _, c := range d.Spec.Template.Spec.Containers {
			if q, ok := c.Resources.Limits["memory"]; ok && c.Name == "manager" {
				return q.String(), nil
			}
		}
	}
	return "", fmt.Errorf("%s: no Deployment with a manager container with a memory limit", path)
}

// freeAddr is a loopback address with a free port.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

// goMemory is the manager's Go runtime memory, from its net/http/pprof endpoint.
type goMemory struct {
	goroutines int
	heapInuse  int64 // HeapInuse: spans with objects, live or not yet collected
	stackInuse int64
	live       int64 // HeapAlloc right after a forced collection: what is live
	numGC      int64
}

// readGoMemory reads the manager's goroutines and heap, then forces a collection and reads the
// live heap (HeapAlloc just after it). Read the resident set before: a collection does not give
// memory back to the system at once, but call it last all the same.
func readGoMemory(addr string) (goMemory, error) {
	var m goMemory
	c := &http.Client{Timeout: 30 * time.Second}
	get := func(path string) (string, error) {
		resp, err := c.Get("http://" + addr + path)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	g, err := get("/debug/pprof/goroutine?debug=1")
	if err != nil {
		return m, err
	}
	if _, err := fmt.Sscanf(g, "goroutine profile: total %d", &m.goroutines); err != nil {
		return m, fmt.Errorf("goroutine profile: %w", err)
	}
	before, err := get("/debug/pprof/heap?debug=1")
	if err != nil {
		return m, err
	}
	stats := memStats(before)
	m.heapInuse, m.stackInuse, m.numGC = stats["HeapInuse"], stats["Stack"], stats["NumGC"]
	after, err := get("/debug/pprof/heap?debug=1&gc=1")
	if err != nil {
		return m, err
	}
	m.live = memStats(after)["HeapAlloc"]
	return m, nil
}

// memStats parses the "# Name = value" lines that close a debug=1 heap profile (runtime.MemStats;
// "Stack = inuse / sys" gives the in-use figure).
func memStats(profile string) map[string]int64 {
	out := map[string]int64{}
	sc := bufio.NewScanner(strings.NewReader(profile))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		k, v, ok := strings.Cut(strings.TrimPrefix(sc.Text(), "# "), " = ")
		if !ok || strings.Contains(k, " ") {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		if n, err := strconv.ParseInt(f[0], 10, 64); err == nil {
			out[k] = n
		}
	}
	return out
}

// softLimitFromLog is the soft memory limit the manager logged at start ("none" or a quantity),
// or "?" when its log does not say.
func softLimitFromLog(path string) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return "?"
	}
	for _, line := range strings.Split(string(data), "\n") {
		if !strings.Contains(line, `"soft memory limit"`) {
			continue
		}
		if _, rest, ok := strings.Cut(line, `"limit":"`); ok {
			if v, _, ok := strings.Cut(rest, `"`); ok {
				return v
			}
		}
	}
	return "?"
}
