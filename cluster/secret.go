package cluster

import (
	"crypto/hmac"
	"crypto/sha256"
	"fmt"
	"hash"
	"os"
	"strings"
)

// MinSecretLen is the shortest cluster secret accepted, in bytes (after
// trimming surrounding white space): 128 bits of a random secret.
const MinSecretLen = 16

// Secret is the cluster secret: every daemon of a cluster holds the same
// one (--cluster-secret FILE). It authenticates daemons to each other
// (the control handshake) and the directory's records (each carries an
// HMAC over its key and body). It is never sent anywhere. The zero value
// is no secret and fails every check.
type Secret struct {
	key [sha256.Size]byte
	ok  bool
}

// NewSecret derives the cluster key from the secret's bytes, which must be
// at least MinSecretLen long.
func NewSecret(b []byte) (Secret, error) {
	b = []byte(strings.TrimSpace(string(b)))
	if len(b) < MinSecretLen {
		return Secret{}, fmt.Errorf("%w: %d bytes, at least %d needed (e.g. head -c 32 /dev/urandom | base64 > FILE)", ErrSecret, len(b), MinSecretLen)
	}
	m := hmac.New(sha256.New, []byte("cudaipc cluster secret v1"))
	m.Write(b)
	var s Secret
	copy(s.key[:], m.Sum(nil))
	s.ok = true
	return s, nil
}

// LoadSecret reads the cluster secret from path. The file must not be
// readable or writable by group or others (like an ssh key): a secret
// every local user can read authenticates nothing.
func LoadSecret(path string) (Secret, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return Secret{}, fmt.Errorf("%w: %v", ErrSecret, err)
	}
	if !fi.Mode().IsRegular() {
		return Secret{}, fmt.Errorf("%w: %s is not a regular file", ErrSecret, path)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return Secret{}, fmt.Errorf("%w: %s has mode %#o; make it private: chmod 600 %s", ErrSecret, path, fi.Mode().Perm(), path)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return Secret{}, fmt.Errorf("%w: %v", ErrSecret, err)
	}
	s, err := NewSecret(b)
	if err != nil {
		return Secret{}, fmt.Errorf("%s: %w", path, err)
	}
	return s, nil
}

// Valid reports whether s holds a secret.
func (s Secret) Valid() bool { return s.ok }

// mac returns an HMAC-SHA256 keyed by a key derived from the secret for
// one purpose, so that a MAC made for one use (a record) is never valid
// for another (a handshake).
func (s Secret) mac(purpose string) hash.Hash {
	m := hmac.New(sha256.New, s.key[:])
	m.Write([]byte(purpose))
	k := m.Sum(nil)
	return hmac.New(sha256.New, k)
}
