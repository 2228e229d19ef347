// Package monitoring validates the optional Prometheus overlay (config/prometheus): the
// ServiceMonitor, PodMonitor and PrometheusRule decode strictly into the fields this project
// uses of the Prometheus Operator's kinds, the Grafana dashboard decodes strictly into the
// dashboard model it uses, and every metric any expression names is one the manager or the
// agent really exports (read from their registries, not from a list kept here).
//
// The expressions are not parsed with Prometheus' PromQL parser: github.com/prometheus/prometheus
// would raise the module's Kubernetes and OpenTelemetry versions for one test. A misspelt
// metric — the likeliest mistake — is caught by the registry check.
package monitoring

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/yaml"

	apportionv1 "github.com/apportion/apportion/api/v1alpha1"
	agentmetrics "github.com/apportion/apportion/internal/agent/metrics"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/controller"
	"github.com/apportion/apportion/internal/push"
)

var dir = filepath.Join("..", "..", "config", "prometheus")

// Typed subsets of the Prometheus Operator's kinds (monitoring.coreos.com/v1): a field this
// project writes that is not here fails the strict decode, so a typo cannot hide.
type objectMeta struct {
	Name   string            `json:"name"`
	Labels map[string]string `json:"labels,omitempty"`
}

type labelSelector struct {
	MatchLabels map[string]string `json:"matchLabels,omitempty"`
}

type serviceMonitor struct {
	APIVersion string     `json:"apiVersion"`
	Kind       string     `json:"kind"`
	Metadata   objectMeta `json:"metadata"`
	Spec       struct {
		Endpoints []struct {
			Port            string `json:"port"`
			Path            string `json:"path"`
			Scheme          string `json:"scheme"`
			BearerTokenFile string `json:"bearerTokenFile"`
			TLSConfig       struct {
				InsecureSkipVerify bool `json:"insecureSkipVerify"`
			} `json:"tlsConfig"`
		} `json:"endpoints"`
		Selector labelSelector `json:"selector"`
	} `json:"spec"`
}

type podMonitor struct {
	APIVersion string     `json:"apiVersion"`
	Kind       string     `json:"kind"`
	Metadata   objectMeta `json:"metadata"`
	Spec       struct {
		NamespaceSelector struct {
			Any bool `json:"any"`
		} `json:"namespaceSelector"`
		Selector            labelSelector `json:"selector"`
		PodMetricsEndpoints []struct {
			Port   string `json:"port"`
			Path   string `json:"path"`
			Scheme string `json:"scheme"`
		} `json:"podMetricsEndpoints"`
	} `json:"spec"`
}

type prometheusRule struct {
	APIVersion string     `json:"apiVersion"`
	Kind       string     `json:"kind"`
	Metadata   objectMeta `json:"metadata"`
	Spec       struct {
		Groups []struct {
			Name  string `json:"name"`
			Rules []struct {
				Alert       string            `json:"alert"`
				Expr        string            `json:"expr"`
				For         string            `json:"for"`
				Labels      map[string]string `json:"labels"`
				Annotations map[string]string `json:"annotations"`
			} `json:"rules"`
		} `json:"groups"`
	} `json:"spec"`
}

// The Grafana dashboard model, as far as dashboard.json uses it.
type datasourceRef struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type dashboard struct {
	UID           string   `json:"uid"`
	Title         string   `json:"title"`
	Description   string   `json:"description"`
	Tags          []string `json:"tags"`
	Timezone      string   `json:"timezone"`
	SchemaVersion int      `json:"schemaVersion"`
	Version       int      `json:"version"`
	Editable      bool     `json:"editable"`
	Refresh       string   `json:"refresh"`
	Time          struct {
		From string `json:"from"`
		To   string `json:"to"`
	} `json:"time"`
	Templating struct {
		List []struct {
			Name       string         `json:"name"`
			Type       string         `json:"type"`
			Label      string         `json:"label"`
			Datasource *datasourceRef `json:"datasource,omitempty"`
			Query      string         `json:"query"`
			IncludeAll bool           `json:"includeAll,omitempty"`
			Multi      bool           `json:"multi,omitempty"`
			Refresh    int            `json:"refresh,omitempty"`
		} `json:"list"`
	} `json:"templating"`
	Panels []struct {
		ID          int           `json:"id"`
		Type        string        `json:"type"`
		Title       string        `json:"title"`
		Description string        `json:"description"`
		Datasource  datasourceRef `json:"datasource"`
		GridPos     struct {
			X int `json:"x"`
			Y int `json:"y"`
			W int `json:"w"`
			H int `json:"h"`
		} `json:"gridPos"`
		FieldConfig struct {
			Defaults struct {
				Unit string `json:"unit"`
			} `json:"defaults"`
			Overrides []json.RawMessage `json:"overrides"`
		} `json:"fieldConfig"`
		Targets []struct {
			RefID        string        `json:"refId"`
			Datasource   datasourceRef `json:"datasource"`
			Expr         string        `json:"expr"`
			LegendFormat string        `json:"legendFormat"`
		} `json:"targets"`
	} `json:"panels"`
}

func readStrict(t *testing.T, file string, into any) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, file))
	if err != nil {
		t.Fatal(err)
	}
	if strings.HasSuffix(file, ".json") {
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.DisallowUnknownFields()
		if err := dec.Decode(into); err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		return
	}
	if err := yaml.UnmarshalStrict(b, into); err != nil {
		t.Fatalf("%s: %v", file, err)
	}
}

func TestOverlayDecodesAndNamesRealMetrics(t *testing.T) {
	exported := exportedMetrics(t)

	var sm serviceMonitor
	readStrict(t, "monitor.yaml", &sm)
	if sm.Kind != "ServiceMonitor" || len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "https" || sm.Spec.Endpoints[0].Scheme != "https" {
		t.Errorf("ServiceMonitor %+v: want one https endpoint on the metrics Service's port https", sm)
	}
	var pm podMonitor
	readStrict(t, "podmonitor.yaml", &pm)
	if pm.Kind != "PodMonitor" || len(pm.Spec.PodMetricsEndpoints) != 1 || pm.Spec.PodMetricsEndpoints[0].Port != apportionv1.AgentPortName {
		t.Errorf("PodMonitor %+v: want the agents' %s port", pm, apportionv1.AgentPortName)
	}

	var rule prometheusRule
	readStrict(t, "rules.yaml", &rule)
	var exprs []string
	alerts := map[string]bool{}
	for _, g := range rule.Spec.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" || r.Expr == "" || r.Labels["severity"] == "" || r.Annotations["summary"] == "" {
				t.Errorf("rule %+v: an alert needs a name, an expression, a severity and a summary", r)
			}
			alerts[r.Alert] = true
			exprs = append(exprs, r.Expr)
		}
	}
	// The alerts issue 12 asks for.
	for _, a := range []string{"ApportionQuotaOversubscribed", "ApportionPodsUnreachable", "ApportionLedgerNearLimit",
		"ApportionAgentLeaseExpired", "ApportionBreakerOpen", "ApportionDownstream429",
		// and issue 31: the warning threshold, and what Observe would refuse.
		"ApportionQuotaNearLimit", "ApportionObserveWouldRefuse"} {
		if !alerts[a] {
			t.Errorf("PrometheusRule lacks alert %s", a)
		}
	}

	var d dashboard
	readStrict(t, "dashboard.json", &d)
	if d.UID == "" || len(d.Panels) == 0 {
		t.Fatalf("dashboard without uid or panels")
	}
	titles := map[string]bool{}
	for _, p := range d.Panels {
		titles[p.Title] = true
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			exprs = append(exprs, tg.Expr)
		}
	}
	for _, want := range []string{"In-flight / permits per downstream", "Rejections by reason", "Per-second peak", "Breaker state",
		"Utilization", "Would refuse (Observe)"} {
		if !titles[want] {
			t.Errorf("dashboard lacks panel %q", want)
		}
	}
	for _, v := range d.Templating.List {
		if v.Type == "query" {
			exprs = append(exprs, v.Query)
		}
	}

	named := 0
	for _, e := range exprs {
		if strings.Count(e, "(") != strings.Count(e, ")") || strings.Count(e, "{") != strings.Count(e, "}") {
			t.Errorf("unbalanced brackets in %q", e)
		}
		for _, m := range metricRef.FindAllString(e, -1) {
			named++
			if !exported[m] {
				t.Errorf("%q names %s, which neither the manager nor the agent exports", e, m)
			}
		}
	}
	if named == 0 {
		t.Fatal("no expression names an apportion metric: the pattern is broken")
	}
}

// metricRef matches a metric name of ours in an expression.
var metricRef = regexp.MustCompile(`\bapportion_(?:agent|manager)_[a-z0-9_]+`)

// exportedMetrics is every metric name the agent's and the manager's registries describe,
// histograms with their _bucket, _sum and _count series.
func exportedMetrics(t *testing.T) map[string]bool {
	t.Helper()
	rec := &describing{names: map[string]bool{}}
	m := agentmetrics.New()
	if err := rec.Register(m.Registry); err != nil {
		t.Fatal(err)
	}
	_, err := push.New(push.Options{
		Client:   noAgents{},
		Epoch:    push.EpochFunc(func(context.Context) (int64, error) { return 1, nil }),
		Registry: rec,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := controller.RegisterUsageMetrics(rec); err != nil {
		t.Fatal(err)
	}
	for _, must := range []string{"apportion_agent_inflight", "apportion_manager_limit", "apportion_manager_quota_peak_second_calls"} {
		if !rec.names[must] {
			t.Fatalf("registries describe %v, without %s: the collection is broken", slices.Sorted(mapKeys(rec.names)), must)
		}
	}
	return rec.names
}

func mapKeys(m map[string]bool) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// describing is a Registerer that records the names of what is registered with it.
type describing struct{ names map[string]bool }

var fqName = regexp.MustCompile(`fqName: "([^"]+)"`)

func (d *describing) Register(c prometheus.Collector) error {
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	for desc := range ch {
		s := fqName.FindStringSubmatch(desc.String())
		if s == nil {
			continue
		}
		d.names[s[1]] = true
		for _, suffix := range []string{"_bucket", "_sum", "_count"} {
			d.names[s[1]+suffix] = true
		}
	}
	return nil
}

func (d *describing) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		_ = d.Register(c)
	}
}

func (d *describing) Unregister(prometheus.Collector) bool { return true }

// noAgents is an AgentClient that is never called: the engine is built, not started.
type noAgents struct{}

func (noAgents) Push(context.Context, assignment.Endpoint, *assignment.Assignment) (*assignment.State, error) {
	panic("not started")
}

func (noAgents) State(context.Context, assignment.Endpoint, int64) (*assignment.State, error) {
	panic("not started")
}
