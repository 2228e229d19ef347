package main

import (
	"container/heap"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

// MemQueue is an in-memory delay queue: a message is received once its due time has come,
// earliest first. It stands in for the broker in the example and its test.
type MemQueue struct {
	mu    sync.Mutex
	clk   clock.PassiveClock
	items dueHeap
	seq   int
	// OnRedeliver, if set, sees every re-delivery scheduled (the test records them).
	OnRedeliver func(m Message, at time.Time)
}

// NewMemQueue returns an empty queue reading clk.
func NewMemQueue(clk clock.PassiveClock) *MemQueue { return &MemQueue{clk: clk} }

// Publish adds a message due now, as its first delivery.
func (q *MemQueue) Publish(id string, body []byte) {
	q.push(Message{ID: id, Body: body, Attempt: 1}, q.clk.Now())
}

// Receive returns the earliest message that is due.
func (q *MemQueue) Receive() (Message, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.items) == 0 || q.items[0].due.After(q.clk.Now()) {
		return Message{}, false
	}
	return heap.Pop(&q.items).(due).m, true
}

// Ack does nothing more: Receive already took the message out.
func (q *MemQueue) Ack(Message) {}

// Redeliver schedules m again at at.
func (q *MemQueue) Redeliver(m Message, at time.Time) {
	m.Attempt++
	if q.OnRedeliver != nil {
		q.OnRedeliver(m, at)
	}
	q.push(m, at)
}

// Next is when the earliest message is due; ok false when the queue is empty.
func (q *MemQueue) Next() (time.Time, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.items) == 0 {
		return time.Time{}, false
	}
	return q.items[0].due, true
}

func (q *MemQueue) push(m Message, at time.Time) {
	q.mu.Lock()
	q.seq++
	heap.Push(&q.items, due{m: m, due: at, seq: q.seq})
	q.mu.Unlock()
}

type due struct {
	m   Message
	due time.Time
	seq int
}

type dueHeap []due

func (h dueHeap) Len() int { return len(h) }
func (h dueHeap) Less(i, j int) bool {
	if !h[i].due.Equal(h[j].due) {
		return h[i].due.Before(h[j].due)
	}
	return h[i].seq < h[j].seq
}
func (h dueHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *dueHeap) Push(x any)   { *h = append(*h, x.(due)) }
func (h *dueHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
