package cudaipc

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"fmt"
)

// HandleSize is the size of CUipcMemHandle and CUipcEventHandle.
const HandleSize = 64

// MemHandle is an exported device allocation (CUipcMemHandle): 64 opaque
// bytes that name the whole allocation, not an offset inside it. It is a
// bearer capability, so String prints only a fingerprint; MarshalText and
// MarshalBinary give the real bytes for transport.
type MemHandle [HandleSize]byte

// EventHandle is an exported interprocess event (CUipcEventHandle).
type EventHandle [HandleSize]byte

func fingerprint(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:6])
}

func decodeHandle(kind string, dst *[HandleSize]byte, text []byte) error {
	// Check the length before decoding: Decode writes past a destination
	// that is too short for its input (and panics).
	if len(text) > base64.StdEncoding.EncodedLen(HandleSize) {
		return fmt.Errorf("cudaipc: invalid %s text: %d characters, want %d", kind, len(text), base64.StdEncoding.EncodedLen(HandleSize))
	}
	var tmp [HandleSize + 3]byte // room to detect over-long input
	n, err := base64.StdEncoding.Strict().Decode(tmp[:], text)
	if err != nil {
		return fmt.Errorf("cudaipc: invalid %s text: %v", kind, err)
	}
	if n != HandleSize {
		return fmt.Errorf("cudaipc: invalid %s text: %d bytes, want %d", kind, n, HandleSize)
	}
	copy(dst[:], tmp[:HandleSize])
	return nil
}

func decodeHandleBinary(kind string, dst *[HandleSize]byte, b []byte) error {
	if len(b) != HandleSize {
		return fmt.Errorf("cudaipc: invalid %s: %d bytes, want %d", kind, len(b), HandleSize)
	}
	copy(dst[:], b)
	return nil
}

// IsZero reports whether h is all zero bytes (never a valid handle).
func (h MemHandle) IsZero() bool { return h == MemHandle{} }

// String returns a fingerprint safe to log: "MemHandle(sha256:…)".
func (h MemHandle) String() string { return "MemHandle(sha256:" + fingerprint(h[:]) + ")" }

// MarshalText encodes h as standard base64 (88 characters).
func (h MemHandle) MarshalText() ([]byte, error) {
	return []byte(base64.StdEncoding.EncodeToString(h[:])), nil
}

// UnmarshalText decodes standard base64 of exactly 64 bytes.
func (h *MemHandle) UnmarshalText(b []byte) error {
	return decodeHandle("MemHandle", (*[HandleSize]byte)(h), b)
}

// MarshalBinary returns the 64 raw bytes.
func (h MemHandle) MarshalBinary() ([]byte, error) { return append([]byte(nil), h[:]...), nil }

// UnmarshalBinary accepts exactly 64 bytes.
func (h *MemHandle) UnmarshalBinary(b []byte) error {
	return decodeHandleBinary("MemHandle", (*[HandleSize]byte)(h), b)
}

// IsZero reports whether h is all zero bytes (never a valid handle).
func (h EventHandle) IsZero() bool { return h == EventHandle{} }

// String returns a fingerprint safe to log: "EventHandle(sha256:…)".
func (h EventHandle) String() string { return "EventHandle(sha256:" + fingerprint(h[:]) + ")" }

// MarshalText encodes h as standard base64 (88 characters).
func (h EventHandle) MarshalText() ([]byte, error) {
	return []byte(base64.StdEncoding.EncodeToString(h[:])), nil
}

// UnmarshalText decodes standard base64 of exactly 64 bytes.
func (h *EventHandle) UnmarshalText(b []byte) error {
	return decodeHandle("EventHandle", (*[HandleSize]byte)(h), b)
}

// MarshalBinary returns the 64 raw bytes.
func (h EventHandle) MarshalBinary() ([]byte, error) { return append([]byte(nil), h[:]...), nil }

// UnmarshalBinary accepts exactly 64 bytes.
func (h *EventHandle) UnmarshalBinary(b []byte) error {
	return decodeHandleBinary("EventHandle", (*[HandleSize]byte)(h), b)
}
