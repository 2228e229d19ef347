package hubscale

import (
	"bufio"
	"fmt"
	"strconv"
	"strings"
)

// requestKey is one series of the API server's apiserver_request_total.
type requestKey struct{ verb, group, resource, subresource, code string }

// requestCounts is apiserver_request_total by series.
type requestCounts map[requestKey]float64

// parseRequestTotal reads the apiserver_request_total series of a Prometheus text exposition (the
// API server's /metrics). Label values are read with Go's quoting rules, which the exposition's
// escapes (\\, \", \n) are a subset of.
func parseRequestTotal(text string) (requestCounts, error) {
	out := requestCounts{}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		line := sc.Text()
		rest, ok := strings.CutPrefix(line, "apiserver_request_total{")
		if !ok {
			continue
		}
		labels, value, err := splitSeries(rest)
		if err != nil {
			return nil, fmt.Errorf("%w: %q", err, line)
		}
		v, err := strconv.ParseFloat(strings.Fields(value)[0], 64)
		if err != nil {
			return nil, fmt.Errorf("value of %q: %w", line, err)
		}
		k := requestKey{labels["verb"], labels["group"], labels["resource"], labels["subresource"], labels["code"]}
		out[k] += v
	}
	return out, sc.Err()
}

// splitSeries parses `name="value",...} 12` (after the opening brace) into the labels and what
// follows the closing brace.
func splitSeries(s string) (map[string]string, string, error) {
	labels := map[string]string{}
	for {
		s = strings.TrimLeft(s, ", ")
		if rest, ok := strings.CutPrefix(s, "}"); ok {
			if strings.TrimSpace(rest) == "" {
				return nil, "", fmt.Errorf("a series without a value")
			}
			return labels, strings.TrimSpace(rest), nil
		}
		name, rest, ok := strings.Cut(s, "=")
		if !ok || !strings.HasPrefix(rest, `"`) {
			return nil, "", fmt.Errorf("a malformed label")
		}
		// The value ends at the first quote not escaped.
		end := 1
		for ; end < len(rest); end++ {
			if rest[end] == '\\' {
				end++
				continue
			}
			if rest[end] == '"' {
				break
			}
		}
		if end >= len(rest) {
			return nil, "", fmt.Errorf("an unterminated label value")
		}
		v, err := strconv.Unquote(rest[:end+1])
		if err != nil {
			return nil, "", fmt.Errorf("label %s: %w", name, err)
		}
		labels[strings.TrimSpace(name)] = v
		s = rest[end+1:]
	}
}

// isWrite says whether an API server verb changes state.
func isWrite(verb string) bool {
	switch verb {
	case "POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY", "CREATE", "UPDATE":
		return true
	}
	return false
}

// traffic is what a window of requests was, from two readings of apiserver_request_total.
type traffic struct {
	byVerb map[string]float64 // requests on API resources, by verb
	// memberWrites are writes of ClusterSlice status: the members' acknowledgements, drain bounds
	// and demands. sliceWrites are the hub's writes of ClusterSlices (grants published, created,
	// deleted); quotaWrites its GlobalQuota writes (allocation, finalizer); otherWrites every
	// other write (the manager's leader election Lease, Events, ...).
	memberWrites, sliceWrites, quotaWrites, otherWrites float64
	memberReads                                         float64 // GETs of single ClusterSlices
	conflicts                                           float64 // 409 answers to writes
}

// diffTraffic is the requests between two readings. Requests without a resource (the
// benchmark's own /metrics scrapes, discovery) are left out.
func diffTraffic(before, after requestCounts) traffic {
	t := traffic{byVerb: map[string]float64{}}
	for k, v := range after {
		d := v - before[k]
		if d <= 0 || k.resource == "" {
			continue
		}
		t.byVerb[k.verb] += d
		apportion := k.group == "apportion.io"
		switch {
		case !isWrite(k.verb):
			if apportion && k.resource == "clusterslices" && k.verb == "GET" {
				t.memberReads += d
			}
			continue
		case apportion && k.resource == "clusterslices" && k.subresource == "status":
			t.memberWrites += d
		case apportion && k.resource == "clusterslices":
			t.sliceWrites += d
		case apportion && k.resource == "globalquotas":
			t.quotaWrites += d
		default:
			t.otherWrites += d
		}
		if k.code == "409" {
			t.conflicts += d
		}
	}
	return t
}

func (t traffic) writes() float64 {
	return t.memberWrites + t.sliceWrites + t.quotaWrites + t.otherWrites
}

func (t traffic) total() float64 {
	var s float64
	for _, v := range t.byVerb {
		s += v
	}
	return s
}
