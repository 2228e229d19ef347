package semaphore

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	xsync "golang.org/x/sync/semaphore"
)

// sem is the common shape benchmarked; every variant pays the same
// interface-call overhead.
type sem interface {
	Acquire(ctx context.Context) error
	Release()
}

type xsyncSem struct{ w *xsync.Weighted }

func (s xsyncSem) Acquire(ctx context.Context) error { return s.w.Acquire(ctx, 1) }
func (s xsyncSem) Release()                          { s.w.Release(1) }

// chanSem is the classic buffered-channel semaphore: no FIFO guarantee, no
// resizing.
type chanSem chan struct{}

func (s chanSem) Acquire(ctx context.Context) error {
	select {
	case s <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
func (s chanSem) Release() { <-s }

// BenchmarkAcquireRelease measures one Acquire+Release pair.
//
//   - uncontended: one goroutine, limit 1, never waits.
//   - 8goroutines: 8 goroutines share a limit of 4, so about half of the
//     acquisitions queue and are woken by a Release.
func BenchmarkAcquireRelease(b *testing.B) {
	impls := []struct {
		name string
		new  func(limit int) sem
	}{
		{"apportion", func(n int) sem { return New(n) }},
		{"xsync", func(n int) sem { return xsyncSem{xsync.NewWeighted(int64(n))} }},
		{"chan", func(n int) sem { return make(chanSem, n) }},
	}
	for _, impl := range impls {
		b.Run(impl.name+"/uncontended", func(b *testing.B) {
			s := impl.new(1)
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				if err := s.Acquire(ctx); err != nil {
					b.Fatal(err)
				}
				s.Release()
			}
		})
		b.Run(impl.name+"/8goroutines", func(b *testing.B) {
			const goroutines, limit = 8, 4
			s := impl.new(limit)
			ctx := context.Background()
			var left atomic.Int64
			left.Store(int64(b.N))
			b.ReportAllocs()
			b.ResetTimer()
			var wg sync.WaitGroup
			for range goroutines {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for left.Add(-1) >= 0 {
						if err := s.Acquire(ctx); err != nil {
							b.Error(err)
							return
						}
						s.Release()
					}
				}()
			}
			wg.Wait()
		})
	}
}
