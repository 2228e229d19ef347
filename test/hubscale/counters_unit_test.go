package hubscale

import "testing"

// The benchmark's write rates come from these two functions: a miscount here is a wrong figure
// in docs/benchmarks.md, so they are tested on an exposition shaped like the API server's.
func TestTraffic(t *testing.T) {
	const before = `# HELP apiserver_request_total [STABLE] Counter of apiserver requests.
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",dry_run="",group="apportion.io",resource="clusterslices",scope="resource",subresource="",verb="GET",version="v1alpha1"} 100
apiserver_request_total{code="200",component="apiserver",dry_run="",group="apportion.io",resource="clusterslices",scope="resource",subresource="status",verb="PUT",version="v1alpha1"} 7
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="PUT",version="v1"} 3
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="",scope="",subresource="/metrics",verb="GET",version=""} 1
apiserver_request_duration_seconds_bucket{component="apiserver",verb="GET",le="0.1"} 5
`
	const after = `apiserver_request_total{code="200",component="apiserver",dry_run="",group="apportion.io",resource="clusterslices",scope="resource",subresource="",verb="GET",version="v1alpha1"} 160
apiserver_request_total{code="200",component="apiserver",dry_run="",group="apportion.io",resource="clusterslices",scope="resource",subresource="status",verb="PUT",version="v1alpha1"} 9
apiserver_request_total{code="409",component="apiserver",dry_run="",group="apportion.io",resource="clusterslices",scope="resource",subresource="status",verb="PUT",version="v1alpha1"} 1
apiserver_request_total{code="200",component="apiserver",dry_run="",group="apportion.io",resource="clusterslices",scope="resource",subresource="",verb="PUT",version="v1alpha1"} 4
apiserver_request_total{code="200",component="apiserver",dry_run="",group="apportion.io",resource="globalquotas",scope="resource",subresource="status",verb="PUT",version="v1alpha1"} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="PUT",version="v1"} 8
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="",scope="",subresource="/metrics",verb="GET",version=""} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="events",scope="resource",subresource="",verb="POST",version="v1"} 1
`
	b, err := parseRequestTotal(before)
	if err != nil {
		t.Fatal(err)
	}
	a, err := parseRequestTotal(after)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != 4 {
		t.Errorf("parsed %d series of the first reading, want 4: %v", len(b), b)
	}
	tr := diffTraffic(b, a)
	for name, got := range map[string][2]float64{
		"member writes":  {tr.memberWrites, 3},
		"slice writes":   {tr.sliceWrites, 4},
		"quota writes":   {tr.quotaWrites, 2},
		"other writes":   {tr.otherWrites, 6},
		"member reads":   {tr.memberReads, 60},
		"conflicts":      {tr.conflicts, 1},
		"GET":            {tr.byVerb["GET"], 60}, // the /metrics scrape is not an API resource
		"PUT":            {tr.byVerb["PUT"], 14},
		"POST":           {tr.byVerb["POST"], 1},
		"all writes":     {tr.writes(), 15},
		"every resource": {tr.total(), 75},
	} {
		if got[0] != got[1] {
			t.Errorf("%s: %v, want %v", name, got[0], got[1])
		}
	}
	for _, bad := range []string{
		`apiserver_request_total{verb="GET" 3`,
		`apiserver_request_total{verb="GET"}`,
		`apiserver_request_total{verb=GET} 3`,
		`apiserver_request_total{verb="GET"} x`,
	} {
		if _, err := parseRequestTotal(bad); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
	if c, err := parseRequestTotal(`apiserver_request_total{verb="G\"E,T",resource="x"} 2`); err != nil || c[requestKey{verb: `G"E,T`, resource: "x"}] != 2 {
		t.Errorf("escaped quote: %v, %v", c, err)
	}
}
