package cudaipc

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"strconv"
	"strings"
)

// Kind says what a Region's handle names and how it is opened.
type Kind uint16

// Region kinds. KindCUDAIPC and KindVMMFD are implemented; KindHost is
// reserved so that every implementation of docs/region.md numbers it alike.
const (
	// KindCUDAIPC is device memory from cuMemAlloc/cudaMalloc exported with
	// cuIpcGetMemHandle ("cuda-ipc"): same machine, same PID namespace.
	KindCUDAIPC Kind = 1
	// KindVMMFD is a VMM allocation (cuMemCreate) shared as a POSIX file
	// descriptor ("vmm-fd"). The region carries everything but the
	// descriptor, which travels beside it (SCM_RIGHTS over a Unix socket)
	// and is given to Import with WithFile. It works across PID namespaces.
	KindVMMFD Kind = 2
	// KindHost is reserved for shared host memory ("host").
	KindHost Kind = 3
)

var kindNames = map[Kind]string{KindCUDAIPC: "cuda-ipc", KindVMMFD: "vmm-fd", KindHost: "host"}

// String returns the name the JSON encoding uses, e.g. "cuda-ipc".
func (k Kind) String() string {
	if s, ok := kindNames[k]; ok {
		return s
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// ParseKind parses a name String prints.
func ParseKind(s string) (Kind, error) {
	for k, n := range kindNames {
		if n == s {
			return k, nil
		}
	}
	return 0, fmt.Errorf("unknown kind %q", s)
}

// RegionVersion is the format version of a region of one allocation.
// This package writes it for every such region and reads it.
const RegionVersion = 1

// RegionVersionPieces is the format version of a KindVMMFD region that
// spans several allocations (MorePieces): a version 1 reader refuses it by
// its version, never misreads it.
const RegionVersionPieces = 2

// RegionBinarySize is the length of a Region's binary encoding, version 1.
// A version 2 region is RegionBinarySize + 4 + 24 bytes per further piece.
const RegionBinarySize = 164

// MaxRegionPieces bounds the allocations one region spans: 65,536 pieces
// of PyTorch's 20 MiB expandable segments are 1.25 TiB, more than any GPU
// holds. Transports bound it further (a store packet is 64 KiB).
const MaxRegionPieces = 1 << 16

// regionMagic opens every binary Region: "CIPR".
var regionMagic = [4]byte{'C', 'I', 'P', 'R'}

// Region describes a byte range of a GPU allocation exported by one process
// so that another can map it: what one process hands another. It is a plain
// value; see docs/region.md for its binary and JSON encodings.
//
// The handle (KindCUDAIPC) or the descriptor (KindVMMFD) names the whole
// allocation, which is why Offset travels beside it. Like the handle, a
// KindCUDAIPC Region is a bearer capability: any process of the same
// machine and PID namespace that holds it can read and write the memory.
// Keep it secret. A KindVMMFD Region is useless without its descriptor.
type Region struct {
	Version      uint16       // format version, RegionVersion
	Kind         Kind         // KindCUDAIPC or KindVMMFD
	Handle       MemHandle    // KindCUDAIPC: cuIpcGetMemHandle of the allocation's base; KindVMMFD: zero
	AllocationID AllocationID // KindVMMFD: the exporter's id of the allocation; KindCUDAIPC: zero
	Offset       int64        // start of the region inside the allocation
	Size         int64        // length of the region in bytes, > 0
	AllocSize    int64        // size of the whole allocation (cuMemGetAddressRange; KindVMMFD: the mapped size)
	Device       UUID         // the GPU that holds the memory
	ExporterPID  int          // pid of the exporting process, in its PID namespace
	PIDNamespace uint64       // inode of the exporter's /proc/self/ns/pid
	BootID       BootID       // the exporter's /proc/sys/kernel/random/boot_id
	BufferID     uint64       // KindCUDAIPC: CU_POINTER_ATTRIBUTE_BUFFER_ID of the allocation in the exporter; KindVMMFD: zero
	ExporterBase DevicePtr    // the allocation's base address in the exporter

	// MorePieces (KindVMMFD, version 2 only) lists the allocations mapped
	// right after the first one (AllocationID, AllocSize), back to back in
	// address order, when one virtual range is backed by several physical
	// allocations (PyTorch's expandable segments). Offset and Size then
	// address the whole range, and one descriptor per piece, first piece
	// first, travels beside the region. Empty for one allocation.
	MorePieces []Piece
}

// Piece is one allocation of a KindVMMFD region after its first.
type Piece struct {
	AllocationID AllocationID // the exporter's id of the allocation, as Region.AllocationID
	Size         int64        // the allocation's mapped size, > 0
}

// Pieces returns every allocation the region spans, first to last: one
// for a version 1 region. The slice is new.
func (r Region) Pieces() []Piece {
	return append([]Piece{{r.AllocationID, r.AllocSize}}, r.MorePieces...)
}

// MappedSize returns the bytes the region's allocations span together:
// AllocSize plus the sizes of MorePieces.
func (r Region) MappedSize() int64 {
	n := r.AllocSize
	for _, p := range r.MorePieces {
		n += p.Size
	}
	return n
}

// Equal reports whether r and o describe the same memory in the same
// words (Region has a slice and is not comparable with ==).
func (r Region) Equal(o Region) bool {
	if len(r.MorePieces) != len(o.MorePieces) {
		return false
	}
	for i := range r.MorePieces {
		if r.MorePieces[i] != o.MorePieces[i] {
			return false
		}
	}
	r.MorePieces, o.MorePieces = nil, nil
	return r.header() == o.header()
}

// regionHeader is a Region without its pieces: comparable.
type regionHeader struct {
	Version      uint16
	Kind         Kind
	Handle       MemHandle
	AllocationID AllocationID
	Offset       int64
	Size         int64
	AllocSize    int64
	Device       UUID
	ExporterPID  int
	PIDNamespace uint64
	BootID       BootID
	BufferID     uint64
	ExporterBase DevicePtr
}

func (r Region) header() regionHeader {
	return regionHeader{r.Version, r.Kind, r.Handle, r.AllocationID, r.Offset, r.Size, r.AllocSize,
		r.Device, r.ExporterPID, r.PIDNamespace, r.BootID, r.BufferID, r.ExporterBase}
}

// AllocationID names one VMM allocation for importers: the exporter draws
// it at random when it allocates (ShareableBuffer) and never gives it to
// another allocation, so that two KindVMMFD regions with the same id are
// pieces of the same physical memory and share one import. It is not a
// secret: without the descriptor it opens nothing.
type AllocationID [16]byte

// NewAllocationID returns a random AllocationID (crypto/rand: 128 bits,
// so ids of different exporters do not collide).
func NewAllocationID() AllocationID {
	var a AllocationID
	for a.IsZero() {
		_, _ = rand.Read(a[:])
	}
	return a
}

// String returns the 32 lower-case hex digits of a.
func (a AllocationID) String() string { return hex.EncodeToString(a[:]) }

// ParseAllocationID parses the form String prints.
func ParseAllocationID(s string) (AllocationID, error) {
	var a AllocationID
	if len(s) != 32 {
		return a, fmt.Errorf("%q: want 32 hex digits", s)
	}
	if _, err := hex.Decode(a[:], []byte(s)); err != nil {
		return a, fmt.Errorf("%q: %v", s, err)
	}
	return a, nil
}

// MarshalText implements encoding.TextMarshaler.
func (a AllocationID) MarshalText() ([]byte, error) { return []byte(a.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (a *AllocationID) UnmarshalText(b []byte) error {
	v, err := ParseAllocationID(string(b))
	if err != nil {
		return err
	}
	*a = v
	return nil
}

// IsZero reports whether a is the zero id.
func (a AllocationID) IsZero() bool { return a == AllocationID{} }

// ErrInvalidRegion matches every error about a malformed Region or
// EventDescriptor (a *RegionError).
var ErrInvalidRegion = errors.New("cudaipc: invalid region")

// RegionError says which field of a Region or EventDescriptor is wrong and
// why. It matches ErrInvalidRegion.
type RegionError struct {
	What   string // "region" or "event descriptor"
	Field  string // e.g. "size", "crc32", "magic"
	Reason string
}

func (e *RegionError) Error() string {
	return "cudaipc: invalid " + e.What + ": " + e.Field + ": " + e.Reason
}

// Is reports whether target is ErrInvalidRegion.
func (e *RegionError) Is(target error) bool { return target == ErrInvalidRegion }

func regionErr(field, format string, args ...any) error {
	return &RegionError{What: "region", Field: field, Reason: fmt.Sprintf(format, args...)}
}

// Validate checks every field; it returns a *RegionError naming the first
// bad one. Import, the encoders and the decoders call it.
func (r Region) Validate() error {
	switch {
	case r.Version != RegionVersion && r.Version != RegionVersionPieces:
		return regionErr("version", "%d: this package reads versions %d and %d", r.Version, RegionVersion, RegionVersionPieces)
	case r.Version == RegionVersionPieces && r.Kind != KindVMMFD:
		return regionErr("version", "%d is the form of a vmm-fd region of several allocations; this region is %s", r.Version, r.Kind)
	case r.Version == RegionVersionPieces && len(r.MorePieces) == 0:
		return regionErr("pieces", "a version %d region spans at least two allocations; write one allocation as version %d", r.Version, RegionVersion)
	case r.Version == RegionVersion && len(r.MorePieces) > 0:
		return regionErr("version", "%d: a region of %d allocations is version %d", r.Version, 1+len(r.MorePieces), RegionVersionPieces)
	case len(r.MorePieces) >= MaxRegionPieces:
		return regionErr("pieces", "%d allocations: at most %d", 1+len(r.MorePieces), MaxRegionPieces)
	case r.Kind == KindHost:
		return regionErr("kind", "%s (%d) is reserved and not implemented by this version", r.Kind, uint16(r.Kind))
	case r.Kind == 0:
		return regionErr("kind", "missing")
	case r.Kind != KindCUDAIPC && r.Kind != KindVMMFD:
		return regionErr("kind", "unknown kind %d", uint16(r.Kind))
	case r.Kind == KindCUDAIPC && r.Handle.IsZero():
		return regionErr("handle", "all zero bytes: not an exported handle")
	case r.Kind == KindCUDAIPC && !r.AllocationID.IsZero():
		return regionErr("allocation_id", "set in a cuda-ipc region: only vmm-fd regions have one")
	case r.Kind == KindVMMFD && r.AllocationID.IsZero():
		return regionErr("allocation_id", "zero: a vmm-fd region names its allocation by a non-zero id")
	case r.Kind == KindVMMFD && !r.Handle.IsZero():
		return regionErr("handle", "set in a vmm-fd region: its descriptor travels beside the region, not in it")
	case r.Size <= 0:
		return regionErr("size", "%d: must be positive", r.Size)
	case r.Offset < 0:
		return regionErr("offset", "%d: must not be negative", r.Offset)
	case r.AllocSize <= 0:
		return regionErr("alloc_size", "%d: must be positive", r.AllocSize)
	}
	mapped, err := r.checkPieces()
	if err != nil {
		return err
	}
	switch {
	case r.Offset > mapped || r.Size > mapped-r.Offset:
		if len(r.MorePieces) > 0 {
			return regionErr("size", "[%d, %d+%d) runs past the end of the %d bytes the %d allocations span", r.Offset, r.Offset, r.Size, mapped, 1+len(r.MorePieces))
		}
		return regionErr("size", "[%d, %d+%d) runs past the end of the %d-byte allocation", r.Offset, r.Offset, r.Size, r.AllocSize)
	case r.Device.IsZero():
		return regionErr("device", "zero GPU UUID")
	case r.ExporterPID <= 0 || r.ExporterPID > math.MaxInt32:
		return regionErr("exporter_pid", "%d: not a process id", r.ExporterPID)
	case r.PIDNamespace == 0:
		return regionErr("pid_namespace", "zero: want the inode of the exporter's /proc/self/ns/pid")
	case r.BootID.IsZero():
		return regionErr("boot_id", "zero: want the exporter's /proc/sys/kernel/random/boot_id")
	case r.Kind == KindCUDAIPC && r.BufferID == 0:
		return regionErr("buffer_id", "zero: want CU_POINTER_ATTRIBUTE_BUFFER_ID of the allocation")
	case r.Kind == KindVMMFD && r.BufferID != 0:
		return regionErr("buffer_id", "%d in a vmm-fd region: must be zero (the allocation id names the allocation)", r.BufferID)
	case r.ExporterBase == 0:
		return regionErr("exporter_base", "zero: want the allocation's base address in the exporter")
	case uint64(r.ExporterBase)+uint64(mapped) < uint64(r.ExporterBase):
		return regionErr("exporter_base", "%#x + %d bytes wraps around the address space", uint64(r.ExporterBase), mapped)
	}
	return nil
}

// checkPieces checks MorePieces (positive sizes, non-zero ids, no
// allocation twice, a total below 2^62) and returns the bytes all pieces
// span.
func (r Region) checkPieces() (int64, error) {
	total := r.AllocSize
	if len(r.MorePieces) == 0 {
		return total, nil
	}
	seen := make(map[AllocationID]struct{}, 1+len(r.MorePieces))
	seen[r.AllocationID] = struct{}{}
	for i, p := range r.MorePieces {
		switch {
		case p.AllocationID.IsZero():
			return 0, regionErr("pieces", "piece %d: zero allocation id", i+1)
		case p.Size <= 0:
			return 0, regionErr("pieces", "piece %d: size %d: must be positive", i+1, p.Size)
		case p.Size > math.MaxInt64/4-total:
			return 0, regionErr("pieces", "piece %d: the pieces' sizes add up past 2^61", i+1)
		}
		if _, dup := seen[p.AllocationID]; dup {
			return 0, regionErr("pieces", "piece %d: allocation %s appears twice", i+1, p.AllocationID)
		}
		seen[p.AllocationID] = struct{}{}
		total += p.Size
	}
	return total, nil
}

// Sub returns the region of r that starts off bytes into r and is size
// bytes long, e.g. to hand out slices of one exported allocation without
// exporting again.
func (r Region) Sub(off, size int64) (Region, error) {
	if off < 0 || size <= 0 || off > r.Size || size > r.Size-off {
		return Region{}, &ArgError{Op: "Region.Sub", Arg: "range", Reason: fmt.Sprintf("[%d, %d+%d) is outside the %d-byte region", off, off, size, r.Size)}
	}
	s := r
	s.Offset += off
	s.Size = size
	return s, nil
}

// String describes r for logs without the handle's bytes.
func (r Region) String() string {
	if r.Kind == KindVMMFD && len(r.MorePieces) > 0 {
		return fmt.Sprintf("Region(%s %d bytes at +%d of %d in %d allocations, %s, pid %d, first allocation %s)",
			r.Kind, r.Size, r.Offset, r.MappedSize(), 1+len(r.MorePieces), r.Device, r.ExporterPID, r.AllocationID)
	}
	if r.Kind == KindVMMFD {
		return fmt.Sprintf("Region(%s %d bytes at +%d of %d, %s, pid %d, allocation %s)",
			r.Kind, r.Size, r.Offset, r.AllocSize, r.Device, r.ExporterPID, r.AllocationID)
	}
	return fmt.Sprintf("Region(%s %d bytes at +%d of %d, %s, pid %d, buffer %d, %s)",
		r.Kind, r.Size, r.Offset, r.AllocSize, r.Device, r.ExporterPID, r.BufferID, r.Handle)
}

// BinarySize returns the length of r's binary encoding: RegionBinarySize
// for version 1, and 4 + 24 bytes more per further piece for version 2.
func (r Region) BinarySize() int {
	if len(r.MorePieces) == 0 {
		return RegionBinarySize
	}
	return RegionBinarySize + 4 + pieceBinarySize*len(r.MorePieces)
}

// pieceBinarySize is the length of one further piece in a version 2
// region: its allocation id and its size.
const pieceBinarySize = 24

// AppendBinary appends the binary encoding (docs/region.md) to b.
func (r Region) AppendBinary(b []byte) ([]byte, error) {
	if err := r.Validate(); err != nil {
		return b, err
	}
	start := len(b)
	b = append(b, regionMagic[:]...)
	b = binary.LittleEndian.AppendUint16(b, r.Version)
	b = binary.LittleEndian.AppendUint16(b, uint16(r.Kind))
	if r.Kind == KindVMMFD {
		// The 64 handle bytes: the allocation id, then 48 zero bytes.
		b = append(b, r.AllocationID[:]...)
		b = append(b, make([]byte, 64-len(r.AllocationID))...)
	} else {
		b = append(b, r.Handle[:]...)
	}
	b = binary.LittleEndian.AppendUint64(b, uint64(r.Offset))
	b = binary.LittleEndian.AppendUint64(b, uint64(r.Size))
	b = binary.LittleEndian.AppendUint64(b, uint64(r.AllocSize))
	b = append(b, r.Device[:]...)
	b = binary.LittleEndian.AppendUint32(b, uint32(r.ExporterPID))
	b = binary.LittleEndian.AppendUint32(b, 0) // flags, reserved
	b = binary.LittleEndian.AppendUint64(b, r.PIDNamespace)
	b = append(b, r.BootID[:]...)
	b = binary.LittleEndian.AppendUint64(b, r.BufferID)
	b = binary.LittleEndian.AppendUint64(b, uint64(r.ExporterBase))
	if len(r.MorePieces) > 0 {
		b = binary.LittleEndian.AppendUint32(b, uint32(1+len(r.MorePieces)))
		for _, p := range r.MorePieces {
			b = append(b, p.AllocationID[:]...)
			b = binary.LittleEndian.AppendUint64(b, uint64(p.Size))
		}
	}
	b = binary.LittleEndian.AppendUint32(b, crc32.ChecksumIEEE(b[start:]))
	return b, nil
}

// MarshalBinary returns the binary encoding, BinarySize bytes.
func (r Region) MarshalBinary() ([]byte, error) {
	return r.AppendBinary(make([]byte, 0, r.BinarySize()))
}

// UnmarshalBinary decodes and validates the binary encoding of either
// version. A length other than the version's, a bad magic, version,
// checksum or field is a *RegionError.
func (r *Region) UnmarshalBinary(b []byte) error {
	if len(b) < 8 {
		return regionErr("length", "%d bytes: too short for a binary region (%d)", len(b), RegionBinarySize)
	}
	if !bytes.Equal(b[0:4], regionMagic[:]) {
		return regionErr("magic", "%q: want %q", b[0:4], regionMagic[:])
	}
	le := binary.LittleEndian
	version, kind := le.Uint16(b[4:]), Kind(le.Uint16(b[6:]))
	switch {
	case version != RegionVersion && version != RegionVersionPieces:
		return regionErr("version", "%d: this package reads versions %d and %d", version, RegionVersion, RegionVersionPieces)
	case version == RegionVersionPieces && kind != KindVMMFD:
		return regionErr("version", "%d is the form of a vmm-fd region of several allocations; this region is %s", version, kind)
	}
	want := RegionBinarySize
	var count int
	if version == RegionVersionPieces {
		if len(b) < RegionBinarySize+4 {
			return regionErr("length", "%d bytes: a version 2 region has at least %d", len(b), RegionBinarySize+4+pieceBinarySize)
		}
		count = int(le.Uint32(b[160:]))
		if count < 2 || count > MaxRegionPieces {
			return regionErr("pieces", "piece count %d: want 2..%d", count, MaxRegionPieces)
		}
		want = RegionBinarySize + 4 + pieceBinarySize*(count-1)
	}
	if len(b) != want {
		return regionErr("length", "%d bytes: want %d", len(b), want)
	}
	end := want - 4
	if got, sum := le.Uint32(b[end:]), crc32.ChecksumIEEE(b[:end]); got != sum {
		return regionErr("crc32", "%#08x: bytes 0-%d sum to %#08x", got, end-1, sum)
	}
	if f := le.Uint32(b[116:]); f != 0 {
		return regionErr("flags", "%#x: no flags are defined; must be zero", f)
	}
	var v Region
	v.Version, v.Kind = version, kind
	if v.Kind == KindVMMFD {
		copy(v.AllocationID[:], b[8:24])
		if !allZero(b[24:72]) {
			return regionErr("handle", "bytes 24-71 of a vmm-fd region are reserved and must be zero")
		}
	} else {
		copy(v.Handle[:], b[8:72])
	}
	off, size, alloc := le.Uint64(b[72:]), le.Uint64(b[80:]), le.Uint64(b[88:])
	if off > math.MaxInt64 || size > math.MaxInt64 || alloc > math.MaxInt64 {
		return regionErr("size", "offset %d, size %d, alloc_size %d: must be below 2^63", off, size, alloc)
	}
	v.Offset, v.Size, v.AllocSize = int64(off), int64(size), int64(alloc)
	copy(v.Device[:], b[96:112])
	v.ExporterPID = int(le.Uint32(b[112:]))
	v.PIDNamespace = le.Uint64(b[120:])
	copy(v.BootID[:], b[128:144])
	v.BufferID = le.Uint64(b[144:])
	v.ExporterBase = DevicePtr(le.Uint64(b[152:]))
	if count > 0 {
		v.MorePieces = make([]Piece, count-1)
		for i := range v.MorePieces {
			at := RegionBinarySize + pieceBinarySize*i
			copy(v.MorePieces[i].AllocationID[:], b[at:at+16])
			n := le.Uint64(b[at+16:])
			if n > math.MaxInt64 {
				return regionErr("pieces", "piece %d: size %d: must be below 2^63", i+1, n)
			}
			v.MorePieces[i].Size = int64(n)
		}
	}
	if err := v.Validate(); err != nil {
		return err
	}
	*r = v
	return nil
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// regionJSON is the JSON form; docs/region.md documents each field. The
// per-kind fields are pointers so that a field of the other kind is an
// error even when it holds zero.
type regionJSON struct {
	Version      uint16        `json:"version"`
	Kind         string        `json:"kind"`
	Handle       *MemHandle    `json:"handle,omitempty"`
	AllocationID *AllocationID `json:"allocation_id,omitempty"`
	Offset       int64         `json:"offset"`
	Size         int64         `json:"size"`
	AllocSize    int64         `json:"alloc_size"`
	Device       UUID          `json:"device"`
	ExporterPID  int           `json:"exporter_pid"`
	PIDNamespace uint64        `json:"pid_namespace"`
	BootID       BootID        `json:"boot_id"`
	BufferID     *uint64       `json:"buffer_id,omitempty"`
	ExporterBase string        `json:"exporter_base"`
	MorePieces   []pieceJSON   `json:"more_pieces,omitempty"`
}

type pieceJSON struct {
	AllocationID *AllocationID `json:"allocation_id"`
	Size         int64         `json:"alloc_size"`
}

// MarshalJSON encodes r as one JSON object, the handle in base64, the
// device as "GPU-…" and the exporter's base address as a "0x…" string
// (addresses can exceed the 2^53 that JavaScript numbers hold exactly).
func (r Region) MarshalJSON() ([]byte, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	j := regionJSON{
		Version: r.Version, Kind: r.Kind.String(),
		Offset: r.Offset, Size: r.Size, AllocSize: r.AllocSize, Device: r.Device,
		ExporterPID: r.ExporterPID, PIDNamespace: r.PIDNamespace, BootID: r.BootID,
		ExporterBase: "0x" + strconv.FormatUint(uint64(r.ExporterBase), 16),
	}
	if r.Kind == KindVMMFD {
		j.AllocationID = &r.AllocationID
	} else {
		j.Handle, j.BufferID = &r.Handle, &r.BufferID
	}
	for i := range r.MorePieces {
		j.MorePieces = append(j.MorePieces, pieceJSON{&r.MorePieces[i].AllocationID, r.MorePieces[i].Size})
	}
	return json.Marshal(j)
}

// UnmarshalJSON decodes and validates the JSON encoding. Unknown fields are
// rejected, so that a misspelt field is an error rather than a zero.
func (r *Region) UnmarshalJSON(b []byte) error {
	var j regionJSON
	if err := strictJSON(b, &j); err != nil {
		// encoding/json's errors begin with "json: " too: say it once.
		return regionErr("json", "%s", strings.TrimPrefix(err.Error(), "json: "))
	}
	// Missing fields decode as zero and Validate reports them in order.
	var k Kind
	if j.Kind != "" {
		var err error
		if k, err = ParseKind(j.Kind); err != nil {
			return regionErr("kind", "%v", err)
		}
	}
	var base DevicePtr
	if j.ExporterBase != "" {
		var err error
		if base, err = parseHexAddr(j.ExporterBase); err != nil {
			return regionErr("exporter_base", "%v", err)
		}
	}
	v := Region{
		Version: j.Version, Kind: k,
		Offset: j.Offset, Size: j.Size, AllocSize: j.AllocSize, Device: j.Device,
		ExporterPID: j.ExporterPID, PIDNamespace: j.PIDNamespace, BootID: j.BootID,
		ExporterBase: base,
	}
	// A field of the other kind is refused by name, even when zero.
	switch {
	case k == KindVMMFD && j.Handle != nil:
		return regionErr("handle", "not a field of a vmm-fd region: its descriptor travels beside the region")
	case k == KindVMMFD && j.BufferID != nil:
		return regionErr("buffer_id", "not a field of a vmm-fd region")
	case k == KindCUDAIPC && j.AllocationID != nil:
		return regionErr("allocation_id", "not a field of a %s region", k)
	}
	if j.Handle != nil {
		v.Handle = *j.Handle
	}
	if j.AllocationID != nil {
		v.AllocationID = *j.AllocationID
	}
	if j.BufferID != nil {
		v.BufferID = *j.BufferID
	}
	if j.MorePieces != nil && len(j.MorePieces) == 0 {
		return regionErr("pieces", "an empty more_pieces: leave the field out for one allocation")
	}
	if len(j.MorePieces) >= MaxRegionPieces {
		return regionErr("pieces", "%d allocations: at most %d", 1+len(j.MorePieces), MaxRegionPieces)
	}
	for i, p := range j.MorePieces {
		if p.AllocationID == nil {
			return regionErr("pieces", "piece %d: no allocation_id", i+1)
		}
		v.MorePieces = append(v.MorePieces, Piece{*p.AllocationID, p.Size})
	}
	if err := v.Validate(); err != nil {
		return err
	}
	*r = v
	return nil
}

// DecodeRegion decodes either encoding: binary when b starts with the
// magic "CIPR", JSON otherwise.
func DecodeRegion(b []byte) (Region, error) {
	var r Region
	var err error
	if bytes.HasPrefix(b, regionMagic[:]) {
		err = r.UnmarshalBinary(b)
	} else {
		err = r.UnmarshalJSON(b)
	}
	return r, err
}

func strictJSON(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if len(bytes.TrimSpace(b[dec.InputOffset():])) != 0 {
		return errors.New("data after the object")
	}
	return nil
}

func parseHexAddr(s string) (DevicePtr, error) {
	h, ok := strings.CutPrefix(s, "0x")
	if !ok || h == "" || len(h) > 16 {
		return 0, fmt.Errorf("%q: want a hex address such as \"0x7f3a00000000\"", s)
	}
	v, err := strconv.ParseUint(h, 16, 64)
	if err != nil {
		return 0, fmt.Errorf("%q: %v", s, err)
	}
	return DevicePtr(v), nil
}
