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

// RegionVersion is the format version this package writes and reads.
const RegionVersion = 1

// RegionBinarySize is the length of a Region's binary encoding, version 1.
const RegionBinarySize = 164

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
	case r.Version != RegionVersion:
		return regionErr("version", "%d: this package reads version %d", r.Version, RegionVersion)
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
	case r.Offset > r.AllocSize || r.Size > r.AllocSize-r.Offset:
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
	case uint64(r.ExporterBase)+uint64(r.AllocSize) < uint64(r.ExporterBase):
		return regionErr("exporter_base", "%#x + %d bytes wraps around the address space", uint64(r.ExporterBase), r.AllocSize)
	}
	return nil
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
	if r.Kind == KindVMMFD {
		return fmt.Sprintf("Region(%s %d bytes at +%d of %d, %s, pid %d, allocation %s)",
			r.Kind, r.Size, r.Offset, r.AllocSize, r.Device, r.ExporterPID, r.AllocationID)
	}
	return fmt.Sprintf("Region(%s %d bytes at +%d of %d, %s, pid %d, buffer %d, %s)",
		r.Kind, r.Size, r.Offset, r.AllocSize, r.Device, r.ExporterPID, r.BufferID, r.Handle)
}

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
	b = binary.LittleEndian.AppendUint32(b, crc32.ChecksumIEEE(b[start:]))
	return b, nil
}

// MarshalBinary returns the RegionBinarySize-byte encoding.
func (r Region) MarshalBinary() ([]byte, error) {
	return r.AppendBinary(make([]byte, 0, RegionBinarySize))
}

// UnmarshalBinary decodes and validates the binary encoding. Any other
// length, a bad magic, version, checksum or field is a *RegionError.
func (r *Region) UnmarshalBinary(b []byte) error {
	if len(b) < 8 {
		return regionErr("length", "%d bytes: too short for a binary region (%d)", len(b), RegionBinarySize)
	}
	if !bytes.Equal(b[0:4], regionMagic[:]) {
		return regionErr("magic", "%q: want %q", b[0:4], regionMagic[:])
	}
	le := binary.LittleEndian
	if v := le.Uint16(b[4:]); v != RegionVersion {
		return regionErr("version", "%d: this package reads version %d", v, RegionVersion)
	}
	if len(b) != RegionBinarySize {
		return regionErr("length", "%d bytes: want %d", len(b), RegionBinarySize)
	}
	if got, want := le.Uint32(b[160:]), crc32.ChecksumIEEE(b[:160]); got != want {
		return regionErr("crc32", "%#08x: bytes 0-159 sum to %#08x", got, want)
	}
	if f := le.Uint32(b[116:]); f != 0 {
		return regionErr("flags", "%#x: no flags are defined; must be zero", f)
	}
	var v Region
	v.Version = le.Uint16(b[4:])
	v.Kind = Kind(le.Uint16(b[6:]))
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
