package assignment

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/apportion/apportion/internal/h1"
	"github.com/apportion/apportion/internal/h1/h1test"
)

// This file measures what one agent answer costs the manager: a real loopback server sends
// the answer, the manager's client (Client over h1, set up as cmd/manager sets it up) reads
// it. TestHostileAnswers asserts the bound; BenchmarkHostileAnswer prints bytes per answer
// (docs/benchmarks.md, "Hostile answers").

// hostileBody is a body of about n bytes: prefix, elem repeated (sep between), suffix.
func hostileBody(n int, prefix, elem, sep, suffix string) []byte {
	var b bytes.Buffer
	b.Grow(n)
	b.WriteString(prefix)
	for i := 0; b.Len()+len(elem)+len(sep)+len(suffix) < n; i++ {
		if i > 0 {
			b.WriteString(sep)
		}
		b.WriteString(elem)
	}
	b.WriteString(suffix)
	return b.Bytes()
}

// rawAnswer is a whole HTTP/1.1 answer.
func rawAnswer(status int, ctype string, body []byte) []byte {
	head := fmt.Sprintf("HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n", status, ctype, len(body))
	return append([]byte(head), body...)
}

// distinctFields is a head's fields, about n bytes of distinct small ones.
func distinctFields(n int) []byte {
	var b bytes.Buffer
	for i := 0; b.Len() < n-16; i++ {
		fmt.Fprintf(&b, "a%x: b\r\n", i)
	}
	return b.Bytes()
}

// serveRaw serves answer to every request on loopback, on kept-alive connections, and
// returns its URL. The client's requests are GETs without a body.
func serveRaw(t testing.TB, answer []byte) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for {
					if _, err := h1test.ReadHead(br); err != nil {
						return
					}
					if _, err := c.Write(answer); err != nil {
						return // the client closed: it read what it wanted
					}
				}
			}()
		}
	}()
	return "http://" + ln.Addr().String()
}

// answerCase is one answer and what the client makes of it: the text of its error ("" when it
// reads a State).
type answerCase struct {
	name   string
	answer func() []byte
	want   string
}

const hostileSize = 8<<20 - 64 // under the client's former cap, 8 MiB

func answerCases(t testing.TB) []answerCase {
	js, pj := "application/json", "application/problem+json"
	normal, err := json.Marshal(realisticState())
	if err != nil {
		t.Fatal(err)
	}
	maximal, err := json.Marshal(extremeState())
	if err != nil {
		t.Fatal(err)
	}
	body := func(status int, ctype, prefix, elem, sep, suffix string) func() []byte {
		return func() []byte { return rawAnswer(status, ctype, hostileBody(hostileSize, prefix, elem, sep, suffix)) }
	}
	head := func(status string, fields []byte) []byte { return append([]byte(status+"\r\n"), fields...) }
	return []answerCase{
		{"normal-state", func() []byte { return rawAnswer(200, js, normal) }, ""},
		{"maximal-state", func() []byte { return rawAnswer(200, js, maximal) }, ""},
		{"8MiB-empty-downstreams", body(200, js, `{"downstreams":[`, `{}`, ",", `]}`), "more than 32 elements"},
		{"8MiB-rejected-keys", body(200, js, `{"downstreams":[{"rejected":{`, `"k":1`, ",", `}}]}`), "more than 8 members"},
		{"8MiB-capabilities", body(200, js, `{"capabilities":[`, `""`, ",", `]}`), "more than 16 elements"},
		{"8MiB-unknown-member", body(200, js, `{"future":[`, `0`, ",", `]}`), "exceeds the size limit"},
		{"8MiB-string", body(200, js, `{"instance":"`, `x`, "", `"}`), "a string longer than"},
		{"8MiB-malformed", body(200, js, `{"x":[`, `0 `, "", `]}`), "invalid character"},
		{"8MiB-trailing-data", body(200, js, `{}`, `{}`, "", ``), "after top-level value"},
		{"8MiB-deep-nesting", body(200, js, `{"x":`, `[`, "", ``), "nested deeper than"},
		{"8MiB-409-state-downstreams", body(409, pj, `{"status":409,"state":{"downstreams":[`, `{}`, ",", `]}}`), "agent answered 409"},
		{"8MiB-403-state-lanes", body(403, pj, `{"status":403,"reason":"wrong-instance","state":{"downstreams":[{"lanes":[`, `{}`, ",", `]}]}}`), "agent answered 403"},
		{"8MiB-400-errors", body(400, pj, `{"status":400,"errors":[`, `""`, ",", `]}`), "agent answered 400"},
		{"8MiB-500-detail", body(500, pj, `{"status":500,"detail":"`, `x`, "", `"}`), "exceeds the size limit"},
		{"8MiB-503-text", body(503, "text/plain", ``, `x`, "", ``), "agent answered 503"},
		{"1MiB-head", func() []byte {
			return append(head("HTTP/1.1 200 X", distinctFields(1<<20-64)), rawAnswer(200, js, []byte("{}"))[len("HTTP/1.1 200 X\r\n"):]...)
		}, "head is larger than 4 KiB"},
		{"8x1MiB-103-heads", func() []byte {
			h := append(head("HTTP/1.1 103 X", distinctFields(1<<20-64)), "\r\n"...)
			return append(bytes.Repeat(h, 8), rawAnswer(200, js, []byte("{}"))...)
		}, "head is larger than 4 KiB"},
	}
}

// managerClient is the client as cmd/manager sets it up.
func managerClient() *Client {
	hc := h1.NewClient()
	hc.SetMaxIdlePerHost(1)
	hc.SetMaxResponseHeaderBytes(MaxAnswerHeadBytes)
	return &Client{HTTP: h1.HTTPClient{C: hc}, Key: keyNew, Clock: clocktesting.NewFakePassiveClock(testNow)}
}

// readAnswer has c read the State at url and returns the error's text ("" for none).
func readAnswer(c *Client, url string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := c.State(ctx, Endpoint{URL: url, Pod: self.Pod}, 3)
	if err != nil {
		return err.Error()
	}
	return ""
}

// allocPerAnswer is what the process allocates per answer while c reads the State at url n
// times (runtime.MemStats.TotalAlloc: the client's allocations, and the loopback server's,
// which reads a request head per answer), after one answer to warm up.
func allocPerAnswer(c *Client, url string, n int) (uint64, string) {
	msg := readAnswer(c, url)
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for range n {
		msg = readAnswer(c, url)
	}
	runtime.ReadMemStats(&after)
	return (after.TotalAlloc - before.TotalAlloc) / uint64(n), msg
}

// Every hostile answer, each of 8 MiB (1 MiB heads, 8 MiB of 1xx heads), costs the manager
// less than maxHostileAlloc, and is refused with a clear error; a normal and the longest valid
// State are read. Before the bounds, an 8 MiB answer of empty downstreams cost 1.5 GiB.
func TestHostileAnswers(t *testing.T) {
	const maxHostileAlloc = 1 << 20
	c := managerClient()
	for _, tc := range answerCases(t) {
		url := serveRaw(t, tc.answer())
		per, msg := allocPerAnswer(c, url, 5)
		t.Logf("%-28s %9d B allocated per answer: %.100q", tc.name, per, msg)
		if tc.want == "" && msg != "" {
			t.Errorf("%s: refused: %s", tc.name, msg)
		}
		if tc.want != "" && !strings.Contains(msg, tc.want) {
			t.Errorf("%s: %q, want an error with %q", tc.name, msg, tc.want)
		}
		if per > maxHostileAlloc {
			t.Errorf("%s: %d bytes allocated per answer, more than %d", tc.name, per, maxHostileAlloc)
		}
	}
}

// BenchmarkHostileAnswer: bytes allocated (B/op) per answer the manager's client reads, for a
// normal State, the longest valid one and each hostile answer of TestHostileAnswers. Run with
// -benchtime=20x: the 8 MiB answers take a few milliseconds each.
func BenchmarkHostileAnswer(b *testing.B) {
	for _, tc := range answerCases(b) {
		b.Run(tc.name, func(b *testing.B) {
			c := managerClient()
			url := serveRaw(b, tc.answer())
			readAnswer(c, url)
			b.ReportAllocs()
			for b.Loop() {
				readAnswer(c, url)
			}
		})
	}
}
