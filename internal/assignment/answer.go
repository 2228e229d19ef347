package assignment

import (
	"bytes"
	"encoding/json"
	"encoding/json/jsontext"
	jsonv2 "encoding/json/v2"
	"errors"
	"fmt"
	"io"
	"strconv"
)

// This file bounds what one agent answer may cost the manager. Every pod is untrusted input:
// whoever may run a pod in an app namespace can answer on an agent port. So the client reads
// at most what a real agent can send (MaxStateBytes, MaxProblemBytes), and refuses a list or
// map longer than a real agent's before it allocates the element beyond the bound. Before
// these bounds, one 8 MiB State of empty downstreams made the manager allocate 1.5 GiB
// (docs/benchmarks.md, "Hostile answers").

// What a State holds beyond the Assignment it reflects (whose bounds Validate enforces). The
// agent keeps within them; the manager refuses an answer that does not.
const (
	// MaxLaneStates bounds a DownstreamState's lanes: the declared ones and "default".
	MaxLaneStates = MaxLanes + 1
	// MaxRejectedReasons bounds a Rejected map (DownstreamState, LaneState), and
	// MaxReasonLength its keys: tokens of [a-z0-9-] (the agent has six, at most 17 long).
	MaxRejectedReasons = 8
	MaxReasonLength    = 24
	// MaxCapabilities bounds State.Capabilities, and MaxCapabilityLength each: tokens of
	// [a-z0-9-].
	MaxCapabilities     = 16
	MaxCapabilityLength = 64
	// MaxSecondCounts bounds DownstreamState.Seconds: the per-second counts of the last minute.
	MaxSecondCounts = 60
	// MaxBreakerLength bounds DownstreamState.Breaker ("closed", "open", "half-open").
	MaxBreakerLength = 16
	// (State.Instance is a token of [0-9a-f], the agent's 16 long, of at most
	// MaxInstanceLength.)

	// MaxAnswerHeadBytes bounds an answer's head (the agent's are below 300 bytes: the status
	// line, Content-Type, Content-Length, Cache-Control, Date, Retry-After or
	// WWW-Authenticate). The manager sets its HTTP client's limit to it
	// (h1.Client.SetMaxResponseHeaderBytes): parsing a head of many small fields allocates
	// about 14 times its size.
	MaxAnswerHeadBytes = 4 << 10

	// MaxProblemErrors bounds Problem.Errors.
	MaxProblemErrors = 64
	// MaxProblemBytes caps a problem answer without a State (the agent's are below 1 KiB, but
	// for a 400 listing many fields); MaxProblemBytes + MaxStateBytes one that may carry a
	// State (409, 403).
	MaxProblemBytes = 16 << 10
)

// The longest JSON of each State part, as the agent writes it (json.Marshal: compact, every
// member present): the fixed text (member names, quotes, brackets) plus the longest value of
// each member, plus a comma between list elements. Numbers take at most jsonInt32 and
// jsonInt64 bytes, times jsonTime, durations jsonDuration. Names are DNS labels and the tokens
// above, written as they are; a switch name is any printable ASCII, and json.Marshal writes
// <, > and & as \u003c: six bytes a character.
const (
	jsonInt32    = len("-2147483648")
	jsonInt64    = len("-9223372036854775808")
	jsonTime     = len(`"2006-01-02T15:04:05.999999999-07:00"`) // RFC 3339, years 0..9999
	jsonDuration = len(`"-2562047h47m16.854775808s"`)           // time.Duration(math.MinInt64)
	jsonEscaped  = len(`\u003c`)

	// A Rejected map: MaxRejectedReasons members "reason":count.
	rejectedBytes = len(`{}`) + MaxRejectedReasons*(len(`"":`)+MaxReasonLength+jsonInt64) + MaxRejectedReasons - 1
	// A LaneState: the fixed text, a lane name, four counts, a Rejected map.
	laneStateBytes = len(`{"name":"","reserved":,"inFlight":,"waiting":,"borrowed":,"rejected":}`) +
		MaxDownstreamNameLength + 4*jsonInt32 + rejectedBytes
	// A DownstreamState: the fixed text, its name, five counts, the breaker, two counters, a
	// Rejected map, MaxLaneStates lanes, the Observe flag, a WouldRefuse map, the per-second
	// counts. About 7.2 KiB, of which the lanes take three quarters.
	downstreamStateBytes = len(`{"name":"","permits":,"effectivePermits":,"limit":,"inFlight":,"waiting":,"breaker":"","requests":,"upstream429":,"rejected":,"lanes":[],"observe":true,"wouldRefuse":,"secondsEnd":,"seconds":[]}`) +
		MaxDownstreamNameLength + 5*jsonInt32 + MaxBreakerLength + 2*jsonInt64 + rejectedBytes +
		MaxLaneStates*laneStateBytes + MaxLaneStates - 1 +
		rejectedBytes + jsonInt64 + MaxSecondCounts*jsonInt32 + MaxSecondCounts - 1
	// A SwitchState: the fixed text, an escaped switch name, a time.
	switchStateBytes = len(`{"name":"","active":false,"expiresAt":}`) + jsonEscaped*MaxSwitchNameLength + jsonTime

	// MaxStateBytes caps a State answer: the longest State the bounds allow, the fixed text,
	// its instance, uptime, epoch, generation and lease end, MaxDownstreams downstreams,
	// MaxSwitches switches and MaxCapabilities capabilities. 342 KiB: the downstreams 217, the
	// switches 124. TestMaxStateBytes encodes that State to exactly this many bytes; a real
	// agent's longest is 273 KiB (TestRealAgentStateWithinBounds), a realistic State 1 KiB.
	MaxStateBytes = len(`{"instance":"","uptime":,"epoch":,"generation":,"configured":false,"leaseExpiresAt":,"leaseExpired":false,"downstreams":[],"switches":[],"capabilities":[]}`) +
		MaxInstanceLength + jsonDuration + 2*jsonInt64 + jsonTime +
		MaxDownstreams*downstreamStateBytes + MaxDownstreams - 1 +
		MaxSwitches*switchStateBytes + MaxSwitches - 1 +
		MaxCapabilities*(len(`""`)+MaxCapabilityLength) + MaxCapabilities - 1
)

// Decoding options of the answers: encoding/json's semantics (what json.Unmarshal does, so a
// valid answer decodes exactly as before), with every list and map of a State or Problem
// decoded by a function that refuses its element beyond the bound before it allocates it. An
// answer that names a bounded member twice is refused too (a repeat would decode the list
// again, each time up to its bound). Unknown members are skipped without being kept, as
// json.Unmarshal does (a newer agent may add some); their size counts against the cap, their
// strings and nesting against answerReader's bounds.
var (
	// encoding/json's semantics but for its error reporting, which reads a whole value before
	// decoding any of it (to report a syntax error before changing the target) and decodes on
	// after a first error: an answer is decoded as it is read, and the first error ends it.
	// A valid answer decodes the same either way.
	answerOptions     = jsonv2.JoinOptions(json.DefaultOptionsV1(), json.ReportErrorsWithLegacySemantics(false))
	stateUnmarshalers = jsonv2.JoinUnmarshalers(
		boundedList[DownstreamState](MaxDownstreams),
		boundedList[LaneState](MaxLaneStates),
		boundedList[SwitchState](MaxSwitches),
		boundedList[string](MaxCapabilities),
		boundedInt32s(MaxSecondCounts),
		boundedMap(MaxRejectedReasons),
	)
	stateOptions   = jsonv2.JoinOptions(answerOptions, jsonv2.WithUnmarshalers(stateUnmarshalers))
	problemOptions = jsonv2.JoinOptions(answerOptions, jsonv2.WithUnmarshalers(jsonv2.JoinUnmarshalers(
		boundedList[string](MaxProblemErrors),
		// A Problem's State is decoded with a State's bounds (its capabilities', not errors').
		jsonv2.UnmarshalFromFunc(func(dec *jsontext.Decoder, v **State) error {
			switch dec.PeekKind() {
			case jsontext.KindNull:
				_, err := dec.ReadToken()
				*v = nil
				return err
			case jsontext.KindBeginObject:
			default:
				return errors.ErrUnsupported // encoding/json's own error for a mistyped value
			}
			if *v != nil {
				return errGivenTwice
			}
			*v = new(State)
			return jsonv2.UnmarshalDecode(dec, *v, stateOptions)
		}),
	)))
)

// errGivenTwice refuses a bounded member named twice in one object.
var errGivenTwice = errors.New("given twice")

// boundedList decodes a []T of at most limit elements. Its errors are reported with the JSON
// pointer of the list.
func boundedList[T any](limit int) *jsonv2.Unmarshalers {
	return boundedListOf(limit, 0, func(dec *jsontext.Decoder, v *T) error { return jsonv2.UnmarshalDecode(dec, v) })
}

// boundedInt32s is boundedList[int32] with a fast path for the elements: a plain integer in
// range is parsed from the number token itself. An agent reports MaxSecondCounts of them per
// downstream in every answer, and the generic path's per-element UnmarshalDecode (an arshaler
// lookup each) was 7 % of an idle manager's CPU at 1,000 pods (docs/benchmarks.md). Any other
// element (a fraction, an exponent, out of range, null, a string) is decoded by the generic
// path, from its raw value, with the answer's options: the same value, or the same refusal, as
// encoding/json.
func boundedInt32s(limit int) *jsonv2.Unmarshalers {
	return boundedListOf(limit, limit, func(dec *jsontext.Decoder, v *int32) error {
		raw, err := dec.ReadValue()
		if err != nil {
			return err
		}
		if n, err := strconv.ParseInt(string(raw), 10, 32); err == nil {
			*v = int32(n)
			return nil
		}
		return jsonv2.Unmarshal(raw, v, answerOptions)
	})
}

// boundedListOf decodes a []T of at most limit elements with elem, a list given twice or
// beyond the bound refused before its element is allocated; capacity is what the list is made
// with (a list of known size is not grown by appends).
func boundedListOf[T any](limit, capacity int, elem func(*jsontext.Decoder, *T) error) *jsonv2.Unmarshalers {
	return jsonv2.UnmarshalFromFunc(func(dec *jsontext.Decoder, v *[]T) error {
		switch dec.PeekKind() {
		case jsontext.KindNull:
			_, err := dec.ReadToken()
			*v = nil
			return err
		case jsontext.KindBeginArray:
		default:
			return errors.ErrUnsupported
		}
		if *v != nil {
			return errGivenTwice
		}
		if _, err := dec.ReadToken(); err != nil {
			return err
		}
		*v = make([]T, 0, capacity)
		for dec.PeekKind() != jsontext.KindEndArray {
			if len(*v) == limit {
				return fmt.Errorf("more than %d elements", limit)
			}
			*v = append(*v, *new(T))
			if err := elem(dec, &(*v)[len(*v)-1]); err != nil {
				return err
			}
		}
		_, err := dec.ReadToken()
		return err
	})
}

// boundedMap decodes a map[string]int64 of at most limit members, counted as they come (a
// repeated name included).
func boundedMap(limit int) *jsonv2.Unmarshalers {
	return jsonv2.UnmarshalFromFunc(func(dec *jsontext.Decoder, v *map[string]int64) error {
		switch dec.PeekKind() {
		case jsontext.KindNull:
			_, err := dec.ReadToken()
			*v = nil
			return err
		case jsontext.KindBeginObject:
		default:
			return errors.ErrUnsupported
		}
		if *v != nil {
			return errGivenTwice
		}
		if _, err := dec.ReadToken(); err != nil {
			return err
		}
		m := map[string]int64{}
		*v = m
		for n := 0; dec.PeekKind() != jsontext.KindEndObject; n++ {
			if n == limit {
				return fmt.Errorf("more than %d members", limit)
			}
			tok, err := dec.ReadToken()
			if err != nil {
				return err
			}
			name := tok.String() // before the next read voids tok
			var count int64
			if err := jsonv2.UnmarshalDecode(dec, &count); err != nil {
				return err
			}
			m[name] = count
		}
		_, err := dec.ReadToken()
		return err
	})
}

// answerReader reads an answer for the decoder: at most limit bytes of r, no string (its
// bytes between the quotes, as written) longer than maxString and no value nested deeper than
// maxAnswerDepth; beyond a bound it fails, at once. Only the decoder's buffer holds what it
// reads, and its buffer must hold a whole string: without these bounds one string of 300 KiB
// made it allocate 1.4 MiB, and 10,000 nested arrays (the decoder's own limit) 460 KiB. It
// keeps the first len(head) bytes read in head.
//
// It follows the JSON text with a small lexer: outside a string, '"' opens one and brackets
// nest; inside, a backslash escapes the next byte and '"' closes it. On valid JSON it agrees
// with the decoder; on invalid JSON it may refuse what the decoder would refuse anyway.
type answerReader struct {
	r         io.Reader
	remain    int
	limit     int
	maxString int
	head      []byte
	kept      int

	inString, escaped bool
	stringLen, depth  int
}

// maxAnswerDepth bounds the nesting of an answer: a State nests 6 deep (its downstreams'
// lanes' rejected maps), a Problem's State 7; the rest is room for members a newer agent adds.
const maxAnswerDepth = 32

// maxStateString bounds a State's strings as written: the longest is a switch name, escaped.
const maxStateString = jsonEscaped * MaxSwitchNameLength

func (a *answerReader) Read(p []byte) (int, error) {
	if a.remain <= 0 {
		// At the cap: one byte more is too much.
		var one [1]byte
		n, err := a.r.Read(one[:])
		if n > 0 {
			return 0, fmt.Errorf("%w of %d bytes", ErrTooLarge, a.limit)
		}
		return 0, err
	}
	if len(p) > a.remain {
		p = p[:a.remain]
	}
	n, err := a.r.Read(p)
	a.remain -= n
	a.kept += copy(a.head[a.kept:], p[:n])
	if lexErr := a.lex(p[:n]); lexErr != nil {
		return 0, lexErr
	}
	return n, err
}

// lex follows p (see answerReader). Strings, most of an answer, are skipped with IndexByte.
func (a *answerReader) lex(p []byte) error {
	for i := 0; i < len(p); {
		if a.inString {
			if a.escaped { // the byte after a backslash: part of the string, whatever it is
				a.escaped = false
				a.stringLen++
				i++
			} else {
				rest := p[i:]
				end := bytes.IndexByte(rest, '"')
				seg := rest
				if end >= 0 {
					seg = rest[:end]
				}
				if k := bytes.IndexByte(seg, '\\'); k >= 0 {
					a.stringLen += k + 1
					a.escaped = true
					i += k + 1
				} else if end < 0 {
					a.stringLen += len(rest)
					i = len(p)
				} else {
					a.stringLen += end
					a.inString = false
					i += end + 1
				}
			}
			if a.stringLen > a.maxString {
				return fmt.Errorf("a string longer than %d bytes", a.maxString)
			}
			continue
		}
		switch p[i] {
		case '"':
			a.inString, a.stringLen = true, 0
		case '[', '{':
			if a.depth++; a.depth > maxAnswerDepth {
				return fmt.Errorf("nested deeper than %d", maxAnswerDepth)
			}
		case ']', '}':
			a.depth--
		}
		i++
	}
	return nil
}

// decodeState decodes one State of at most MaxStateBytes from r, with the bounds of
// stateOptions and answerReader: exactly what json.Unmarshal decodes of a valid answer.
// Trailing data after the State is an error.
func decodeState(r io.Reader) (*State, error) {
	ar := &answerReader{r: r, remain: MaxStateBytes, limit: MaxStateBytes, maxString: maxStateString}
	st := new(State)
	if err := jsonv2.UnmarshalRead(ar, st, stateOptions); err != nil {
		return nil, err
	}
	return st, nil
}

// decodeProblem decodes one Problem of at most limit bytes from r, with the bounds of
// problemOptions and answerReader (a string may be as long as MaxProblemBytes). It returns the
// first bytes read (up to len(head)) with any error.
func decodeProblem(r io.Reader, limit int, head []byte) (*Problem, []byte, error) {
	ar := &answerReader{r: r, remain: limit, limit: limit, maxString: MaxProblemBytes, head: head}
	p := new(Problem)
	if err := jsonv2.UnmarshalRead(ar, p, problemOptions); err != nil {
		return nil, head[:ar.kept], err
	}
	return p, head[:ar.kept], nil
}
