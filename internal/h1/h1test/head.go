package h1test

import (
	"bufio"
	"strings"
)

// ReadHead reads one message head from br, up to and with the empty line that ends it, as the
// raw upstreams of the tests see it.
func ReadHead(br *bufio.Reader) (string, error) {
	var head strings.Builder
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return head.String(), err
		}
		head.WriteString(line)
		if line == "\r\n" {
			return head.String(), nil
		}
	}
}
