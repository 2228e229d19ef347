//go:build !linux

package h1

import "net"

// fastConn is c itself on systems without the raw I/O of rawio_linux.go.
func fastConn(c net.Conn) net.Conn { return c }
