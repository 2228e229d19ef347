package h1

import (
	"bufio"
	"io"
	"net"
	"os"
	"sync"
	"syscall"
	"unsafe"
)

// rawIO reads and writes a TCP connection with raw read(2) and write(2) on its non-blocking
// descriptor, through syscall.RawConn so that the runtime's poller still waits for readiness
// and enforces deadlines.
//
// Why: net.Conn's Read and Write go through syscall.Syscall, whose entry into the scheduler
// wakes the runtime's monitor thread (sysmon) whenever it sleeps because every P was idle.
// For the agent, idle between two calls a few hundred microseconds apart, that was several
// thread wake-ups per call (a futex wake, then sysmon's 20 µs naps until it sleeps again),
// which on a virtual machine cost more CPU than the proxying. A read or write of a non-blocking
// socket never blocks, so it needs none of that: RawSyscall is the documented way to make
// such a call.
type rawIO struct {
	net.Conn
	rc syscall.RawConn

	rmu  sync.Mutex // one Read at a time: the state below is shared with the callback
	rfn  func(fd uintptr) bool
	rbuf []byte
	rn   int
	rerr syscall.Errno

	wmu  sync.Mutex
	wfn  func(fd uintptr) bool
	wbuf []byte
	wn   int
	werr syscall.Errno

	// awaitNext: the next Write is a request's last, and its answer is read next (see
	// writeAwait); set and cleared by the writer's goroutine (awaitAnswer).
	awaitNext bool
	afn       func(fd uintptr) bool
	primed    bool // the request was written in afn: a next call of afn means readable
}

// fastConn wraps c in a rawIO when it is a TCP connection; otherwise it returns c.
func fastConn(c net.Conn) net.Conn {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return c
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return c
	}
	f := &rawIO{Conn: c, rc: rc}
	f.rfn, f.wfn, f.afn = f.read, f.write, f.writeThenWait // bound once: no closure allocated per call
	return f
}

// awaitAnswer flushes bw, which writes to c, so that its write, when c is a rawIO, is
// writeAwait's: it returns once the request is written whole and the connection is readable.
// Only for the last write of a request whose answer the caller reads next on the same
// goroutine, with nothing written concurrently: a write that waits for an answer before the
// rest of the request is sent would wait until the deadline.
func awaitAnswer(c net.Conn, bw *bufio.Writer) error {
	f, ok := c.(*rawIO)
	if !ok {
		return bw.Flush()
	}
	f.awaitNext = true
	err := bw.Flush()
	f.awaitNext = false // flush had nothing to write
	return err
}

func (f *rawIO) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	f.rmu.Lock()
	defer f.rmu.Unlock()
	f.rbuf = p
	err := f.rc.Read(f.rfn)
	f.rbuf = nil
	switch {
	case err != nil:
		return 0, err // deadline passed, closed: the poller's errors, as net.Conn's
	case f.rerr != 0:
		return 0, &net.OpError{Op: "read", Net: "tcp", Source: f.LocalAddr(), Addr: f.RemoteAddr(), Err: os.NewSyscallError("read", f.rerr)}
	case f.rn == 0:
		return 0, io.EOF
	}
	return f.rn, nil
}

func (f *rawIO) read(fd uintptr) bool {
	for {
		n, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&f.rbuf[0])), uintptr(len(f.rbuf)))
		switch e {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false // wait until readable
		case 0:
			f.rn, f.rerr = int(n), 0
		default:
			f.rn, f.rerr = 0, e
		}
		return true
	}
}

func (f *rawIO) Write(p []byte) (int, error) {
	f.wmu.Lock()
	defer f.wmu.Unlock()
	if f.awaitNext && len(p) > 0 {
		f.awaitNext = false
		return f.writeAwait(p)
	}
	return f.writeLocked(p)
}

func (f *rawIO) writeLocked(p []byte) (int, error) {
	written := 0
	for written < len(p) {
		f.wbuf = p[written:]
		err := f.rc.Write(f.wfn)
		f.wbuf = nil
		if err != nil {
			return written, err
		}
		if f.werr != 0 {
			return written, &net.OpError{Op: "write", Net: "tcp", Source: f.LocalAddr(), Addr: f.RemoteAddr(), Err: os.NewSyscallError("write", f.werr)}
		}
		written += f.wn
	}
	return written, nil
}

func (f *rawIO) write(fd uintptr) bool {
	for {
		n, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&f.wbuf[0])), uintptr(len(f.wbuf)))
		switch e {
		case syscall.EINTR:
			continue
		case syscall.EAGAIN:
			return false // wait until writable
		case 0:
			f.wn, f.werr = int(n), 0
		default:
			f.wn, f.werr = 0, e
		}
		return true
	}
}

// writeAwait writes p, the end of a request, and then waits until the connection is readable:
// the read of the answer that follows finds it there, rather than failing with EAGAIN first and
// then waiting (a system call per call saved; the upstream never answers within the write).
//
// Why it cannot miss the answer: it writes from inside a RawConn.Read callback, that is after
// the poller forgot any readiness it had noted for the descriptor (internal/poll's prepareRead)
// and before it waits for the next. The answer can only arrive after the request was written, so
// its arrival is a readiness the wait sees, however fast it comes. (Bytes the upstream sent
// before, unasked, were found by the idle check when the connection was taken: see peeker.)
// A write that the socket takes only in part (a full send buffer) is finished by the ordinary
// write path, and the answer is then read the ordinary way; so is every error. When the wait
// ends by the read deadline or a close, p was written: the read that follows reports it.
func (f *rawIO) writeAwait(p []byte) (int, error) {
	f.rmu.Lock()
	f.wbuf, f.wn, f.werr, f.primed = p, 0, 0, false
	_ = f.rc.Read(f.afn) // its error (deadline, closed) is the next read's too
	n, werr := f.wn, f.werr
	f.wbuf = nil
	f.rmu.Unlock()
	if werr != 0 {
		return n, &net.OpError{Op: "write", Net: "tcp", Source: f.LocalAddr(), Addr: f.RemoteAddr(), Err: os.NewSyscallError("write", werr)}
	}
	if n < len(p) {
		m, err := f.writeLocked(p[n:])
		return n + m, err
	}
	return n, nil
}

// writeThenWait is writeAwait's callback: first the write (true: done with the descriptor,
// whole or not; false: written whole, wait until readable), then, when the poller calls it
// again, true: readable.
func (f *rawIO) writeThenWait(fd uintptr) bool {
	if f.primed {
		return true
	}
	f.primed = true
	for {
		n, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&f.wbuf[0])), uintptr(len(f.wbuf)))
		switch e {
		case syscall.EINTR:
			continue
		case 0:
			f.wn = int(n)
			return f.wn < len(f.wbuf)
		case syscall.EAGAIN:
			return true // the send buffer is full: the ordinary write path waits for room
		default:
			f.werr = e
			return true
		}
	}
}

// CloseWrite half-closes the connection (the server's gentle close).
func (f *rawIO) CloseWrite() error {
	if cw, ok := f.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// SyscallConn gives the descriptor (the pool's idle check peeks at it).
func (f *rawIO) SyscallConn() (syscall.RawConn, error) { return f.rc, nil }
