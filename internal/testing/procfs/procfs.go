// Package procfs reads what the benchmarks measure of a process from Linux's /proc: its CPU time,
// its resident set, its children by name, and the load average printed beside each figure.
// Shared by test/scale and test/hubscale, which measure the manager and the API server the same way.
package procfs

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// userHZ is the kernel's USER_HZ, the unit of /proc/<pid>/stat's times: 100 on Linux.
const userHZ = 100

// CPU is a process's user + system CPU time so far.
func CPU(pid int) (time.Duration, error) {
	f, err := Stat(pid)
	if err != nil {
		return 0, err
	}
	// f[0] is field 3 (state); utime is field 14, stime field 15.
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	return time.Duration(ut+st) * time.Second / userHZ, nil
}

// Stat is /proc/<pid>/stat's fields from the state on (the command before them may hold spaces,
// so they start after the last ')').
func Stat(pid int) ([]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return nil, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return nil, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return nil, fmt.Errorf("unexpected /proc/%d/stat", pid)
	}
	return f, nil
}

// Mem is a process's resident set now and at its peak, in bytes.
func Mem(pid int) (rss, hwm int64, err error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	for l := range strings.SplitSeq(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		fs := strings.Fields(v)
		if !ok || len(fs) == 0 {
			continue
		}
		n, _ := strconv.ParseInt(fs[0], 10, 64)
		switch k {
		case "VmRSS":
			rss = n * 1024
		case "VmHWM":
			hwm = n * 1024
		}
	}
	return rss, hwm, nil
}

// Children are this process's child processes with one of the given command names (envtest's
// kube-apiserver and etcd), by name.
func Children(names ...string) map[string]int {
	out := map[string]int{}
	self := strconv.Itoa(os.Getpid())
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		pid, err := strconv.Atoi(filepath.Base(d))
		if err != nil {
			continue
		}
		comm, err := os.ReadFile(filepath.Join(d, "comm"))
		if err != nil {
			continue
		}
		name := strings.TrimSpace(string(comm))
		for _, n := range names {
			if name != n {
				continue
			}
			if f, err := Stat(pid); err == nil && f[1] == self {
				out[n] = pid
			}
		}
	}
	return out
}

// LoadAvg is /proc/loadavg's 1-minute figure ("?" when it cannot be read).
func LoadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	if f := strings.Fields(string(b)); len(f) > 0 {
		return f[0]
	}
	return "?"
}
