package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/testing/loadgen"
)

// cpuTime is the CPU time a process's threads have used, in nanoseconds: the sum of the first
// field of /proc/<pid>/task/*/schedstat (time on a CPU, as the scheduler counts it). The
// utime and stime of /proc/<pid>/stat count in 10 ms ticks, too coarse for the agent's few
// hundred milliseconds per run. A thread that exited is no longer counted: the Go runtime keeps
// its threads, and the benchmark reads the time only while the agent runs.
func cpuTime(pid int) (time.Duration, error) {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	if err != nil {
		return 0, err
	}
	if len(tasks) == 0 {
		return 0, fmt.Errorf("process %d has no threads listed in /proc", pid)
	}
	var sum time.Duration
	for _, f := range tasks {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // the thread exited between the listing and the read
		}
		ns, err := strconv.ParseInt(strings.Fields(string(b))[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("parsing %s: %q", f, b)
		}
		sum += time.Duration(ns)
	}
	return sum, nil
}

// drive sends GETs to url at rps for dur, open loop, and returns the latencies.
func drive(b *testing.B, c *http.Client, url string, rps int, dur time.Duration) loadgen.Latencies {
	lat, err := loadgen.OpenLoop(c, url, rps, dur)
	if err != nil {
		b.Error(err)
	}
	return lat
}

func pct(l loadgen.Latencies, p float64) float64 { return loadgen.Micros(l.Pct(p)) }

// BenchmarkAgentCPU runs the agent binary as its own process, drives 2,000 calls/s through it
// for 3 s to a trivial upstream (both in this process, on 127.0.0.1) and reads the agent's CPU
// time before and after: vCPU per 1,000 calls/s (target <= 0.05). It also reports the agent's
// CPU when idle for as long, and the latency a separate-process agent adds over calling the
// upstream directly at the same rate. It runs the agent as shipped (one processor unless
// GOMAXPROCS is set) and with GOMAXPROCS=2 (Go's default under a container CPU limit).
func BenchmarkAgentCPU(b *testing.B) {
	const rps, dur = 2000, 3 * time.Second
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") }))
	defer up.Close()
	file := filepath.Join(b.TempDir(), "bootstrap.json")
	boot := `{"downstreams":[{"name":"up","upstream":"` + up.URL + `","permits":1024,"safeDefaultPermits":1024,
		"acquireTimeout":"1s","requestTimeout":"10s","fallback":{"action":"Reject"}}]}`
	if err := os.WriteFile(file, []byte(boot), 0o600); err != nil {
		b.Fatal(err)
	}
	for _, procs := range []string{"default", "2"} {
		b.Run("GOMAXPROCS="+procs, func(b *testing.B) {
			var env []string
			if procs != "default" {
				env = []string{"GOMAXPROCS=" + procs}
			}
			p := startAgentEnv(b, env, "--insecure-no-auth", "--bootstrap", file)
			defer p.cmd.Process.Kill()
			measureCPU(b, p, up.URL, rps, dur)
		})
	}
}

func measureCPU(b *testing.B, p *agentProc, upURL string, rps int, dur time.Duration) {
	pid := p.cmd.Process.Pid
	newClient := func() *http.Client {
		return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, MaxIdleConns: 512}}
	}
	direct, via := newClient(), newClient()
	for range b.N {
		c0, err := cpuTime(pid)
		if err != nil {
			b.Fatal(err)
		}
		time.Sleep(dur)
		c1, _ := cpuTime(pid)
		drive(b, direct, upURL+"/x", rps, 300*time.Millisecond) // warm-up
		drive(b, via, p.dataURL+"/up/x", rps, 300*time.Millisecond)
		// CPU: one contiguous run through the agent.
		c2, _ := cpuTime(pid)
		t := time.Now()
		drive(b, via, p.dataURL+"/up/x", rps, dur)
		elapsed := time.Since(t)
		c3, _ := cpuTime(pid)
		// Latency: direct and agent alternating in slices, so that both see the same
		// background load.
		var dl, al []time.Duration
		for range 10 {
			dl = append(dl, drive(b, direct, upURL+"/x", rps, dur/10)...)
			al = append(al, drive(b, via, p.dataURL+"/up/x", rps, dur/10)...)
		}

		vcpu := (c3 - c2).Seconds() / elapsed.Seconds()
		b.ReportMetric(vcpu/(float64(rps)/1000), "vCPU-per-1000rps")
		b.ReportMetric(float64(c3-c2)/float64(time.Millisecond), "agent-cpu-ms")
		b.ReportMetric((c1-c0).Seconds()/dur.Seconds(), "idle-vCPU")
		b.ReportMetric(pct(al, .5)-pct(dl, .5), "p50-added-µs")
		b.ReportMetric(pct(al, .99)-pct(dl, .99), "p99-added-µs")
		b.ReportMetric(pct(dl, .5), "direct-p50-µs")
		b.ReportMetric(pct(al, .5), "agent-p50-µs")
		b.ReportMetric(0, "ns/op")
	}
}
