package push

import (
	"bytes"
	"crypto/ed25519"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/agent/control"
	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/keys"
)

// testBackend is an agent backend with the enforcer's documented semantics (fencing by
// (epoch, generation), a renewal for the pair held, a lease from acceptance, the fallback when it
// lapses), reading the test's clock. The engine tests serve it through the agent's real control
// handler (authentication, strict decoding, 409 answers).
type testBackend struct {
	mu         sync.Mutex
	now        func() time.Time
	epoch, gen int64
	configured bool
	a          *assignment.Assignment
	acceptedAt time.Time
	inflight   map[string]int32
	// accepted lists every assignment applied (renewals included) as "e<epoch>/g<gen>".
	accepted []string
	// lapses counts the pushes accepted after the lease they renewed had lapsed; maxGap is the
	// longest time between two accepted pushes.
	lapses int
	maxGap time.Duration
}

// noteAccept records an accepted push at now for lapses and maxGap. b.mu is held.
func (b *testBackend) noteAccept(now time.Time) {
	if b.a != nil && b.configured {
		gap := now.Sub(b.acceptedAt)
		b.maxGap = max(b.maxGap, gap)
		if gap >= b.a.LeaseTTL.D() {
			b.lapses++
		}
	}
}

func newTestBackend(now func() time.Time) *testBackend {
	return &testBackend{now: now, inflight: map[string]int32{}}
}

// Instance: the test backend has none (the engine tests fake restarts otherwise), so pushes are
// signed for instance "".
func (b *testBackend) Instance() string { return "" }

// Apply implements control.Backend; the lease counts from acceptance (the engine's model: a
// signed time only ever ends a lease earlier).
func (b *testBackend) Apply(a *assignment.Assignment, _ time.Time) (assignment.State, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.configured {
		if c := assignment.ComparePair(a.Epoch, a.Generation, b.epoch, b.gen); c < 0 {
			return b.stateLocked(), fmt.Errorf("%w: pushed %d/%d", assignment.ErrStale, a.Epoch, a.Generation)
		} else if c == 0 {
			b.noteAccept(b.now())
			b.acceptedAt = b.now()
			b.accepted = append(b.accepted, fmt.Sprintf("e%d/g%d", a.Epoch, a.Generation))
			return b.stateLocked(), nil
		}
	}
	b.noteAccept(b.now())
	b.epoch, b.gen, b.configured, b.a, b.acceptedAt = a.Epoch, a.Generation, true, a, b.now()
	b.accepted = append(b.accepted, fmt.Sprintf("e%d/g%d", a.Epoch, a.Generation))
	return b.stateLocked(), nil
}

func (b *testBackend) State() assignment.State {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.stateLocked()
}

func (b *testBackend) Ready() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.configured
}

func (b *testBackend) stateLocked() assignment.State {
	st := assignment.State{Epoch: b.epoch, Generation: b.gen, Configured: b.configured}
	if b.a == nil {
		return st
	}
	now := b.now()
	st.LeaseExpiresAt = b.acceptedAt.Add(b.a.LeaseTTL.D())
	st.LeaseExpired = !now.Before(st.LeaseExpiresAt)
	for _, d := range b.a.Downstreams {
		eff := d.Permits
		if st.LeaseExpired {
			eff = d.LapsedLimit()
		}
		st.Downstreams = append(st.Downstreams, assignment.DownstreamState{
			Name: d.Name, Permits: d.Permits, EffectivePermits: eff, InFlight: b.inflight[d.Name],
		})
	}
	for _, s := range b.a.Switches {
		st.Switches = append(st.Switches, assignment.SwitchState{Name: s.Name, Active: now.Before(s.ExpiresAt), ExpiresAt: s.ExpiresAt})
	}
	return st
}

// permits is what the backend holds for a downstream (-1 when unconfigured), and its epoch.
func (b *testBackend) permits(ds string) (int32, int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.a == nil {
		return -1, 0
	}
	for _, d := range b.a.Downstreams {
		if d.Name == ds {
			return d.Permits, b.epoch
		}
	}
	return 0, b.epoch
}

// Agent modes.
const (
	agentNormal int32 = iota
	agentFail         // answers 503
	agentHang         // holds every request until the client gives up or release is closed
)

// testAgent is one in-process agent on a loopback httptest server.
type testAgent struct {
	b       *testBackend
	srv     *httptest.Server
	mode    atomic.Int32
	release chan struct{}
	calls   atomic.Int64
	// old makes it an agent of the first release (serveFirstRelease); proofs counts the
	// requests it got with a batch proof (old or not).
	old    atomic.Bool
	proofs atomic.Int64
}

var quietLog = slog.New(slog.DiscardHandler)

var testKey = assignment.SigningKey{ID: "k20260701-120000", Private: ed25519.NewKeyFromSeed(bytes.Repeat([]byte{7}, ed25519.SeedSize))}

// testKeys is a schedule that signs with testKey.
func testKeys(testing.TB) keys.Schedule {
	return keys.Schedule{Signing: testKey, Published: []assignment.SigningKey{testKey}}
}

// newTestAgent serves a test backend as pod ("namespace/name"), trusting testKey.
func newTestAgent(t testing.TB, now func() time.Time, pod string) *testAgent {
	ts, err := assignment.NewTrustSet(testKey.Public())
	if err != nil {
		t.Fatal(err)
	}
	ta := &testAgent{b: newTestBackend(now), release: make(chan struct{})}
	h := control.New(control.Options{Backend: ta.b, Trust: func() assignment.TrustSet { return ts }, Pod: pod, Logger: quietLog})
	ta.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ta.calls.Add(1)
		switch ta.mode.Load() {
		case agentFail:
			http.Error(w, "unavailable", http.StatusServiceUnavailable)
			return
		case agentHang:
			select {
			case <-r.Context().Done():
				return
			case <-ta.release:
			}
		}
		if strings.Contains(r.Header.Get("Authorization"), ",proof=") {
			ta.proofs.Add(1)
		}
		if ta.old.Load() {
			ta.serveFirstRelease(w, r, h)
			return
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(func() {
		ta.unblock()
		ta.srv.Close()
	})
	return ta
}

var releaseOnce sync.Map

func (ta *testAgent) unblock() {
	if _, loaded := releaseOnce.LoadOrStore(ta, true); !loaded {
		close(ta.release)
	}
}

// serveFirstRelease answers as an agent of the first release: its States carry no
// capabilities, and a request with a batch proof is refused as malformed (it does not know the
// parameter).
func (ta *testAgent) serveFirstRelease(w http.ResponseWriter, r *http.Request, h http.Handler) {
	if strings.Contains(r.Header.Get("Authorization"), ",proof=") {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusForbidden)
		_, _ = w.Write([]byte(`{"title":"Forbidden","status":403,"code":"forbidden","reason":"malformed"}`))
		return
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	body := rec.Body.Bytes()
	var doc map[string]any
	if json.Unmarshal(body, &doc) == nil {
		delete(doc, "capabilities")
		if st, ok := doc["state"].(map[string]any); ok {
			delete(st, "capabilities")
		}
		body, _ = json.Marshal(doc)
	}
	maps.Copy(w.Header(), rec.Header())
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(rec.Code)
	_, _ = w.Write(body)
}
