package assignment

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// FuzzDecode: Decode never panics, and whatever it accepts re-encodes into a document that it
// accepts again, decoding to an equal value. The same inputs go to the client's answer
// decoders (answer.go), held to json.Unmarshal: whatever they accept, json.Unmarshal accepts
// and decodes to an equal value, within the bounds.
func FuzzDecode(f *testing.F) {
	realistic, err := json.Marshal(realisticState())
	if err != nil {
		f.Fatal(err)
	}
	f.Add(realistic)
	f.Add([]byte(`{"downstreams":[{"name":"a","rejected":{"no-permit":1,"a\u0041":2,"\ud800":3},"lanes":[{"name":"b","rejected":{}}]}],"capabilities":["batch-signatures"],"future":{"x":[1]}}`))
	f.Add([]byte("{\"downstreams\":[{\"rejected\":{\"\xff\xfe\":1}}],\"instance\":\"\xc3\"}"))
	f.Add([]byte(`{"Downstreams":[{"NAME":"a"}],"downstreams":null,"switches":[{"name":"ns/a","active":true,"expiresAt":"2030-01-02T15:04:05Z"}]}`))
	f.Add([]byte(`{"title":"Stale","status":409,"code":"stale-assignment","errors":["a"],"state":{"epoch":3,"downstreams":[]}}`))
	f.Add([]byte(`{"downstreams":[],"downstreams":[]}`))
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
		checkAnswerDecoders(t, data)
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

// checkAnswerDecoders holds decodeState and decodeProblem to json.Unmarshal on data, and
// decodeState to accepting what json.Marshal writes of a State within the bounds.
func checkAnswerDecoders(t *testing.T, data []byte) {
	var v1 State
	if json.Unmarshal(data, &v1) == nil && withinBounds(&v1) {
		// (json.Marshal refuses some times json.Unmarshal reads, such as a 24-hour offset.)
		if enc, err := json.Marshal(&v1); err == nil && len(enc) <= MaxStateBytes {
			checkMarshaledState(t, enc)
		}
	}
	if st, err := decodeState(bytes.NewReader(data)); err == nil {
		var want State
		if err := json.Unmarshal(data, &want); err != nil {
			t.Fatalf("decodeState accepted %q, which json.Unmarshal refuses: %v", data, err)
		}
		if diff := cmp.Diff(&want, st); diff != "" {
			t.Fatalf("decodeState(%q) differs from json.Unmarshal (-want +got):\n%s", data, diff)
		}
		checkStateBounds(t, st)
	}
	if p, _, err := decodeProblem(bytes.NewReader(data), MaxProblemBytes+MaxStateBytes, nil); err == nil {
		var want Problem
		if err := json.Unmarshal(data, &want); err != nil {
			t.Fatalf("decodeProblem accepted %q, which json.Unmarshal refuses: %v", data, err)
		}
		if diff := cmp.Diff(&want, p); diff != "" {
			t.Fatalf("decodeProblem(%q) differs from json.Unmarshal (-want +got):\n%s", data, diff)
		}
		if len(p.Errors) > MaxProblemErrors {
			t.Fatalf("%d errors", len(p.Errors))
		}
		if p.State != nil {
			checkStateBounds(t, p.State)
		}
	}
}

func checkStateBounds(t *testing.T, st *State) {
	if len(st.Downstreams) > MaxDownstreams || len(st.Switches) > MaxSwitches || len(st.Capabilities) > MaxCapabilities {
		t.Fatalf("a State beyond its bounds: %d downstreams, %d switches, %d capabilities", len(st.Downstreams), len(st.Switches), len(st.Capabilities))
	}
	for _, d := range st.Downstreams {
		if len(d.Lanes) > MaxLaneStates || len(d.Rejected) > MaxRejectedReasons {
			t.Fatalf("a downstream beyond its bounds: %d lanes, %d reasons", len(d.Lanes), len(d.Rejected))
		}
		for _, l := range d.Lanes {
			if len(l.Rejected) > MaxRejectedReasons {
				t.Fatalf("a lane with %d reasons", len(l.Rejected))
			}
		}
	}
}

// withinBounds reports whether a State keeps within what a real agent sends: the lists'
// bounds and strings that, escaped, fit maxStateString (its size, MaxStateBytes, follows).
func withinBounds(st *State) bool {
	short := func(s string) bool { return jsonEscaped*len(s) <= maxStateString }
	ok := len(st.Downstreams) <= MaxDownstreams && len(st.Switches) <= MaxSwitches &&
		len(st.Capabilities) <= MaxCapabilities && short(st.Instance)
	rejectedOK := func(m map[string]int64) bool {
		for k := range m {
			ok = ok && short(k)
		}
		return len(m) <= MaxRejectedReasons
	}
	for _, d := range st.Downstreams {
		ok = ok && len(d.Lanes) <= MaxLaneStates && rejectedOK(d.Rejected) && short(d.Name) && short(d.Breaker)
		for _, l := range d.Lanes {
			ok = ok && rejectedOK(l.Rejected) && short(l.Name)
		}
	}
	for _, s := range st.Switches {
		ok = ok && short(s.Name)
	}
	for _, c := range st.Capabilities {
		ok = ok && short(c)
	}
	return ok
}

// checkMarshaledState: decodeState accepts enc, what json.Marshal wrote of a State within the
// bounds, as json.Unmarshal decodes it.
func checkMarshaledState(t *testing.T, enc []byte) {
	var want State
	if err := json.Unmarshal(enc, &want); err != nil {
		t.Fatal(err)
	}
	st, err := decodeState(bytes.NewReader(enc))
	if err != nil {
		t.Fatalf("decodeState refused %q, a State within the bounds as json.Marshal writes it: %v", enc, err)
	}
	if diff := cmp.Diff(&want, st); diff != "" {
		t.Fatalf("decodeState(%q) differs from json.Unmarshal (-want +got):\n%s", enc, diff)
	}
}
