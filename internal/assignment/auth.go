package assignment

import (
	"crypto/ed25519"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Authentication of the control API.
//
// The manager signs every control request with an Ed25519 private key that exists only in its
// own namespace; an agent verifies with public keys (a TrustSet, mounted from the
// "apportion-trust" ConfigMap), so nothing an agent or an app namespace holds can sign. A request
// carries
//
//	Authorization: Apportion-Ed25519 keyid=<id>,ts=<unix ms>,pod=<namespace/name>,instance=<id>,epoch=<n>,sig=<base64url>
//
// (and a proof parameter when it was signed in a batch: batchsign.go), and sig is the Ed25519
// signature, unpadded base64url, of the signature base
//
//	"Apportion-Ed25519 v1\n" + method + "\n" + path + "\n" + ts + "\n" + pod + "\n" +
//	instance + "\n" + epoch + "\n" + hex(sha256(body))
//
// where path is the request's escaped URL path without the query and body the exact request body
// (empty for GET). The parameters bind a signature to its target:
//
//   - pod: the addressed pod; an agent refuses a signature for another pod (reason wrong-pod).
//   - instance: the addressed agent process (State.Instance); a push (PUT) must name the process
//     that receives it (reason wrong-instance), so a push captured before an agent restarted
//     cannot be replayed to the new process. A GET may leave it empty (the manager's first
//     contact, when it does not know the process yet).
//   - epoch: the signing manager's epoch; a push's must equal its body's (reason binding-mismatch).
//   - ts: when it was signed; refused when more than MaxClockSkew away from the verifier's clock
//     (reason stale-timestamp). An agent also ends a pushed lease no later than ts + LeaseTTL, so
//     a replay within the window cannot extend a lease (package enforce).
//
// Every refusal has a reason (an AuthError's Reason, the Reason* constants), which the agent
// answers with (401 for ReasonMissing, 403 for the others) and counts in
// apportion_agent_rejected_pushes_total{reason}.

// AuthScheme is the Authorization scheme of the control API.
const AuthScheme = "Apportion-Ed25519"

// signatureBasePrefix versions the signature base.
const signatureBasePrefix = "Apportion-Ed25519 v1\n"

// MaxClockSkew is how far a request's timestamp may be from the verifier's clock.
const MaxClockSkew = 2 * time.Minute

// Reasons a control request is refused (AuthError.Reason). They are stable: metric labels and
// problem codes use them.
const (
	ReasonMissing         = "missing-credentials" // no Authorization of the AuthScheme: 401
	ReasonMalformed       = "malformed"           // a malformed header, parameter or signature
	ReasonUnknownKey      = "unknown-key"         // the key id is not trusted (never, or withdrawn)
	ReasonBadSignature    = "bad-signature"       // the signature does not verify (other key, changed body, method or path)
	ReasonStaleTimestamp  = "stale-timestamp"     // ts more than MaxClockSkew away
	ReasonWrongPod        = "wrong-pod"           // signed for another pod
	ReasonWrongInstance   = "wrong-instance"      // signed for another agent process (a restart)
	ReasonBindingMismatch = "binding-mismatch"    // the signed epoch or instance differs from the body's
)

var (
	// ErrMissingCredentials: the request has no Authorization header of the AuthScheme.
	// The control API answers 401.
	ErrMissingCredentials = errors.New("missing " + AuthScheme + " authorization")
	// ErrInvalidCredentials: any other refusal. The control API answers 403. The wrapping
	// AuthError says why.
	ErrInvalidCredentials = errors.New("invalid credentials")
)

// AuthError is a refused control request: Reason is one of the Reason* constants, Detail says
// more (never with key material). It wraps ErrMissingCredentials or ErrInvalidCredentials.
type AuthError struct {
	Reason string
	Detail string
}

func (e *AuthError) Error() string {
	if e.Reason == ReasonMissing {
		return ErrMissingCredentials.Error()
	}
	return ErrInvalidCredentials.Error() + ": " + e.Reason + ": " + e.Detail
}

// Unwrap makes errors.Is work with the two sentinels.
func (e *AuthError) Unwrap() error {
	if e.Reason == ReasonMissing {
		return ErrMissingCredentials
	}
	return ErrInvalidCredentials
}

func refuse(reason, format string, args ...any) *AuthError {
	return &AuthError{Reason: reason, Detail: fmt.Sprintf(format, args...)}
}

// AuthReason returns the reason of a refusal (an *AuthError), or "" for other errors.
func AuthReason(err error) string {
	var ae *AuthError
	if errors.As(err, &ae) {
		return ae.Reason
	}
	return ""
}

// SigningKey is the manager's private key. Only the manager holds it.
type SigningKey struct {
	ID      string
	Private ed25519.PrivateKey
}

// String never prints the key.
func (k SigningKey) String() string { return "SigningKey(" + k.ID + ")" }

// GoString never prints the key.
func (k SigningKey) GoString() string { return k.String() }

// Public is the verifying half.
func (k SigningKey) Public() PublicKey {
	return PublicKey{ID: k.ID, Key: k.Private.Public().(ed25519.PublicKey)}
}

// PublicKey is a key an agent trusts.
type PublicKey struct {
	ID  string
	Key ed25519.PublicKey
}

// TrustSet holds the public keys a verifier accepts, by id. The zero TrustSet accepts nothing.
type TrustSet struct {
	keys map[string]ed25519.PublicKey
}

// NewTrustSet builds a TrustSet; ids must be unique and valid (see ValidKeyID), keys
// ed25519.PublicKeySize bytes.
func NewTrustSet(keys ...PublicKey) (TrustSet, error) {
	ts := TrustSet{keys: make(map[string]ed25519.PublicKey, len(keys))}
	for _, k := range keys {
		if !ValidKeyID(k.ID) {
			return TrustSet{}, fmt.Errorf("key id %q: must be 1-128 characters of [A-Za-z0-9._-] not starting with '.'", k.ID)
		}
		if len(k.Key) != ed25519.PublicKeySize {
			return TrustSet{}, fmt.Errorf("key %q: an Ed25519 public key is %d bytes, got %d", k.ID, ed25519.PublicKeySize, len(k.Key))
		}
		if _, dup := ts.keys[k.ID]; dup {
			return TrustSet{}, fmt.Errorf("key %q given twice", k.ID)
		}
		ts.keys[k.ID] = slices.Clone(k.Key)
	}
	return ts, nil
}

// ValidKeyID reports whether id is 1-128 characters of [A-Za-z0-9._-] not starting with '.'.
func ValidKeyID(id string) bool {
	if id == "" || len(id) > 128 || id[0] == '.' {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// Len is the number of keys.
func (ts TrustSet) Len() int { return len(ts.keys) }

// IDs returns the key ids, sorted.
func (ts TrustSet) IDs() []string {
	ids := make([]string, 0, len(ts.keys))
	for id := range ts.keys {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// TrustFileSuffix ends the name of every file of a trust directory: "<key id>.pem".
const TrustFileSuffix = ".pem"

// MarshalPublicKey encodes a public key as the PEM "PUBLIC KEY" (PKIX) block a trust file holds.
func MarshalPublicKey(k ed25519.PublicKey) ([]byte, error) {
	der, err := x509.MarshalPKIXPublicKey(k)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), nil
}

// ParsePublicKey decodes one PEM "PUBLIC KEY" block holding an Ed25519 key, and nothing else.
func ParsePublicKey(data []byte) (ed25519.PublicKey, error) {
	b, rest := pem.Decode(data)
	if b == nil || b.Type != "PUBLIC KEY" {
		return nil, errors.New(`not a PEM "PUBLIC KEY" block`)
	}
	if len(strings.TrimSpace(string(rest))) != 0 {
		return nil, errors.New("data after the PEM block")
	}
	pub, err := x509.ParsePKIXPublicKey(b.Bytes)
	if err != nil {
		return nil, err
	}
	k, ok := pub.(ed25519.PublicKey)
	if !ok {
		return nil, fmt.Errorf("a %T, not an Ed25519 public key", pub)
	}
	return k, nil
}

// MarshalPrivateKey encodes a private key as a PEM "PRIVATE KEY" (PKCS #8) block.
func MarshalPrivateKey(k ed25519.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// ParsePrivateKey decodes one PEM "PRIVATE KEY" (PKCS #8) block holding an Ed25519 key.
func ParsePrivateKey(data []byte) (ed25519.PrivateKey, error) {
	b, _ := pem.Decode(data)
	if b == nil || b.Type != "PRIVATE KEY" {
		return nil, errors.New(`not a PEM "PRIVATE KEY" block`)
	}
	priv, err := x509.ParsePKCS8PrivateKey(b.Bytes)
	if err != nil {
		return nil, err
	}
	k, ok := priv.(ed25519.PrivateKey)
	if !ok {
		return nil, fmt.Errorf("a %T, not an Ed25519 private key", priv)
	}
	return k, nil
}

// LoadTrustDir reads the public keys of a trust directory (the "apportion-trust" ConfigMap
// mounted as a volume): one file "<key id>.pem" per key holding a PEM "PUBLIC KEY" block. The
// volume's hidden entries ("..data" and the timestamped directory it points to) and every name
// starting with '.' are skipped and symbolic links are followed; any other file, a file that is
// not such a key, and a directory with no key are errors.
func LoadTrustDir(dir string) (TrustSet, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return TrustSet{}, fmt.Errorf("reading trust directory: %w", err)
	}
	var keys []PublicKey
	for _, e := range entries {
		name := e.Name()
		if strings.HasPrefix(name, ".") {
			continue
		}
		path := filepath.Join(dir, name)
		fi, err := os.Stat(path) // follows the ConfigMap volume's symlinks
		if err != nil {
			return TrustSet{}, fmt.Errorf("trust file %s: %w", path, err)
		}
		if fi.IsDir() {
			continue
		}
		id, ok := strings.CutSuffix(name, TrustFileSuffix)
		if !ok {
			return TrustSet{}, fmt.Errorf("trust file %s: names must be <key id>%s", path, TrustFileSuffix)
		}
		if !fi.Mode().IsRegular() {
			return TrustSet{}, fmt.Errorf("trust file %s: not a regular file", path)
		}
		if fi.Size() > 16<<10 {
			return TrustSet{}, fmt.Errorf("trust file %s: larger than 16 KiB", path)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return TrustSet{}, fmt.Errorf("trust file %s: %w", path, err)
		}
		k, err := ParsePublicKey(data)
		if err != nil {
			return TrustSet{}, fmt.Errorf("trust file %s: %w", path, err)
		}
		keys = append(keys, PublicKey{ID: id, Key: k})
	}
	if len(keys) == 0 {
		return TrustSet{}, fmt.Errorf("trust directory %s holds no key file", dir)
	}
	ts, err := NewTrustSet(keys...)
	if err != nil {
		return TrustSet{}, fmt.Errorf("trust directory %s: %w", dir, err)
	}
	return ts, nil
}

// Target is what a signature binds a request to besides its method, path and body: the
// addressed agent and the signing manager's epoch.
type Target struct {
	// Pod is the addressed pod, "namespace/name".
	Pod string
	// Instance is the addressed agent process (State.Instance); empty only for a first GET.
	Instance string
	// Epoch is the signing manager's epoch (for a push, the Assignment's).
	Epoch int64
}

// Sign sets req's Authorization header for body (the exact bytes sent; nil for none), bound to
// to, with key at time now.
func Sign(req *http.Request, body []byte, key SigningKey, to Target, now time.Time) {
	p := newPending(req, body, key, to, now)
	signBatch([]*pendingSig{p})
	req.Header.Set("Authorization", p.header())
}

func signatureBase(method, path, ts, pod, instance, epoch string, body []byte) []byte {
	sum := sha256.Sum256(body)
	b := make([]byte, 0, len(signatureBasePrefix)+len(method)+len(path)+len(ts)+len(pod)+len(instance)+len(epoch)+6+2*sha256.Size)
	b = append(b, signatureBasePrefix...)
	for _, s := range []string{method, path, ts, pod, instance, epoch} {
		b = append(b, s...)
		b = append(b, '\n')
	}
	return hex.AppendEncode(b, sum[:])
}

// Self is what a verifying agent is: its pod ("namespace/name") and its process instance.
type Self struct {
	Pod      string
	Instance string
}

// Verified is what a valid signature says.
type Verified struct {
	KeyID  string
	Signed time.Time // the signed timestamp
	Target Target
}

// Verify checks req's Authorization header against body (the exact bytes received) with the keys
// of trust, at time now, for the agent self. The signed pod must be self.Pod; the signed
// instance must be self.Instance, or empty when instanceOptional (a GET). It returns what was
// signed, or an *AuthError (wrapping ErrMissingCredentials: answer 401; ErrInvalidCredentials:
// 403) whose Reason says why and whose Detail names the key id but no key material.
func Verify(req *http.Request, body []byte, trust TrustSet, self Self, instanceOptional bool, now time.Time) (Verified, error) {
	h := req.Header.Get("Authorization")
	scheme, params, _ := strings.Cut(h, " ")
	if h == "" || !strings.EqualFold(scheme, AuthScheme) {
		return Verified{}, &AuthError{Reason: ReasonMissing}
	}
	var keyID, ts, pod, instance, epoch, sigText, proofText string
	var seen int
	for part := range strings.SplitSeq(params, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			return Verified{}, refuse(ReasonMalformed, "malformed authorization parameter")
		}
		var bit int
		switch k {
		case "keyid":
			keyID, bit = v, 1
		case "ts":
			ts, bit = v, 2
		case "pod":
			pod, bit = v, 4
		case "instance":
			instance, bit = v, 8
		case "epoch":
			epoch, bit = v, 16
		case "sig":
			sigText, bit = v, 32
		case "proof":
			proofText, bit = v, 64 // optional: a batch signature (batchsign.go)
		default:
			return Verified{}, refuse(ReasonMalformed, "unknown authorization parameter %q", truncate(k, 32))
		}
		if seen&bit != 0 {
			return Verified{}, refuse(ReasonMalformed, "authorization parameter %q given twice", k)
		}
		seen |= bit
	}
	if seen&63 != 63 {
		return Verified{}, refuse(ReasonMalformed, "authorization needs keyid, ts, pod, instance, epoch and sig (and may have proof)")
	}
	pub, ok := trust.keys[keyID]
	if !ok {
		return Verified{}, refuse(ReasonUnknownKey, "key id %q is not trusted", truncate(keyID, 128))
	}
	ms, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || ms < 0 {
		return Verified{}, refuse(ReasonMalformed, "malformed timestamp (key id %q)", keyID)
	}
	ep, err := strconv.ParseInt(epoch, 10, 64)
	if err != nil || ep < 0 {
		return Verified{}, refuse(ReasonMalformed, "malformed epoch (key id %q)", keyID)
	}
	sig, err := base64.RawURLEncoding.DecodeString(sigText)
	if err != nil || len(sig) != ed25519.SignatureSize {
		return Verified{}, refuse(ReasonMalformed, "malformed signature (key id %q)", keyID)
	}
	// The signature first: the reasons below then describe what the manager really signed.
	msg := signatureBase(req.Method, req.URL.EscapedPath(), ts, pod, instance, epoch, body)
	if seen&64 != 0 {
		siblings, sides, err := parseProof(proofText)
		if err != nil {
			return Verified{}, refuse(ReasonMalformed, "%s (key id %q)", err.Error(), keyID)
		}
		msg = batchMessage(foldProof(leafHash(msg), siblings, sides))
	}
	if !ed25519.Verify(pub, msg, sig) {
		return Verified{}, refuse(ReasonBadSignature, "signature does not verify (key id %q)", keyID)
	}
	signed := time.UnixMilli(ms)
	if skew := now.Sub(signed); skew > MaxClockSkew || skew < -MaxClockSkew {
		return Verified{}, refuse(ReasonStaleTimestamp, "signed at %s, more than %s away from the agent's clock (key id %q)",
			signed.UTC().Format(time.RFC3339Nano), MaxClockSkew, keyID)
	}
	if pod != self.Pod {
		return Verified{}, refuse(ReasonWrongPod, "signed for pod %q, this is %q", truncate(pod, 300), self.Pod)
	}
	if instance != self.Instance && (instance != "" || !instanceOptional) {
		return Verified{}, refuse(ReasonWrongInstance, "signed for agent instance %q, this is %q (the agent restarted)", truncate(instance, 64), self.Instance)
	}
	return Verified{KeyID: keyID, Signed: signed, Target: Target{Pod: pod, Instance: instance, Epoch: ep}}, nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
