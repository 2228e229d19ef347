package assignment

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/google/go-cmp/cmp"
)

// extremeState is the State the derivation of MaxStateBytes counts: every list full, every
// name at its longest (a switch name of characters json.Marshal escapes to six bytes), every
// number at its longest (the most negative), every optional member present.
func extremeState() State {
	name := func(c byte) string { return strings.Repeat(string(c), MaxDownstreamNameLength) }
	rejected := func() map[string]int64 {
		m := make(map[string]int64, MaxRejectedReasons)
		for i := range MaxRejectedReasons {
			m[fmt.Sprintf("%0*d", MaxReasonLength, i)] = math.MinInt64
		}
		return m
	}
	// RFC 3339 at its longest: nanoseconds without a trailing zero, a negative offset.
	at := time.Date(2006, 1, 2, 15, 4, 5, 999999999, time.FixedZone("", -7*3600))
	st := State{
		Instance: strings.Repeat("f", MaxInstanceLength), Uptime: Duration(math.MinInt64),
		Epoch: math.MinInt64, Generation: math.MinInt64, LeaseExpiresAt: at,
	}
	for i := range MaxDownstreams {
		d := DownstreamState{Name: name(byte('a' + i%26)), Permits: math.MinInt32, EffectivePermits: math.MinInt32,
			Limit: math.MinInt32, InFlight: math.MinInt32, Waiting: math.MinInt32,
			Breaker: strings.Repeat("h", MaxBreakerLength), Requests: math.MinInt64, Upstream429: math.MinInt64,
			Rejected: rejected(), Observe: true, WouldRefuse: rejected(), SecondsEnd: math.MinInt64}
		for range MaxSecondCounts {
			d.Seconds = append(d.Seconds, math.MinInt32)
		}
		for j := range MaxLaneStates {
			d.Lanes = append(d.Lanes, LaneState{Name: name(byte('a' + j)), Reserved: math.MinInt32, InFlight: math.MinInt32,
				Waiting: math.MinInt32, Borrowed: math.MinInt32, Rejected: rejected()})
		}
		st.Downstreams = append(st.Downstreams, d)
	}
	for range MaxSwitches {
		st.Switches = append(st.Switches, SwitchState{Name: strings.Repeat("<", MaxSwitchNameLength), ExpiresAt: at})
	}
	for range MaxCapabilities {
		st.Capabilities = append(st.Capabilities, strings.Repeat("c", MaxCapabilityLength))
	}
	return st
}

// The derivation of MaxStateBytes counts every byte: the State at every bound encodes to
// exactly MaxStateBytes, the client decodes it as json.Unmarshal does, and one byte more is
// refused. (TestRealAgentStateWithinBounds shows a real agent's maximal State within it.)
func TestMaxStateBytes(t *testing.T) {
	data, err := json.Marshal(extremeState())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("MaxStateBytes = %d (%.0f KiB): a downstream takes %d bytes, a lane %d, a switch %d",
		MaxStateBytes, float64(MaxStateBytes)/1024, downstreamStateBytes, laneStateBytes, switchStateBytes)
	if len(data) != MaxStateBytes {
		t.Fatalf("the extreme State encodes to %d bytes, MaxStateBytes is %d: the derivation is wrong", len(data), MaxStateBytes)
	}
	got, err := decodeState(bytes.NewReader(data))
	if err != nil {
		t.Fatalf("decoding the extreme State: %v", err)
	}
	var want State
	if err := json.Unmarshal(data, &want); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(&want, got); diff != "" {
		t.Fatalf("decodeState differs from json.Unmarshal (-want +got):\n%s", diff)
	}
	if _, err := decodeState(bytes.NewReader(append(data, ' '))); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("a State of MaxStateBytes+1 bytes: %v, want ErrTooLarge", err)
	}
}

// Valid answers decode exactly as json.Unmarshal decodes them, unknown members (a newer
// agent's) included.
func TestDecodeAnswerAsUnmarshal(t *testing.T) {
	realistic, err := json.Marshal(realisticState())
	if err != nil {
		t.Fatal(err)
	}
	states := []string{
		string(realistic),
		`{}`, `null`, ` {"epoch":3} `,
		`{"downstreams":[],"switches":null,"capabilities":[]}`,
		`{"downstreams":[{"name":"a","rejected":{},"lanes":[]}],"future":{"x":[1,[2,{"y":null}]]},"capabilities":["batch-signatures","x"]}`,
		`{"downstreams":[{"rejected":{"a\u0041":1,"\ud83d\ude00":2}}],"instance":"\u00e9"}`,
		`{"downstreams":[{"name":"a"}],"downstreams":null}`,
		`{"Epoch":3,"DOWNSTREAMS":[{"NAME":"a"}]}`, // encoding/json matches names without case
		// What the lexer of answerReader must not take for structure: quotes and backslashes
		// escaped in strings, brackets in strings and names.
		`{"instance":"\\","downstreams":[{"name":"\"[{","breaker":"\\\"}]"}],"[{\"":"\\\\"}`,
		`{"switches":[{"name":"ns/\u003c\u0022\u005c","expiresAt":"2030-01-02T15:04:05Z"}]}`,
		// Per-second counts: the fast path's integers and what it leaves to the generic path.
		`{"downstreams":[{"seconds":[0,1,-0,2147483647,-2147483648, 7 ,null]}]}`,
	}
	for _, s := range states {
		var want *State
		if err := json.Unmarshal([]byte(s), &want); err != nil {
			t.Fatalf("json.Unmarshal(%s): %v", s, err)
		}
		if want == nil {
			want = new(State) // decodeState decodes into a State, not a pointer: null leaves it zero
		}
		// Whole, and a byte per read: the lexer keeps its state across reads.
		for _, r := range []io.Reader{strings.NewReader(s), iotest.OneByteReader(strings.NewReader(s))} {
			got, err := decodeState(r)
			if err != nil {
				t.Fatalf("decodeState(%s): %v", s, err)
			}
			if diff := cmp.Diff(want, got); diff != "" {
				t.Fatalf("decodeState(%s) differs from json.Unmarshal (-want +got):\n%s", s, diff)
			}
		}
	}
	problems := []string{
		`{"title":"Stale assignment","status":409,"code":"stale-assignment","state":` + string(realistic) + `}`,
		`{"title":"Invalid","status":400,"errors":["a: b","c: d"],"future":1}`,
		`{"status":403,"reason":"wrong-instance","state":null}`,
	}
	for _, s := range problems {
		var want Problem
		if err := json.Unmarshal([]byte(s), &want); err != nil {
			t.Fatal(err)
		}
		got, head, err := decodeProblem(strings.NewReader(s), MaxProblemBytes+MaxStateBytes, make([]byte, 16))
		if err != nil {
			t.Fatalf("decodeProblem(%s): %v", s, err)
		}
		if diff := cmp.Diff(&want, got); diff != "" {
			t.Fatalf("decodeProblem(%s) differs from json.Unmarshal (-want +got):\n%s", s, diff)
		}
		if string(head) != s[:16] {
			t.Fatalf("head %q, want %q", head, s[:16])
		}
	}
}

// A per-second count that is not a 32-bit integer is refused, as encoding/json refuses it: the
// fast path of boundedInt32s takes only what it can parse whole and leaves the rest to the
// generic decoder.
func TestDecodeSecondsRefusedAsUnmarshal(t *testing.T) {
	for _, elem := range []string{`1.5`, `1e2`, `2147483648`, `-2147483649`, `"1"`, `true`, `[]`, `{}`} {
		in := `{"downstreams":[{"seconds":[3,` + elem + `]}]}`
		var want State
		if err := json.Unmarshal([]byte(in), &want); err == nil {
			t.Fatalf("json.Unmarshal(%s) accepted it: the case is not a refusal", in)
		}
		if got, err := decodeState(strings.NewReader(in)); err == nil {
			t.Fatalf("decodeState(%s) = %+v, want a refusal as json.Unmarshal's", in, got)
		}
	}
}

// Every list and map is refused one element beyond its bound (and accepted at it), a bounded
// member given twice is refused, and so are malformed, trailing and too deeply nested data.
func TestDecodeAnswerBounds(t *testing.T) {
	list := func(n int, elem string) string {
		return "[" + strings.TrimSuffix(strings.Repeat(elem+",", n), ",") + "]"
	}
	obj := func(n int) string {
		var b strings.Builder
		for i := range n {
			if i > 0 {
				b.WriteString(",")
			}
			fmt.Fprintf(&b, `"r%d":1`, i)
		}
		return "{" + b.String() + "}"
	}
	for _, tc := range []struct {
		name, at, over, want string
	}{
		{"downstreams", `{"downstreams":` + list(MaxDownstreams, `{}`) + `}`, `{"downstreams":` + list(MaxDownstreams+1, `{}`) + `}`, `"/downstreams": more than 32 elements`},
		{"lanes", `{"downstreams":[{"lanes":` + list(MaxLaneStates, `{}`) + `}]}`, `{"downstreams":[{"lanes":` + list(MaxLaneStates+1, `{}`) + `}]}`, `"/downstreams/0/lanes": more than 9 elements`},
		{"switches", `{"switches":` + list(MaxSwitches, `{}`) + `}`, `{"switches":` + list(MaxSwitches+1, `{}`) + `}`, `"/switches": more than 64 elements`},
		{"capabilities", `{"capabilities":` + list(MaxCapabilities, `""`) + `}`, `{"capabilities":` + list(MaxCapabilities+1, `""`) + `}`, `"/capabilities": more than 16 elements`},
		{"rejected", `{"downstreams":[{"rejected":` + obj(MaxRejectedReasons) + `}]}`, `{"downstreams":[{"rejected":` + obj(MaxRejectedReasons+1) + `}]}`, `"/downstreams/0/rejected": more than 8 members`},
		{"lane rejected", `{"downstreams":[{"lanes":[{"rejected":` + obj(MaxRejectedReasons) + `}]}]}`, `{"downstreams":[{"lanes":[{"rejected":` + obj(MaxRejectedReasons+1) + `}]}]}`, `"/downstreams/0/lanes/0/rejected": more than 8 members`},
		{"rejected repeats", `{"downstreams":[{"rejected":{"a":1,"a":2}}]}`, `{"downstreams":[{"rejected":{` + strings.TrimSuffix(strings.Repeat(`"a":1,`, MaxRejectedReasons+1), ",") + `}}]}`, "more than 8 members"},
		{"seconds", `{"downstreams":[{"seconds":` + list(MaxSecondCounts, `1`) + `}]}`, `{"downstreams":[{"seconds":` + list(MaxSecondCounts+1, `1`) + `}]}`, `"/downstreams/0/seconds": more than 60 elements`},
		{"seconds twice", `{"downstreams":[{"seconds":[]}]}`, `{"downstreams":[{"seconds":[],"seconds":[]}]}`, "given twice"},
		{"twice", `{"downstreams":[],"capabilities":[]}`, `{"downstreams":[],"downstreams":[]}`, `"/downstreams": given twice`},
		{"twice without case", `{"downstreams":null,"Downstreams":[]}`, `{"downstreams":[{}],"DOWNSTREAMS":[{}]}`, "given twice"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := decodeState(strings.NewReader(tc.at)); err != nil {
				t.Fatalf("at the bound: %v", err)
			}
			_, err := decodeState(strings.NewReader(tc.over))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("beyond the bound: %v, want %q", err, tc.want)
			}
		})
	}
	for _, tc := range []struct{ name, in, want string }{
		{"malformed", `{"downstreams":[{]}`, "invalid character"},
		{"truncated", `{"downstreams":[{}`, "unexpected EOF"},
		{"trailing data", `{} {}`, "invalid character"},
		{"not an object", `[1]`, "unmarshal JSON array into Go assignment.State"},
		// (encoding/json/v2 says "cannot" or "unable to" at random: the tests match the rest.)
		{"mistyped list", `{"downstreams":{}}`, `unmarshal JSON object into Go []assignment.DownstreamState within "/downstreams"`},
		{"deep", `{"x":` + strings.Repeat("[", maxAnswerDepth) + strings.Repeat("]", maxAnswerDepth) + `}`, "nested deeper than 32"},
		{"long string", `{"instance":"` + strings.Repeat(`\"`, maxStateString/2) + `x"}`, "a string longer than 1902 bytes"},
		{"long name", `{"` + strings.Repeat("x", maxStateString+1) + `":1}`, "a string longer than 1902 bytes"},
		{"empty", ``, "EOF"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, r := range []io.Reader{strings.NewReader(tc.in), iotest.OneByteReader(strings.NewReader(tc.in))} {
				_, err := decodeState(r)
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("decodeState: %v, want %q", err, tc.want)
				}
			}
		})
	}
	for _, s := range []string{
		`{"x":` + strings.Repeat("[", maxAnswerDepth-1) + strings.Repeat("]", maxAnswerDepth-1) + `}`,
		`{"instance":"` + strings.Repeat(`\"`, maxStateString/2) + `"}`,
		`{"instance":"` + strings.Repeat(`[`, 3*maxStateString/4) + `", "x":{"y":"{{{{"}}`,
	} {
		if _, err := decodeState(iotest.OneByteReader(strings.NewReader(s))); err != nil {
			t.Fatalf("decodeState(%.60s…) at the bound: %v", s, err)
		}
	}
	// A problem's errors have their own bound, its State a State's.
	for _, tc := range []struct{ name, at, over, want string }{
		{"errors", `{"errors":` + list(MaxProblemErrors, `""`) + `}`, `{"errors":` + list(MaxProblemErrors+1, `""`) + `}`, `"/errors": more than 64 elements`},
		{"state capabilities", `{"state":{"capabilities":` + list(MaxCapabilities, `""`) + `}}`, `{"state":{"capabilities":` + list(MaxCapabilities+1, `""`) + `}}`, `"/state/capabilities": more than 16 elements`},
		{"state downstreams", `{"state":{"downstreams":` + list(MaxDownstreams, `{}`) + `}}`, `{"state":{"downstreams":` + list(MaxDownstreams+1, `{}`) + `}}`, `"/state/downstreams": more than 32 elements`},
		{"state twice", `{"state":{},"errors":[]}`, `{"state":{},"state":{}}`, `"/state": given twice`},
	} {
		t.Run("problem "+tc.name, func(t *testing.T) {
			if _, _, err := decodeProblem(strings.NewReader(tc.at), MaxProblemBytes+MaxStateBytes, nil); err != nil {
				t.Fatalf("at the bound: %v", err)
			}
			_, _, err := decodeProblem(strings.NewReader(tc.over), MaxProblemBytes+MaxStateBytes, nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("beyond the bound: %v, want %q", err, tc.want)
			}
		})
	}
}
