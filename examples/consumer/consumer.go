package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/utils/clock"
)

// Message is one queue message. Attempt counts deliveries, from 1.
type Message struct {
	ID      string
	Body    []byte
	Attempt int
}

// Queue is what the consumer needs from a broker: receive a due message, acknowledge it, and
// schedule its re-delivery for later (SQS's ChangeMessageVisibility, RabbitMQ's delayed
// exchange, a Kafka retry topic with a due time, JetStream's NakWithDelay...).
type Queue interface {
	// Receive returns a message that is due now, or ok false when none is.
	Receive() (m Message, ok bool)
	// Ack removes m for good.
	Ack(m Message)
	// Redeliver acknowledges this delivery of m and delivers it again, with Attempt+1, at at.
	Redeliver(m Message, at time.Time)
}

// DeadLetter takes a message the consumer gives up on, with why.
type DeadLetter func(m Message, reason string)

// Backoff is jittered exponential backoff ("full jitter": a delay drawn uniformly from
// [0, min(Max, Base·2^(attempt-1))]) that never invites a retry before the server's
// Retry-After: the delay is at least Retry-After. Jitter spreads the retries of many consumers
// refused at the same moment, so they do not come back together and be refused together again.
type Backoff struct {
	Base, Max time.Duration
	// Rand returns a number in [0, 1); it draws the jitter.
	Rand func() float64
}

// Delay is the wait before delivery attempt+1, after attempt failed with retryAfter (0: none).
func (b Backoff) Delay(attempt int, retryAfter time.Duration) time.Duration {
	ceiling := b.Max
	if attempt-1 < 62 {
		if d := b.Base * time.Duration(math.Pow(2, float64(attempt-1))); d > 0 && d < b.Max {
			ceiling = d
		}
	}
	return max(time.Duration(b.Rand()*float64(ceiling)), retryAfter)
}

// Consumer delivers each message to a downstream through the Apportion agent. A message the
// downstream took (2xx) is acknowledged. One that was refused — by the agent (its
// X-Apportion-Reason names why: no-permit, rate-limited, circuit-open, queue-full, degraded...)
// or by the downstream (429, 502, 503, 504) — is scheduled for re-delivery after Backoff, and
// after MaxAttempts deliveries goes to the dead-letter handler and counts as dropped. Any other
// answer (a 4xx: the message itself is wrong) goes to the dead-letter handler at once: retrying
// cannot fix it. The consumer never waits or retries in a loop itself: a refused message goes
// back to the queue, and the consumer moves on to the next one.
type Consumer struct {
	Queue       Queue
	Client      *http.Client
	URL         string // the agent's URL for the downstream: http://127.0.0.1:15001/<downstream>/<path>
	MaxAttempts int
	Backoff     Backoff
	DeadLetter  DeadLetter
	Clock       clock.PassiveClock
	Metrics     *Metrics
}

// Metrics are the consumer's counters.
type Metrics struct {
	Delivered   prometheus.Counter
	Redelivered *prometheus.CounterVec // by reason
	Dropped     *prometheus.CounterVec // by reason: max-attempts or rejected
}

// NewMetrics registers the consumer's metrics in reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Delivered: prometheus.NewCounter(prometheus.CounterOpts{Name: "consumer_messages_delivered_total",
			Help: "Messages the downstream took."}),
		Redelivered: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "consumer_messages_redelivered_total",
			Help: "Deliveries refused and scheduled again, by the refusal's reason."}, []string{"reason"}),
		Dropped: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "consumer_messages_dropped_total",
			Help: "Messages given to the dead-letter handler, by reason."}, []string{"reason"}),
	}
	reg.MustRegister(m.Delivered, m.Redelivered, m.Dropped)
	return m
}

// Drain handles every message due now. Call it when the queue signals a message, or on a timer.
func (c *Consumer) Drain(ctx context.Context) {
	for ctx.Err() == nil {
		m, ok := c.Queue.Receive()
		if !ok {
			return
		}
		c.Handle(ctx, m)
	}
}

// Handle delivers one message and settles it: acknowledged, scheduled again or dead-lettered.
func (c *Consumer) Handle(ctx context.Context, m Message) {
	out := c.deliver(ctx, m)
	switch {
	case out.ok:
		c.Metrics.Delivered.Inc()
		c.Queue.Ack(m)
	case !out.retryable:
		c.drop(m, "rejected", out.reason)
	case m.Attempt >= c.MaxAttempts:
		c.drop(m, "max-attempts", out.reason)
	default:
		c.Metrics.Redelivered.WithLabelValues(out.reason).Inc()
		c.Queue.Redeliver(m, c.Clock.Now().Add(c.Backoff.Delay(m.Attempt, out.retryAfter)))
	}
}

func (c *Consumer) drop(m Message, metric, reason string) {
	c.Metrics.Dropped.WithLabelValues(metric).Inc()
	c.Queue.Ack(m)
	c.DeadLetter(m, metric+": "+reason)
}

// outcome is what one delivery came to.
type outcome struct {
	ok, retryable bool
	reason        string
	retryAfter    time.Duration
}

func (c *Consumer) deliver(ctx context.Context, m Message) outcome {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.URL, bytes.NewReader(m.Body))
	if err != nil {
		return outcome{reason: err.Error()}
	}
	req.Header.Set("Idempotency-Key", m.ID) // a re-delivery is the same message
	res, err := c.Client.Do(req)
	if err != nil {
		// The agent did not answer (it restarts, say): try again later, like a refusal.
		return outcome{retryable: true, reason: "unreachable"}
	}
	defer res.Body.Close()
	_, _ = io.Copy(io.Discard, res.Body)
	ra := retryAfter(res.Header.Get("Retry-After"), c.Clock.Now())
	switch {
	case res.StatusCode/100 == 2:
		return outcome{ok: true}
	case res.Header.Get("X-Apportion-Reason") != "":
		// The agent answered for the downstream: a refusal (or a fallback that is no success).
		return outcome{retryable: true, reason: res.Header.Get("X-Apportion-Reason"), retryAfter: ra}
	case res.StatusCode == http.StatusTooManyRequests, res.StatusCode == http.StatusBadGateway,
		res.StatusCode == http.StatusServiceUnavailable, res.StatusCode == http.StatusGatewayTimeout:
		return outcome{retryable: true, reason: strconv.Itoa(res.StatusCode), retryAfter: ra}
	}
	return outcome{reason: fmt.Sprintf("status %d", res.StatusCode)}
}

// retryAfter reads a Retry-After field (RFC 9110 §10.2.3): seconds, or an HTTP date; 0 when
// absent or unreadable.
func retryAfter(v string, now time.Time) time.Duration {
	if v == "" {
		return 0
	}
	if s, err := strconv.ParseInt(v, 10, 64); err == nil && s >= 0 {
		return time.Duration(s) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return t.Sub(now)
	}
	return 0
}
