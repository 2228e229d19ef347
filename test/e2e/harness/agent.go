package harness

import (
	"github.com/apportion/apportion/internal/assignment"

	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Agent ports on each agent's own loopback address (the sample Deployment's).
const (
	AgentControlPort = 15000
	AgentDataPort    = 15001
)

// Agent is one real agent process bound to its own loopback address: the "pod".
type Agent struct {
	*Proc
	// Namespace and Pod name the Pod object that represents it; control calls are signed for it.
	Namespace, Pod string
	// IP is its loopback address, the Pod's status.podIP.
	IP string
	// DataPort and ControlPort listen on IP.
	DataPort, ControlPort int
	TrustDir              string
	// restarts counts Start calls after the first.
	restarts int
	// draining is set when its pod is being shut down: the app stops calling.
	draining atomic.Bool
	// gated is set while no traffic may reach it: in the cluster mode, until its pod is a
	// ready endpoint (clusterpods.go); never in the simulated mode.
	gated atomic.Bool
	// firstCall is when the load generator first called it (UnixNano; 0: never), firstStatus
	// the status of the first answer it got.
	firstCall   atomic.Int64
	firstStatus atomic.Int32
	// appCalls counts the app's calls through the agent under way: registered before the app
	// checks Draining, so that drainAgent, which sets it first, can wait for every call that
	// passed the check (the app container stops before its native sidecar is sent SIGTERM).
	appCalls atomic.Int64
	// up is set once the current process answered /healthz (Start): until then its pod's
	// container is not ready and takes no traffic.
	up atomic.Bool
}

// FirstStatus is the HTTP status of the first answer the app got through the agent (0: none).
func (a *Agent) FirstStatus() int { return int(a.firstStatus.Load()) }

// Serving reports whether traffic may reach the agent (its pod is a ready endpoint in the
// cluster mode; always in the simulated one).
func (a *Agent) Serving() bool { return !a.gated.Load() }

// FirstCall is when the app first called through the agent (zero: never).
func (a *Agent) FirstCall() time.Time {
	if n := a.firstCall.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// noteCall records the app's first call through the agent.
func (a *Agent) noteCall() { a.firstCall.CompareAndSwap(0, time.Now().UnixNano()) }

// SetDraining marks the pod as shutting down: the load generator's "app" stops calling.
func (a *Agent) SetDraining() { a.draining.Store(true) }

// Draining reports SetDraining.
func (a *Agent) Draining() bool { return a.draining.Load() }

// beginAppCall registers an app call about to be sent; false (nothing registered) when the pod is
// shutting down and the app no longer calls. endAppCall ends a registered one.
func (a *Agent) beginAppCall() bool {
	a.appCalls.Add(1)
	if a.Draining() {
		a.appCalls.Add(-1)
		return false
	}
	return true
}

func (a *Agent) endAppCall() { a.appCalls.Add(-1) }

// waitAppCalls waits up to d for the app's calls under way to end.
func (a *Agent) waitAppCalls(d time.Duration) {
	for end := time.Now().Add(d); a.appCalls.Load() > 0 && time.Now().Before(end); {
		time.Sleep(5 * time.Millisecond)
	}
}

// ControlURL is the base URL of the control API.
func (a *Agent) ControlURL() string {
	return "http://" + net.JoinHostPort(a.IP, strconv.Itoa(a.ControlPort))
}

// DataURL is the URL the app calls to reach downstream ds.
func (a *Agent) DataURL(ds string) string {
	return "http://" + net.JoinHostPort(a.IP, strconv.Itoa(a.DataPort)) + "/" + ds
}

// Restarts is how many times the agent was started again.
func (a *Agent) Restarts() int { return a.restarts }

// Endpoint addresses the agent's control API for a signed call.
func (a *Agent) Endpoint() assignment.Endpoint {
	return assignment.Endpoint{URL: a.ControlURL(), Pod: a.Namespace + "/" + a.Pod}
}

// NewAgent prepares (does not start) an agent for pod namespace/pod at ip with the flags of a
// hand-written sidecar: the pod's identity (what the downward API's POD_NAMESPACE and POD_NAME
// give a real one) and the trust directory (the apportion-trust ConfigMap's volume); its log goes
// to dir/<pod>.log.
func NewAgent(bin *Binaries, namespace, pod, ip, trustDir, dir string, extra ...string) *Agent {
	spec := AgentSpec{DataPort: AgentDataPort, ControlPort: AgentControlPort, Args: []string{
		"--listen=" + net.JoinHostPort(ip, strconv.Itoa(AgentDataPort)),
		"--control-listen=" + net.JoinHostPort(ip, strconv.Itoa(AgentControlPort)),
		"--trust-dir=" + trustDir,
		"--pod-namespace=" + namespace,
		"--pod-name=" + pod,
	}}
	return newAgentFromSpec(bin, namespace, pod, ip, trustDir, dir, spec, extra...)
}

// newAgentFromSpec prepares the agent of an admitted pod namespace/pod (agentSpecFromPod): its
// args and environment, then the harness's own args (a shorter drain, to keep tests fast) and
// extra.
func newAgentFromSpec(bin *Binaries, namespace, pod, ip, trustDir, dir string, spec AgentSpec, extra ...string) *Agent {
	a := &Agent{Namespace: namespace, Pod: pod, IP: ip, DataPort: spec.DataPort, ControlPort: spec.ControlPort, TrustDir: trustDir}
	args := slices.Clone(spec.Args)
	if bin.AgentHas("drain-timeout") {
		args = append(args, "--drain-timeout=2s")
	}
	a.Proc = &Proc{
		Name:    "agent " + pod,
		Path:    bin.Agent,
		Args:    append(args, extra...),
		Env:     spec.Env,
		LogPath: filepath.Join(dir, pod+".log"),
	}
	return a
}

// Start starts the process and waits until its control port answers /healthz.
func (a *Agent) Start(ctx context.Context) error {
	if a.Pid() != 0 {
		a.restarts++
	}
	a.draining.Store(false)
	a.up.Store(false)
	if err := a.Proc.Start(); err != nil {
		return err
	}
	if err := a.waitPath(ctx, "/healthz", 20*time.Second); err != nil {
		return err
	}
	a.up.Store(true)
	return nil
}

// Up reports whether the agent's current process has answered /healthz since Start: a
// container restarting after a crash is not ready, and a Service sends it nothing until it is.
func (a *Agent) Up() bool { return a.up.Load() }

// WaitReady waits until /readyz answers 200 (an assignment was applied).
func (a *Agent) WaitReady(ctx context.Context, timeout time.Duration) error {
	return a.waitPath(ctx, "/readyz", timeout)
}

var probeClient = &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}

func (a *Agent) waitPath(ctx context.Context, path string, timeout time.Duration) error {
	return poll(ctx, timeout, 20*time.Millisecond, func() error {
		resp, err := probeClient.Get(a.ControlURL() + path)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("status %d", resp.StatusCode)
		}
		if !a.Running() {
			return fatal(fmt.Errorf("%s exited (%w); see %s", a.Name, exitCause(a.ExitErr()), a.LogPath))
		}
		return fmt.Errorf("%s: %s not 200 after %s (last: %w); see %s", a.Name, path, timeout, err, a.LogPath)
	})
}

// exitCause is a process's exit error, or one saying it exited with status 0.
func exitCause(err error) error {
	if err == nil {
		return errors.New("exit status 0")
	}
	return err
}

// IPPool hands out loopback addresses 127.B.x.y whose agent ports are free. B is picked at
// random per pool so that concurrent runs on one machine (a test and the demo) do not collide.
type IPPool struct {
	mu   sync.Mutex
	b    int
	next int
}

// NewIPPool returns a pool with a random second octet in 20..239.
func NewIPPool() *IPPool { return &IPPool{b: 20 + rand.IntN(220)} }

// Next returns an address not handed out before whose agent ports can be bound.
func (p *IPPool) Next() (string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for tries := 0; tries < 1000; tries++ {
		n := p.next
		p.next++
		ip := fmt.Sprintf("127.%d.%d.%d", p.b, n/250, n%250+1)
		if portsFree(ip, AgentControlPort, AgentDataPort) {
			return ip, nil
		}
	}
	return "", fmt.Errorf("no loopback address with free ports %d and %d", AgentControlPort, AgentDataPort)
}

func portsFree(ip string, ports ...int) bool {
	for _, port := range ports {
		l, err := net.Listen("tcp", net.JoinHostPort(ip, strconv.Itoa(port)))
		if err != nil {
			return false
		}
		l.Close()
	}
	return true
}

// StaticAgents is an AgentSource over a fixed list (whose processes may die).
type StaticAgents []*Agent

// Agents lists the running ones.
func (s StaticAgents) Agents() []*Agent {
	out := make([]*Agent, 0, len(s))
	for _, a := range s {
		if a.Running() {
			out = append(out, a)
		}
	}
	return out
}
