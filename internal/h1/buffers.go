package h1

import "sync"

// BufferSize is the size of the copy buffers BufferPool hands out.
const BufferSize = 32 << 10

var copyBuffers = sync.Pool{New: func() any { return new([BufferSize]byte) }}

// BufferPool recycles 32 KiB copy buffers: the client's request body writer uses them, and it
// is an httputil.BufferPool, so that a proxy's copies share them.
type BufferPool struct{}

// Get returns a buffer of BufferSize bytes.
func (BufferPool) Get() []byte { return copyBuffers.Get().(*[BufferSize]byte)[:] }

// Put recycles b when it is at least BufferSize long.
func (BufferPool) Put(b []byte) {
	if cap(b) >= BufferSize {
		copyBuffers.Put((*[BufferSize]byte)(b[:BufferSize])) // no allocation
	}
}
