package assignment

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Batch signatures.
//
// Signing was the largest single cost of a lease renewal to the manager (one Ed25519 signature
// per request, every RenewEvery, per pod). SignTogether signs several requests with one
// signature: each request's signature base (the same string Sign signs) is a leaf of a Merkle
// tree, the signature is over the root, and each request carries the sibling hashes from its leaf
// to the root:
//
//	Authorization: Apportion-Ed25519 keyid=…,ts=…,pod=…,instance=…,epoch=…,sig=<sig over the root>,proof=<sides>.<hashes>
//
//	leaf    = SHA-256(0x00 || signature base)
//	node    = SHA-256(0x01 || left || right)          (a node without a pair moves up unchanged)
//	signed  = "Apportion-Ed25519 batch v1\n" || root  (32 bytes)
//	hashes  = unpadded base64url of the siblings from the leaf up, 32 bytes each (1 to 16 of them)
//	sides   = decimal; bit i set: sibling i is the left one
//
// A verifier hashes its own request's signature base into a leaf, folds the siblings in, and
// checks the signature over the root. What a signature binds is unchanged: the leaf is the whole
// signature base (method, path, timestamp, pod, instance, epoch, body digest), and SHA-256 makes
// a proof for any other base infeasible; the 0x00/0x01 prefixes keep a leaf from passing for an
// inner node (as in RFC 6962), and the distinct "batch" prefix keeps a root signature from
// passing for a single request's signature and the reverse. A proof reveals to the agent that
// receives it only hashes of other requests' bases. A request signed alone carries no proof and
// is exactly what Sign makes.
//
// Only agents that advertise CapabilityBatchSignatures in their State get proofs (an older agent
// refuses the unknown parameter as malformed).

// CapabilityBatchSignatures is the State capability of an agent that verifies batch signatures.
const CapabilityBatchSignatures = "batch-signatures"

// batchSignaturePrefix versions what a batch signature signs (the prefix, then the root).
const batchSignaturePrefix = "Apportion-Ed25519 batch v1\n"

// maxProofDepth bounds a proof's siblings: a batch holds at most 1<<maxProofDepth requests.
const maxProofDepth = 16

// MaxBatch is the most requests SignTogether signs with one signature.
const MaxBatch = 1 << maxProofDepth

type digest = [sha256.Size]byte

func leafHash(base []byte) digest {
	h := sha256.New()
	h.Write([]byte{0})
	h.Write(base)
	var d digest
	h.Sum(d[:0])
	return d
}

func nodeHash(left, right *digest) digest {
	var b [1 + 2*sha256.Size]byte
	b[0] = 1
	copy(b[1:], left[:])
	copy(b[1+sha256.Size:], right[:])
	return sha256.Sum256(b[:])
}

func batchMessage(root digest) []byte {
	return append([]byte(batchSignaturePrefix), root[:]...)
}

// merkleProofs builds the tree over leaves and returns its root and, for every leaf, its
// siblings from the bottom up (concatenated) and their sides (bit i set: sibling i is on the
// left).
func merkleProofs(leaves []digest) (root digest, proofs [][]byte, sides []uint32) {
	n := len(leaves)
	proofs, sides = make([][]byte, n), make([]uint32, n)
	pos := make([]int, n) // each leaf's index in the current level
	for i := range pos {
		pos[i] = i
	}
	level := leaves
	for len(level) > 1 {
		for i := range n {
			j := pos[i]
			if sib := j ^ 1; sib < len(level) {
				if j&1 == 1 {
					sides[i] |= 1 << (len(proofs[i]) / sha256.Size)
				}
				proofs[i] = append(proofs[i], level[sib][:]...)
			}
			pos[i] = j / 2
		}
		next := make([]digest, (len(level)+1)/2)
		for k := range next {
			if 2*k+1 < len(level) {
				next[k] = nodeHash(&level[2*k], &level[2*k+1])
			} else {
				next[k] = level[2*k]
			}
		}
		level = next
	}
	return level[0], proofs, sides
}

// foldProof is the root a proof leads to from leaf.
func foldProof(leaf digest, siblings []byte, sides uint32) digest {
	h := leaf
	for i := 0; i*sha256.Size < len(siblings); i++ {
		var s digest
		copy(s[:], siblings[i*sha256.Size:])
		if sides&(1<<i) != 0 {
			h = nodeHash(&s, &h)
		} else {
			h = nodeHash(&h, &s)
		}
	}
	return h
}

func formatProof(siblings []byte, sides uint32) string {
	return strconv.FormatUint(uint64(sides), 10) + "." + base64.RawURLEncoding.EncodeToString(siblings)
}

// parseProof decodes a proof parameter: 1 to maxProofDepth siblings, no side bit beyond them.
func parseProof(s string) (siblings []byte, sides uint32, err error) {
	sideText, hashText, ok := strings.Cut(s, ".")
	if !ok {
		return nil, 0, errors.New("a proof is <sides>.<hashes>")
	}
	v, err := strconv.ParseUint(sideText, 10, 32)
	if err != nil {
		return nil, 0, errors.New("malformed proof sides")
	}
	siblings, err = base64.RawURLEncoding.DecodeString(hashText)
	if err != nil {
		return nil, 0, errors.New("malformed proof hashes")
	}
	k := len(siblings) / sha256.Size
	if len(siblings)%sha256.Size != 0 || k < 1 || k > maxProofDepth {
		return nil, 0, errors.New("a proof holds 1 to 16 hashes of 32 bytes")
	}
	if v>>k != 0 {
		return nil, 0, errors.New("proof sides name more hashes than it holds")
	}
	return siblings, uint32(v), nil
}

// pendingSig is one request's signature in the making.
type pendingSig struct {
	base []byte
	key  SigningKey
	// the signed parameters, as the header carries them
	ts, epoch, pod, instance string
	sig                      []byte
	proof                    string
}

func newPending(req *http.Request, body []byte, key SigningKey, to Target, now time.Time) *pendingSig {
	p := &pendingSig{key: key, ts: strconv.FormatInt(now.UnixMilli(), 10), epoch: strconv.FormatInt(to.Epoch, 10),
		pod: to.Pod, instance: to.Instance}
	p.base = signatureBase(req.Method, req.URL.EscapedPath(), p.ts, p.pod, p.instance, p.epoch, body)
	return p
}

// header is the Authorization header of a signed request.
func (p *pendingSig) header() string {
	h := AuthScheme + " keyid=" + p.key.ID + ",ts=" + p.ts + ",pod=" + p.pod + ",instance=" + p.instance +
		",epoch=" + p.epoch + ",sig=" + base64.RawURLEncoding.EncodeToString(p.sig)
	if p.proof != "" {
		h += ",proof=" + p.proof
	}
	return h
}

// signBatch signs one batch: a lone request as Sign does, more with one signature over the
// Merkle root of their bases.
func signBatch(batch []*pendingSig) {
	key := batch[0].key.Private
	if len(batch) == 1 {
		batch[0].sig = ed25519.Sign(key, batch[0].base)
		return
	}
	leaves := make([]digest, len(batch))
	for i, q := range batch {
		leaves[i] = leafHash(q.base)
	}
	root, proofs, sides := merkleProofs(leaves)
	sig := ed25519.Sign(key, batchMessage(root))
	for i, q := range batch {
		q.sig, q.proof = sig, formatProof(proofs[i], sides[i])
	}
}
