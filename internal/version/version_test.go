package version

import (
	"strings"
	"testing"
)

func TestStringNamesProgramAndVersion(t *testing.T) {
	old := Version
	t.Cleanup(func() { Version = old })
	Version = "v9.8.7"
	got := String("agent")
	if !strings.HasPrefix(got, "agent v9.8.7 (revision ") {
		t.Errorf("String(agent) = %q, want the program, the stamped version and the revision", got)
	}
}
