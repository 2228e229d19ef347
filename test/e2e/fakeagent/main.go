// Command fakeagent is a stand-in for the agent that the harness's own tests use as a control: it
// enforces a fixed number of permits per downstream (--permits), proxies
// /<downstream>/<path> to --upstream, and answers the signed GET /v1/state, /healthz and /readyz
// like the agent. It takes no assignment. With permits summing above the downstream's limit it
// must make the invariant monitor and the downstream report violations: that proves the checks
// can fail.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/apportion/apportion/internal/assignment"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:15001", "data address")
	ctl := flag.String("control-listen", "127.0.0.1:15000", "control address")
	trustDir := flag.String("trust-dir", "", "directory of trusted public keys (<id>.pem)")
	podNS := flag.String("pod-namespace", "", "pod namespace")
	podName := flag.String("pod-name", "", "pod name")
	name := flag.String("downstream", "logistics", "downstream name")
	upstream := flag.String("upstream", "", "upstream URL")
	permits := flag.Int("permits", 1, "fixed permits")
	acquire := flag.Duration("acquire-timeout", 200*time.Millisecond, "permit wait")
	flag.Parse()
	if err := run(*listen, *ctl, *trustDir, *podNS+"/"+*podName, *name, *upstream, int32(*permits), *acquire); err != nil {
		fmt.Fprintln(os.Stderr, "fakeagent:", err)
		os.Exit(1)
	}
}

func run(listen, ctl, trustDir, pod, name, upstream string, permits int32, acquire time.Duration) error {
	keys, err := assignment.LoadTrustDir(trustDir)
	if err != nil {
		return err
	}
	up, err := url.Parse(upstream)
	if err != nil {
		return err
	}
	sem := make(chan struct{}, permits)
	var inFlight, requests atomic.Int64
	proxy := httputil.NewSingleHostReverseProxy(up)
	data := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rest, ok := strings.CutPrefix(r.URL.Path, "/"+name)
		if !ok {
			http.NotFound(w, r)
			return
		}
		requests.Add(1)
		t := time.NewTimer(acquire)
		defer t.Stop()
		select {
		case sem <- struct{}{}:
		case <-t.C:
			http.Error(w, "no permit", http.StatusServiceUnavailable)
			return
		}
		inFlight.Add(1)
		defer func() { inFlight.Add(-1); <-sem }()
		r.URL.Path = rest
		proxy.ServeHTTP(w, r)
	})
	state := func() assignment.State {
		return assignment.State{Epoch: 1, Generation: 1, Configured: true, LeaseExpiresAt: time.Now().Add(time.Hour),
			Downstreams: []assignment.DownstreamState{{Name: name, Permits: permits, EffectivePermits: permits,
				InFlight: int32(inFlight.Load()), Requests: requests.Load()}}}
	}
	control := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/healthz", "/readyz":
			_, _ = io.WriteString(w, "ok")
		case assignment.PathState:
			if _, err := assignment.Verify(r, nil, keys, assignment.Self{Pod: pod}, true, time.Now()); err != nil {
				http.Error(w, err.Error(), http.StatusForbidden)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(state())
		default:
			http.NotFound(w, r)
		}
	})
	ln1, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	ln2, err := net.Listen("tcp", ctl)
	if err != nil {
		return err
	}
	s1, s2 := &http.Server{Handler: data}, &http.Server{Handler: control}
	go func() { _ = s1.Serve(ln1) }()
	go func() { _ = s2.Serve(ln2) }()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = s1.Shutdown(sctx)
	return s2.Shutdown(sctx)
}
