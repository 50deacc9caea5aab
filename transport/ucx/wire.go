package ucx

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math/bits"
)

// ErrMalformed matches every error about bytes from a peer (a worker
// address or a region key) that fail the checks made before UCX sees them.
var ErrMalformed = errors.New("ucx: malformed peer data")

// MalformedError says what is wrong with a worker address or region key.
type MalformedError struct {
	What   string // "worker address" or "region key"
	Reason string
}

func (e *MalformedError) Error() string {
	return "ucx: malformed " + e.What + ": " + e.Reason
}

// Is makes errors.Is(err, ErrMalformed) true.
func (e *MalformedError) Is(target error) bool { return target == ErrMalformed }

// Limits on what a peer may hand over. Real worker addresses are tens to a
// few thousand bytes; packed rkeys are under a kilobyte per memory domain.
const (
	MaxAddressLen = 64 << 10
	MaxRkeyLen    = 64 << 10
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// The envelopes: magic (4), format version (1), the producer's UCX major
// and minor (1+1), reserved (1), then for a region key its address (8) and
// length (8), the payload length (4), the payload, and a CRC-32C (4) of
// everything before it. Little-endian.
var (
	magicAddress = [4]byte{'u', 'c', 'W', 'A'}
	magicKey     = [4]byte{'u', 'c', 'R', 'K'}
)

const envelopeVersion = 1

// WorkerAddress is a UCP worker address (what ucp_worker_get_address
// returns) as it travels between nodes. Its binary encoding (MarshalBinary)
// is an envelope with a checksum; UnmarshalBinary checks the envelope and
// the first byte of UCX's own format (its address version), which is all
// that is checked before ucp_ep_create parses the rest.
type WorkerAddress struct {
	ucxMajor, ucxMinor uint8
	b                  []byte
}

// Bytes returns the raw UCX address bytes (not a copy: do not modify).
func (a WorkerAddress) Bytes() []byte { return a.b }

// UCXVersion returns the UCX major and minor version of the worker that
// made the address, as recorded in the envelope.
func (a WorkerAddress) UCXVersion() (major, minor int) { return int(a.ucxMajor), int(a.ucxMinor) }

// MarshalBinary encodes the address in its envelope.
func (a WorkerAddress) MarshalBinary() ([]byte, error) {
	if err := checkAddress(a.b); err != nil {
		return nil, err
	}
	return seal(magicAddress, a.ucxMajor, a.ucxMinor, nil, a.b), nil
}

// UnmarshalBinary decodes and checks an envelope made by MarshalBinary.
func (a *WorkerAddress) UnmarshalBinary(b []byte) error {
	major, minor, _, payload, err := open("worker address", magicAddress, 0, b, MaxAddressLen)
	if err != nil {
		return err
	}
	if err := checkAddress(payload); err != nil {
		return err
	}
	*a = WorkerAddress{ucxMajor: major, ucxMinor: minor, b: payload}
	return nil
}

// checkAddress checks what can be checked of a packed ucp_address_t without
// parsing UCX's internal format: it is not empty, within MaxAddressLen, and
// its header byte carries a known address version (UCP_OBJECT_VERSION_V1
// or V2 in the low four bits, in UCX 1.13 and 1.16).
func checkAddress(b []byte) error {
	switch {
	case len(b) < 2:
		return &MalformedError{What: "worker address", Reason: fmt.Sprintf("%d bytes, too short", len(b))}
	case len(b) > MaxAddressLen:
		return &MalformedError{What: "worker address", Reason: fmt.Sprintf("%d bytes, more than %d", len(b), MaxAddressLen)}
	case b[0]&0x0f > 1:
		return &MalformedError{What: "worker address", Reason: fmt.Sprintf("unknown address version %d", b[0]&0x0f)}
	}
	return nil
}

// RegionKey is what a peer needs to read a registered MemRegion: where the
// region lies in the owner's address space and its packed rkey. Its binary
// encoding (MarshalBinary) is an envelope with a checksum.
type RegionKey struct {
	// Addr is the region's first byte in the owner's address space.
	Addr uint64
	// Len is the region's length in bytes.
	Len uint64
	// Rkey is the packed remote key (ucp_rkey_pack).
	Rkey []byte

	ucxMajor, ucxMinor uint8
}

// Contains reports whether [addr, addr+n) lies inside the region.
func (k RegionKey) Contains(addr, n uint64) bool {
	if addr < k.Addr {
		return false
	}
	off := addr - k.Addr
	return off <= k.Len && n <= k.Len-off
}

// MarshalBinary encodes the key in its envelope.
func (k RegionKey) MarshalBinary() ([]byte, error) {
	if err := checkKey(k.Addr, k.Len, k.Rkey); err != nil {
		return nil, err
	}
	var hdr [16]byte
	binary.LittleEndian.PutUint64(hdr[0:], k.Addr)
	binary.LittleEndian.PutUint64(hdr[8:], k.Len)
	return seal(magicKey, k.ucxMajor, k.ucxMinor, hdr[:], k.Rkey), nil
}

// UnmarshalBinary decodes and checks an envelope made by MarshalBinary.
func (k *RegionKey) UnmarshalBinary(b []byte) error {
	major, minor, hdr, payload, err := open("region key", magicKey, 16, b, MaxRkeyLen)
	if err != nil {
		return err
	}
	addr := binary.LittleEndian.Uint64(hdr[0:])
	length := binary.LittleEndian.Uint64(hdr[8:])
	if err := checkKey(addr, length, payload); err != nil {
		return err
	}
	*k = RegionKey{Addr: addr, Len: length, Rkey: payload, ucxMajor: major, ucxMinor: minor}
	return nil
}

// checkKey checks the region bounds and walks the packed rkey as UCX 1.13
// and 1.16 lay it out (ucp_rkey_pack): a 64-bit map of memory domains, a
// memory type byte, then for each domain in the map a size byte and that
// many bytes, then optionally a system device byte followed by 3-byte
// distance entries. Each domain's key bytes themselves are UCX's to judge.
func checkKey(addr, length uint64, rkey []byte) error {
	bad := func(format string, args ...any) error {
		return &MalformedError{What: "region key", Reason: fmt.Sprintf(format, args...)}
	}
	if length == 0 {
		return bad("empty region")
	}
	if addr+length < addr {
		return bad("region [%#x, +%d) wraps around the address space", addr, length)
	}
	if len(rkey) > MaxRkeyLen {
		return bad("rkey of %d bytes, more than %d", len(rkey), MaxRkeyLen)
	}
	if len(rkey) < 9 {
		return bad("rkey of %d bytes, too short", len(rkey))
	}
	mdMap := binary.LittleEndian.Uint64(rkey)
	if mdMap == 0 {
		return bad("rkey names no memory domain")
	}
	if mt := rkey[8]; mt > byte(MemoryRDMA) {
		return bad("rkey has unknown memory type %d", mt)
	}
	p := 9
	for i := 0; i < bits.OnesCount64(mdMap); i++ {
		if p >= len(rkey) {
			return bad("rkey ends before domain %d of %d", i+1, bits.OnesCount64(mdMap))
		}
		n := int(rkey[p])
		p++
		if p+n > len(rkey) {
			return bad("rkey domain %d claims %d bytes, %d left", i+1, n, len(rkey)-p)
		}
		p += n
	}
	if rest := rkey[p:]; len(rest) > 0 {
		// system device, then (sys_dev, latency, bandwidth) triples; 255 is
		// UCS_SYS_DEVICE_ID_UNKNOWN, never packed and not a valid index.
		if rest[0] == 0xff || (len(rest)-1)%3 != 0 {
			return bad("rkey has %d trailing bytes that are no device distance list", len(rest))
		}
		for j := 1; j < len(rest); j += 3 {
			if rest[j] == 0xff {
				return bad("rkey distance names device 255")
			}
		}
	}
	return nil
}

func seal(magic [4]byte, major, minor uint8, hdr, payload []byte) []byte {
	b := make([]byte, 0, 8+len(hdr)+4+len(payload)+4)
	b = append(b, magic[:]...)
	b = append(b, envelopeVersion, major, minor, 0)
	b = append(b, hdr...)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(payload)))
	b = append(b, payload...)
	return binary.LittleEndian.AppendUint32(b, crc32.Checksum(b, castagnoli))
}

func open(what string, magic [4]byte, hdrLen int, b []byte, max int) (major, minor uint8, hdr, payload []byte, err error) {
	bad := func(format string, args ...any) error {
		return &MalformedError{What: what, Reason: fmt.Sprintf(format, args...)}
	}
	fixed := 8 + hdrLen + 4
	if len(b) < fixed+4 {
		return 0, 0, nil, nil, bad("%d bytes, shorter than the %d-byte envelope", len(b), fixed+4)
	}
	if [4]byte(b[:4]) != magic {
		return 0, 0, nil, nil, bad("wrong magic %q", b[:4])
	}
	if b[4] != envelopeVersion {
		return 0, 0, nil, nil, bad("envelope version %d, this build reads %d", b[4], envelopeVersion)
	}
	if b[7] != 0 {
		return 0, 0, nil, nil, bad("reserved byte is %d, not 0", b[7])
	}
	n := binary.LittleEndian.Uint32(b[8+hdrLen:])
	if uint64(n) > uint64(max) {
		return 0, 0, nil, nil, bad("payload of %d bytes, more than %d", n, max)
	}
	if len(b) != fixed+int(n)+4 {
		return 0, 0, nil, nil, bad("%d bytes, the envelope says %d", len(b), fixed+int(n)+4)
	}
	body := b[:len(b)-4]
	if got, want := crc32.Checksum(body, castagnoli), binary.LittleEndian.Uint32(b[len(b)-4:]); got != want {
		return 0, 0, nil, nil, bad("checksum %#08x, the envelope says %#08x", got, want)
	}
	payload = append([]byte(nil), b[fixed:fixed+int(n)]...)
	hdr = append([]byte(nil), b[8:8+hdrLen]...)
	return b[5], b[6], hdr, payload, nil
}
