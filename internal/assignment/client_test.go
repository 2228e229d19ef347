package assignment

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/h1"
)

func TestClient(t *testing.T) {
	keys := mustTrust(t, keyNew)
	// The handler the server answers with, swapped by the test between calls. Behind a pointer:
	// h1 reads and writes its sockets with raw system calls, which the race detector does not
	// see as the synchronisation they are (net/http's socket calls are annotated for it).
	type answerFunc func(w http.ResponseWriter, a *Assignment)
	var answerP atomic.Pointer[answerFunc]
	setAnswer := func(f answerFunc) { answerP.Store(&f) }
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if _, err := Verify(r, body, keys, self, r.Method == http.MethodGet, testNow); err != nil {
			t.Errorf("server: %v", err)
			w.WriteHeader(http.StatusForbidden)
			return
		}
		var a *Assignment
		if r.Method == http.MethodPut {
			if r.URL.Path != PathAssignment || r.Header.Get("Content-Type") != "application/json" {
				t.Errorf("PUT %s %s", r.URL.Path, r.Header.Get("Content-Type"))
			}
			var err error
			if a, err = Decode(bytes.NewReader(body), DefaultMaxBytes); err != nil {
				t.Errorf("server decode: %v", err)
			}
		} else if r.URL.Path != PathState {
			t.Errorf("GET %s", r.URL.Path)
		}
		(*answerP.Load())(w, a)
	}))
	defer srv.Close()
	// The same over net/http and over the manager's lean client (h1.HTTPClient).
	for _, tc := range []struct {
		name string
		hc   Doer
	}{{"net/http", srv.Client()}, {"h1", h1.HTTPClient{C: h1.NewClient()}}} {
		hc := tc.hc
		t.Run(tc.name, func(t *testing.T) {
			c := &Client{HTTP: hc, Key: keyNew, Clock: clocktesting.NewFakePassiveClock(testNow)}
			a, err := Decode(bytes.NewReader(validJSON(t)), DefaultMaxBytes)
			if err != nil {
				t.Fatal(err)
			}
			a.Instance = self.Instance
			to := Endpoint{URL: srv.URL, Pod: self.Pod}
			ctx := context.Background()

			writeJSON := func(w http.ResponseWriter, ct string, status int, v any) {
				w.Header().Set("Content-Type", ct)
				w.WriteHeader(status)
				_ = json.NewEncoder(w).Encode(v)
			}

			setAnswer(func(w http.ResponseWriter, got *Assignment) {
				if got == nil {
					got = a
				}
				writeJSON(w, "application/json", 200, State{Epoch: got.Epoch, Generation: got.Generation, Configured: true,
					Downstreams: []DownstreamState{{Name: "payments", Permits: 12, EffectivePermits: 12, InFlight: 3}}})
			})
			st, err := c.Push(ctx, Endpoint{URL: srv.URL + "/", Pod: self.Pod}, a)
			if err != nil {
				t.Fatalf("Push: %v", err)
			}
			if st.Epoch != 3 || st.Generation != 17 || st.Downstreams[0].InFlight != 3 {
				t.Fatalf("state = %+v", st)
			}
			if st, err = c.State(ctx, to, 3); err != nil || !st.Configured {
				t.Fatalf("State = %+v, %v", st, err)
			}

			setAnswer(func(w http.ResponseWriter, _ *Assignment) {
				writeJSON(w, "application/problem+json", 409, Problem{Title: "stale", Status: 409, Code: CodeStaleAssignment,
					State: &State{Epoch: 4, Generation: 1, Configured: true}})
			})
			_, err = c.Push(ctx, to, a)
			var stale *StaleError
			if !errors.As(err, &stale) || stale.State.Epoch != 4 {
				t.Fatalf("Push on 409 = %v, want *StaleError with epoch 4", err)
			}

			// A 403 wrong-instance with the State: the agent restarted; the engine learns it as from a 409.
			setAnswer(func(w http.ResponseWriter, _ *Assignment) {
				writeJSON(w, "application/problem+json", 403, Problem{Title: "Forbidden", Status: 403, Code: CodeForbidden,
					Reason: ReasonWrongInstance, State: &State{Instance: "new", Epoch: 3, Generation: 0}})
			})
			_, err = c.Push(ctx, to, a)
			if !errors.As(err, &stale) || stale.State.Instance != "new" {
				t.Fatalf("Push on 403 wrong-instance = %v, want *StaleError with the new instance", err)
			}
			// Any other 403 is a StatusError with its reason.
			setAnswer(func(w http.ResponseWriter, _ *Assignment) {
				writeJSON(w, "application/problem+json", 403, Problem{Title: "Forbidden", Status: 403, Code: CodeForbidden, Reason: ReasonUnknownKey})
			})
			_, err = c.Push(ctx, to, a)
			if se := new(StatusError); !errors.As(err, &se) || se.StatusCode != 403 || se.Problem.Reason != ReasonUnknownKey {
				t.Fatalf("Push on 403 unknown-key = %v", err)
			}

			setAnswer(func(w http.ResponseWriter, _ *Assignment) {
				writeJSON(w, "application/problem+json", 400, Problem{Title: "invalid", Status: 400, Code: CodeInvalidAssignment,
					Detail: "the assignment is invalid", Errors: []string{"downstreams[0].permits: must be between 0 and 1000000"}})
			})
			_, err = c.Push(ctx, to, a)
			var se *StatusError
			if !errors.As(err, &se) || se.StatusCode != 400 || !strings.Contains(err.Error(), "downstreams[0].permits") {
				t.Fatalf("Push on 400 = %v", err)
			}

			setAnswer(func(w http.ResponseWriter, _ *Assignment) { http.Error(w, "boom", 500) })
			if _, err = c.State(ctx, to, 3); !errors.As(err, &se) || se.StatusCode != 500 || !strings.Contains(err.Error(), "boom") {
				t.Fatalf("State on 500 = %v", err)
			}

			// An invalid assignment is never sent.
			bad := *a
			bad.Epoch = 0
			setAnswer(func(w http.ResponseWriter, _ *Assignment) { t.Error("invalid assignment was sent") })
			if _, err = c.Push(ctx, to, &bad); err == nil || !strings.Contains(err.Error(), "epoch") {
				t.Fatalf("Push(invalid) = %v", err)
			}
		})
	}
}

// BenchmarkClientPush: one signed push of an encoded 1,500-byte assignment and its State
// answer, over net/http's client and over h1.HTTPClient, to a server that answers a canned
// State without verifying (its cost is the same under both). The difference is the client's:
// the manager's per-renewal transport cost (docs/benchmarks.md, "Scale").
func BenchmarkClientPush(b *testing.B) {
	answer, _ := json.Marshal(State{Epoch: 3, Generation: 17, Configured: true,
		Downstreams: []DownstreamState{{Name: "payments", Permits: 12, EffectivePermits: 12, InFlight: 3}}})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(answer)
	}))
	defer srv.Close()
	body := bytes.Repeat([]byte("x"), 1500)
	a := &Assignment{Epoch: 3, Generation: 17, Instance: self.Instance}
	to := Endpoint{URL: srv.URL, Pod: self.Pod}
	for _, tc := range []struct {
		name string
		hc   Doer
	}{
		{"net-http", &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2, ReadBufferSize: 2 << 10, WriteBufferSize: 2 << 10}}},
		{"h1", h1.HTTPClient{C: h1.NewClient()}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			c := &Client{HTTP: tc.hc, Key: keyNew}
			b.ReportAllocs()
			for b.Loop() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				if _, err := c.PushEncoded(ctx, to, a, body); err != nil {
					b.Fatal(err)
				}
				cancel()
			}
		})
	}
}
