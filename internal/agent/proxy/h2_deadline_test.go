package proxy

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/wait"
)

// An HTTP/2 caller holds its permit no longer than the call's deadline on its own side either
// (forwardH2 sets the stream's deadlines only if the call is still forwarding then): an app
// that stops reading a long answer has its stream reset answerWriteGrace after the deadline,
// and one that stops sending its body gets a 408 at the deadline; both permits come back.
func TestH2AppSideBoundedByDeadline(t *testing.T) {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	chunk := strings.Repeat("x", 32<<10)
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/read" {
			_, _ = io.Copy(io.Discard, r.Body)
			return
		}
		rc := http.NewResponseController(w)
		for range 1024 { // 32 MiB: more than the flow-control windows on the way hold
			if _, err := io.WriteString(w, chunk); err != nil {
				return
			}
			if rc.Flush() != nil {
				return
			}
		}
	}))
	up.Config.Protocols = &p
	up.Start()
	t.Cleanup(up.Close)
	a := newAgent(t, nil)
	d := downstream("slow", up.URL, 2)
	d.RequestTimeout = assignment.Duration(300 * time.Millisecond)
	zero := assignment.Duration(0)
	d.AbandonedHold = &zero
	a.apply(t, nil, d)
	sem := a.enf.Table().Lookup("slow").Sem
	c := h2cClient(t)
	c.Timeout = 0 // the agent's bounds end the calls, not the client's

	// Within: several times the bounds (300ms, and the grace after it), well short of anything
	// else that could end the stream.
	within := func(what string) {
		t.Helper()
		if !wait.Within(5*time.Second, func() bool { return sem.Stats().InFlight == 0 }) {
			t.Fatalf("the permit of a call whose %s is still held after 5s", what)
		}
	}

	// The app reads the answer's head, then nothing.
	start := time.Now()
	res, err := c.Get(a.srv.URL + "/slow/big")
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if res.ProtoMajor != 2 || res.StatusCode != http.StatusOK {
		t.Fatalf("the answer's head: %s %d", res.Proto, res.StatusCode)
	}
	within("app stopped reading")
	t.Logf("the permit of a call whose app stopped reading came back after %v (deadline 300ms, grace %v)", time.Since(start), answerWriteGrace)

	// The app sends part of its body, then nothing.
	pr, pw := io.Pipe()
	defer pw.Close()
	go func() { _, _ = pw.Write([]byte("part")) }()
	start = time.Now()
	res2, err := c.Post(a.srv.URL+"/slow/read", "text/plain", pr)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(res2.Body)
	res2.Body.Close()
	if res2.StatusCode != http.StatusRequestTimeout {
		t.Fatalf("a body that stopped coming: %d %q, want 408", res2.StatusCode, b)
	}
	within("app stopped sending")
	t.Logf("a body that stopped coming: 408 after %v", time.Since(start))
}
