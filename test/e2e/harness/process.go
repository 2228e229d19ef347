package harness

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"time"
)

// Proc is one child process started in its own process group, its output appended to a log
// file. Signals go to the whole group.
type Proc struct {
	Name    string
	Path    string
	Args    []string
	Env     []string
	LogPath string

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	exitErr error
	stopped bool // SIGSTOPped
}

// procs tracks every running Proc so that KillAll can end them on an abnormal exit.
var procs = struct {
	sync.Mutex
	m map[*Proc]struct{}
}{m: map[*Proc]struct{}{}}

// KillAll kills (SIGKILL) the process group of every Proc still running. The
// demo calls it from its signal handler; tests rely on Cleanup.
func KillAll() {
	procs.Lock()
	list := make([]*Proc, 0, len(procs.m))
	for p := range procs.m {
		list = append(list, p)
	}
	procs.Unlock()
	for _, p := range list {
		_ = p.Kill()
	}
}

// Start starts the process. It is an error to start a running Proc.
func (p *Proc) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		select {
		case <-p.done:
		default:
			return fmt.Errorf("%s: already running (pid %d)", p.Name, p.cmd.Process.Pid)
		}
	}
	logf, err := os.OpenFile(p.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	fmt.Fprintf(logf, "==== %s start %s %v\n", time.Now().Format(time.RFC3339Nano), p.Path, p.Args)
	cmd := exec.Command(p.Path, p.Args...)
	cmd.Env = append(os.Environ(), p.Env...)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Own process group (signals reach every child); killed if the harness dies.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("%s: %w", p.Name, err)
	}
	p.cmd, p.done, p.exitErr, p.stopped = cmd, make(chan struct{}), nil, false
	procs.Lock()
	procs.m[p] = struct{}{}
	procs.Unlock()
	done := p.done
	go func() {
		err := cmd.Wait()
		fmt.Fprintf(logf, "==== %s exit: %v\n", time.Now().Format(time.RFC3339Nano), err)
		logf.Close()
		p.mu.Lock()
		p.exitErr = err
		p.mu.Unlock()
		procs.Lock()
		delete(procs.m, p)
		procs.Unlock()
		close(done)
	}()
	return nil
}

// Pid is the process id, 0 before Start.
func (p *Proc) Pid() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.cmd.Process == nil {
		return 0
	}
	return p.cmd.Process.Pid
}

// Running reports whether the process was started and has not exited (a stopped process runs).
func (p *Proc) Running() bool {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	if done == nil {
		return false
	}
	select {
	case <-done:
		return false
	default:
		return true
	}
}

// Done is closed when the process exits; nil before Start.
func (p *Proc) Done() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done
}

// ExitErr is the process's exit error after Done.
func (p *Proc) ExitErr() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exitErr
}

// Suspended reports whether the process was SIGSTOPped and not continued.
func (p *Proc) Suspended() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stopped
}

func (p *Proc) signal(sig syscall.Signal) error {
	pid := p.Pid()
	if pid == 0 || !p.Running() {
		return errNotRunning
	}
	if err := syscall.Kill(-pid, sig); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("%s: signal %v: %w", p.Name, sig, err)
	}
	return nil
}

var errNotRunning = errors.New("not running")

// Suspend sends SIGSTOP: the process stays alive but answers nothing.
func (p *Proc) Suspend() error { return p.freeze(syscall.SIGSTOP, true) }

// Resume sends SIGCONT.
func (p *Proc) Resume() error { return p.freeze(syscall.SIGCONT, false) }

func (p *Proc) freeze(sig syscall.Signal, stopped bool) error {
	if err := p.signal(sig); err != nil {
		return err
	}
	p.mu.Lock()
	p.stopped = stopped
	p.mu.Unlock()
	return nil
}

// Kill sends SIGKILL to the group and waits for the exit; a stopped process dies without running
// again (no SIGCONT: a frozen agent must not get a chance to act). Killing a process that is not
// running is a no-op.
func (p *Proc) Kill() error {
	if !p.Running() {
		return nil
	}
	if err := p.signal(syscall.SIGKILL); err != nil && !errors.Is(err, errNotRunning) {
		return err
	}
	select {
	case <-p.Done():
		return nil
	case <-time.After(10 * time.Second):
		return fmt.Errorf("%s: pid %d did not die after SIGKILL", p.Name, p.Pid())
	}
}

// Stop sends SIGTERM and waits up to grace for the exit, then kills. A stopped (SIGSTOPped)
// process cannot handle SIGTERM: like a kubelet facing a frozen container, Stop waits out the
// grace and kills it, without letting it run again.
func (p *Proc) Stop(grace time.Duration) error {
	if !p.Running() {
		return nil
	}
	if err := p.signal(syscall.SIGTERM); err != nil && !errors.Is(err, errNotRunning) {
		return err
	}
	select {
	case <-p.Done():
		return nil
	case <-time.After(grace):
		return p.Kill()
	}
}
