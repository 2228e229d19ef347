package assignment

import (
	"bytes"
	"strings"
	"testing"
)

func TestDecodeUpstreamTLS(t *testing.T) {
	good := map[string]any{"serverName": "payments.partner.example", "caFile": "/var/run/apportion/upstream-tls/payments/ca.crt",
		"certFile": "/var/run/apportion/upstream-tls/payments/tls.crt", "keyFile": "/var/run/apportion/upstream-tls/payments/tls.key",
		"minVersion": "1.3"}
	body := mutate(t, func(m map[string]any) { ds(m, 0)["tls"] = good })
	a, err := Decode(bytes.NewReader(body), DefaultMaxBytes)
	if err != nil {
		t.Fatal(err)
	}
	want := UpstreamTLS{ServerName: "payments.partner.example", CAFile: "/var/run/apportion/upstream-tls/payments/ca.crt",
		CertFile: "/var/run/apportion/upstream-tls/payments/tls.crt", KeyFile: "/var/run/apportion/upstream-tls/payments/tls.key", MinVersion: "1.3"}
	if got := a.Downstreams[0].TLS; got == nil || *got != want {
		t.Fatalf("tls %+v", got)
	}
	for _, tc := range []struct {
		name string
		i    int // the downstream: 0 is https, 1 http
		tls  map[string]any
		want []string
	}{
		{"on an http upstream", 1, map[string]any{"serverName": "geo"}, []string{"downstreams[1].tls: applies to an https upstream only"}},
		{"bad server name", 0, map[string]any{"serverName": "Payments_1"}, []string{"downstreams[0].tls.serverName: must be a lower-case DNS name"}},
		{"long server name", 0, map[string]any{"serverName": strings.Repeat("a.", 127) + "a"}, []string{"downstreams[0].tls.serverName"}},
		{"relative and unclean paths", 0, map[string]any{"caFile": "ca.crt", "certFile": "/a/../b", "keyFile": "/" + strings.Repeat("k", MaxTLSPathLength)}, []string{
			"downstreams[0].tls.caFile: must be a clean absolute path", "downstreams[0].tls.certFile: must be a clean absolute path",
			"downstreams[0].tls.keyFile: must be a clean absolute path",
		}},
		{"cert without key", 0, map[string]any{"certFile": "/c"}, []string{"downstreams[0].tls.keyFile: certFile and keyFile go together"}},
		{"version", 0, map[string]any{"minVersion": "1.1"}, []string{`downstreams[0].tls.minVersion: must be "1.2" or "1.3"`}},
		{"skip with a CA", 0, map[string]any{"insecureSkipVerify": true, "caFile": "/ca"}, []string{"downstreams[0].tls.caFile: has no use with insecureSkipVerify"}},
		{"unknown field", 0, map[string]any{"ca": "/ca"}, []string{"downstreams[0].tls.ca: unknown field"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := mutate(t, func(m map[string]any) { ds(m, tc.i)["tls"] = tc.tls })
			_, err := Decode(bytes.NewReader(body), DefaultMaxBytes)
			if err == nil {
				t.Fatal("decoded")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}
