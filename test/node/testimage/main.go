// Command testimage is the one binary of the real-node lane's own image (test/node): the pod
// sandbox ("pause") the node's containerd runs every pod in, and the app container of the
// sample Deployment.
//
// With no arguments it waits for SIGTERM or SIGINT and exits 0, which is all a sandbox
// container does: no registry is reachable from the lane, so the node cannot pull
// registry.k8s.io/pause and uses this image, built by the test, instead.
//
// With the argument "app" it also waits for a signal, and with LOAD_URL set (or LOAD_URL_FROM
// naming the variable that holds it) it first serves
// /stats on :8080 and calls LOAD_URL from LOAD_CONCURRENCY goroutines (default 4) until
// stopped, counting answers by status: a stand-in for an app that calls its downstream
// through the injected agent.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	if len(os.Args) > 1 && os.Args[1] == "app" {
		u := os.Getenv("LOAD_URL")
		if from := os.Getenv("LOAD_URL_FROM"); u == "" && from != "" {
			u = os.Getenv(from) // e.g. the URL the injector hands the app
		}
		if u != "" {
			go load(u)
		}
	}
	<-stop
}

// stats counts answers by status code; calls counts attempts.
var (
	mu    sync.Mutex
	stats = map[string]int{}
)

func count(key string) {
	mu.Lock()
	stats[key]++
	mu.Unlock()
}

func load(url string) {
	n, err := strconv.Atoi(os.Getenv("LOAD_CONCURRENCY"))
	if err != nil || n <= 0 {
		n = 4
	}
	http.HandleFunc("/stats", func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		_ = json.NewEncoder(w).Encode(stats)
	})
	go func() {
		srv := &http.Server{Addr: ":8080", ReadHeaderTimeout: 5 * time.Second}
		fmt.Fprintln(os.Stderr, srv.ListenAndServe())
	}()
	client := &http.Client{Timeout: 10 * time.Second}
	for range n {
		go func() {
			for {
				resp, err := client.Get(url)
				if err != nil {
					count("error")
					time.Sleep(100 * time.Millisecond)
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				count(strconv.Itoa(resp.StatusCode))
				if resp.StatusCode != http.StatusOK {
					// A refusal (no permit) is immediate: do not spin the node's CPU on them.
					time.Sleep(20 * time.Millisecond)
				}
			}
		}()
	}
}
