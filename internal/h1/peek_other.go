//go:build !linux

package h1

import "net"

// peeker cannot look at a socket without reading it on this system: idle connections are
// assumed open (a closed one fails its next call with 502, never re-sent).
type peeker struct{}

func (*peeker) init(net.Conn) {}

func (*peeker) idle() bool { return true }
