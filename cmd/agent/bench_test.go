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

	"github.com/apportion/apportion/internal/agent/loadgen"
)

// clockTicks is USER_HZ, the unit of utime and stime in /proc/<pid>/stat: 100 on Linux.
const clockTicks = 100

// cpuTime is the user+system CPU time a process has used, from /proc/<pid>/stat.
func cpuTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces: split after it.
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	// fields[0] is field 3 (state); utime and stime are fields 14 and 15.
	utime, err1 := strconv.ParseInt(fields[11], 10, 64)
	stime, err2 := strconv.ParseInt(fields[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("parsing %s", s)
	}
	return time.Duration(utime+stime) * time.Second / clockTicks, nil
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
// time from /proc/<pid>/stat before and after: vCPU per 1,000 calls/s (target <= 0.05). It also
// reports the agent's CPU when idle for as long, and the latency a separate-process agent adds
// over calling the upstream directly at the same rate. It runs with the Go runtime's default
// GOMAXPROCS and with GOMAXPROCS=1 (what a sidecar with a CPU limit of one core or less gets).
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
	for _, procs := range []string{"default", "1"} {
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
		b.ReportMetric(float64((c3 - c2).Milliseconds()), "agent-cpu-ms")
		b.ReportMetric((c1-c0).Seconds()/dur.Seconds(), "idle-vCPU")
		b.ReportMetric(pct(al, .5)-pct(dl, .5), "p50-added-µs")
		b.ReportMetric(pct(al, .99)-pct(dl, .99), "p99-added-µs")
		b.ReportMetric(pct(dl, .5), "direct-p50-µs")
		b.ReportMetric(pct(al, .5), "agent-p50-µs")
		b.ReportMetric(0, "ns/op")
	}
}
