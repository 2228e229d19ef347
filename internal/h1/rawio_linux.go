package h1

import (
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
	f.rfn, f.wfn = f.read, f.write // bound once: no closure allocated per call
	return f
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

// CloseWrite half-closes the connection (the server's gentle close).
func (f *rawIO) CloseWrite() error {
	if cw, ok := f.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// SyscallConn gives the descriptor (the pool's idle check peeks at it).
func (f *rawIO) SyscallConn() (syscall.RawConn, error) { return f.rc, nil }
