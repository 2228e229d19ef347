package main

import (
	"strings"
	"testing"

	"github.com/apportion/apportion/internal/controller"
)

// --status-writers bounds the status writes in flight: at least one, else no status is ever
// written.
func TestStatusWritersFlag(t *testing.T) {
	o, _, err := parseFlags([]string{"--agent-image=a"})
	if err != nil {
		t.Fatal(err)
	}
	if o.statusWriters != controller.DefaultStatusWriters {
		t.Errorf("--status-writers defaults to %d; want %d", o.statusWriters, controller.DefaultStatusWriters)
	}
	if o, _, err := parseFlags([]string{"--agent-image=a", "--status-writers=3"}); err != nil || o.statusWriters != 3 {
		t.Errorf("--status-writers=3: %d, %v", o.statusWriters, err)
	}
	for _, n := range []string{"0", "-1"} {
		if _, _, err := parseFlags([]string{"--agent-image=a", "--status-writers=" + n}); err == nil || !strings.Contains(err.Error(), "--status-writers") {
			t.Errorf("--status-writers=%s: %v; want an error naming --status-writers", n, err)
		}
	}
}
