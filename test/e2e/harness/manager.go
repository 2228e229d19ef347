package harness

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"
)

// ManagerOptions are the manager's settings. Flags the built manager does not accept are left
// out (and listed in Manager.Unsupported), so the harness runs the manager as it is.
type ManagerOptions struct {
	// Namespace restricts the manager to one namespace (--namespace), when it supports that.
	Namespace string
	// LeaseTTL, RenewEvery and PushTimeout set the push engine's timings; zero leaves the
	// manager's default.
	LeaseTTL, RenewEvery, PushTimeout time.Duration
	// NoWebhook runs it without the injection webhook: a second manager beside the first (the
	// webhook's address is the control plane's one, served by the first).
	NoWebhook bool
	// ExtraArgs are passed as they are.
	ExtraArgs []string
	// Env is added to the environment (KUBECONFIG is set by the harness).
	Env []string
}

// Manager is the real manager binary, run against the ControlPlane.
type Manager struct {
	*Proc
	Opts ManagerOptions
	// Unsupported lists the flags the options asked for that the binary does not accept.
	Unsupported []string
	probe       string
	starts      atomic.Int32
}

// NewManager prepares (does not start) the manager; its log goes to dir/manager.log.
func NewManager(bin *Binaries, cp *ControlPlane, dir string, o ManagerOptions) (*Manager, error) {
	port, err := freePort("127.0.0.1")
	if err != nil {
		return nil, err
	}
	m := &Manager{Opts: o, probe: net.JoinHostPort("127.0.0.1", strconv.Itoa(port))}
	args := []string{"--metrics-bind-address=0", "--health-probe-bind-address=" + m.probe}
	want := func(name, value string) {
		if bin.ManagerHas(name) {
			args = append(args, "--"+name+"="+value)
		} else {
			m.Unsupported = append(m.Unsupported, "--"+name)
		}
	}
	if o.Namespace != "" {
		want("namespace", o.Namespace)
	}
	if o.LeaseTTL > 0 {
		want("lease-ttl", o.LeaseTTL.String())
	}
	if o.RenewEvery > 0 {
		want("renew-every", o.RenewEvery.String())
	}
	if o.PushTimeout > 0 {
		want("push-timeout", o.PushTimeout.String())
	}
	switch {
	case cp.Webhook != nil && !o.NoWebhook && bin.ManagerHas("webhook-port"):
		// The manager serves the injection webhook where envtest told the API server to call it,
		// with envtest's certificate (the cert-manager mode: no rotation of its own).
		args = append(args,
			"--webhook-host="+cp.Webhook.LocalServingHost,
			"--webhook-port="+strconv.Itoa(cp.Webhook.LocalServingPort),
			"--webhook-cert-dir="+cp.Webhook.LocalServingCertDir,
			"--webhook-cert-rotation=false",
			"--agent-image="+AgentImage,
		)
	case bin.ManagerHas("webhook-port"):
		args = append(args, "--webhook-port=0")
	}
	args = append(args, o.ExtraArgs...)
	m.Proc = &Proc{
		Name:    "manager",
		Path:    bin.Manager,
		Args:    args,
		Env:     append([]string{"KUBECONFIG=" + cp.Kubeconfig}, o.Env...),
		LogPath: filepath.Join(dir, "manager.log"),
	}
	return m, nil
}

// Start starts the manager and waits until its readiness probe answers.
func (m *Manager) Start(ctx context.Context) error {
	if err := m.Proc.Start(); err != nil {
		return err
	}
	m.starts.Add(1)
	return m.WaitReady(ctx, 60*time.Second)
}

// Starts counts the manager's starts.
func (m *Manager) Starts() int { return int(m.starts.Load()) }

// WaitReady polls the manager's /readyz.
func (m *Manager) WaitReady(ctx context.Context, timeout time.Duration) error {
	c := &http.Client{Timeout: 500 * time.Millisecond}
	return poll(ctx, timeout, 50*time.Millisecond, func() error {
		resp, err := c.Get("http://" + m.probe + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if !m.Running() {
			return fatal(fmt.Errorf("manager exited before ready (%w); see %s", exitCause(m.ExitErr()), m.LogPath))
		}
		return fmt.Errorf("manager not ready after %s; see %s", timeout, m.LogPath)
	})
}

// Restart kills the manager (SIGKILL) and starts it again.
func (m *Manager) Restart(ctx context.Context) error {
	if err := m.Kill(); err != nil {
		return err
	}
	return m.Start(ctx)
}

// freePort asks the kernel for a free TCP port on ip.
func freePort(ip string) (int, error) {
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
