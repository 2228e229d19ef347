package h1

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// dialRaw dials addr and wraps the connection as the client does (a rawIO).
func dialRaw(t *testing.T, addr string) *rawIO {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	f, ok := fastConn(c).(*rawIO)
	if !ok {
		t.Fatal("a TCP connection is not wrapped in a rawIO")
	}
	return f
}

// readable reports, without waiting or consuming, whether c has bytes to read.
func readable(t *testing.T, c *rawIO) bool {
	t.Helper()
	var b [1]byte
	var n uintptr
	var e syscall.Errno
	if err := c.rc.Read(func(fd uintptr) bool {
		n, _, e = syscall.RawSyscall6(syscall.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&b[0])), 1,
			syscall.MSG_PEEK|syscall.MSG_DONTWAIT, 0, 0)
		return true
	}); err != nil {
		t.Fatal(err)
	}
	if e != 0 && e != syscall.EAGAIN {
		t.Fatal(e)
	}
	return e == 0 && n == 1
}

// TestAwaitAnswerWaitsForTheAnswer: a request flushed with awaitAnswer is written whole, and
// awaitAnswer returns only once its answer can be read, though the upstream answers late, and
// for every request on the connection in turn (each wait sees its own answer, none is missed).
func TestAwaitAnswerWaitsForTheAnswer(t *testing.T) {
	addr, _ := listenRaw(t, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				return
			}
			if line == "late\n" {
				time.Sleep(20 * time.Millisecond)
			}
			if _, err := io.WriteString(c, "got "+line); err != nil {
				return
			}
		}
	})
	f := dialRaw(t, addr)
	br := bufio.NewReader(f)
	bw := bufio.NewWriter(f)
	for i, req := range []string{"late\n", "at once\n", "late\n", "at once\n"} {
		_, _ = bw.WriteString(req)
		if err := awaitAnswer(f, bw); err != nil {
			t.Fatal(err)
		}
		if !readable(t, f) {
			t.Fatalf("request %d (%q): awaitAnswer returned before the answer could be read", i, req)
		}
		got, err := br.ReadString('\n')
		if err != nil || got != "got "+req {
			t.Fatalf("request %d: answer %q, %v; want %q", i, got, err, "got "+req)
		}
	}
	if f.awaitNext {
		t.Error("the next write would still wait for an answer")
	}
}

// TestAwaitAnswerPartialWrite: a request larger than the socket takes at once is finished by the
// ordinary write path, whole and in order, and its answer read after.
func TestAwaitAnswerPartialWrite(t *testing.T) {
	const size = 16 << 20
	addr, _ := listenRaw(t, func(c net.Conn) {
		time.Sleep(50 * time.Millisecond) // let the sender fill the socket's buffers
		n, _ := io.CopyN(io.Discard, c, size)
		_, _ = io.WriteString(c, "got "+strconv.FormatInt(n, 10)+"\n")
	})
	f := dialRaw(t, addr)
	if err := f.SetDeadline(time.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	bw := bufio.NewWriterSize(f, size) // one Flush, one Write of the whole request
	_, _ = bw.Write(bytes.Repeat([]byte{'x'}, size))
	if err := awaitAnswer(f, bw); err != nil {
		t.Fatal(err)
	}
	got, err := bufio.NewReader(f).ReadString('\n')
	if want := "got " + strconv.Itoa(size) + "\n"; err != nil || got != want {
		t.Fatalf("answer %q, %v; want %q", got, err, want)
	}
}

// TestAwaitAnswerDeadline: an upstream that never answers: awaitAnswer returns at the read
// deadline with the request written, and the read that follows fails with the deadline.
func TestAwaitAnswerDeadline(t *testing.T) {
	got := make(chan string, 1)
	addr, _ := listenRaw(t, func(c net.Conn) {
		line, _ := bufio.NewReader(c).ReadString('\n')
		got <- line
		_, _ = io.Copy(io.Discard, c) // never answers
	})
	f := dialRaw(t, addr)
	if err := f.SetReadDeadline(time.Now().Add(50 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	bw := bufio.NewWriter(f)
	_, _ = bw.WriteString("hello\n")
	if err := awaitAnswer(f, bw); err != nil {
		t.Fatalf("the request was written; awaitAnswer: %v", err)
	}
	if line := <-got; line != "hello\n" {
		t.Fatalf("the upstream read %q", line)
	}
	if _, err := f.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read after the deadline: %v", err)
	}
}

// TestAwaitAnswerClosed: an upstream that closes instead of answering ends the wait, and the
// read that follows sees the end of the connection.
func TestAwaitAnswerClosed(t *testing.T) {
	addr, _ := listenRaw(t, func(c net.Conn) {
		_, _ = bufio.NewReader(c).ReadString('\n')
		time.Sleep(10 * time.Millisecond)
	})
	f := dialRaw(t, addr)
	if err := f.SetDeadline(time.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	bw := bufio.NewWriter(f)
	_, _ = bw.WriteString("hello\n")
	if err := awaitAnswer(f, bw); err != nil {
		t.Fatal(err)
	}
	if _, err := f.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("read after the upstream closed: %v", err)
	}
}
