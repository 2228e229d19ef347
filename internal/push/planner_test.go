package push

import (
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestPlan(t *testing.T) {
	type E = planEntry
	tests := []struct {
		name       string
		limit      int32
		recovering bool
		entries    []E
		want       []int32
	}{
		{
			name:  "scale-out 8→10 at factor 0.8: old pods lowered, new ones granted from the headroom",
			limit: 100,
			entries: []E{
				{Name: "p0", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p1", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p2", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p3", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p4", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p5", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p6", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p7", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p8", Target: 8, CanRaise: true},
				{Name: "p9", Target: 8, CanRaise: true},
			},
			// Σ held = 80 until the lowerings are acknowledged: room 20 covers both new pods.
			want: []int32{8, 8, 8, 8, 8, 8, 8, 8, 8, 8},
		},
		{
			name:  "scale-out with no headroom: new pods wait for acknowledged lowerings",
			limit: 80,
			entries: []E{
				{Name: "p0", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p1", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p2", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p3", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p4", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p5", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p6", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p7", Grant: 10, Target: 8, Held: 10, CanRaise: true},
				{Name: "p8", Target: 8, CanRaise: true},
				{Name: "p9", Target: 8, CanRaise: true},
			},
			want: []int32{8, 8, 8, 8, 8, 8, 8, 8, 0, 0},
		},
		{
			name:  "partly acknowledged lowerings: the freed room goes to the new pods, partially",
			limit: 80,
			entries: []E{
				{Name: "p0", Grant: 8, Target: 8, Held: 8, CanRaise: true},
				{Name: "p1", Grant: 8, Target: 8, Held: 8, CanRaise: true},
				{Name: "p2", Grant: 8, Target: 8, Held: 8, CanRaise: true},
				{Name: "p3", Grant: 8, Target: 8, Held: 10, CanRaise: true},
				{Name: "p4", Grant: 8, Target: 8, Held: 10, CanRaise: true},
				{Name: "p5", Grant: 8, Target: 8, Held: 10, CanRaise: true},
				{Name: "p6", Grant: 8, Target: 8, Held: 10, CanRaise: true},
				{Name: "p7", Grant: 8, Target: 8, Held: 10, CanRaise: true},
				{Name: "p8", Target: 8, CanRaise: true},
				{Name: "p9", Target: 8, CanRaise: true},
			},
			// Σ = 24 + 50 = 74: room 6, all to p8.
			want: []int32{8, 8, 8, 8, 8, 8, 8, 8, 6, 0},
		},
		{
			name:  "an unacknowledged raise is counted: no room for anyone else",
			limit: 20,
			entries: []E{
				{Name: "a", Grant: 5, Target: 5, Held: 15, CanRaise: true}, // a push of 15 may have landed
				{Name: "b", Grant: 2, Target: 5, Held: 2, CanRaise: true},
			},
			want: []int32{5, 5},
		},
		{
			name:  "calls in flight above a lowered limit stay counted",
			limit: 20,
			entries: []E{
				{Name: "a", Grant: 4, Target: 4, Held: 14, CanRaise: true},
				{Name: "b", Grant: 4, Target: 10, Held: 4, CanRaise: true},
			},
			want: []int32{4, 6},
		},
		{
			name:  "unreachable pods are only lowered",
			limit: 100,
			entries: []E{
				{Name: "a", Grant: 10, Target: 3, Held: 10, CanRaise: false},
				{Name: "b", Grant: 0, Target: 0, Held: 0, CanRaise: false},
			},
			want: []int32{3, 0},
		},
		{
			name:       "recovery: no raise above what is counted, lowerings go through",
			limit:      100,
			recovering: true,
			entries: []E{
				{Name: "a", Grant: 0, Target: 8, Held: 5, CanRaise: true}, // holds 5 from the previous manager
				{Name: "b", Grant: 0, Target: 8, Held: 0, CanRaise: true}, // new pod
				{Name: "c", Grant: 0, Target: 8, Held: 12, CanRaise: true},
			},
			want: []int32{5, 0, 8},
		},
		{
			name:  "limit lowered below what is counted: lower everyone, raise nobody",
			limit: 10,
			entries: []E{
				{Name: "a", Grant: 10, Target: 5, Held: 10, CanRaise: true},
				{Name: "b", Grant: 2, Target: 5, Held: 2, CanRaise: true},
			},
			want: []int32{5, 2},
		},
		{
			name:  "new pods are raised before topping up others",
			limit: 10,
			entries: []E{
				{Name: "a", Grant: 4, Target: 8, Held: 4, CanRaise: true},
				{Name: "z", Grant: 0, Target: 8, Held: 0, CanRaise: true},
			},
			want: []int32{4, 6},
		},
		{
			name:  "a restarted agent's old calls (carry) add to whatever it is granted",
			limit: 20,
			entries: []E{
				{Name: "a", Grant: 4, Target: 10, Held: 6, Carry: 6, CanRaise: true}, // counted 12
				{Name: "b", Grant: 4, Target: 4, Held: 4, CanRaise: true},
			},
			// Raising a to its Held (6) is free; the last 4 permits of room take it to 10.
			want: []int32{10, 4},
		},
		{
			name:       "recovery: a phantom (what a pod may hold unseen) is no headroom",
			limit:      100,
			recovering: true,
			entries: []E{
				{Name: "a", Grant: 0, Target: 8, Held: 2, Phantom: 11, CanRaise: true}, // old lease lapsed: enforces 2
				{Name: "b", Grant: 0, Target: 8, Phantom: 3, CanRaise: true},           // answered before a late push could land
			},
			want: []int32{2, 0},
		},
		{
			name:  "after recovery, raising within a phantom costs nothing (one semaphore)",
			limit: 14,
			entries: []E{
				{Name: "a", Grant: 0, Target: 8, Phantom: 3, CanRaise: true},
				{Name: "b", Grant: 11, Target: 11, Held: 11, CanRaise: true},
			},
			want: []int32{3, 11},
		},
		{
			name:  "raising within what is already counted costs nothing",
			limit: 10,
			entries: []E{
				{Name: "a", Grant: 2, Target: 8, Held: 6, CanRaise: true},
				{Name: "b", Grant: 4, Target: 4, Held: 4, CanRaise: true},
			},
			want: []int32{6, 4},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := plan(tt.limit, tt.recovering, tt.entries)
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("grants (-want +got):\n%s", diff)
			}
			var before, after int64
			for i, e := range tt.entries {
				ae := e
				ae.Grant = got[i]
				before += int64(e.counted())
				after += int64(ae.counted())
				if ae.counted() > e.counted() && (!e.CanRaise || tt.recovering) {
					t.Errorf("%s: counted grew from %d to %d but it may not be raised", e.Name, e.counted(), ae.counted())
				}
				if tt.recovering && got[i] > max(e.Grant, e.Held) {
					t.Errorf("%s: raised to %d during recovery, above what it surely holds (%d)", e.Name, got[i], max(e.Grant, e.Held))
				}
				if got[i] > max(e.Target, e.Grant) {
					t.Errorf("%s: granted %d above target %d", e.Name, got[i], e.Target)
				}
			}
			if before <= int64(tt.limit) && after > int64(tt.limit) {
				t.Errorf("Σ counted %d > limit %d after planning", after, tt.limit)
			}
			if before > int64(tt.limit) && after > before {
				t.Errorf("Σ counted grew from %d to %d above the limit %d", before, after, tt.limit)
			}
		})
	}
}
