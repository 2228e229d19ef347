package assignment

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
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
// Every control request carries
//
//	Authorization: Apportion-HMAC-SHA256 keyid=<id>,ts=<unix seconds>,sig=<hex>
//
// where sig = hex(HMAC-SHA256(secret, method + "\n" + path + "\n" + ts + "\n" +
// hex(sha256(body)))), path being the request's escaped URL path without the query, and body
// the exact request body (empty for GET). The verifier accepts a signature made with any key of
// its KeySet (so a key can be rotated: mount the new and the old one, switch the signers, then
// remove the old one) and refuses a timestamp more than MaxClockSkew away from its clock.
// A signed request can be replayed within that window; every control call is idempotent under
// the fencing rules, so a replay cannot roll an agent back.

// AuthScheme is the Authorization scheme of the control API.
const AuthScheme = "Apportion-HMAC-SHA256"

// MaxClockSkew is how far a request's timestamp may be from the verifier's clock.
const MaxClockSkew = 2 * time.Minute

// MinSecretLength is the shortest secret LoadKeyDir and NewKeySet accept.
const MinSecretLength = 32

var (
	// ErrMissingCredentials: the request has no Authorization header of the AuthScheme.
	// The control API answers 401.
	ErrMissingCredentials = errors.New("missing " + AuthScheme + " authorization")
	// ErrInvalidCredentials: a malformed header, an unknown key id, a wrong signature or a
	// timestamp out of the allowed skew. The control API answers 403. The wrapping error says
	// which, never with the secret.
	ErrInvalidCredentials = errors.New("invalid credentials")
)

// Key is a shared signing key.
type Key struct {
	ID     string
	Secret []byte
}

// String never prints the secret.
func (k Key) String() string { return "Key(" + k.ID + ")" }

// GoString never prints the secret.
func (k Key) GoString() string { return k.String() }

// KeySet holds the keys a verifier accepts, by id. The zero KeySet accepts nothing.
type KeySet struct {
	keys map[string][]byte
}

// NewKeySet builds a KeySet; ids must be unique and valid (see ValidKeyID), secrets at least
// MinSecretLength bytes.
func NewKeySet(keys ...Key) (KeySet, error) {
	ks := KeySet{keys: make(map[string][]byte, len(keys))}
	for _, k := range keys {
		if !ValidKeyID(k.ID) {
			return KeySet{}, fmt.Errorf("key id %q: must be 1-128 characters of [A-Za-z0-9._-]", k.ID)
		}
		if len(k.Secret) < MinSecretLength {
			return KeySet{}, fmt.Errorf("key %q: secret must be at least %d bytes, has %d", k.ID, MinSecretLength, len(k.Secret))
		}
		if _, dup := ks.keys[k.ID]; dup {
			return KeySet{}, fmt.Errorf("key %q given twice", k.ID)
		}
		ks.keys[k.ID] = slices.Clone(k.Secret)
	}
	return ks, nil
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
func (ks KeySet) Len() int { return len(ks.keys) }

// IDs returns the key ids, sorted.
func (ks KeySet) IDs() []string {
	ids := make([]string, 0, len(ks.keys))
	for id := range ks.keys {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// Key returns the key with this id.
func (ks KeySet) Key(id string) (Key, bool) {
	s, ok := ks.keys[id]
	if !ok {
		return Key{}, false
	}
	return Key{ID: id, Secret: slices.Clone(s)}, true
}

// Current returns the key signers should use: by convention the one whose id sorts last
// (name keys so that the newest sorts last, e.g. "2026-07-01" or "k0007"). ok is false when the
// set is empty.
func (ks KeySet) Current() (Key, bool) {
	ids := ks.IDs()
	if len(ids) == 0 {
		return Key{}, false
	}
	return ks.Key(ids[len(ids)-1])
}

// LoadKeyDir reads one key per regular file of dir: the file name is the key id, the file's
// exact contents (a trailing newline included) the secret, of at least MinSecretLength bytes.
// This is how a Kubernetes Secret mounted as a volume looks; its hidden entries ("..data" and
// the timestamped directory they point to) and every name starting with '.' are skipped, and
// symbolic links are followed. A directory with no key is an error.
func LoadKeyDir(dir string) (KeySet, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return KeySet{}, fmt.Errorf("reading key directory: %w", err)
	}
	var keys []Key
	for _, e := range entries {
		name := e.Name()
		if strings.HasPrefix(name, ".") {
			continue
		}
		path := filepath.Join(dir, name)
		fi, err := os.Stat(path) // follows the Secret volume's symlinks
		if err != nil {
			return KeySet{}, fmt.Errorf("key file %s: %w", path, err)
		}
		if fi.IsDir() {
			continue
		}
		if !fi.Mode().IsRegular() {
			return KeySet{}, fmt.Errorf("key file %s: not a regular file", path)
		}
		if fi.Size() > 64<<10 {
			return KeySet{}, fmt.Errorf("key file %s: larger than 64 KiB", path)
		}
		secret, err := os.ReadFile(path)
		if err != nil {
			return KeySet{}, fmt.Errorf("key file %s: %w", path, err)
		}
		keys = append(keys, Key{ID: name, Secret: secret})
	}
	if len(keys) == 0 {
		return KeySet{}, fmt.Errorf("key directory %s holds no key file", dir)
	}
	ks, err := NewKeySet(keys...)
	if err != nil {
		return KeySet{}, fmt.Errorf("key directory %s: %w", dir, err)
	}
	return ks, nil
}

// Sign sets req's Authorization header for body (the exact bytes sent; nil for none) with key
// at time now.
func Sign(req *http.Request, body []byte, key Key, now time.Time) {
	ts := strconv.FormatInt(now.Unix(), 10)
	sig := signature(key.Secret, req.Method, req.URL.EscapedPath(), ts, body)
	req.Header.Set("Authorization", AuthScheme+" keyid="+key.ID+",ts="+ts+",sig="+hex.EncodeToString(sig))
}

func signature(secret []byte, method, path, ts string, body []byte) []byte {
	bodySum := sha256.Sum256(body)
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(method))
	mac.Write([]byte{'\n'})
	mac.Write([]byte(path))
	mac.Write([]byte{'\n'})
	mac.Write([]byte(ts))
	mac.Write([]byte{'\n'})
	var hexSum [2 * sha256.Size]byte
	hex.Encode(hexSum[:], bodySum[:])
	mac.Write(hexSum[:])
	return mac.Sum(nil)
}

// Verify checks req's Authorization header against body (the exact bytes received) with any key
// of keys, at time now. It returns nil, an error wrapping ErrMissingCredentials (answer 401), or
// one wrapping ErrInvalidCredentials (answer 403) that says why and names the key id but never a
// secret.
func Verify(req *http.Request, body []byte, keys KeySet, now time.Time) error {
	h := req.Header.Get("Authorization")
	scheme, params, _ := strings.Cut(h, " ")
	if h == "" || !strings.EqualFold(scheme, AuthScheme) {
		return ErrMissingCredentials
	}
	var keyID, ts, sigHex string
	var seen int
	for part := range strings.SplitSeq(params, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			return fmt.Errorf("%w: malformed authorization parameter", ErrInvalidCredentials)
		}
		switch k {
		case "keyid":
			keyID, seen = v, seen|1
		case "ts":
			ts, seen = v, seen|2
		case "sig":
			sigHex, seen = v, seen|4
		default:
			return fmt.Errorf("%w: unknown authorization parameter %q", ErrInvalidCredentials, truncate(k, 32))
		}
	}
	if seen != 7 {
		return fmt.Errorf("%w: authorization needs keyid, ts and sig", ErrInvalidCredentials)
	}
	secret, ok := keys.keys[keyID]
	if !ok {
		return fmt.Errorf("%w: unknown key id %q", ErrInvalidCredentials, truncate(keyID, 128))
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return fmt.Errorf("%w: malformed timestamp", ErrInvalidCredentials)
	}
	if skew := now.Unix() - sec; sec < 0 || skew > int64(MaxClockSkew/time.Second) || skew < -int64(MaxClockSkew/time.Second) {
		return fmt.Errorf("%w: timestamp %d is more than %s away from the agent's clock (key id %q)", ErrInvalidCredentials, sec, MaxClockSkew, keyID)
	}
	got, err := hex.DecodeString(sigHex)
	if err != nil || len(got) != sha256.Size {
		return fmt.Errorf("%w: malformed signature (key id %q)", ErrInvalidCredentials, keyID)
	}
	want := signature(secret, req.Method, req.URL.EscapedPath(), ts, body)
	if !hmac.Equal(got, want) {
		return fmt.Errorf("%w: signature mismatch (key id %q)", ErrInvalidCredentials, keyID)
	}
	return nil
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}
