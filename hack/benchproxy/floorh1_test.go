package main

import (
	"bufio"
	"errors"
	"net"
	"strings"
	"testing"
)

// The floor is only a floor if it is a proxy: calls on one kept-alive connection through it get
// the upstream's answers, in order.
func TestFloorH1PassesCalls(t *testing.T) {
	upLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = upLn.Close() })
	go func() { _ = serveOn(upLn) }()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() { _ = serveEach(ln, func(c net.Conn) { relayH1(c, upLn.Addr().String()) }) }()
	cl := newClient(ln.Addr().String())
	t.Cleanup(cl.close)
	for i := range 5 {
		if _, err := cl.call(); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if n := len(cl.idle); n != 1 {
		t.Fatalf("%d connections after 5 calls in a row, want the one kept alive", n)
	}
}

// A message's body is copied by its Content-Length, and the next message starts after it; a
// length it cannot read ends the connection rather than guessing.
func TestFloorH1CopiesBodies(t *testing.T) {
	in := "POST /a HTTP/1.1\r\nHost: h\r\ncontent-length: 5\r\n\r\nhelloGET /b HTTP/1.1\r\nHost: h\r\n\r\n"
	r := bufio.NewReader(strings.NewReader(in))
	var out strings.Builder
	w := bufio.NewWriter(&out)
	for range 2 {
		if err := copyMessage(w, r); err != nil {
			t.Fatal(err)
		}
	}
	if out.String() != in {
		t.Fatalf("copied %q, want %q", out.String(), in)
	}
	bad := bufio.NewReader(strings.NewReader("HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"))
	if err := copyMessage(bufio.NewWriter(&out), bad); !errors.Is(err, errFraming) {
		t.Fatalf("got %v for an unreadable Content-Length, want errFraming", err)
	}
}
