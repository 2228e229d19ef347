package assignment

import (
	"bytes"
	"encoding/json"
	"encoding/json/jsontext"
	jsonv2 "encoding/json/v2"
	"testing"
	"time"
)

// realisticState is a State as an agent of a pod in three quotas answers a renewal: one
// downstream with lanes, rejection counters, a breaker, a switch. Its JSON is what the
// manager decodes per renewal (about 1 KiB).
func realisticState() State {
	at := time.Date(2026, 12, 1, 18, 30, 0, 123456789, time.UTC)
	return State{
		Instance: "7f3c9a1e5b2d4c6f", Uptime: Duration(73*time.Hour + 12*time.Minute + 5*time.Second),
		Epoch: 3, Generation: 1742, Configured: true, LeaseExpiresAt: at.Add(30 * time.Second),
		Downstreams: []DownstreamState{
			{Name: "payments", Permits: 12, EffectivePermits: 12, Limit: 12, InFlight: 3, Breaker: "closed",
				Requests: 18734512, Upstream429: 214, Rejected: map[string]int64{"queue-full": 1290, "timeout": 37},
				SecondsEnd: at.Unix(), Seconds: secondCounts(),
				Lanes: []LaneState{
					{Name: "interactive", Reserved: 8, InFlight: 2, Borrowed: 1, Rejected: map[string]int64{"queue-full": 12}},
					{Name: "batch", Reserved: 2, InFlight: 1, Waiting: 4, Rejected: map[string]int64{"queue-full": 1278, "timeout": 37}},
					{Name: "default", Reserved: 2},
				}},
			{Name: "search", Permits: 40, EffectivePermits: 40, Limit: 36, InFlight: 17, Waiting: 2, Breaker: "closed",
				Requests: 90817263, Upstream429: 5, Rejected: map[string]int64{"timeout": 4}},
			{Name: "users", Permits: 6, EffectivePermits: 6, Limit: 6, InFlight: 0, Requests: 1203},
		},
		Switches: []SwitchState{{Name: "checkout/shed-batch", Active: true, ExpiresAt: at.Add(10 * time.Minute)}},
	}
}

// secondCounts is a minute of per-second call counts, as an agent reports them with every
// answer (MaxSecondCounts).
func secondCounts() []int32 {
	out := make([]int32, MaxSecondCounts)
	for i := range out {
		out[i] = int32(380 + (i*37)%90)
	}
	return out
}

// BenchmarkStateDecode: decoding the realistic State, about 1 KiB, as the manager does once
// per renewal: encoding/json (v1) vs encoding/json/v2, and the client's bounded decoder
// (decodeState: v1's semantics on v2's streaming decoder, every list bounded, answer.go).
// Since Go 1.25's jsonv2 became the default, v1 runs on v2's decoder, so v1 and v2 cost about
// the same: the reason the client keeps v1's semantics (docs/benchmarks.md, "Scale").
func BenchmarkStateDecode(b *testing.B) {
	data, err := json.Marshal(realisticState())
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("%d bytes", len(data))
	b.Run("v1", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			var st State
			if err := json.Unmarshal(data, &st); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("bounded", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(data)))
		r := bytes.NewReader(data)
		for b.Loop() {
			r.Reset(data)
			if _, err := decodeState(r); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("v2", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			var st State
			if err := jsonv2.Unmarshal(data, &st); err != nil {
				b.Fatal(err)
			}
		}
	})
	// v2 with v1's semantics where they differ for this input: duplicate names and invalid
	// UTF-8 accepted (unknown fields are ignored by both by default, and names are matched
	// exactly, as agents write them).
	v1ish := jsonv2.JoinOptions(jsontext.AllowDuplicateNames(true), jsontext.AllowInvalidUTF8(true))
	b.Run("v2-v1-semantics", func(b *testing.B) {
		b.ReportAllocs()
		b.SetBytes(int64(len(data)))
		for b.Loop() {
			var st State
			if err := jsonv2.Unmarshal(data, &st, v1ish); err != nil {
				b.Fatal(err)
			}
		}
	})
}
