package lanes

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/apportion/apportion/internal/agent/semaphore"
)

// BenchmarkAcquireRelease compares one Acquire+Release pair of the lane semaphore with package
// semaphore's, in the same harness and run (go test -bench . ./internal/agent/lanes/):
//
//   - uncontended: one goroutine, never waits (semaphore limit 1; lanes limit 4 with a 50 %
//     reserved core lane, calls on the default lane);
//   - 8goroutines: 8 goroutines share 4 permits, about half of the acquisitions queue (lanes:
//     goroutines alternate core and default).
func BenchmarkAcquireRelease(b *testing.B) {
	type impl struct {
		acquire func(ctx context.Context, g int) error
		release func(g int)
	}
	impls := []struct {
		name string
		new  func(limit int) impl
	}{
		{"semaphore", func(n int) impl {
			s := semaphore.New(n)
			return impl{func(ctx context.Context, _ int) error { return s.Acquire(ctx) }, func(int) { s.Release() }}
		}},
		{"lanes", func(n int) impl {
			s := New(n, []Spec{{ReservePercent: 50, LendPercent: 50}, {}})
			return impl{func(ctx context.Context, g int) error { return s.Acquire(ctx, g%2) }, func(g int) { s.Release(g % 2) }}
		}},
	}
	for _, im := range impls {
		b.Run(im.name+"/uncontended", func(b *testing.B) {
			s := im.new(4)
			ctx := context.Background()
			b.ReportAllocs()
			for b.Loop() {
				if err := s.acquire(ctx, 1); err != nil {
					b.Fatal(err)
				}
				s.release(1)
			}
		})
		b.Run(im.name+"/8goroutines", func(b *testing.B) {
			const goroutines, limit = 8, 4
			s := im.new(limit)
			ctx := context.Background()
			var left atomic.Int64
			left.Store(int64(b.N))
			b.ReportAllocs()
			b.ResetTimer()
			var wg sync.WaitGroup
			for g := range goroutines {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for left.Add(-1) >= 0 {
						if err := s.acquire(ctx, g); err != nil {
							b.Error(err)
							return
						}
						s.release(g)
					}
				}()
			}
			wg.Wait()
		})
	}
}
