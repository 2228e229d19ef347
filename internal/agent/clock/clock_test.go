package clock

import (
	"testing"
	"time"
)

func TestFake(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	c := NewFake(t0)
	var got []string
	var at []time.Time
	c.AfterFunc(2*time.Second, func() { got = append(got, "b"); at = append(at, c.Now()) })
	c.AfterFunc(time.Second, func() {
		got = append(got, "a")
		at = append(at, c.Now())
		// Scheduled from a callback, due within the same Advance: runs too, in order.
		c.AfterFunc(500*time.Millisecond, func() { got = append(got, "a2"); at = append(at, c.Now()) })
	})
	stopped := c.AfterFunc(time.Second, func() { got = append(got, "never") })
	if !stopped.Stop() || stopped.Stop() {
		t.Fatal("Stop must report true once")
	}
	c.Advance(999 * time.Millisecond)
	if len(got) != 0 {
		t.Fatalf("ran early: %v", got)
	}
	c.Advance(5 * time.Second)
	want := []string{"a", "a2", "b"}
	if len(got) != 3 || got[0] != want[0] || got[1] != want[1] || got[2] != want[2] {
		t.Fatalf("ran %v, want %v", got, want)
	}
	for i, d := range []time.Duration{time.Second, 1500 * time.Millisecond, 2 * time.Second} {
		if !at[i].Equal(t0.Add(d)) {
			t.Errorf("%s ran at %v, want t0+%v", got[i], at[i].Sub(t0), d)
		}
	}
	if !c.Now().Equal(t0.Add(5999*time.Millisecond)) || c.Pending() != 0 {
		t.Fatalf("now %v pending %d", c.Now().Sub(t0), c.Pending())
	}
	c.Set(t0) // never backwards
	if !c.Now().Equal(t0.Add(5999 * time.Millisecond)) {
		t.Fatal("Set moved the clock backwards")
	}
}
