package main

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"strconv"
)

// floor-h1 is the plain HTTP/1.1 part's floor: as little as an HTTP/1.1 proxy in Go can do on
// the runtime's poller — one goroutine per app connection with its own kept-alive upstream
// connection, each message's head copied line by line to its blank line and a Content-Length
// body after it, flushed once. Nothing is validated, no field is added or removed, nothing is
// admitted or counted: it is not a proxy anyone should run, only what any proxy written in Go
// costs here (the poller's waits, one goroutine's wake-up per message, two reads and two writes
// per call). Its distance to HAProxy is the runtime's; the agent's distance to it is the agent's.

// serveH1Relay serves floor-h1 on addr, forwarding to upAddr.
func serveH1Relay(addr, upAddr string) error {
	ln, err := listen(addr)
	if err != nil {
		return err
	}
	return serveEach(ln, func(c net.Conn) { relayH1(c, upAddr) })
}

// serveEach serves every connection ln accepts with handle, each on a goroutine of its own, until
// ln fails (closed).
func serveEach(ln net.Listener, handle func(net.Conn)) error {
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		go handle(c)
	}
}

// relayH1 passes c's requests to a connection of its own to upAddr and the answers back, one at
// a time, until either side closes or sends what it cannot frame.
func relayH1(c net.Conn, upAddr string) {
	defer func() { _ = c.Close() }()
	u, err := net.Dial("tcp", upAddr)
	if err != nil {
		return
	}
	defer func() { _ = u.Close() }()
	cr, ur := bufio.NewReaderSize(c, 4096), bufio.NewReaderSize(u, 4096)
	cw, uw := bufio.NewWriterSize(c, 4096), bufio.NewWriterSize(u, 4096)
	for copyMessage(uw, cr) == nil && copyMessage(cw, ur) == nil {
	}
}

var errFraming = errors.New("floor-h1: a Content-Length it cannot read")

// copyMessage copies one message from r to w: the head up to its blank line, then as many body
// bytes as its Content-Length says (none without one), then flushes w.
func copyMessage(w *bufio.Writer, r *bufio.Reader) error {
	length := 0
	for {
		line, err := r.ReadSlice('\n')
		if err != nil {
			return err
		}
		_, _ = w.Write(line)
		if len(line) <= 2 {
			break
		}
		if k, v, ok := bytes.Cut(line, []byte(":")); ok && bytes.EqualFold(k, []byte("Content-Length")) {
			if length, err = strconv.Atoi(string(bytes.TrimSpace(v))); err != nil || length < 0 {
				return errFraming
			}
		}
	}
	if _, err := io.CopyN(w, r, int64(length)); err != nil {
		return err
	}
	return w.Flush()
}
