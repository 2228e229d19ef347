package assignment

import (
	"bytes"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func lane(name string, reserve int, extra map[string]any) map[string]any {
	l := map[string]any{"name": name, "reservePercent": reserve, "lendPercent": 50, "methods": []any{"POST"}}
	for k, v := range extra {
		l[k] = v
	}
	return l
}

func TestDecodeLanes(t *testing.T) {
	body := mutate(t, func(m map[string]any) {
		ds(m, 0)["lanes"] = []any{lane("core", 30, map[string]any{
			"headers": []any{map[string]any{"name": "X-Lane", "value": "core"}}, "pathPrefixes": []any{"/orders"},
		})}
	})
	a, err := Decode(bytes.NewReader(body), DefaultMaxBytes)
	if err != nil {
		t.Fatalf("Decode: %v", err)
	}
	want := []Lane{{Name: "core", ReservePercent: 30, LendPercent: 50, Headers: []HeaderMatch{{Name: "X-Lane", Value: "core"}},
		Methods: []string{"POST"}, PathPrefixes: []string{"/orders"}}}
	if diff := cmp.Diff(want, a.Downstreams[0].Lanes); diff != "" {
		t.Fatalf("lanes (-want +got):\n%s", diff)
	}
}

func TestDecodeLaneErrors(t *testing.T) {
	tests := []struct {
		name  string
		lanes []any
		want  []string
	}{
		{"duplicate names", []any{lane("core", 10, nil), lane("core", 10, nil)}, []string{`downstreams[0].lanes[1].name: duplicate of downstreams[0].lanes[0].name "core"`}},
		{"default is taken", []any{lane("default", 10, nil)}, []string{`downstreams[0].lanes[0].name: "default" is the lane of unmatched calls`}},
		{"bad name", []any{lane("Core", 10, nil)}, []string{"downstreams[0].lanes[0].name: must be a DNS label"}},
		{"reserves over 100", []any{lane("a", 60, nil), lane("b", 50, nil)}, []string{"downstreams[0].lanes: reservePercent sums to 110, more than 100"}},
		{"percent ranges", []any{lane("a", 101, map[string]any{"lendPercent": -1})}, []string{
			"downstreams[0].lanes[0].reservePercent: must be between 0 and 100", "downstreams[0].lanes[0].lendPercent: must be between 0 and 100",
		}},
		{"no match", []any{map[string]any{"name": "a", "reservePercent": 10, "lendPercent": 0}}, []string{"downstreams[0].lanes[0]: must match on headers, methods or pathPrefixes"}},
		{"bad method and prefix", []any{lane("a", 10, map[string]any{"methods": []any{"FETCH"}, "pathPrefixes": []any{"orders"}})}, []string{
			"downstreams[0].lanes[0].methods[0]: must be one of", "downstreams[0].lanes[0].pathPrefixes[0]: must start with /",
		}},
		{"bad header", []any{lane("a", 10, map[string]any{"headers": []any{map[string]any{"name": "X Lane", "value": "a\x01"}}})}, []string{
			"downstreams[0].lanes[0].headers[0].name: must be a valid header name", "downstreams[0].lanes[0].headers[0].value: must be at most",
		}},
		{"unknown field", []any{lane("a", 10, map[string]any{"reserve": 3})}, []string{"downstreams[0].lanes[0].reserve: unknown field"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			body := mutate(t, func(m map[string]any) { ds(m, 0)["lanes"] = tt.lanes })
			_, err := Decode(bytes.NewReader(body), DefaultMaxBytes)
			if err == nil {
				t.Fatal("decoded")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
	tooMany := make([]any, MaxLanes+1)
	for i := range tooMany {
		tooMany[i] = lane(string(rune('a'+i)), 1, nil)
	}
	body := mutate(t, func(m map[string]any) { ds(m, 0)["lanes"] = tooMany })
	if _, err := Decode(bytes.NewReader(body), DefaultMaxBytes); err == nil || !strings.Contains(err.Error(), "at most 8 lanes") {
		t.Fatalf("9 lanes: %v", err)
	}
}
