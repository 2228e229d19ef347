package fallback

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"
)

// entry returns an entry whose Size under a 1-byte key is exactly n.
func entry(n int) Entry {
	return Entry{Response: Response{Status: 200, Body: []byte(strings.Repeat("x", n-1))}}
}

func TestSize(t *testing.T) {
	e := Entry{Response: Response{
		Header: http.Header{"Content-Type": {"text/plain"}, "X-A": {"1", "22"}},
		Body:   []byte("hello"),
	}}
	// key 3 + body 5 + "Content-Type"(12)+"text/plain"(10) + ("X-A"(3)+1) + ("X-A"(3)+2)
	if got, want := Size("abc", &e), int64(3+5+22+4+5); got != want {
		t.Errorf("Size = %d, want %d", got, want)
	}
}

func TestKey(t *testing.T) {
	if got, want := Key("search", "/v1/q?term=a&page=2"), "search GET /v1/q?term=a&page=2"; got != want {
		t.Errorf("Key = %q, want %q", got, want)
	}
	if Key("search", "/q?a=1") == Key("search", "/q?a=2") {
		t.Error("the query is not part of the key")
	}
}

// keys lists the cache's keys from most to least recently used.
func keys(c *Cache) []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var ks []string
	for n := c.head; n != nil; n = n.next {
		ks = append(ks, n.key)
	}
	return ks
}

func TestCacheLRU(t *testing.T) {
	type op struct {
		put  string // key to put (size bytes), or
		size int
		get  string // key to get
		hit  bool
	}
	tests := []struct {
		name      string
		max       int64
		ops       []op
		wantKeys  []string // most recent first
		wantBytes int64
	}{
		{
			name:      "fits",
			max:       30,
			ops:       []op{{put: "a", size: 10}, {put: "b", size: 10}, {put: "c", size: 10}},
			wantKeys:  []string{"c", "b", "a"},
			wantBytes: 30,
		},
		{
			name:      "evicts the least recently put",
			max:       30,
			ops:       []op{{put: "a", size: 10}, {put: "b", size: 10}, {put: "c", size: 10}, {put: "d", size: 10}},
			wantKeys:  []string{"d", "c", "b"},
			wantBytes: 30,
		},
		{
			name: "a get makes an entry recent",
			max:  30,
			ops: []op{
				{put: "a", size: 10}, {put: "b", size: 10}, {put: "c", size: 10},
				{get: "a", hit: true},
				{put: "d", size: 10},
			},
			wantKeys:  []string{"d", "a", "c"},
			wantBytes: 30,
		},
		{
			name: "evicts as many as needed",
			max:  30,
			ops: []op{
				{put: "a", size: 10}, {put: "b", size: 10}, {put: "c", size: 10},
				{put: "d", size: 25},
				{get: "a"}, {get: "b"}, {get: "c"},
			},
			wantKeys:  []string{"d"},
			wantBytes: 25,
		},
		{
			name:      "an entry of exactly the bound is stored",
			max:       30,
			ops:       []op{{put: "a", size: 10}, {put: "b", size: 30}},
			wantKeys:  []string{"b"},
			wantBytes: 30,
		},
		{
			name:      "an entry larger than the bound is not stored and evicts nothing else",
			max:       30,
			ops:       []op{{put: "a", size: 10}, {put: "b", size: 31}, {get: "b"}},
			wantKeys:  []string{"a"},
			wantBytes: 10,
		},
		{
			name:      "an oversized replacement drops the old entry",
			max:       30,
			ops:       []op{{put: "a", size: 10}, {put: "b", size: 10}, {put: "a", size: 31}, {get: "a"}},
			wantKeys:  []string{"b"},
			wantBytes: 10,
		},
		{
			name:      "replacing a key recounts its size and makes it recent",
			max:       30,
			ops:       []op{{put: "a", size: 10}, {put: "b", size: 10}, {put: "a", size: 5}},
			wantKeys:  []string{"a", "b"},
			wantBytes: 15,
		},
		{
			name:      "a zero bound stores nothing",
			max:       0,
			ops:       []op{{put: "a", size: 1}, {get: "a"}},
			wantKeys:  nil,
			wantBytes: 0,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := NewCache(tt.max)
			for i, o := range tt.ops {
				if o.put != "" {
					c.Put(o.put, entry(o.size))
					if st := c.Stats(); st.Bytes > tt.max {
						t.Fatalf("op %d: %d bytes > bound %d", i, st.Bytes, tt.max)
					}
					continue
				}
				if _, hit := c.Get(o.get); hit != o.hit {
					t.Fatalf("op %d: Get(%q) hit = %v, want %v", i, o.get, hit, o.hit)
				}
			}
			if diff := cmp.Diff(tt.wantKeys, keys(c)); diff != "" {
				t.Errorf("keys, most recent first (-want +got):\n%s", diff)
			}
			want := CacheStats{Entries: len(tt.wantKeys), Bytes: tt.wantBytes, MaxBytes: tt.max}
			if diff := cmp.Diff(want, c.Stats()); diff != "" {
				t.Errorf("stats (-want +got):\n%s", diff)
			}
		})
	}
}

func TestCacheGetReturnsWhatWasPut(t *testing.T) {
	c := NewCache(1 << 10)
	e := Entry{Response: Response{Status: 200, Header: http.Header{"Etag": {`"1"`}}, Body: []byte("b")}, StoredAt: t0}
	c.Put("k", e)
	got, ok := c.Get("k")
	if !ok {
		t.Fatal("miss")
	}
	if diff := cmp.Diff(e, *got); diff != "" {
		t.Errorf("(-want +got):\n%s", diff)
	}
}

// TestCacheConcurrent checks under -race that the byte accounting stays
// exact and bounded while many goroutines put and get.
func TestCacheConcurrent(t *testing.T) {
	const bound = 2000
	c := NewCache(bound)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(g), 1))
			for range 2000 {
				k := fmt.Sprint(r.IntN(50))
				if r.IntN(2) == 0 {
					c.Put(k, entry(1+r.IntN(300)))
				} else {
					c.Get(k)
				}
			}
		}()
	}
	wg.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	var sum int64
	n := 0
	for nd := c.head; nd != nil; nd = nd.next {
		sum += Size(nd.key, nd.e)
		n++
	}
	if sum != c.used || sum > bound || n != len(c.items) {
		t.Errorf("accounting: list sum %d, used %d, bound %d, list %d entries, map %d", sum, c.used, bound, n, len(c.items))
	}
}

func TestStorable(t *testing.T) {
	h := func(kv ...string) http.Header {
		out := http.Header{}
		for i := 0; i < len(kv); i += 2 {
			out.Add(kv[i], kv[i+1])
		}
		return out
	}
	tests := []struct {
		name   string
		req    http.Header
		status int
		resp   http.Header
		want   bool
	}{
		{"plain 200", h(), 200, h("Content-Type", "application/json"), true},
		{"204", h(), 204, h(), true},
		{"206 partial", h(), 206, h(), false},
		{"404", h(), 404, h(), false},
		{"500", h(), 500, h(), false},
		{"304", h(), 304, h(), false},
		{"max-age is fine", h(), 200, h("Cache-Control", "public, max-age=60"), true},
		{"response no-store", h(), 200, h("Cache-Control", "max-age=60, no-store"), false},
		{"response private", h(), 200, h("Cache-Control", "private"), false},
		{"response private with fields", h(), 200, h("Cache-Control", `private="Set-Cookie"`), false},
		{"response no-cache forbids serving stale", h(), 200, h("Cache-Control", "no-cache"), false},
		{"response must-revalidate forbids serving stale", h(), 200, h("Cache-Control", "must-revalidate"), false},
		{"directives are case-insensitive", h(), 200, h("Cache-Control", "No-Store"), false},
		{"directive on a second field line", h(), 200, h("Cache-Control", "max-age=5", "Cache-Control", "private"), false},
		{"request no-store", h("Cache-Control", "no-store"), 200, h(), false},
		{"set-cookie", h(), 200, h("Set-Cookie", "sid=1"), false},
		{"authorized request, not public", h("Authorization", "Bearer x"), 200, h(), false},
		{"authorized request, public response", h("Authorization", "Bearer x"), 200, h("Cache-Control", "public"), true},
		{"gzip body", h(), 200, h("Content-Encoding", "gzip"), false},
		{"identity encoding", h(), 200, h("Content-Encoding", "identity"), true},
		{"vary accept-encoding", h(), 200, h("Vary", "Accept-Encoding"), true},
		{"vary on something else", h(), 200, h("Vary", "Accept-Encoding, Accept-Language"), false},
		{"vary star", h(), 200, h("Vary", "*"), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Storable(tt.req, tt.status, tt.resp); got != tt.want {
				t.Errorf("Storable = %v, want %v", got, tt.want)
			}
		})
	}
}
