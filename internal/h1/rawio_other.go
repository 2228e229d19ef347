//go:build !linux

package h1

import (
	"bufio"
	"net"
)

// fastConn is c itself on systems without the raw I/O of rawio_linux.go.
func fastConn(c net.Conn) net.Conn { return c }

// awaitAnswer is bw's Flush: the ordinary write, then the ordinary read.
func awaitAnswer(_ net.Conn, bw *bufio.Writer) error { return bw.Flush() }
