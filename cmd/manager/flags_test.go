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

// The trust ConfigMap's name is not a flag: the injector mounts apportionv1.TrustConfigMap, and
// the manager's RBAC and the admission policy name it, so a manager told to keep another name
// would give every injected pod a volume that does not exist (internal/controller checks that the
// ConfigMap an injected pod mounts is the one the trust reconciler keeps).
func TestNoTrustConfigMapFlag(t *testing.T) {
	if _, _, err := parseFlags([]string{"--agent-image=a", "--trust-configmap=keys"}); err == nil || !strings.Contains(err.Error(), "trust-configmap") {
		t.Errorf("--trust-configmap=keys: %v; want it refused as an unknown flag", err)
	}
}

// --hub adds the hub role; without it the manager runs as before.
func TestHubFlag(t *testing.T) {
	o, _, err := parseFlags([]string{"--agent-image=a"})
	if err != nil || o.hub {
		t.Fatalf("default: hub %v, %v; want off", o.hub, err)
	}
	if o, _, err := parseFlags([]string{"--agent-image=a", "--hub"}); err != nil || !o.hub {
		t.Errorf("--hub: %v, %v", o.hub, err)
	}
}
