package proxy

import (
	"io"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/h1/h1test"
)

// TestSmugglingCorpus sends each vector of h1test.Smuggling (see SmuggleVector) through the
// agent.
func TestSmugglingCorpus(t *testing.T) {
	up := newByteLog(t)
	a := newAgent(t, nil)
	a.apply(t, nil, downstream("up", up.URL, 4))
	host := strings.TrimPrefix(up.URL, "http://")
	follow := func(path string) string {
		return "GET " + path + " HTTP/1.1\r\nHost: {H}\r\nX-Forwarded-For: 127.0.0.1\r\n\r\n"
	}
	for _, v := range h1test.Smuggling {
		t.Run(v.Name, func(t *testing.T) {
			up.reset()
			c, br := rawConn(t, a)
			go io.WriteString(c, v.Raw)
			first := readAnswer(t, br)
			if first.status != v.Status || first.close != v.Closes {
				t.Fatalf("first answer %d close=%v %q, want %d close=%v", first.status, first.close, first.body, v.Status, v.Closes)
			}
			want := v.Up
			if v.Name == "pipelined" {
				if second := readAnswer(t, br); second.status != 200 || second.body != "/y" {
					t.Fatalf("pipelined second answer %d %q", second.status, second.body)
				}
			}
			if !first.close {
				io.WriteString(c, "GET /up/same HTTP/1.1\r\nHost: a\r\n\r\n")
				if r := readAnswer(t, br); r.status != 200 || r.body != "/same" {
					t.Fatalf("next request on the same connection = %d %q, want its own answer", r.status, r.body)
				}
				want += follow("/same")
			} else if n, err := br.Read(make([]byte, 1)); n != 0 || err == nil {
				t.Fatalf("the connection stayed open after an answer that said close")
			}
			if r := exchange(t, a, "GET /up/other HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer victim\r\n\r\n"); r.status != 200 || r.body != "/other" {
				t.Fatalf("next request on another connection = %d %q, want its own answer", r.status, r.body)
			}
			want += strings.Replace(follow("/other"), "\r\nX-Forwarded-For", "\r\nAuthorization: Bearer victim\r\nX-Forwarded-For", 1)
			// The upstream reads on its own goroutines: wait for its log to be complete.
			received := func() string { return strings.ReplaceAll(up.all(), host, "{H}") }
			deadline := time.Now().Add(5 * time.Second)
			for received() != want && time.Now().Before(deadline) {
				time.Sleep(5 * time.Millisecond)
			}
			if got := received(); got != want {
				t.Fatalf("the upstream received:\n%q\nwant:\n%q", got, want)
			}
		})
	}
}
