package assignment

import (
	"bytes"
	"encoding/json"
	"testing"
)

// rampRaise decodes strictly like any member, and travels only when set (omitempty: content
// without it is byte for byte what an older manager sent).
func TestRampRaiseDecodes(t *testing.T) {
	body := mutate(t, func(m map[string]any) {
		ds(m, 0)["rampRaise"] = true
	})
	a, err := Decode(bytes.NewReader(body), DefaultMaxBytes)
	if err != nil {
		t.Fatalf("Decode: %v", err)
	}
	if !a.Downstreams[0].RampRaise || a.Downstreams[1].RampRaise {
		t.Fatalf("rampRaise decoded as %v, %v; want true, false", a.Downstreams[0].RampRaise, a.Downstreams[1].RampRaise)
	}
	body = mutate(t, func(m map[string]any) {
		ds(m, 0)["rampRaise"] = "yes"
	})
	if _, err := Decode(bytes.NewReader(body), DefaultMaxBytes); err == nil {
		t.Fatal("rampRaise \"yes\" decoded")
	}
	a.Downstreams[0].RampRaise = false
	b, err := json.Marshal(a.Downstreams[0])
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(b, []byte("rampRaise")) {
		t.Fatalf("an unset rampRaise travels: %s", b)
	}
}
