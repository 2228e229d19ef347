package assignment

import "testing"

func TestLapsedLimit(t *testing.T) {
	for _, tc := range []struct {
		permits, safeDefault int32
		failClosed           bool
		want                 int32
	}{
		{permits: 10, safeDefault: 3, want: 3},
		{permits: 2, safeDefault: 3, want: 2}, // never above what was granted
		{permits: 0, safeDefault: 3, want: 0},
		{permits: 10, safeDefault: 0, want: 0},
		{permits: 10, safeDefault: 3, failClosed: true, want: 0},
		{permits: -1, safeDefault: 3, want: 0}, // never below 0
	} {
		if got := LapsedLimit(tc.permits, tc.safeDefault, tc.failClosed); got != tc.want {
			t.Errorf("LapsedLimit(%d, %d, %v) = %d, want %d", tc.permits, tc.safeDefault, tc.failClosed, got, tc.want)
		}
		d := Downstream{Permits: tc.permits, SafeDefaultPermits: tc.safeDefault, FailClosed: tc.failClosed}
		if got := d.LapsedLimit(); got != tc.want {
			t.Errorf("Downstream%+v.LapsedLimit() = %d, want %d", d, got, tc.want)
		}
	}
	if got := LapsedLimit(7, 4, false); got != 4 { // the agent's int form
		t.Errorf("LapsedLimit[int](7, 4, false) = %d, want 4", got)
	}
}
