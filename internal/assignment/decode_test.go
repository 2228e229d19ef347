package assignment

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

func validJSON(t testing.TB) []byte {
	t.Helper()
	b, err := os.ReadFile("testdata/valid.json")
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// mutate decodes the valid document generically, lets f change it and re-encodes it.
func mutate(t testing.TB, f func(m map[string]any)) []byte {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(validJSON(t), &m); err != nil {
		t.Fatal(err)
	}
	f(m)
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func ds(m map[string]any, i int) map[string]any {
	return m["downstreams"].([]any)[i].(map[string]any)
}

func sw(m map[string]any, i int) map[string]any {
	return m["switches"].([]any)[i].(map[string]any)
}

func TestDecodeValid(t *testing.T) {
	a, err := Decode(bytes.NewReader(validJSON(t)), DefaultMaxBytes)
	if err != nil {
		t.Fatalf("Decode: %v", err)
	}
	want := &Assignment{
		Epoch: 3, Generation: 17, LeaseTTL: Duration(30 * time.Second),
		Downstreams: []Downstream{
			{
				Name: "payments", Upstream: "https://payments.internal:8443/api", Permits: 12, SafeDefaultPermits: 4,
				AcquireTimeout: Duration(200 * time.Millisecond), RequestTimeout: Duration(30 * time.Second),
				Rate: &Rate{PerSecond: 25.5, Burst: 5, Mode: ModeTokenBucket},
				Breaker: &Breaker{
					Window: Duration(10 * time.Second), FailureRatePercent: 50, SlowCallThreshold: Duration(time.Second),
					SlowCallRatePercent: 100, MinimumCalls: 20, OpenDuration: Duration(30 * time.Second), HalfOpenProbes: 3,
				},
				Fallback: Fallback{Action: ActionServeStale, MaxStaleness: Duration(5 * time.Minute), AllowedMethods: []string{"GET", "HEAD"}},
				Recovery: &Recovery{
					Window:   Duration(time.Second),
					Ramp:     &Ramp{Shape: ShapeLinear, InitialPercent: 10, StepPercent: 10, HealthyWindows: 2, LatencyTarget: Duration(250 * time.Millisecond)},
					Adaptive: &Adaptive{TolerancePercent: 150, BaselineWindows: 60, MinLimit: 1},
				},
				MaxWaiting: ptrTo[int32](6), DeadlineHeader: "X-Request-Timeout", AbandonedHold: ptrTo(Duration(0)),
			},
			{
				Name: "geo", Upstream: "http://geo.default.svc.cluster.local", FailClosed: true,
				AcquireTimeout: Duration(time.Millisecond), RequestTimeout: Duration(10 * time.Minute),
				Fallback: Fallback{Action: ActionStatic, Static: &StaticResponse{
					Status: 200, Headers: map[string]string{"Content-Type": "application/json"}, Body: `{"country":"unknown"}`,
				}},
			},
		},
		Switches: []Switch{{
			Name: "shop/degrade-geo", Downstream: "geo", ExpiresAt: time.Date(2030, 1, 2, 15, 4, 5, 0, time.UTC),
			Percent: 25, KeyHeader: "X-User-Id", Headers: []HeaderMatch{{Name: "X-Tier", Value: "free"}},
			Methods: []string{"GET"}, Action: Fallback{Action: ActionReject},
		}},
	}
	if diff := cmp.Diff(want, a); diff != "" {
		t.Fatalf("decoded (-want +got):\n%s", diff)
	}
}

// TestDecodeErrors: every refusal names the path of each offending field, and all of them are
// reported at once.
func TestDecodeErrors(t *testing.T) {
	tests := []struct {
		name string
		body []byte
		max  int64
		want []string // each must appear in the error, in this order of FieldErrors when >1
	}{
		{name: "empty body", body: nil, want: []string{"body: empty body"}},
		{name: "not json", body: []byte(`{"epoch": 1,`), want: []string{"body: "}},
		{name: "two values", body: append(validJSON(t), []byte(` {}`)...), want: []string{"body: must hold exactly one JSON value"}},
		{name: "array at root", body: []byte(`[]`), want: []string{"body: must be an object"}},
		{name: "too large", body: validJSON(t), max: 100, want: []string{"exceeds the size limit"}},
		{name: "unknown top-level field", body: mutate(t, func(m map[string]any) { m["epoc"] = 1 }), want: []string{"epoc: unknown field"}},
		{name: "unknown nested field", body: mutate(t, func(m map[string]any) {
			ds(m, 0)["breaker"].(map[string]any)["windw"] = "1s"
		}), want: []string{"downstreams[0].breaker.windw: unknown field"}},
		{name: "case-mismatched field", body: mutate(t, func(m map[string]any) {
			delete(ds(m, 1), "permits")
			ds(m, 1)["Permits"] = 3
		}), want: []string{"downstreams[1].Permits: unknown field"}},
		{name: "duplicate field", body: bytes.Replace(validJSON(t), []byte(`"epoch": 3,`), []byte(`"epoch": 3, "epoch": 4,`), 1), want: []string{"epoch: duplicate field"}},
		{name: "numeric duration", body: mutate(t, func(m map[string]any) { ds(m, 0)["acquireTimeout"] = 200 }), want: []string{`downstreams[0].acquireTimeout: duration must be a string such as "200ms"`}},
		{name: "bad duration", body: mutate(t, func(m map[string]any) { ds(m, 1)["requestTimeout"] = "10 minutes" }), want: []string{`downstreams[1].requestTimeout: invalid duration "10 minutes"`}},
		{name: "wrong type", body: mutate(t, func(m map[string]any) { ds(m, 0)["permits"] = "12" }), want: []string{"downstreams[0].permits: must be a 32-bit integer"}},
		{name: "int32 overflow", body: mutate(t, func(m map[string]any) { ds(m, 0)["permits"] = 1 << 40 }), want: []string{"downstreams[0].permits: must be a 32-bit integer"}},
		{name: "bad time", body: mutate(t, func(m map[string]any) { sw(m, 0)["expiresAt"] = "tomorrow" }), want: []string{"switches[0].expiresAt: must be an RFC 3339 time"}},
		{name: "shape errors all reported", body: mutate(t, func(m map[string]any) {
			m["x"] = 1
			ds(m, 1)["acquireTimeout"] = 5
		}), want: []string{"x: unknown field", "downstreams[1].acquireTimeout: duration must be a string"}},
		{name: "acquireTimeout range", body: mutate(t, func(m map[string]any) { ds(m, 0)["acquireTimeout"] = "6s" }), want: []string{"downstreams[0].acquireTimeout: must be between 1ms and 5s"}},
		{name: "requestTimeout range", body: mutate(t, func(m map[string]any) { ds(m, 1)["requestTimeout"] = "5ms" }), want: []string{"downstreams[1].requestTimeout: must be between 10ms and 10m"}},
		{name: "leaseTTL range", body: mutate(t, func(m map[string]any) { m["leaseTTL"] = "11m" }), want: []string{"leaseTTL: must be between 100ms and 10m"}},
		{name: "epoch and generation", body: mutate(t, func(m map[string]any) { m["epoch"] = 0; m["generation"] = -1 }), want: []string{"epoch: must be at least 1", "generation: must be at least 1"}},
		{name: "negative permits", body: mutate(t, func(m map[string]any) { ds(m, 0)["permits"] = -1; ds(m, 0)["safeDefaultPermits"] = -2 }), want: []string{"downstreams[0].permits: must be between 0 and", "downstreams[0].safeDefaultPermits: must be between 0 and"}},
		{name: "bad names", body: mutate(t, func(m map[string]any) { ds(m, 0)["name"] = "Payments"; ds(m, 1)["name"] = "-geo" }), want: []string{"downstreams[0].name: must be a DNS label", "downstreams[1].name: must be a DNS label"}},
		{name: "duplicate names", body: mutate(t, func(m map[string]any) { ds(m, 1)["name"] = "payments"; sw(m, 0)["downstream"] = "payments" }), want: []string{`downstreams[1].name: duplicate of downstreams[0].name "payments"`}},
		{name: "relative upstream", body: mutate(t, func(m map[string]any) { ds(m, 0)["upstream"] = "/api" }), want: []string{"downstreams[0].upstream: must be an absolute http or https URL"}},
		{name: "ftp upstream", body: mutate(t, func(m map[string]any) { ds(m, 1)["upstream"] = "ftp://geo" }), want: []string{"downstreams[1].upstream: must be an absolute http or https URL"}},
		{name: "rate", body: mutate(t, func(m map[string]any) {
			ds(m, 0)["rate"] = map[string]any{"perSecond": 0, "burst": -1, "mode": "Leaky"}
		}), want: []string{"downstreams[0].rate.perSecond: must be a finite number greater than 0", "downstreams[0].rate.burst: must be 0 or more", `downstreams[0].rate.mode: must be "TokenBucket" or "Pacing"`}},
		{name: "breaker ranges", body: mutate(t, func(m map[string]any) {
			ds(m, 0)["breaker"] = map[string]any{"window": "500ms", "failureRatePercent": 101, "slowCallThreshold": "0s",
				"slowCallRatePercent": 0, "minimumCalls": 0, "openDuration": "2h", "halfOpenProbes": 101}
		}), want: []string{
			"downstreams[0].breaker.window: must be between 1s and 10m",
			"downstreams[0].breaker.failureRatePercent: must be between 1 and 100",
			"downstreams[0].breaker.slowCallThreshold: must be between 1ms and 10m",
			"downstreams[0].breaker.slowCallRatePercent: must be between 1 and 100",
			"downstreams[0].breaker.minimumCalls: must be between 1 and",
			"downstreams[0].breaker.openDuration: must be between 100ms and 1h",
			"downstreams[0].breaker.halfOpenProbes: must be between 1 and 100",
		}},
		{name: "recovery ranges", body: mutate(t, func(m map[string]any) {
			ds(m, 0)["recovery"] = map[string]any{"window": "10ms",
				"ramp":     map[string]any{"shape": "Cubic", "initialPercent": 0, "stepPercent": 101, "healthyWindows": 0, "latencyTarget": "20m"},
				"adaptive": map[string]any{"tolerancePercent": 100, "baselineWindows": 1, "minLimit": 0}}
		}), want: []string{
			"downstreams[0].recovery.window: must be between 100ms and 1m",
			`downstreams[0].recovery.ramp.shape: must be "Linear" or "Exponential"`,
			"downstreams[0].recovery.ramp.initialPercent: must be between 1 and 100",
			"downstreams[0].recovery.ramp.stepPercent: must be between 1 and 100",
			"downstreams[0].recovery.ramp.healthyWindows: must be between 1 and 100",
			"downstreams[0].recovery.ramp.latencyTarget: must be between 1ms and 10m",
			"downstreams[0].recovery.adaptive.tolerancePercent: must be between 101 and 1000",
			"downstreams[0].recovery.adaptive.baselineWindows: must be between 2 and 10000",
			"downstreams[0].recovery.adaptive.minLimit: must be between 1 and",
		}},
		{name: "recovery unknown field", body: mutate(t, func(m map[string]any) {
			ds(m, 0)["recovery"] = map[string]any{"window": "1s", "ramp": map[string]any{"shape": "Linear", "initialPercent": 10, "stepPercent": 10, "healthyWindows": 2, "aggression": 1}}
		}), want: []string{"downstreams[0].recovery.ramp.aggression: unknown field"}},
		{name: "queue, deadline header, hold", body: mutate(t, func(m map[string]any) {
			ds(m, 0)["maxWaiting"] = -1
			ds(m, 0)["deadlineHeader"] = "Content-Length"
			ds(m, 0)["abandonedHold"] = "11m"
			ds(m, 1)["deadlineHeader"] = "x timeout"
			ds(m, 1)["abandonedHold"] = "-1s"
		}), want: []string{
			"downstreams[0].maxWaiting: must be between 0 and",
			`downstreams[0].deadlineHeader: "Content-Length" is a field the agent or HTTP itself sets`,
			"downstreams[0].abandonedHold: must be between 0s and 10m",
			"downstreams[1].deadlineHeader: must be an HTTP field name",
			"downstreams[1].abandonedHold: must be between 0s and 10m",
		}},
		{name: "maxWaiting type", body: mutate(t, func(m map[string]any) { ds(m, 0)["maxWaiting"] = "3" }), want: []string{"downstreams[0].maxWaiting: must be a 32-bit integer"}},
		{name: "fallback action", body: mutate(t, func(m map[string]any) { ds(m, 0)["fallback"] = map[string]any{"action": "Ignore"} }), want: []string{`downstreams[0].fallback.action: must be "Reject", "Static" or "ServeStale"`}},
		{name: "static missing", body: mutate(t, func(m map[string]any) { ds(m, 1)["fallback"] = map[string]any{"action": "Static"} }), want: []string{"downstreams[1].fallback.static: is required when action is Static"}},
		{name: "static status", body: mutate(t, func(m map[string]any) {
			ds(m, 1)["fallback"].(map[string]any)["static"].(map[string]any)["status"] = 600
		}), want: []string{"downstreams[1].fallback.static.status: must be between 200 and 599"}},
		{name: "static status informational", body: mutate(t, func(m map[string]any) {
			ds(m, 1)["fallback"].(map[string]any)["static"].(map[string]any)["status"] = 101
		}), want: []string{"downstreams[1].fallback.static.status: must be between 200 and 599"}},
		{name: "static 204 with a body", body: mutate(t, func(m map[string]any) {
			st := ds(m, 1)["fallback"].(map[string]any)["static"].(map[string]any)
			st["status"], st["body"] = 204, "x"
		}), want: []string{"downstreams[1].fallback.static.body: must be empty with status 204 or 304"}},
		{name: "static 304 with a body", body: mutate(t, func(m map[string]any) {
			st := ds(m, 1)["fallback"].(map[string]any)["static"].(map[string]any)
			st["status"], st["body"] = 304, "x"
		}), want: []string{"downstreams[1].fallback.static.body: must be empty with status 204 or 304"}},
		{name: "epoch and generation bounded", body: mutate(t, func(m map[string]any) {
			m["epoch"], m["generation"] = int64(math.MaxInt64), int64(math.MaxInt64)
		}), want: []string{"epoch: must be between 1 and 9007199254740991", "generation: must be between 1 and 9007199254740991"}},
		{name: "static header name", body: mutate(t, func(m map[string]any) {
			ds(m, 1)["fallback"].(map[string]any)["static"].(map[string]any)["headers"] = map[string]any{"Bad Header": "x"}
		}), want: []string{`downstreams[1].fallback.static.headers["Bad Header"]: is not a valid header name`}},
		{name: "maxStaleness missing and methods", body: mutate(t, func(m map[string]any) {
			ds(m, 0)["fallback"] = map[string]any{"action": "ServeStale", "allowedMethods": []any{"GET", "FETCH"}}
		}), want: []string{"downstreams[0].fallback.maxStaleness: is required when action is ServeStale", "downstreams[0].fallback.allowedMethods[1]: must be one of GET"}},
		{name: "switch percent", body: mutate(t, func(m map[string]any) { sw(m, 0)["percent"] = 0 }), want: []string{"switches[0].percent: must be between 1 and 100"}},
		{name: "switch keyHeader required", body: mutate(t, func(m map[string]any) { delete(sw(m, 0), "keyHeader") }), want: []string{"switches[0].keyHeader: is required when percent is below 100"}},
		{name: "switch expiresAt required", body: mutate(t, func(m map[string]any) { delete(sw(m, 0), "expiresAt") }), want: []string{"switches[0].expiresAt: is required"}},
		{name: "switch downstream unknown", body: mutate(t, func(m map[string]any) { sw(m, 0)["downstream"] = "nope" }), want: []string{`switches[0].downstream: "nope" is not a listed downstream`}},
		{name: "switch methods", body: mutate(t, func(m map[string]any) { sw(m, 0)["methods"] = []any{"get"} }), want: []string{"switches[0].methods[0]: must be one of"}},
		{name: "switch action", body: mutate(t, func(m map[string]any) { sw(m, 0)["action"] = map[string]any{"action": "Static"} }), want: []string{"switches[0].action.static: is required when action is Static"}},
		{name: "too many downstreams", body: mutate(t, func(m map[string]any) {
			for i := len(m["downstreams"].([]any)); i <= MaxDownstreams; i++ {
				d := maps.Clone(ds(m, 1))
				d["name"] = fmt.Sprintf("d%d", i)
				m["downstreams"] = append(m["downstreams"].([]any), d)
			}
		}), want: []string{"downstreams[32]: beyond the 32 downstreams an assignment may list"}},
		{name: "too many switches", body: mutate(t, func(m map[string]any) {
			for i := len(m["switches"].([]any)); i <= MaxSwitches; i++ {
				s := maps.Clone(sw(m, 0))
				s["name"] = fmt.Sprintf("shop/s%d", i)
				m["switches"] = append(m["switches"].([]any), s)
			}
		}), want: []string{"switches[64]: beyond the 64 switches an assignment may list"}},
		{name: "switch duplicate", body: mutate(t, func(m map[string]any) {
			m["switches"] = append(m["switches"].([]any), sw(m, 0))
		}), want: []string{`switches[1].name: duplicate of switches[0].name "shop/degrade-geo"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			max := tt.max
			if max == 0 {
				max = DefaultMaxBytes
			}
			a, err := Decode(bytes.NewReader(tt.body), max)
			if err == nil {
				t.Fatalf("Decode accepted %s", tt.body)
			}
			if a != nil {
				t.Errorf("Decode returned an assignment with an error")
			}
			msg := err.Error()
			for _, w := range tt.want {
				if !strings.Contains(msg, w) {
					t.Errorf("error %q\ndoes not contain %q", msg, w)
				}
			}
			if tt.max != 0 {
				if !errors.Is(err, ErrTooLarge) {
					t.Errorf("error %v is not ErrTooLarge", err)
				}
				return
			}
			fes := FieldErrors(err)
			if len(fes) < len(tt.want) {
				t.Errorf("got %d field errors %v, want at least %d", len(fes), fes, len(tt.want))
			}
			for _, fe := range fes {
				if fe.Path == "" {
					t.Errorf("field error without a path: %v", fe)
				}
			}
		})
	}
}

func TestValidateSafeDefaultAbovePermitsAllowed(t *testing.T) {
	body := mutate(t, func(m map[string]any) { ds(m, 0)["safeDefaultPermits"] = 100 })
	if _, err := Decode(bytes.NewReader(body), DefaultMaxBytes); err != nil {
		t.Fatalf("safeDefaultPermits > permits refused: %v", err)
	}
}

func TestDecodeBootstrap(t *testing.T) {
	body := mutate(t, func(m map[string]any) {
		delete(m, "epoch")
		delete(m, "generation")
		delete(m, "leaseTTL")
	})
	if _, err := Decode(bytes.NewReader(body), DefaultMaxBytes); err == nil {
		t.Fatal("Decode accepted an assignment without epoch")
	}
	a, err := DecodeBootstrap(bytes.NewReader(body), DefaultMaxBytes)
	if err != nil {
		t.Fatalf("DecodeBootstrap: %v", err)
	}
	if len(a.Downstreams) != 2 {
		t.Fatalf("got %d downstreams", len(a.Downstreams))
	}
	bad := mutate(t, func(m map[string]any) { delete(m, "epoch"); ds(m, 0)["permits"] = -1 })
	if _, err := DecodeBootstrap(bytes.NewReader(bad), DefaultMaxBytes); err == nil || !strings.Contains(err.Error(), "downstreams[0].permits") {
		t.Fatalf("DecodeBootstrap error = %v, want downstreams[0].permits", err)
	}
}

func TestRoundTrip(t *testing.T) {
	a, err := Decode(bytes.NewReader(validJSON(t)), DefaultMaxBytes)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	a2, err := Decode(bytes.NewReader(b), DefaultMaxBytes)
	if err != nil {
		t.Fatalf("re-decoding %s: %v", b, err)
	}
	if diff := cmp.Diff(a, a2); diff != "" {
		t.Fatalf("round trip (-first +second):\n%s", diff)
	}
}

func ptrTo[T any](v T) *T { return &v }
