package assignment

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"
)

// signedTogether signs the requests in one batch, as a BatchSigner does when they queue behind
// a signature in the making.
func signedTogether(reqs []*http.Request, bodies [][]byte, key SigningKey, to []Target) {
	batch := make([]*pendingSig, len(reqs))
	for i, r := range reqs {
		batch[i] = newPending(r, bodies[i], key, to[i], testNow)
	}
	signBatch(batch)
	for i, r := range reqs {
		r.Header.Set("Authorization", batch[i].header())
	}
}

// randomRequests makes n requests to n different agents (pods, instances), each with its own
// body, as a renewal burst does.
func randomRequests(t testing.TB, rng *rand.Rand, n int) ([]*http.Request, [][]byte, []Target, []Self) {
	t.Helper()
	reqs, bodies, to, selves := make([]*http.Request, n), make([][]byte, n), make([]Target, n), make([]Self, n)
	for i := range n {
		selves[i] = Self{Pod: fmt.Sprintf("ns%d/pod-%d", rng.IntN(5), i), Instance: strconv.FormatUint(rng.Uint64(), 16)}
		to[i] = Target{Pod: selves[i].Pod, Instance: selves[i].Instance, Epoch: rng.Int64N(1 << 40)}
		if rng.IntN(4) == 0 {
			reqs[i] = httptest.NewRequest(http.MethodGet, "http://agent:15000"+PathState, nil)
		} else {
			reqs[i] = httptest.NewRequest(http.MethodPut, "http://agent:15000"+PathAssignment, nil)
			bodies[i] = fmt.Appendf(nil, `{"epoch":%d,"generation":%d}`, to[i].Epoch, rng.IntN(1000))
		}
	}
	return reqs, bodies, to, selves
}

func authParam(r *http.Request, name string) string {
	for part := range strings.SplitSeq(strings.TrimPrefix(r.Header.Get("Authorization"), AuthScheme+" "), ",") {
		if k, v, _ := strings.Cut(part, "="); k == name {
			return v
		}
	}
	return ""
}

func setAuthParam(r *http.Request, name, value string) {
	h := r.Header.Get("Authorization")
	old := authParam(r, name)
	r.Header.Set("Authorization", strings.Replace(h, ","+name+"="+old, ","+name+"="+value, 1))
}

// TestBatchSignatureProperty: over random batches of 1 to 70 requests to different agents, every
// request verifies at its own agent (with a proof when the batch has more than one), and no
// request verifies with anything changed: another request's proof or signature, a flipped side,
// a sibling dropped or changed, the proof removed or added, or any signed parameter.
func TestBatchSignatureProperty(t *testing.T) {
	trust := mustTrust(t, keyNew)
	for seed := range uint64(60) {
		rng := rand.New(rand.NewPCG(seed, 19))
		n := 1 + rng.IntN(70)
		if seed < 3 {
			n = int(seed) + 1
		}
		reqs, bodies, to, selves := randomRequests(t, rng, n)
		signedTogether(reqs, bodies, keyNew, to)
		verify := func(i int) error {
			_, err := Verify(reqs[i], bodies[i], trust, selves[i], true, testNow)
			return err
		}
		for i := range n {
			if err := verify(i); err != nil {
				t.Fatalf("seed %d: request %d of %d: %v", seed, i, n, err)
			}
			if got := authParam(reqs[i], "proof") != ""; got != (n > 1) {
				t.Fatalf("seed %d: request %d of %d carries a proof: %v", seed, i, n, got)
			}
		}
		mustRefuse := func(what string, i int, reason string) {
			t.Helper()
			if got := AuthReason(verify(i)); got != reason {
				t.Fatalf("seed %d, batch of %d, request %d, %s: got reason %q, want %q", seed, n, i, what, got, reason)
			}
		}
		i := rng.IntN(n)
		orig := reqs[i].Header.Get("Authorization")
		restore := func() { reqs[i].Header.Set("Authorization", orig) }

		if n > 1 {
			j := (i + 1 + rng.IntN(n-1)) % n
			setAuthParam(reqs[i], "proof", authParam(reqs[j], "proof"))
			mustRefuse("another request's proof", i, ReasonBadSignature)
			restore()

			siblings, sides, err := parseProof(authParam(reqs[i], "proof"))
			if err != nil {
				t.Fatal(err)
			}
			k := len(siblings) / sha256.Size
			bit := uint32(1) << rng.IntN(k)
			setAuthParam(reqs[i], "proof", formatProof(siblings, sides^bit))
			mustRefuse("a side flipped", i, ReasonBadSignature)
			restore()

			if k > 1 {
				setAuthParam(reqs[i], "proof", formatProof(siblings[:len(siblings)-sha256.Size], sides&^(1<<(k-1))))
				mustRefuse("the last sibling dropped", i, ReasonBadSignature)
				restore()
			}

			changed := append([]byte(nil), siblings...)
			changed[rng.IntN(len(changed))] ^= 1 << rng.IntN(8)
			setAuthParam(reqs[i], "proof", formatProof(changed, sides))
			mustRefuse("a sibling changed", i, ReasonBadSignature)
			restore()

			reqs[i].Header.Set("Authorization", strings.Replace(orig, ",proof="+authParam(reqs[i], "proof"), "", 1))
			mustRefuse("the proof removed", i, ReasonBadSignature)
			restore()
		} else {
			reqs[i].Header.Set("Authorization", orig+",proof=0."+base64.RawURLEncoding.EncodeToString(make([]byte, 32)))
			mustRefuse("a proof added to a lone signature", i, ReasonBadSignature)
			restore()
		}

		// Every signed parameter is still bound: the agent's own checks and the signature.
		bodyBefore := bodies[i]
		bodies[i] = append(append([]byte(nil), bodies[i]...), ' ')
		mustRefuse("the body changed", i, ReasonBadSignature)
		bodies[i] = bodyBefore
		for _, p := range []string{"ts", "epoch"} {
			v, _ := strconv.ParseInt(authParam(reqs[i], p), 10, 64)
			setAuthParam(reqs[i], p, strconv.FormatInt(v+1, 10))
			mustRefuse("the "+p+" changed", i, ReasonBadSignature)
			restore()
		}
		setAuthParam(reqs[i], "pod", selves[i].Pod+"x")
		mustRefuse("the pod changed", i, ReasonBadSignature)
		restore()
		if n > 1 {
			// A request with another's whole credentials is another agent's: refused for the pod
			// (it is signed; the agent tells what it was signed for).
			j := (i + 1) % n
			reqs[i].Header.Set("Authorization", reqs[j].Header.Get("Authorization"))
			if err := verify(i); err == nil {
				t.Fatalf("seed %d: request %d verified with request %d's credentials", seed, i, j)
			}
			restore()
		}
		if err := verify(i); err != nil {
			t.Fatalf("seed %d: request %d after restoring: %v", seed, i, err)
		}
	}
}

// TestBatchSignatureFormat recomputes a batch of three by the rules of the package doc, apart
// from the code that makes it: leaves, the promoted third leaf, the root, the signed message and
// each proof.
func TestBatchSignatureFormat(t *testing.T) {
	key := deterministicKey("k2", 2)
	reqs := make([]*http.Request, 3)
	bodies := make([][]byte, 3)
	to := make([]Target, 3)
	for i := range reqs {
		reqs[i] = newReq(t, http.MethodPut, PathAssignment)
		bodies[i] = fmt.Appendf(nil, `{"epoch":7,"generation":%d}`, i+1)
		to[i] = Target{Pod: fmt.Sprintf("shop/gateway-%d", i), Instance: "0123456789abcdef", Epoch: 7}
	}
	signedTogether(reqs, bodies, key, to)

	h := func(parts ...[]byte) []byte {
		s := sha256.New()
		for _, p := range parts {
			s.Write(p)
		}
		return s.Sum(nil)
	}
	leaf := make([][]byte, 3)
	for i := range leaf {
		base := "Apportion-Ed25519 v1\nPUT\n/v1/assignment\n" + strconv.FormatInt(testNow.UnixMilli(), 10) + "\n" +
			to[i].Pod + "\n0123456789abcdef\n7\n" + fmt.Sprintf("%x", sha256.Sum256(bodies[i]))
		leaf[i] = h([]byte{0}, []byte(base))
	}
	n01 := h([]byte{1}, leaf[0], leaf[1])
	root := h([]byte{1}, n01, leaf[2])
	wantProof := []string{
		"0." + base64.RawURLEncoding.EncodeToString(append(append([]byte(nil), leaf[1]...), leaf[2]...)),
		"1." + base64.RawURLEncoding.EncodeToString(append(append([]byte(nil), leaf[0]...), leaf[2]...)),
		"1." + base64.RawURLEncoding.EncodeToString(n01), // promoted: one sibling, on the left
	}
	for i, r := range reqs {
		if got := authParam(r, "proof"); got != wantProof[i] {
			t.Errorf("request %d: proof %s, want %s", i, got, wantProof[i])
		}
		sig, err := base64.RawURLEncoding.DecodeString(authParam(r, "sig"))
		if err != nil {
			t.Fatal(err)
		}
		if !ed25519.Verify(key.Public().Key, append([]byte("Apportion-Ed25519 batch v1\n"), root...), sig) {
			t.Errorf("request %d: the signature is not over the batch root", i)
		}
	}
}

// TestProofMalformed: proofs that cannot be one are refused as malformed before any hashing.
func TestProofMalformed(t *testing.T) {
	trust := mustTrust(t, keyNew)
	h32 := base64.RawURLEncoding.EncodeToString(make([]byte, 32))
	h17 := base64.RawURLEncoding.EncodeToString(make([]byte, 17*32))
	for _, proof := range []string{"", "0", "x." + h32, "0.", "0.!!", "0." + base64.RawURLEncoding.EncodeToString(make([]byte, 31)),
		"2." + h32, "-1." + h32, "0." + h17, "4294967296." + h32} {
		r := newReq(t, http.MethodGet, PathState)
		Sign(r, nil, keyNew, toSelf, testNow)
		r.Header.Set("Authorization", r.Header.Get("Authorization")+",proof="+proof)
		if _, err := Verify(r, nil, trust, self, true, testNow); AuthReason(err) != ReasonMalformed {
			t.Errorf("proof %q: %v, want %s", proof, err, ReasonMalformed)
		}
	}
	r := newReq(t, http.MethodGet, PathState)
	Sign(r, nil, keyNew, toSelf, testNow)
	r.Header.Set("Authorization", r.Header.Get("Authorization")+",proof=0."+h32+",proof=0."+h32)
	if _, err := Verify(r, nil, trust, self, true, testNow); AuthReason(err) != ReasonMalformed {
		t.Errorf("a proof given twice: %v, want %s", err, ReasonMalformed)
	}
}

// TestSignTogetherSend: pushes signed together are sent as signed, each verifies at its agent
// (the control API's checks, over HTTP), and one made unsigned is signed by the Client's key.
func TestSignTogetherSend(t *testing.T) {
	trust := mustTrust(t, keyNew, keyOld)
	const n = 5
	var outs []*Outgoing
	var eps []Endpoint
	for i := range n {
		pod := fmt.Sprintf("shop/gateway-%d", i)
		inst := fmt.Sprintf("%016x", i+1)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			if _, err := Verify(r, body, trust, Self{Pod: pod, Instance: inst}, false, time.Now()); err != nil {
				w.Header().Set("Content-Type", "application/problem+json")
				w.WriteHeader(http.StatusForbidden)
				_, _ = fmt.Fprintf(w, `{"title":"Forbidden","reason":%q}`, AuthReason(err))
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = fmt.Fprintf(w, `{"instance":%q,"epoch":7,"generation":1,"configured":true,"downstreams":[]}`, inst)
		}))
		t.Cleanup(srv.Close)
		a := &Assignment{Epoch: 7, Generation: 1, Instance: inst}
		body, _ := json.Marshal(a)
		ep := Endpoint{URL: srv.URL, Pod: pod}
		o, err := NewOutgoing(ep, a, body)
		if err != nil {
			t.Fatal(err)
		}
		outs, eps = append(outs, o), append(eps, ep)
	}
	SignTogether(outs[:n-1], keyNew, time.Now())
	c := &Client{Key: keyOld}
	for i, o := range outs {
		if got := o.Signed(); got != (i < n-1) {
			t.Fatalf("push %d signed: %v", i, got)
		}
		if _, err := c.Send(t.Context(), o); err != nil {
			t.Fatalf("push %d to %s: %v", i, eps[i].Pod, err)
		}
	}
	// Unsigned drops the batch signature: the push signed anew by the Client's key verifies too.
	if _, err := c.Send(t.Context(), outs[0].Unsigned()); err != nil {
		t.Fatalf("push 0 signed anew: %v", err)
	}
}

func BenchmarkBatchSign(b *testing.B) {
	for _, n := range []int{1, 8, 32} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			rng := rand.New(rand.NewPCG(1, 1))
			reqs, bodies, to, _ := randomRequests(b, rng, n)
			b.ReportAllocs()
			for b.Loop() {
				signedTogether(reqs, bodies, keyNew, to)
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n)/1000, "µs/request")
		})
	}
}
