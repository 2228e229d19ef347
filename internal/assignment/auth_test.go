package assignment

import (
	"bytes"
	"crypto/ed25519"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// deterministicKey makes a key from a fixed seed, so that test vectors are stable.
func deterministicKey(id string, seed byte) SigningKey {
	return SigningKey{ID: id, Private: ed25519.NewKeyFromSeed(bytes.Repeat([]byte{seed}, ed25519.SeedSize))}
}

var (
	testNow  = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	keyOld   = deterministicKey("k1", 1)
	keyNew   = deterministicKey("k2", 2)
	keyOther = deterministicKey("k2", 3) // same id, a key the agent does not trust
	self     = Self{Pod: "shop/gateway-0", Instance: "0123456789abcdef"}
	toSelf   = Target{Pod: self.Pod, Instance: self.Instance, Epoch: 7}
)

func newReq(t *testing.T, method, path string) *http.Request {
	t.Helper()
	return httptest.NewRequest(method, "http://agent:15000"+path, nil)
}

func mustTrust(t *testing.T, keys ...SigningKey) TrustSet {
	t.Helper()
	var pubs []PublicKey
	for _, k := range keys {
		pubs = append(pubs, k.Public())
	}
	ts, err := NewTrustSet(pubs...)
	if err != nil {
		t.Fatal(err)
	}
	return ts
}

// TestVerify: every hostile variant is refused with its reason; valid ones pass.
func TestVerify(t *testing.T) {
	trust := mustTrust(t, keyOld, keyNew)
	body := []byte(`{"epoch":7}`)
	restarted := Self{Pod: self.Pod, Instance: "fedcba9876543210"}
	tests := []struct {
		name     string
		method   string
		setup    func(r *http.Request)
		body     []byte
		self     Self
		now      time.Time
		optional bool   // instanceOptional
		want     string // "" or the Reason
	}{
		{name: "current key", setup: func(r *http.Request) { Sign(r, body, keyNew, toSelf, testNow) }, body: body},
		{name: "previous key still published", setup: func(r *http.Request) { Sign(r, body, keyOld, toSelf, testNow) }, body: body},
		{name: "skew within 2m", setup: func(r *http.Request) { Sign(r, body, keyNew, toSelf, testNow.Add(-119*time.Second)) }, body: body},
		{name: "missing", setup: func(r *http.Request) {}, body: body, want: ReasonMissing},
		{name: "other scheme", setup: func(r *http.Request) { r.Header.Set("Authorization", "Bearer abc") }, body: body, want: ReasonMissing},
		{name: "old HMAC scheme", setup: func(r *http.Request) {
			r.Header.Set("Authorization", "Apportion-HMAC-SHA256 keyid=k2,ts=1,sig=00")
		}, body: body, want: ReasonMissing},
		{name: "signed by an untrusted key under a trusted id", setup: func(r *http.Request) { Sign(r, body, keyOther, toSelf, testNow) }, body: body, want: ReasonBadSignature},
		{name: "signed by an untrusted key id", setup: func(r *http.Request) { Sign(r, body, deterministicKey("k9", 9), toSelf, testNow) }, body: body, want: ReasonUnknownKey},
		{name: "withdrawn key", setup: func(r *http.Request) { Sign(r, body, keyOld, toSelf, testNow) }, body: body, want: ReasonUnknownKey,
			self: self /* trust below has only keyNew */},
		{name: "body changed after signing", setup: func(r *http.Request) { Sign(r, body, keyNew, toSelf, testNow) }, body: []byte(`{"epoch":8}`), want: ReasonBadSignature},
		{name: "method changed", setup: func(r *http.Request) { Sign(r, body, keyNew, toSelf, testNow); r.Method = http.MethodPost }, body: body, want: ReasonBadSignature},
		{name: "path changed", setup: func(r *http.Request) { Sign(r, body, keyNew, toSelf, testNow); r.URL.Path = "/v1/state" }, body: body, want: ReasonBadSignature},
		{name: "signed epoch changed", setup: func(r *http.Request) {
			Sign(r, body, keyNew, toSelf, testNow)
			r.Header.Set("Authorization", strings.Replace(r.Header.Get("Authorization"), "epoch=7", "epoch=8", 1))
		}, body: body, want: ReasonBadSignature},
		{name: "signed pod changed", setup: func(r *http.Request) {
			Sign(r, body, keyNew, Target{Pod: "shop/gateway-1", Instance: self.Instance, Epoch: 7}, testNow)
			r.Header.Set("Authorization", strings.Replace(r.Header.Get("Authorization"), "gateway-1", "gateway-0", 1))
		}, body: body, want: ReasonBadSignature},
		{name: "timestamp too old", setup: func(r *http.Request) { Sign(r, body, keyNew, toSelf, testNow.Add(-121*time.Second)) }, body: body, want: ReasonStaleTimestamp},
		{name: "timestamp in the future", setup: func(r *http.Request) { Sign(r, body, keyNew, toSelf, testNow.Add(3*time.Minute)) }, body: body, want: ReasonStaleTimestamp},
		{name: "replayed to another pod", setup: func(r *http.Request) { Sign(r, body, keyNew, toSelf, testNow) }, body: body,
			self: Self{Pod: "shop/gateway-1", Instance: self.Instance}, want: ReasonWrongPod},
		{name: "replayed to another namespace's pod of the same name", setup: func(r *http.Request) { Sign(r, body, keyNew, toSelf, testNow) }, body: body,
			self: Self{Pod: "other/gateway-0", Instance: self.Instance}, want: ReasonWrongPod},
		{name: "replayed to the restarted process", setup: func(r *http.Request) { Sign(r, body, keyNew, toSelf, testNow) }, body: body,
			self: restarted, want: ReasonWrongInstance},
		{name: "push without instance", setup: func(r *http.Request) {
			Sign(r, body, keyNew, Target{Pod: self.Pod, Epoch: 7}, testNow)
		}, body: body, want: ReasonWrongInstance},
		{name: "GET without instance (first contact)", method: http.MethodGet, optional: true, setup: func(r *http.Request) {
			Sign(r, nil, keyNew, Target{Pod: self.Pod, Epoch: 7}, testNow)
		}},
		{name: "GET for another instance", method: http.MethodGet, optional: true, setup: func(r *http.Request) {
			Sign(r, nil, keyNew, toSelf, testNow)
		}, self: restarted, want: ReasonWrongInstance},
		{name: "malformed", setup: func(r *http.Request) { r.Header.Set("Authorization", AuthScheme+" keyid=k2") }, body: body, want: ReasonMalformed},
		{name: "parameter twice", setup: func(r *http.Request) {
			Sign(r, body, keyNew, toSelf, testNow)
			r.Header.Set("Authorization", r.Header.Get("Authorization")+",pod=x")
		}, body: body, want: ReasonMalformed},
		{name: "unknown parameter", setup: func(r *http.Request) {
			Sign(r, body, keyNew, toSelf, testNow)
			r.Header.Set("Authorization", r.Header.Get("Authorization")+",alg=none")
		}, body: body, want: ReasonMalformed},
		{name: "malformed sig", setup: func(r *http.Request) {
			r.Header.Set("Authorization", fmt.Sprintf("%s keyid=k2,ts=%d,pod=%s,instance=%s,epoch=7,sig=zz", AuthScheme, testNow.UnixMilli(), self.Pod, self.Instance))
		}, body: body, want: ReasonMalformed},
		{name: "huge negative ts", setup: func(r *http.Request) {
			r.Header.Set("Authorization", AuthScheme+" keyid=k2,ts=-9223372036854775808,pod=a/b,instance=,epoch=1,sig=00")
		}, body: body, want: ReasonMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			method := tt.method
			if method == "" {
				method = http.MethodPut
			}
			path := PathAssignment
			if method == http.MethodGet {
				path = PathState
			}
			r := newReq(t, method, path)
			tt.setup(r)
			s := tt.self
			if s == (Self{}) {
				s = self
			}
			if tt.now.IsZero() {
				tt.now = testNow
			}
			ts := trust
			if tt.name == "withdrawn key" {
				ts = mustTrust(t, keyNew)
			}
			v, err := Verify(r, tt.body, ts, s, tt.optional, tt.now)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("Verify: %v", err)
				}
				if v.Target.Pod != self.Pod || v.Target.Epoch != 7 || v.Signed.IsZero() {
					t.Fatalf("Verified = %+v", v)
				}
				return
			}
			if got := AuthReason(err); got != tt.want {
				t.Fatalf("Verify = %v (reason %q), want reason %q", err, got, tt.want)
			}
			wantSentinel := ErrInvalidCredentials
			if tt.want == ReasonMissing {
				wantSentinel = ErrMissingCredentials
			}
			if !errors.Is(err, wantSentinel) {
				t.Fatalf("Verify = %v, want it to wrap %v", err, wantSentinel)
			}
		})
	}
}

func TestSignatureFormat(t *testing.T) {
	// A fixed vector (Ed25519 is deterministic) so that another implementation can check itself.
	r := newReq(t, http.MethodGet, PathState)
	Sign(r, nil, keyOld, Target{Pod: "shop/gateway-0", Epoch: 7}, testNow)
	got := r.Header.Get("Authorization")
	want := AuthScheme + " keyid=k1,ts=1772366400000,pod=shop/gateway-0,instance=,epoch=7,sig="
	if !strings.HasPrefix(got, want) || len(got) != len(want)+86 {
		t.Fatalf("Authorization = %q", got)
	}
	base := string(signatureBase(http.MethodGet, PathState, "1772366400000", "shop/gateway-0", "", "7", nil))
	wantBase := "Apportion-Ed25519 v1\nGET\n/v1/state\n1772366400000\nshop/gateway-0\n\n7\n" +
		"e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
	if base != wantBase {
		t.Fatalf("signature base = %q, want %q", base, wantBase)
	}
	if _, err := Verify(r, []byte{}, mustTrust(t, keyOld), Self{Pod: "shop/gateway-0", Instance: "x"}, true, testNow); err != nil {
		t.Fatalf("empty and nil bodies must sign the same: %v", err)
	}
}

// writeTrustDir lays keys out as the kubelet mounts a ConfigMap: timestamped dir, ..data
// symlink, per-key symlinks.
func writeTrustDir(t *testing.T, keys ...SigningKey) string {
	t.Helper()
	dir := t.TempDir()
	ts := filepath.Join(dir, "..2026_03_01_12_00_00.000000001")
	if err := os.Mkdir(ts, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		b, err := MarshalPublicKey(k.Public().Key)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(ts, k.ID+TrustFileSuffix), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(filepath.Base(ts), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if err := os.Symlink(filepath.Join("..data", k.ID+TrustFileSuffix), filepath.Join(dir, k.ID+TrustFileSuffix)); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestLoadTrustDir(t *testing.T) {
	dir := writeTrustDir(t, keyOld, keyNew)
	ts, err := LoadTrustDir(dir)
	if err != nil {
		t.Fatalf("LoadTrustDir: %v", err)
	}
	if got := strings.Join(ts.IDs(), ","); got != "k1,k2" {
		t.Fatalf("ids = %s", got)
	}
	if s := fmt.Sprintf("%v %+v %#v", keyNew, keyNew, keyNew); strings.Contains(s, fmt.Sprintf("%x", []byte(keyNew.Private))) || strings.Contains(s, fmt.Sprintf("%v", []byte(keyNew.Private)[:8])) {
		t.Fatalf("formatting a signing key prints it: %s", s)
	}

	write := func(name, content string) string {
		d := t.TempDir()
		if err := os.WriteFile(filepath.Join(d, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		return d
	}
	priv, _ := MarshalPrivateKey(keyNew.Private)
	for _, tc := range []struct{ name, dir, msg string }{
		{"not a pem name", write("k1", "x"), "names must be <key id>.pem"},
		{"not PEM", write("k1.pem", "hello"), `not a PEM "PUBLIC KEY" block`},
		{"a private key", write("k1.pem", string(priv)), `not a PEM "PUBLIC KEY" block`},
		{"bad id", write("-bad id.pem", "x"), ""},
		{"empty", t.TempDir(), "holds no key file"},
		{"missing", filepath.Join(dir, "missing"), "reading trust directory"},
	} {
		if _, err := LoadTrustDir(tc.dir); err == nil || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("%s: err = %v, want it to say %q", tc.name, err, tc.msg)
		}
	}
}

func BenchmarkSign(b *testing.B) {
	body := bytes.Repeat([]byte("x"), 1500) // a typical one-downstream assignment
	r := httptest.NewRequest(http.MethodPut, "http://agent:15000"+PathAssignment, nil)
	b.ReportAllocs()
	for b.Loop() {
		Sign(r, body, keyNew, toSelf, testNow)
	}
}

func BenchmarkVerify(b *testing.B) {
	body := bytes.Repeat([]byte("x"), 1500)
	r := httptest.NewRequest(http.MethodPut, "http://agent:15000"+PathAssignment, nil)
	Sign(r, body, keyNew, toSelf, testNow)
	var pubs []PublicKey
	for _, k := range []SigningKey{keyOld, keyNew} {
		pubs = append(pubs, k.Public())
	}
	trust, _ := NewTrustSet(pubs...)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Verify(r, body, trust, self, false, testNow); err != nil {
			b.Fatal(err)
		}
	}
}
