package harness

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/h1/h1test"
)

// HostileKind is how a hostile tenant's "agent" answers the manager's control requests. None of
// them holds a key the manager published: everything it says is unsigned claims, which is all a
// namespace editor can put behind a pod's agent port (issue 26).
type HostileKind string

// The hostile answers. The "epoch" ones claim a newer epoch than any manager ever had
// (MaxSafeEpoch, 2^53−1) in each shape the control API carries a State: the answer itself, a 409
// stale-assignment and a 403 wrong-instance. The "bomb" ones are the largest answers the client
// of today reads (just under its 8 MiB cap) built to cost the most to decode: millions of empty
// list entries. The rest cost time, not memory.
const (
	HostileEpochState         HostileKind = "epoch-state" // 200: a State with epoch 2^53−1
	HostileEpochStale         HostileKind = "epoch-409"   // 409 stale-assignment carrying such a State
	HostileEpochWrongInstance HostileKind = "epoch-403"   // 403 wrong-instance carrying such a State
	HostileStateBomb          HostileKind = "bomb-state"  // 200: a State of ~8 MiB of empty downstreams entries
	HostileProblemBomb        HostileKind = "bomb-409"    // 409 whose State is such a list
	HostileErrorsBomb         HostileKind = "bomb-errors" // 400 problem of ~8 MiB of empty errors entries
	HostileOversized          HostileKind = "oversized"   // 200 announcing 64 MiB, streamed as fast as read
	HostileHang               HostileKind = "hang"        // reads the request, never answers
	HostileDrip               HostileKind = "drip"        // answers one byte every 100 ms
	HostileGarbage            HostileKind = "garbage"     // 4 KiB of random bytes, then closes
)

// HostileKinds lists every kind, in the order above.
var HostileKinds = []HostileKind{
	HostileEpochState, HostileEpochStale, HostileEpochWrongInstance,
	HostileStateBomb, HostileProblemBomb, HostileErrorsBomb, HostileOversized,
	HostileHang, HostileDrip, HostileGarbage,
}

// MaxSafeEpoch is the largest integer a JSON number carries exactly everywhere (2^53−1): the
// epoch a hostile agent claims.
const MaxSafeEpoch = 1<<53 - 1

const (
	// bombBytes is the size of a bomb's body: just under the 8 MiB the control-API client of
	// today reads before it refuses an answer, so that it decodes all of it.
	bombBytes = 8<<20 - 64
	// oversizedBytes is what an oversized answer announces and streams.
	oversizedBytes = 64 << 20
	// dripEvery is the pace of a drip answer, and dripFor how long one drips at most.
	dripEvery = 100 * time.Millisecond
	dripFor   = 2 * time.Minute
)

// HostileCounts is what one kind of hostile agent saw.
type HostileCounts struct {
	// Conns and Requests are the connections accepted and the request heads read.
	Conns, Requests int64
	// Bytes is what it wrote.
	Bytes int64
}

// hostileAgent is one hostile "agent": a raw TCP server on a pod's address that answers every
// control request its kind's way.
type hostileAgent struct {
	kind   HostileKind
	pod    string
	ln     net.Listener
	counts *hostileCounters
	// answer is the complete HTTP response of the kinds that answer at once.
	answer []byte

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	quit   chan struct{}
	wg     sync.WaitGroup
}

type hostileCounters struct {
	conns, requests, bytes atomic.Int64
}

func (c *hostileCounters) snapshot() HostileCounts {
	return HostileCounts{Conns: c.conns.Load(), Requests: c.requests.Load(), Bytes: c.bytes.Load()}
}

// startHostileAgent listens on addr and serves kind's answers for pod (namespace/name).
func startHostileAgent(addr, pod, quota string, kind HostileKind, counts *hostileCounters) (*hostileAgent, error) {
	answer, err := hostileAnswer(kind, pod, quota)
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("hostile agent of %s: %w", pod, err)
	}
	h := &hostileAgent{kind: kind, pod: pod, ln: ln, counts: counts, answer: answer,
		conns: map[net.Conn]struct{}{}, quit: make(chan struct{})}
	h.wg.Go(h.accept)
	return h, nil
}

func (h *hostileAgent) accept() {
	for {
		c, err := h.ln.Accept()
		if err != nil {
			return
		}
		h.mu.Lock()
		if h.closed {
			h.mu.Unlock()
			_ = c.Close()
			return
		}
		h.conns[c] = struct{}{}
		h.mu.Unlock()
		h.counts.conns.Add(1)
		h.wg.Go(func() {
			defer func() {
				h.mu.Lock()
				delete(h.conns, c)
				h.mu.Unlock()
				_ = c.Close()
			}()
			h.serve(c)
		})
	}
}

// serve answers the requests of one connection until its kind ends it or the peer goes.
func (h *hostileAgent) serve(c net.Conn) {
	br := bufio.NewReader(c)
	for {
		head, err := h1test.ReadHead(br)
		if err != nil {
			return
		}
		h.counts.requests.Add(1)
		if n := contentLength(head); n > 0 {
			if _, err := io.CopyN(io.Discard, br, n); err != nil {
				return
			}
		}
		switch h.kind {
		case HostileHang:
			// Holds the connection, and with it the manager's request, until the manager gives
			// up (closes) or the tenant goes.
			_, _ = io.Copy(io.Discard, br)
			return
		case HostileGarbage:
			junk := make([]byte, 4096)
			rng := rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
			for i := range junk {
				junk[i] = byte(rng.Uint32())
			}
			h.write(c, junk)
			return
		case HostileDrip:
			h.drip(c)
			return
		case HostileOversized:
			h.stream(c)
			return
		default:
			if !h.write(c, h.answer) {
				return
			}
		}
	}
}

func (h *hostileAgent) write(c net.Conn, b []byte) bool {
	n, err := c.Write(b)
	h.counts.bytes.Add(int64(n))
	return err == nil
}

// drip writes a plausible answer one byte at a time, every dripEvery, for at most dripFor.
func (h *hostileAgent) drip(c net.Conn) {
	body := `{"epoch":0,"generation":0,"configured":true,"downstreams":[]}`
	msg := fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	t := time.NewTicker(dripEvery)
	defer t.Stop()
	end := time.Now().Add(dripFor)
	for i := 0; ; i = (i + 1) % len(msg) {
		if !h.write(c, []byte{msg[i]}) || time.Now().After(end) {
			return
		}
		select {
		case <-h.quit:
			return
		case <-t.C:
		}
	}
}

// stream announces oversizedBytes of JSON and writes them as fast as the reader takes them.
func (h *hostileAgent) stream(c net.Conn) {
	head := fmt.Sprintf("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", oversizedBytes)
	if !h.write(c, []byte(head)) {
		return
	}
	// "{" and then blanks: valid JSON so far, and never finished.
	if !h.write(c, []byte("{")) {
		return
	}
	chunk := bytes.Repeat([]byte(" "), 64<<10)
	for sent := 1; sent < oversizedBytes; sent += len(chunk) {
		if !h.write(c, chunk) {
			return
		}
	}
}

// Close stops the server and ends every connection.
func (h *hostileAgent) Close() {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return
	}
	h.closed = true
	close(h.quit)
	for c := range h.conns {
		_ = c.Close()
	}
	h.mu.Unlock()
	_ = h.ln.Close()
	h.wg.Wait()
}

// contentLength is a request head's Content-Length (0 when absent or unreadable).
func contentLength(head string) int64 {
	for _, line := range strings.Split(head, "\r\n") {
		name, value, ok := strings.Cut(line, ":")
		if ok && strings.EqualFold(strings.TrimSpace(name), "Content-Length") {
			n, err := strconv.ParseInt(strings.TrimSpace(value), 10, 64)
			if err == nil && n > 0 {
				return n
			}
		}
	}
	return 0
}

// hugeState is a State claiming the newest epoch there can be, and holding quota's downstream.
func hugeState(pod, quota string) assignment.State {
	return assignment.State{
		Instance: "hostile-" + pod, Epoch: MaxSafeEpoch, Generation: MaxSafeEpoch, Configured: true,
		LeaseExpiresAt: time.Now().Add(time.Hour).UTC().Truncate(time.Second),
		Downstreams:    []assignment.DownstreamState{{Name: quota, Permits: 1000, EffectivePermits: 1000, Limit: 1000}},
	}
}

var bombs struct {
	once                 sync.Once
	state, problem, errs []byte
}

// listBomb is prefix, then "{}" or `""` entries joined by commas up to bombBytes, then suffix.
func listBomb(prefix, entry, suffix string) []byte {
	var b bytes.Buffer
	b.Grow(bombBytes)
	b.WriteString(prefix)
	b.WriteString(entry)
	for b.Len()+1+len(entry)+len(suffix) <= bombBytes {
		b.WriteByte(',')
		b.WriteString(entry)
	}
	b.WriteString(suffix)
	return b.Bytes()
}

// hostileAnswer is the complete HTTP response of the kinds that answer at once (nil for the
// others). The bombs are built once and shared.
func hostileAnswer(kind HostileKind, pod, quota string) ([]byte, error) {
	if kind == HostileStateBomb || kind == HostileProblemBomb || kind == HostileErrorsBomb {
		bombs.once.Do(func() {
			bombs.state = listBomb(`{"epoch":0,"generation":0,"configured":true,"downstreams":[`, "{}", "]}")
			bombs.problem = listBomb(`{"title":"Conflict","status":409,"code":"stale-assignment","state":{"epoch":0,"generation":0,"configured":true,"downstreams":[`, "{}", "]}}")
			bombs.errs = listBomb(`{"title":"Bad Request","status":400,"code":"invalid-assignment","errors":[`, `""`, "]}")
		})
	}
	st := hugeState(pod, quota)
	problem := func(status int, code, reason string) ([]byte, error) {
		return json.Marshal(assignment.Problem{Title: "refused", Status: status, Code: code, Reason: reason, State: &st})
	}
	var (
		status int
		ctype  = "application/problem+json"
		body   []byte
		err    error
	)
	switch kind {
	case HostileEpochState:
		status, ctype = 200, "application/json"
		body, err = json.Marshal(st)
	case HostileEpochStale:
		status = 409
		body, err = problem(409, assignment.CodeStaleAssignment, "")
	case HostileEpochWrongInstance:
		status = 403
		body, err = problem(403, assignment.CodeForbidden, assignment.ReasonWrongInstance)
	case HostileStateBomb:
		status, ctype, body = 200, "application/json", bombs.state
	case HostileProblemBomb:
		status, body = 409, bombs.problem
	case HostileErrorsBomb:
		status, body = 400, bombs.errs
	case HostileOversized, HostileHang, HostileDrip, HostileGarbage:
		return nil, nil
	default:
		return nil, fmt.Errorf("unknown hostile kind %q", kind)
	}
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	fmt.Fprintf(&b, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n", status, http.StatusText(status), ctype, len(body))
	b.Write(body)
	return b.Bytes(), nil
}
