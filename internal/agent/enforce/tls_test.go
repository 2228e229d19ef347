package enforce

import (
	"crypto/tls"
	"testing"
	"time"

	"github.com/apportion/apportion/internal/agent/upstreamtls"
	"github.com/apportion/apportion/internal/assignment"
)

// TestUpstreamTLSKeptAcrossPushes: an https downstream gets its upstreamtls.Upstream, the same
// one while its settings stay (its session cache and pooled connections survive a renewal or a
// change of permits), a new one when they change; the URL's host is the default server name; an
// http downstream has none.
func TestUpstreamTLSKeptAcrossPushes(t *testing.T) {
	e, _ := newTestEnforcer(t)
	partner := ds("partner", 4, 2)
	partner.Upstream = "https://api.partner.example:8443/v2"
	partner.TLS = &assignment.UpstreamTLS{CAFile: "/var/run/apportion/upstream-tls/partner/ca.crt", MinVersion: "1.3"}
	plain := ds("plain", 4, 2)
	mustApply(t, e, asg(1, 1, time.Minute, partner, plain))
	first := e.Table().Lookup("partner").Config().TLS
	if first == nil {
		t.Fatal("no TLS for an https downstream")
	}
	want := upstreamtls.Settings{ServerName: "api.partner.example", CAFile: "/var/run/apportion/upstream-tls/partner/ca.crt", MinVersion: tls.VersionTLS13}
	if got := first.Settings(); got != want {
		t.Fatalf("settings %+v, want %+v", got, want)
	}
	if first.Err() == nil {
		t.Fatal("a CA file that does not exist is not an error")
	}
	if e.Table().Lookup("plain").Config().TLS != nil {
		t.Fatal("TLS for an http downstream")
	}
	partner.Permits = 6
	mustApply(t, e, asg(1, 2, time.Minute, partner, plain))
	if e.Table().Lookup("partner").Config().TLS != first {
		t.Fatal("a push with the same TLS settings made a new Upstream")
	}
	partner.TLS.ServerName = "partner.example"
	mustApply(t, e, asg(1, 3, time.Minute, partner, plain))
	if got := e.Table().Lookup("partner").Config().TLS; got == first || got.Settings().ServerName != "partner.example" {
		t.Fatal("new TLS settings kept the old Upstream")
	}
	partner.TLS = nil
	mustApply(t, e, asg(1, 4, time.Minute, partner, plain))
	if got := e.Table().Lookup("partner").Config().TLS.Settings(); got != (upstreamtls.Settings{ServerName: "api.partner.example", MinVersion: tls.VersionTLS12}) {
		t.Fatalf("without a tls block: %+v", got)
	}
}
