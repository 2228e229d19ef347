// Package h1 is the project's HTTP/1.1 engine, written for the agent and shared with the
// manager: a server that serves an http.Handler to the app over its connections (Server), and a
// client that sends requests to http (and, with a Handshaker, https) upstreams over pooled connections (Client.Do). It speaks net/http's vocabulary (http.Handler,
// http.ResponseWriter with http.ResponseController's deadlines, flushing and hijacking,
// *http.Request, *http.Response) and knows nothing of downstreams, permits, breakers or
// fallbacks: that policy is package proxy's, served by it. The manager sends its control-API
// requests to the agents with the same Client, through HTTPClient (http.Client's shape).
//
// Why its own engine, for CPU (see docs/benchmarks.md): http.Server starts a background read
// per request and http.Transport two goroutines per connection with channel handoffs per call;
// on the agent's small calls that machinery cost more than the proxying. Server and Client
// drive a connection from one goroutine, read small heads in one pass (head.go) and read and
// write sockets with raw non-blocking system calls (rawio_linux.go).
//
// What is guaranteed:
//
//   - Server reads exactly what net/http's server reads from the same bytes, and refuses what
//     it refuses (400, 417, 431, 501, 505, closing the connection), but for two deliberate
//     differences allowed by the RFC: a request with both Content-Length and Transfer-Encoding
//     closes the connection after its answer (RFC 9112 §6.1), and the HTTP/2 preface
//     ("PRI * HTTP/2.0", which net/http hands to the handler) is refused with 505 — unless
//     Server.HTTP2 is set and the connection starts with the whole 24-byte preface: then the
//     connection is HTTP/2 with prior knowledge (h2c) and is handed to net/http's own HTTP/2
//     server (h2c.go), which owns its framing. FuzzServerDifferential holds it to that on
//     arbitrary input, with HTTP2 set and without; FuzzRequestHead and FuzzResponseHead hold
//     the one-pass head readers to net/http's.
//   - Client never sends a request twice: a pooled connection is checked before it is reused
//     (peek_linux.go), and any failure after the request was written is returned.
//   - Hop-by-hop fields (IsHopByHop, RemoveHopByHop) are the one list of the agent.
//
// TLS: the client speaks TLS to a Target whose TLS Handshaker is set (the agent's
// upstreamtls.Upstream: crypto/tls over the raw connection, so the fast path stays); the server
// is plain HTTP (the app is on loopback).
//
// Not done: HTTP/2 of its own (the server hands h2c connections to net/http's; the client is
// HTTP/1.1 only), server-side TLS, Content-Type sniffing, protocol upgrades and Expect: 100-continue on
// the client side (CanSend tells; http.Transport sends those).
package h1
