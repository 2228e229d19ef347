package fallback

import (
	"net/http"
	"strings"
	"sync"
	"time"
)

// Entry is a cached response.
type Entry struct {
	Response
	StoredAt time.Time
}

// Key is the cache key of a GET to downstream for requestURI, the request
// target as received including the query (r.URL.RequestURI()). Only GETs
// are cached; downstream names contain no spaces, so the key is unambiguous.
func Key(downstream, requestURI string) string {
	return downstream + " GET " + requestURI
}

// Size is what an entry costs against the cache's byte bound: the bytes of
// the key, the body, and every header name and value. The key is counted so
// that a flood of tiny responses under long URLs is bounded too.
func Size(key string, e *Entry) int64 {
	n := int64(len(key) + len(e.Body))
	for k, vs := range e.Header {
		for _, v := range vs {
			n += int64(len(k) + len(v))
		}
	}
	return n
}

// Cache is a byte-bounded LRU of responses for ServeStale. It is safe for
// concurrent use.
//
// Put takes ownership of the entry's Header and Body: the caller must not
// modify them afterwards. Get returns the stored entry itself, which callers
// must treat as read-only (Render copies the header before changing it).
type Cache struct {
	mu         sync.Mutex
	max, used  int64
	items      map[string]*node
	head, tail *node // head is the most recently used
}

type node struct {
	key        string
	e          *Entry
	size       int64
	prev, next *node
}

// CacheStats describes a Cache.
type CacheStats struct {
	Entries  int
	Bytes    int64 // sum of Size over the entries; <= MaxBytes
	MaxBytes int64
}

// NewCache returns a cache holding at most maxBytes (as counted by Size).
// maxBytes <= 0 makes a cache that stores nothing.
func NewCache(maxBytes int64) *Cache {
	return &Cache{max: maxBytes, items: map[string]*node{}}
}

// Put stores e under key as the most recently used entry, replacing any
// entry for key, then evicts least recently used entries until the total is
// within the bound. An entry larger than the bound is not stored, and the
// entry it would have replaced is dropped too: it is older than a response
// the downstream has since given.
func (c *Cache) Put(key string, e Entry) {
	size := Size(key, &e)
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.items[key]; ok {
		c.remove(old)
	}
	if size > c.max {
		return
	}
	n := &node{key: key, e: &e, size: size}
	c.items[key] = n
	c.pushFront(n)
	c.used += size
	for c.used > c.max {
		c.remove(c.tail)
	}
}

// Get returns the entry for key and marks it most recently used.
func (c *Cache) Get(key string) (*Entry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n, ok := c.items[key]
	if !ok {
		return nil, false
	}
	c.unlink(n)
	c.pushFront(n)
	return n.e, true
}

// Stats returns the cache's occupancy.
func (c *Cache) Stats() CacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	return CacheStats{Entries: len(c.items), Bytes: c.used, MaxBytes: c.max}
}

func (c *Cache) remove(n *node) {
	c.unlink(n)
	delete(c.items, n.key)
	c.used -= n.size
}

func (c *Cache) pushFront(n *node) {
	n.prev, n.next = nil, c.head
	if c.head != nil {
		c.head.prev = n
	} else {
		c.tail = n
	}
	c.head = n
}

func (c *Cache) unlink(n *node) {
	if n.prev != nil {
		n.prev.next = n.next
	} else {
		c.head = n.next
	}
	if n.next != nil {
		n.next.prev = n.prev
	} else {
		c.tail = n.prev
	}
	n.prev, n.next = nil, nil
}

// Storable reports whether a downstream's answer to a GET may be kept for
// ServeStale. The cache key ignores who asked and how, so this follows the
// shared-cache rules of RFC 9111 (§3, §3.5) conservatively, plus the
// directives that forbid serving stale (§4.2.4):
//
//   - the status is 2xx other than 206 (a fallback should not replay errors
//     or partial content);
//   - neither request nor response says no-store; the response is not
//     private, no-cache, must-revalidate or proxy-revalidate, and sets no
//     cookie;
//   - a request with Authorization is stored only if the response is public;
//   - the body is not content-encoded (a gzip body must not reach a client
//     that did not ask for it), and Vary, if any, names only
//     Accept-Encoding (which is then harmless).
func Storable(reqHeader http.Header, status int, respHeader http.Header) bool {
	if status < 200 || status > 299 || status == http.StatusPartialContent {
		return false
	}
	if hasDirective(reqHeader, "no-store") {
		return false
	}
	for _, d := range []string{"no-store", "private", "no-cache", "must-revalidate", "proxy-revalidate"} {
		if hasDirective(respHeader, d) {
			return false
		}
	}
	if len(respHeader.Values("Set-Cookie")) > 0 {
		return false
	}
	if reqHeader.Get("Authorization") != "" && !hasDirective(respHeader, "public") {
		return false
	}
	if ce := strings.TrimSpace(respHeader.Get("Content-Encoding")); ce != "" && !strings.EqualFold(ce, "identity") {
		return false
	}
	for _, v := range respHeader.Values("Vary") {
		for _, f := range strings.Split(v, ",") {
			if f = strings.TrimSpace(f); f != "" && !strings.EqualFold(f, "Accept-Encoding") {
				return false
			}
		}
	}
	return true
}

// hasDirective reports whether h's Cache-Control has directive d (with or
// without an argument), case-insensitively.
func hasDirective(h http.Header, d string) bool {
	for _, v := range h.Values("Cache-Control") {
		for _, part := range strings.Split(v, ",") {
			name, _, _ := strings.Cut(strings.TrimSpace(part), "=")
			if strings.EqualFold(strings.TrimSpace(name), d) {
				return true
			}
		}
	}
	return false
}
