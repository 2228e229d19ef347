package fallback

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

var t0 = time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC)

func TestDecide(t *testing.T) {
	static := Response{Status: 200, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"items":[]}`)}
	static503 := Response{Status: 503, Body: []byte("maintenance")}
	fresh := &Entry{Response: Response{Status: 200, Body: []byte("cached")}, StoredAt: t0.Add(-30 * time.Second)}
	future := &Entry{Response: Response{Status: 200}, StoredAt: t0.Add(time.Minute)}

	staleCfg := Config{Action: ServeStale, MaxStaleness: time.Minute}
	in := func(method string, stale *Entry) Input {
		return Input{Downstream: "payments", Reason: CircuitOpen, Method: method, RetryAfter: 3 * time.Second, Stale: stale, Now: t0}
	}
	reject := func(why Downgrade) Decision {
		return Decision{Action: Reject, Reason: CircuitOpen, Downstream: "payments", Downgraded: why, RetryAfter: 3 * time.Second}
	}
	staticD := func(r Response) Decision {
		return Decision{Action: Static, Reason: CircuitOpen, Downstream: "payments", Static: r}
	}

	tests := []struct {
		name string
		cfg  Config
		in   Input
		want Decision
	}{
		{"empty action rejects", Config{}, in("GET", fresh), reject("")},
		{"reject", Config{Action: Reject}, in("GET", fresh), reject("")},
		{"reject keeps an unknown retry time unknown", Config{},
			Input{Downstream: "payments", Reason: NoPermit, Method: "GET"},
			Decision{Action: Reject, Reason: NoPermit, Downstream: "payments"}},
		{"unknown action rejects", Config{Action: "Teapot"}, in("GET", nil), reject(UnknownAction)},

		{"static answers GET", Config{Action: Static, Static: static}, in("GET", nil), staticD(static)},
		{"static answers HEAD", Config{Action: Static, Static: static}, in("HEAD", nil), staticD(static)},
		{"static answers OPTIONS", Config{Action: Static, Static: static}, in("OPTIONS", nil), staticD(static)},
		{"static never fakes a POST by default", Config{Action: Static, Static: static}, in("POST", nil), reject(MethodNotAllowed)},
		{"static never fakes a PUT by default, idempotent or not", Config{Action: Static, Static: static}, in("PUT", nil), reject(MethodNotAllowed)},
		{"static never fakes a DELETE by default", Config{Action: Static, Static: static}, in("DELETE", nil), reject(MethodNotAllowed)},
		{"static status 0 is a success too", Config{Action: Static, Static: Response{Body: []byte("ok")}}, in("POST", nil), reject(MethodNotAllowed)},
		{"methods are case-sensitive", Config{Action: Static, Static: static}, in("get", nil), reject(MethodNotAllowed)},
		{"static answers a listed POST", Config{Action: Static, Static: static, AllowedMethods: []string{"POST"}}, in("POST", nil), staticD(static)},
		{"a configured list replaces the defaults", Config{Action: Static, Static: static, AllowedMethods: []string{"POST"}}, in("GET", nil), reject(MethodNotAllowed)},
		{"an error static claims nothing and answers any method", Config{Action: Static, Static: static503}, in("POST", nil), staticD(static503)},

		{"serve stale: fresh enough", staleCfg, in("GET", fresh),
			Decision{Action: ServeStale, Reason: CircuitOpen, Downstream: "payments", Stale: fresh, Age: 30 * time.Second}},
		{"serve stale: age equal to MaxStaleness is too old", Config{Action: ServeStale, MaxStaleness: 30 * time.Second}, in("GET", fresh), reject(StaleTooOld)},
		{"serve stale: MaxStaleness 0 serves nothing", Config{Action: ServeStale}, in("GET", fresh), reject(StaleTooOld)},
		{"serve stale: no entry", staleCfg, in("GET", nil), reject(NoStaleEntry)},
		{"serve stale: HEAD is allowed but not cached", staleCfg, in("HEAD", fresh), reject(StaleNeedsGET)},
		{"serve stale: POST", staleCfg, in("POST", fresh), reject(MethodNotAllowed)},
		{"serve stale: GET not in the configured list", Config{Action: ServeStale, MaxStaleness: time.Minute, AllowedMethods: []string{"HEAD"}}, in("GET", fresh), reject(MethodNotAllowed)},
		{"serve stale: an entry stored in the future has age 0", staleCfg, in("GET", future),
			Decision{Action: ServeStale, Reason: CircuitOpen, Downstream: "payments", Stale: future}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if diff := cmp.Diff(tt.want, Decide(tt.cfg, tt.in)); diff != "" {
				t.Errorf("Decide mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

func TestRenderReject(t *testing.T) {
	tests := []struct {
		name       string
		reason     Reason
		retryAfter time.Duration
		wantRetry  []string // nil: no Retry-After
		wantCode   string
		wantTitle  string
	}{
		{"unknown retry time sends no Retry-After", NoPermit, 0, nil, "APPORTION_NO_PERMIT", "Downstream concurrency limit reached"},
		{"1ms rounds up to 1", RateLimited, time.Millisecond, []string{"1"}, "APPORTION_RATE_LIMITED", "Downstream rate limit reached"},
		{"whole seconds stay", CircuitOpen, 3 * time.Second, []string{"3"}, "APPORTION_CIRCUIT_OPEN", "Downstream circuit breaker open"},
		{"just over rounds up", CircuitOpen, 3*time.Second + time.Nanosecond, []string{"4"}, "APPORTION_CIRCUIT_OPEN", "Downstream circuit breaker open"},
		{"degraded", Degraded, 0, nil, "APPORTION_DEGRADED", "Downstream degraded"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := Render(Decision{Action: Reject, Reason: tt.reason, Downstream: "payments", RetryAfter: tt.retryAfter})
			if r.Status != http.StatusServiceUnavailable {
				t.Errorf("status = %d, want 503", r.Status)
			}
			var got Problem
			if err := json.Unmarshal(r.Body, &got); err != nil {
				t.Fatalf("body %q: %v", r.Body, err)
			}
			want := Problem{
				Type:       "https://apportion.io/problems/" + string(tt.reason),
				Title:      tt.wantTitle,
				Status:     503,
				Detail:     `Apportion did not call downstream "payments" (` + string(tt.reason) + `).`,
				Code:       tt.wantCode,
				Downstream: "payments",
				Reason:     tt.reason,
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Errorf("problem mismatch (-want +got):\n%s", diff)
			}
			wantH := http.Header{
				"Content-Type":         {"application/problem+json"},
				"Cache-Control":        {"no-store"},
				"X-Apportion-Fallback": {"reject"},
				"X-Apportion-Reason":   {string(tt.reason)},
				"Content-Length":       {strconv.Itoa(len(r.Body))},
			}
			if tt.wantRetry != nil {
				wantH["Retry-After"] = tt.wantRetry
			}
			if diff := cmp.Diff(wantH, r.Header); diff != "" {
				t.Errorf("headers mismatch (-want +got):\n%s", diff)
			}
		})
	}
}

func TestRenderStatic(t *testing.T) {
	d := Decision{Action: Static, Reason: Degraded, Downstream: "search", Static: Response{
		Header: http.Header{
			"Content-Type":      {"application/json"},
			"Content-Length":    {"999"},     // wrong on purpose: recomputed
			"Transfer-Encoding": {"chunked"}, // hop-by-hop: dropped
			"Connection":        {"X-Hop"},
			"X-Hop":             {"1"}, // named by Connection: dropped
		},
		Body: []byte(`{"results":[]}`),
	}}
	r := Render(d)
	want := Response{
		Status: 200, // 0 means 200
		Header: http.Header{
			"Content-Type":         {"application/json"},
			"Content-Length":       {"14"},
			"X-Apportion-Fallback": {"static"},
			"X-Apportion-Reason":   {"degraded"},
		},
		Body: []byte(`{"results":[]}`),
	}
	if diff := cmp.Diff(want, r); diff != "" {
		t.Errorf("mismatch (-want +got):\n%s", diff)
	}
	if got := d.Static.Header.Get("Content-Length"); got != "999" {
		t.Errorf("Render modified the configured headers: Content-Length = %q", got)
	}
}

func TestRenderStale(t *testing.T) {
	e := &Entry{Response: Response{
		Status: 200,
		Header: http.Header{"Content-Type": {"text/plain"}, "Age": {"100"}, "Etag": {`"v1"`}},
		Body:   []byte("hello"),
	}, StoredAt: t0}
	r := Render(Decision{Action: ServeStale, Reason: RateLimited, Downstream: "search", Stale: e, Age: 90*time.Second + 999*time.Millisecond})
	want := Response{
		Status: 200,
		Header: http.Header{
			"Content-Type":         {"text/plain"},
			"Etag":                 {`"v1"`},
			"Age":                  {"90"}, // whole seconds, rounded down, replacing the stored Age
			"Content-Length":       {"5"},
			"X-Apportion-Fallback": {"serve-stale"},
			"X-Apportion-Reason":   {"rate-limited"},
		},
		Body: []byte("hello"),
	}
	if diff := cmp.Diff(want, r); diff != "" {
		t.Errorf("mismatch (-want +got):\n%s", diff)
	}
	// The entry is shared with the cache: Render must not have touched it.
	if diff := cmp.Diff(http.Header{"Content-Type": {"text/plain"}, "Age": {"100"}, "Etag": {`"v1"`}}, e.Header); diff != "" {
		t.Errorf("Render modified the cached entry (-want +got):\n%s", diff)
	}
}

func TestWrite(t *testing.T) {
	rec := httptest.NewRecorder()
	rec.Header().Set("X-Apportion-Fallback", "stale value set earlier")
	rec.Header().Set("X-Request-Id", "abc")
	d := Decide(Config{}, Input{Downstream: "payments", Reason: CircuitOpen, Method: "POST", RetryAfter: 2500 * time.Millisecond})
	if err := Write(rec, d); err != nil {
		t.Fatal(err)
	}
	res := rec.Result()
	if res.StatusCode != 503 {
		t.Errorf("status = %d", res.StatusCode)
	}
	got := map[string]string{
		"Content-Type":         res.Header.Get("Content-Type"),
		"Retry-After":          res.Header.Get("Retry-After"),
		"X-Apportion-Fallback": res.Header.Get("X-Apportion-Fallback"),
		"X-Request-Id":         res.Header.Get("X-Request-Id"),
	}
	want := map[string]string{
		"Content-Type":         "application/problem+json",
		"Retry-After":          "3",
		"X-Apportion-Fallback": "reject",
		"X-Request-Id":         "abc", // unrelated headers are left alone
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("headers (-want +got):\n%s", diff)
	}
	var p Problem
	if err := json.NewDecoder(res.Body).Decode(&p); err != nil || p.Code != "APPORTION_CIRCUIT_OPEN" {
		t.Errorf("body: %+v, %v", p, err)
	}
}

// TestWriteHEAD sends a fallback through a real server for a HEAD request:
// the headers arrive, the body does not (net/http drops it).
func TestWriteHEAD(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d := Decide(Config{Action: Static, Static: Response{Body: []byte("static body")}}, Input{Reason: Degraded, Method: r.Method})
		if err := Write(w, d); err != nil {
			t.Errorf("Write: %v", err)
		}
	}))
	defer srv.Close()
	res, err := http.Head(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if res.StatusCode != 200 || res.Header.Get("X-Apportion-Fallback") != "static" || res.ContentLength != int64(len("static body")) {
		t.Errorf("HEAD: status %d, fallback %q, length %d", res.StatusCode, res.Header.Get("X-Apportion-Fallback"), res.ContentLength)
	}
}
