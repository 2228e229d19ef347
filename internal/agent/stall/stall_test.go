package stall

import (
	"testing"
	"time"
)

func TestDetector(t *testing.T) {
	t0 := time.Date(2026, 11, 30, 0, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	type step struct {
		tick    int  // ms; -1: no tick
		ask     int  // ms
		stalled bool // Stalled(ask) after the tick
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"ticking regularly", []step{{100, 150, false}, {200, 250, false}, {300, 399, false}}},
		{"threshold exactly is not a stall", []step{{500, 500, false}, {1000, 1000, false}}},
		{"resumed before the ticker ran", []step{{100, 150, false}, {-1, 5000, true}}},
		{"the tick that ends a stall holds for Hold", []step{
			{100, 100, false}, {3100, 3100, true}, {3500, 3600, true}, {3900, 4099, true}, {4000, 4100, false},
		}},
		{"a late question after regular ticks", []step{{100, 100, false}, {200, 701, true}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := New(500*time.Millisecond, time.Second, t0)
			for i, s := range tc.steps {
				if s.tick >= 0 {
					d.Tick(at(s.tick))
				}
				if got := d.Stalled(at(s.ask)); got != s.stalled {
					t.Fatalf("step %d: Stalled(+%dms) after tick +%dms = %v, want %v", i, s.ask, s.tick, got, s.stalled)
				}
			}
		})
	}
}
