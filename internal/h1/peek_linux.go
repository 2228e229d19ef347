package h1

import (
	"net"
	"syscall"
	"unsafe"
)

// peeker tells, without blocking and without consuming anything, whether an idle connection's
// peer has closed it or sent data: one recvfrom(MSG_PEEK|MSG_DONTWAIT). http.Transport learns
// the same from a goroutine parked in a read on every idle connection; one system call when
// the connection is taken costs less than that goroutine's wake-ups.
type peeker struct {
	raw syscall.RawConn // nil: cannot tell, assume alive
	fn  func(fd uintptr) bool
	n   uintptr
	err syscall.Errno
	b   [1]byte
}

func (p *peeker) init(c net.Conn) {
	if sc, ok := c.(syscall.Conn); ok {
		if raw, err := sc.SyscallConn(); err == nil {
			p.raw = raw
			p.fn = p.recv // bound once: no closure allocated per check
		}
	}
}

// recv runs on the connection's descriptor; RawSyscall: MSG_DONTWAIT never blocks.
func (p *peeker) recv(fd uintptr) bool {
	p.n, _, p.err = syscall.RawSyscall6(syscall.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&p.b[0])), 1,
		syscall.MSG_PEEK|syscall.MSG_DONTWAIT, 0, 0)
	return true // never wait for readiness
}

// idle reports whether the connection is open with nothing to read.
func (p *peeker) idle() bool {
	if p.raw == nil {
		return true
	}
	if err := p.raw.Read(p.fn); err != nil {
		return false
	}
	// EAGAIN: open and nothing to read. 0 bytes without error: closed by the peer. Data, or any
	// other error (a reset): unusable.
	return p.err == syscall.EAGAIN
}
