package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/assignment"
	"github.com/apportion/apportion/internal/testing/wait"
)

var binDir string

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// buildAgent compiles the agent binary into a temporary directory, once per test binary.
var buildAgent = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "apportion-agent-test")
	if err != nil {
		return "", err
	}
	binDir = dir
	bin := filepath.Join(dir, "agent")
	// Built as the agent's image builds it (hack/images: static, CGO_ENABLED=0, -trimpath), which
	// in `make test` also shares the compiled dependencies with the images' test.
	cmd := exec.Command("go", "build", "-trimpath", "-o", bin, ".")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", errors.New(string(out))
	}
	return bin, nil
})

// agentProc is a running agent binary.
type agentProc struct {
	cmd                *exec.Cmd
	dataURL, ctlURL    string
	mu                 sync.Mutex
	logs               []map[string]any
	stderrDone, exited chan struct{}
	exitErr            error
}

func startAgent(t testing.TB, args ...string) *agentProc {
	t.Helper()
	return startAgentEnv(t, nil, args...)
}

// startAgentEnv starts the agent binary with extra environment variables.
func startAgentEnv(t testing.TB, env []string, args ...string) *agentProc {
	t.Helper()
	bin, err := buildAgent()
	if err != nil {
		t.Fatalf("building the agent: %v", err)
	}
	cmd := exec.Command(bin, append([]string{"--listen", "127.0.0.1:0", "--control-listen", "127.0.0.1:0"}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &agentProc{cmd: cmd, stderrDone: make(chan struct{}), exited: make(chan struct{})}
	started := make(chan map[string]any, 1)
	go func() {
		defer close(p.stderrDone)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			var line map[string]any
			if json.Unmarshal(sc.Bytes(), &line) != nil {
				t.Logf("agent (not JSON): %s", sc.Text())
				continue
			}
			p.mu.Lock()
			p.logs = append(p.logs, line)
			p.mu.Unlock()
			if line["msg"] == "agent started" {
				started <- line
			}
		}
	}()
	go func() {
		<-p.stderrDone
		p.exitErr = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		select {
		case <-p.exited:
		default:
			_ = cmd.Process.Kill()
			<-p.exited
		}
	})
	select {
	case line := <-started:
		p.dataURL = "http://" + line["listen"].(string)
		p.ctlURL = "http://" + line["controlListen"].(string)
	case <-p.exited:
		t.Fatalf("agent exited at start: %v; logs %v", p.exitErr, p.logs)
	case <-time.After(10 * time.Second):
		t.Fatal("agent did not start within 10s")
	}
	return p
}

func (p *agentProc) wait(t testing.TB, within time.Duration) int {
	t.Helper()
	select {
	case <-p.exited:
	case <-time.After(within):
		t.Fatalf("agent still running after %v", within)
	}
	var ee *exec.ExitError
	if errors.As(p.exitErr, &ee) {
		return ee.ExitCode()
	}
	if p.exitErr != nil {
		t.Fatal(p.exitErr)
	}
	return 0
}

func (p *agentProc) logged(msg string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.logs {
		if l["msg"] == msg {
			return true
		}
	}
	return false
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestAgentBinary runs the real binary: push a signed assignment, proxy a call, SIGTERM while a
// call is in flight (readyz goes 503, the call finishes), exit 0.
func TestAgentBinary(t *testing.T) {
	release := make(chan struct{})
	var releaseOnce sync.Once
	releaseAll := func() { releaseOnce.Do(func() { close(release) }) }
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			<-release
		}
		io.WriteString(w, "upstream:"+r.URL.Path)
	}))
	defer up.Close()
	// Deferred after the upstream's Close so it runs first: a failure before the release must end
	// the test with its message, not hang in Close waiting for the held handler.
	defer releaseAll()

	trustDir := t.TempDir()
	key := assignment.SigningKey{ID: "k1", Private: ed25519.NewKeyFromSeed(bytes.Repeat([]byte("s"), 32))}
	pub, _ := assignment.MarshalPublicKey(key.Public().Key)
	if err := os.WriteFile(filepath.Join(trustDir, key.ID+".pem"), pub, 0o600); err != nil {
		t.Fatal(err)
	}
	// The drain and request bounds are far above any step's duration on a busy machine: this test
	// shows that a call in flight finishes during the drain, not what happens when a bound passes.
	p := startAgent(t, "--trust-dir", trustDir, "--pod-namespace", "shop", "--pod-name", "gateway-0", "--drain-timeout", "2m")
	to := assignment.Endpoint{URL: p.ctlURL, Pod: "shop/gateway-0"}

	if code, _ := get(t, p.ctlURL+"/readyz"); code != 503 {
		t.Fatalf("readyz before the first assignment = %d", code)
	}
	c := &assignment.Client{HTTP: &http.Client{Timeout: 5 * time.Second}, Key: key}
	first, err := c.State(context.Background(), to, 1) // first contact: learn the process instance
	if err != nil {
		t.Fatalf("State: %v", err)
	}
	a := &assignment.Assignment{Instance: first.Instance, Epoch: 1, Generation: 1, LeaseTTL: assignment.Duration(time.Minute),
		Downstreams: []assignment.Downstream{{
			Name: "svc", Upstream: up.URL, Permits: 4, SafeDefaultPermits: 1,
			AcquireTimeout: assignment.Duration(100 * time.Millisecond), RequestTimeout: assignment.Duration(2 * time.Minute),
			Fallback: assignment.Fallback{Action: assignment.ActionReject},
		}}}
	st, err := c.Push(context.Background(), to, a)
	if err != nil {
		t.Fatalf("Push: %v", err)
	}
	if st.Generation != 1 || st.Downstreams[0].EffectivePermits != 4 {
		t.Fatalf("ack = %+v", st)
	}
	// Unsigned is refused.
	req, _ := http.NewRequest(http.MethodGet, p.ctlURL+assignment.PathState, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 401 {
		t.Fatalf("unsigned state: %d", resp.StatusCode)
	}
	if code, _ := get(t, p.ctlURL+"/readyz"); code != 200 {
		t.Fatalf("readyz after push = %d", code)
	}
	if code, body := get(t, p.dataURL+"/svc/hello"); code != 200 || body != "upstream:/hello" {
		t.Fatalf("proxied call = %d %q", code, body)
	}
	if code, body := get(t, p.ctlURL+"/metrics"); code != 200 || !strings.Contains(body, `apportion_agent_requests_total{downstream="svc"} 1`) ||
		!strings.Contains(body, `apportion_agent_rejected_pushes_total{reason="missing-credentials"} 1`) {
		t.Fatalf("metrics = %d:\n%s", code, body)
	}
	// Signed for another pod: refused.
	other := *a
	other.Generation = 2
	if _, err := c.Push(context.Background(), assignment.Endpoint{URL: p.ctlURL, Pod: "shop/gateway-1"}, &other); err == nil ||
		!strings.Contains(err.Error(), "wrong-pod") {
		t.Fatalf("push signed for another pod = %v", err)
	}

	// A call in flight, then SIGTERM.
	slow := make(chan string, 1)
	go func() {
		resp, err := http.Get(p.dataURL + "/svc/slow")
		if err != nil {
			slow <- err.Error()
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		slow <- string(b)
	}()
	wait.For(t, "the slow call in flight", func() bool {
		st, err := c.State(context.Background(), to, 1)
		return err == nil && st.Downstreams[0].InFlight == 1
	})
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	wait.For(t, "the shutdown log", func() bool { return p.logged("shutting down: draining calls in flight") })
	if code, _ := get(t, p.ctlURL+"/readyz"); code != 503 {
		t.Fatalf("readyz while draining = %d", code)
	}
	releaseAll()
	if got := wait.Recv(t, "the slow call's answer", slow); got != "upstream:/slow" {
		t.Fatalf("in-flight call during drain = %q", got)
	}
	if code := p.wait(t, 10*time.Second); code != 0 {
		t.Fatalf("exit code %d", code)
	}
	if !p.logged("agent stopped") {
		t.Fatal("no 'agent stopped' log")
	}
}

func TestAgentBootstrapInsecure(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	defer up.Close()
	file := filepath.Join(t.TempDir(), "bootstrap.json")
	boot := `{"downstreams":[{"name":"svc","upstream":"` + up.URL + `","permits":10,"safeDefaultPermits":2,
		"acquireTimeout":"10ms","requestTimeout":"1s","fallback":{"action":"Reject"}}]}`
	if err := os.WriteFile(file, []byte(boot), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startAgent(t, "--insecure-no-auth", "--bootstrap", file)
	if !p.logged("INSECURE: the control API accepts unauthenticated requests (--insecure-no-auth); anyone who reaches 127.0.0.1:0 can change this agent's limits. Use it for local experiments only.") {
		t.Error("no loud warning for --insecure-no-auth")
	}
	if code, _ := get(t, p.ctlURL+"/readyz"); code != 200 {
		t.Fatalf("readyz with --bootstrap = %d", code)
	}
	code, body := get(t, p.ctlURL+assignment.PathState)
	var st assignment.State
	if code != 200 || json.Unmarshal([]byte(body), &st) != nil || st.Generation != 0 || !st.LeaseExpired || st.Downstreams[0].EffectivePermits != 2 {
		t.Fatalf("state = %d %s", code, body)
	}
	if code, _ := get(t, p.dataURL+"/svc/"); code != 200 {
		t.Fatalf("proxied = %d", code)
	}
	_ = p.cmd.Process.Signal(syscall.SIGINT)
	if code := p.wait(t, 10*time.Second); code != 0 {
		t.Fatalf("exit code %d", code)
	}
}

func TestFlagValidation(t *testing.T) {
	t.Setenv("POD_NAMESPACE", "")
	t.Setenv("POD_NAME", "")
	keyDir := t.TempDir()
	pub, _ := assignment.MarshalPublicKey(ed25519.NewKeyFromSeed(bytes.Repeat([]byte("x"), 32)).Public().(ed25519.PublicKey))
	if err := os.WriteFile(filepath.Join(keyDir, "k.pem"), pub, 0o600); err != nil {
		t.Fatal(err)
	}
	pod := []string{"--pod-namespace", "shop", "--pod-name", "gateway-0"}
	badBoot := filepath.Join(t.TempDir(), "b.json")
	_ = os.WriteFile(badBoot, []byte(`{"downstreams":[{"name":"x","permits":-1}]}`), 0o600)
	tests := []struct {
		args []string
		want string
	}{
		{nil, "--trust-dir is required"},
		{[]string{"--trust-dir", keyDir, "--insecure-no-auth"}, "exclusive"},
		{[]string{"--trust-dir", keyDir}, "--pod-namespace and --pod-name"},
		{append([]string{"--trust-dir", t.TempDir()}, pod...), "holds no key file"},
		{[]string{"--trust-dir", keyDir, "--pod-namespace", "shop", "--pod-name", "a,b"}, "not a Kubernetes name"},
		{[]string{"--insecure-no-auth", "--listen", "nope"}, "--listen \"nope\": must be host:port"},
		{[]string{"--insecure-no-auth", "--drain-timeout", "-1s"}, "--drain-timeout"},
		{[]string{"--insecure-no-auth", "--stale-cache-bytes", "lots"}, "--stale-cache-bytes"},
		{[]string{"--insecure-no-auth", "--log-level", "loud"}, "--log-level"},
		{[]string{"--insecure-no-auth", "--bootstrap", badBoot}, "downstreams[0].permits"},
		{[]string{"--insecure-no-auth", "--listen", ":15000", "--control-listen", ":15000"}, "must differ"},
		{[]string{"--insecure-no-auth", "extra"}, "unexpected arguments"},
	}
	for _, tt := range tests {
		var stderr bytes.Buffer
		if code := run(tt.args, io.Discard, &stderr); code != 2 || !strings.Contains(stderr.String(), tt.want) {
			t.Errorf("run(%q) = %d, %q; want 2 and %q", tt.args, code, stderr.String(), tt.want)
		}
	}
	var stdout bytes.Buffer
	if code := run([]string{"--version"}, &stdout, io.Discard); code != 0 || !strings.HasPrefix(stdout.String(), "agent dev (revision ") {
		t.Errorf("run(--version) = %d, %q; want 0 and the version line, without --trust-dir", code, stdout.String())
	}
	if n, err := parseSize("16Mi"); err != nil || n != 16<<20 {
		t.Errorf("parseSize(16Mi) = %d, %v", n, err)
	}
	if n, err := parseSize("1000"); err != nil || n != 1000 {
		t.Errorf("parseSize(1000) = %d, %v", n, err)
	}
}

func TestEveryRunsUntilStopped(t *testing.T) {
	var n atomic.Int32
	ran := make(chan struct{}, 1)
	stop := every(time.Millisecond, func() {
		n.Add(1)
		select {
		case ran <- struct{}{}:
		default:
		}
	})
	for range 3 {
		<-ran
	}
	stop()
	time.Sleep(20 * time.Millisecond) // a tick already under way may still finish
	after := n.Load()
	time.Sleep(20 * time.Millisecond)
	if n.Load() < 3 || n.Load() != after {
		t.Fatalf("ran %d times, then %d more after stop", after, n.Load()-after)
	}
}
