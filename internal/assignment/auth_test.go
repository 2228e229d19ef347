package assignment

import (
	"bytes"
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

var (
	testNow  = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	keyOld   = Key{ID: "k1", Secret: bytes.Repeat([]byte("a"), 32)}
	keyNew   = Key{ID: "k2", Secret: bytes.Repeat([]byte("b"), 40)}
	keyOther = Key{ID: "k2", Secret: bytes.Repeat([]byte("c"), 40)} // same id, other secret
)

func newReq(t *testing.T, method, path string) *http.Request {
	t.Helper()
	return httptest.NewRequest(method, "http://agent:15000"+path, nil)
}

func TestVerify(t *testing.T) {
	keys, err := NewKeySet(keyOld, keyNew)
	if err != nil {
		t.Fatal(err)
	}
	body := []byte(`{"epoch":1}`)
	tests := []struct {
		name  string
		setup func(r *http.Request)
		body  []byte
		now   time.Time
		want  error // nil, ErrMissingCredentials or ErrInvalidCredentials
		msg   string
	}{
		{name: "current key", setup: func(r *http.Request) { Sign(r, body, keyNew, testNow) }, body: body, now: testNow},
		{name: "rotated (previous) key", setup: func(r *http.Request) { Sign(r, body, keyOld, testNow) }, body: body, now: testNow},
		{name: "skew within 2m", setup: func(r *http.Request) { Sign(r, body, keyNew, testNow.Add(-119*time.Second)) }, body: body, now: testNow},
		{name: "missing", setup: func(r *http.Request) {}, body: body, now: testNow, want: ErrMissingCredentials},
		{name: "other scheme", setup: func(r *http.Request) { r.Header.Set("Authorization", "Bearer abc") }, body: body, now: testNow, want: ErrMissingCredentials},
		{name: "forged secret", setup: func(r *http.Request) { Sign(r, body, keyOther, testNow) }, body: body, now: testNow, want: ErrInvalidCredentials, msg: "signature mismatch"},
		{name: "body tampered", setup: func(r *http.Request) { Sign(r, body, keyNew, testNow) }, body: []byte(`{"epoch":2}`), now: testNow, want: ErrInvalidCredentials, msg: "signature mismatch"},
		{name: "method tampered", setup: func(r *http.Request) { Sign(r, body, keyNew, testNow); r.Method = http.MethodPost }, body: body, now: testNow, want: ErrInvalidCredentials},
		{name: "path tampered", setup: func(r *http.Request) { Sign(r, body, keyNew, testNow); r.URL.Path = "/v1/state" }, body: body, now: testNow, want: ErrInvalidCredentials},
		{name: "expired", setup: func(r *http.Request) { Sign(r, body, keyNew, testNow.Add(-121*time.Second)) }, body: body, now: testNow, want: ErrInvalidCredentials, msg: "away from the agent's clock"},
		{name: "future", setup: func(r *http.Request) { Sign(r, body, keyNew, testNow.Add(3*time.Minute)) }, body: body, now: testNow, want: ErrInvalidCredentials, msg: "away from the agent's clock"},
		{name: "unknown key", setup: func(r *http.Request) { Sign(r, body, Key{ID: "k9", Secret: keyNew.Secret}, testNow) }, body: body, now: testNow, want: ErrInvalidCredentials, msg: `unknown key id "k9"`},
		{name: "malformed", setup: func(r *http.Request) { r.Header.Set("Authorization", AuthScheme+" keyid=k2") }, body: body, now: testNow, want: ErrInvalidCredentials},
		{name: "malformed sig", setup: func(r *http.Request) {
			r.Header.Set("Authorization", fmt.Sprintf("%s keyid=k2,ts=%d,sig=zz", AuthScheme, testNow.Unix()))
		}, body: body, now: testNow, want: ErrInvalidCredentials, msg: "malformed signature"},
		{name: "huge negative ts", setup: func(r *http.Request) {
			r.Header.Set("Authorization", AuthScheme+" keyid=k2,ts=-9223372036854775808,sig=00")
		}, body: body, now: testNow, want: ErrInvalidCredentials},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newReq(t, http.MethodPut, PathAssignment)
			tt.setup(r)
			err := Verify(r, tt.body, keys, tt.now)
			if tt.want == nil {
				if err != nil {
					t.Fatalf("Verify: %v", err)
				}
				return
			}
			if !errors.Is(err, tt.want) {
				t.Fatalf("Verify = %v, want %v", err, tt.want)
			}
			if tt.msg != "" && !strings.Contains(err.Error(), tt.msg) {
				t.Errorf("Verify = %v, want it to say %q", err, tt.msg)
			}
			for _, k := range []Key{keyOld, keyNew, keyOther} {
				if strings.Contains(err.Error(), string(k.Secret)) {
					t.Errorf("error leaks a secret: %v", err)
				}
			}
		})
	}
}

func TestSignatureFormat(t *testing.T) {
	// A fixed vector so that another implementation (a script, the manager) can check itself.
	r := newReq(t, http.MethodGet, PathState)
	Sign(r, nil, keyOld, testNow)
	got := r.Header.Get("Authorization")
	want := AuthScheme + " keyid=k1,ts=1772366400,sig="
	if !strings.HasPrefix(got, want) || len(got) != len(want)+64 {
		t.Fatalf("Authorization = %q", got)
	}
	if err := Verify(r, []byte{}, mustKeySet(t, keyOld), testNow); err != nil {
		t.Fatalf("empty and nil bodies must sign the same: %v", err)
	}
}

func mustKeySet(t *testing.T, keys ...Key) KeySet {
	t.Helper()
	ks, err := NewKeySet(keys...)
	if err != nil {
		t.Fatal(err)
	}
	return ks
}

func TestLoadKeyDir(t *testing.T) {
	// Laid out as the kubelet mounts a Secret: timestamped dir, ..data symlink, per-key symlinks.
	dir := t.TempDir()
	ts := filepath.Join(dir, "..2026_03_01_12_00_00.000000001")
	if err := os.Mkdir(ts, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, k := range []Key{keyOld, keyNew} {
		if err := os.WriteFile(filepath.Join(ts, k.ID), k.Secret, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink(filepath.Base(ts), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	for _, k := range []Key{keyOld, keyNew} {
		if err := os.Symlink(filepath.Join("..data", k.ID), filepath.Join(dir, k.ID)); err != nil {
			t.Fatal(err)
		}
	}
	ks, err := LoadKeyDir(dir)
	if err != nil {
		t.Fatalf("LoadKeyDir: %v", err)
	}
	if got := strings.Join(ks.IDs(), ","); got != "k1,k2" {
		t.Fatalf("ids = %s", got)
	}
	cur, _ := ks.Current()
	if cur.ID != "k2" || !bytes.Equal(cur.Secret, keyNew.Secret) {
		t.Fatalf("Current = %v", cur)
	}
	if s := fmt.Sprintf("%v %+v %#v", cur, cur, cur); strings.Contains(s, string(keyNew.Secret)) {
		t.Fatalf("formatting a key prints its secret: %s", s)
	}

	short := t.TempDir()
	if err := os.WriteFile(filepath.Join(short, "k"), []byte("too short"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadKeyDir(short); err == nil || !strings.Contains(err.Error(), "at least 32 bytes") {
		t.Fatalf("short secret: err = %v", err)
	}
	if _, err := LoadKeyDir(t.TempDir()); err == nil {
		t.Fatal("empty directory accepted")
	}
	if _, err := LoadKeyDir(filepath.Join(dir, "missing")); err == nil {
		t.Fatal("missing directory accepted")
	}
}
