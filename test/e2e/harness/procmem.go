package harness

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// ProcMemory is a process's resident memory as /proc/<pid>/status says: VmRSS now and VmHWM,
// its peak since the process started, in bytes — what a container's memory limit is held to
// (the OOM killer counts resident pages).
type ProcMemory struct {
	RSS, HWM int64
}

// ReadProcMemory reads pid's VmRSS and VmHWM (Linux).
func ReadProcMemory(pid int) (ProcMemory, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return ProcMemory{}, err
	}
	defer f.Close()
	var m ProcMemory
	found := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), ":")
		if !ok || (name != "VmRSS" && name != "VmHWM") {
			continue
		}
		fields := strings.Fields(value) // "123456 kB"
		if len(fields) != 2 || fields[1] != "kB" {
			return ProcMemory{}, fmt.Errorf("/proc/%d/status: unexpected %s line %q", pid, name, value)
		}
		kb, err := strconv.ParseInt(fields[0], 10, 64)
		if err != nil {
			return ProcMemory{}, fmt.Errorf("/proc/%d/status: %s: %w", pid, name, err)
		}
		if name == "VmRSS" {
			m.RSS = kb << 10
		} else {
			m.HWM = kb << 10
		}
		found++
	}
	if err := sc.Err(); err != nil {
		return ProcMemory{}, err
	}
	if found != 2 {
		return ProcMemory{}, fmt.Errorf("/proc/%d/status has no VmRSS and VmHWM", pid)
	}
	return m, nil
}

// MemoryWatch samples one process's memory until stopped, so that its peak is known even after
// the process exited (its /proc entry goes with it).
type MemoryWatch struct {
	pid    int
	cancel context.CancelFunc
	done   chan struct{}

	mu      sync.Mutex
	peak    ProcMemory // highest VmHWM and VmRSS read
	samples int
	err     error
}

// WatchMemory samples pid's memory every period.
func WatchMemory(pid int, period time.Duration) *MemoryWatch {
	ctx, cancel := context.WithCancel(context.Background())
	w := &MemoryWatch{pid: pid, cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(w.done)
		t := time.NewTicker(period)
		defer t.Stop()
		for {
			w.sample()
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
	}()
	return w
}

func (w *MemoryWatch) sample() {
	m, err := ReadProcMemory(w.pid)
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		w.err = err
		return
	}
	w.samples++
	w.peak.HWM = max(w.peak.HWM, m.HWM)
	w.peak.RSS = max(w.peak.RSS, m.RSS)
}

// Stop samples once more and returns the peak, how many samples were read and the last error
// (a process that exited cannot be read).
func (w *MemoryWatch) Stop() (ProcMemory, int, error) {
	w.cancel()
	<-w.done
	w.sample()
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.peak, w.samples, w.err
}

// MiB formats a byte count in MiB.
func MiB(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
