package hub

import (
	"fmt"
	"testing"
	"time"
)

// BenchmarkReconcile is the hub's pure work for one GlobalQuota's reconcile at a member count:
// the members' acknowledgements and publish times applied, Slices (DemandAware), Plan, and the
// allocation built, with a demand that moves a little every round. The hub's cost per quota is
// this plus its API reads and (on a change only) writes; docs/protocol.md §16.
func BenchmarkReconcile(b *testing.B) {
	for _, n := range []int{4, 64} {
		b.Run(fmt.Sprintf("members=%d", n), func(b *testing.B) {
			l, err := NewLedger(Options{LeaseDuration: 30 * time.Second, ClockMargin: 5 * time.Second})
			if err != nil {
				b.Fatal(err)
			}
			shares := make([]Share, n)
			targets := make([]Target, n)
			for i := range shares {
				shares[i] = Share{Cluster: fmt.Sprintf("cluster-%03d", i), Reserved: 1, Demand: int64(10 + i%7)}
				l.SetDrain(shares[i].Cluster, time.Minute)
			}
			global := int64(20 * n)
			now := time.Unix(1_800_000_000, 0)
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				now = now.Add(time.Second)
				for j := range shares {
					c := l.Current(shares[j].Cluster)
					l.Published(shares[j].Cluster, c.Seq, now)
					l.Acknowledged(shares[j].Cluster, c.Seq)
					shares[j].Current = c.Slice
				}
				shares[i%n].Demand = int64(5 + (i*7)%40)
				want, _, err := Slices(global, DemandAware, shares, 0, nil, now, time.Time{})
				if err != nil {
					b.Fatal(err)
				}
				for j := range targets {
					targets[j] = Target{Cluster: shares[j].Cluster, Reserved: 1, Want: want[j]}
				}
				if _, err := l.Plan(now, global, targets); err != nil {
					b.Fatal(err)
				}
				_ = l.Allocation()
			}
		})
	}
}
