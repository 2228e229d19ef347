package assignment

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// FuzzDecode: Decode never panics, and whatever it accepts re-encodes into a document that it
// accepts again, decoding to an equal value.
func FuzzDecode(f *testing.F) {
	valid := validJSON(f)
	f.Add(valid)
	f.Add([]byte(`{"epoch":1,"generation":1,"leaseTTL":"1s","downstreams":[]}`))
	f.Add([]byte(`{"epoch":1,"generation":1,"leaseTTL":"1s","downstreams":[{"name":"a","upstream":"http://x","permits":1,"safeDefaultPermits":1,"acquireTimeout":"1ms","requestTimeout":"1s","fallback":{"action":"Reject"}}]}`))
	f.Add([]byte(`{"epoch":1,"generation":1,"leaseTTL":"1s","downstreams":[{"name":"a","upstream":"http://x","permits":1,"safeDefaultPermits":1,"acquireTimeout":"1ms","requestTimeout":"1s","fallback":{"action":"Static","static":{"status":200,"headers":{},"body":""}}}],"switches":[]}`))
	f.Add(bytes.Replace(valid, []byte(`"epoch": 3,`), []byte(`"epoch": 3, "epoch": 4,`), 1))
	f.Add([]byte(`{"epoch":1,"generation":1,"leaseTTL":200}`))
	f.Add([]byte(`{"epoch":1e3}`))
	f.Add([]byte(`{"downstreams":[{"rate":{"perSecond":1e400}}]}`))
	f.Add([]byte(`{"switches":[{"expiresAt":"2030-01-02T15:04:05+01:00","headers":null,"action":null}]}`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{} {}`))
	f.Add([]byte(`[1,2,3]`))
	f.Add([]byte(`"\ud800"`))
	f.Add([]byte(``))
	f.Fuzz(func(t *testing.T, data []byte) {
		a, err := Decode(bytes.NewReader(data), DefaultMaxBytes)
		if err != nil {
			if a != nil {
				t.Fatal("Decode returned both a value and an error")
			}
			if len(FieldErrors(err)) == 0 && !bytes.Contains([]byte(err.Error()), []byte("size limit")) {
				t.Fatalf("error without a field path: %v", err)
			}
			return
		}
		b, err := json.Marshal(a)
		if err != nil {
			t.Fatalf("re-encoding an accepted assignment: %v", err)
		}
		a2, err := Decode(bytes.NewReader(b), DefaultMaxBytes)
		if err != nil {
			t.Fatalf("re-decoding %s: %v", b, err)
		}
		if diff := cmp.Diff(a, a2, cmpopts.EquateEmpty()); diff != "" {
			t.Fatalf("round trip of %q (-first +second):\n%s", data, diff)
		}
	})
}
