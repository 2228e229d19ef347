// Command consumer is an example queue consumer that calls a downstream through the Apportion
// agent and re-delivers refused messages later, as docs/consumers.md describes: jittered
// exponential backoff that respects Retry-After, a maximum number of attempts into a
// dead-letter handler, a drop count, and never a synchronous retry loop.
//
// It reads one message a line from standard input into an in-memory delay queue (standing in
// for a broker), delivers them to -url, and exits when every message was delivered or
// dead-lettered:
//
//	go run ./examples/consumer -url http://127.0.0.1:15001/orders/events < messages.txt
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/utils/clock"
)

func main() {
	url := flag.String("url", "http://127.0.0.1:15001/orders/events", "the agent's `URL` for the downstream")
	attempts := flag.Int("max-attempts", 6, "deliveries before a message goes to the dead-letter handler")
	base := flag.Duration("backoff-base", 500*time.Millisecond, "first backoff ceiling")
	maxB := flag.Duration("backoff-max", time.Minute, "largest backoff ceiling")
	flag.Parse()
	if *attempts < 1 || *base <= 0 || *maxB < *base {
		fmt.Fprintln(os.Stderr, "-max-attempts must be at least 1 and 0 < -backoff-base <= -backoff-max")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	clk := clock.RealClock{}
	q := NewMemQueue(clk)
	sc := bufio.NewScanner(os.Stdin)
	for i := 0; sc.Scan(); i++ {
		q.Publish(strconv.Itoa(i), []byte(sc.Text()))
	}
	reg := prometheus.NewRegistry()
	c := &Consumer{
		Queue: q, Client: &http.Client{Timeout: 30 * time.Second}, URL: *url, MaxAttempts: *attempts,
		Backoff: Backoff{Base: *base, Max: *maxB, Rand: rand.Float64},
		DeadLetter: func(m Message, reason string) {
			log.Warn("dead-lettered", "id", m.ID, "attempts", m.Attempt, "reason", reason)
		},
		Clock: clk, Metrics: NewMetrics(reg),
	}
	for ctx.Err() == nil {
		c.Drain(ctx)
		next, ok := q.Next()
		if !ok {
			return // everything delivered or dead-lettered
		}
		// Wait for the next due message: the broker's job in a real consumer.
		select {
		case <-ctx.Done():
		case <-time.After(time.Until(next)):
		}
	}
}
