package kv

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"unicode"
	"unicode/utf8"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol"
)

// Bounds of a description. A description travels in every info of its
// regions, so its encoding is at most protocol.MaxSpaceSize bytes.
const (
	MaxLayers  = protocol.MaxKVLayers
	MaxParts   = 8
	MaxRegions = 1024
	MaxBlocks  = 1 << 30
	maxNode    = 255
)

// ErrInvalidDesc is matched (errors.Is) by every error of a description
// that breaks the format's rules: a bad encoding, a block past its region,
// sizes that overflow.
var ErrInvalidDesc = errors.New("kv: invalid space description")

// DescError says which field of a description is wrong.
type DescError struct {
	Field  string
	Reason string
}

func (e *DescError) Error() string {
	return "kv: invalid space description: " + e.Field + ": " + e.Reason
}

// Is matches ErrInvalidDesc.
func (e *DescError) Is(target error) bool { return target == ErrInvalidDesc }

func descErr(field, format string, a ...any) error {
	return &DescError{Field: field, Reason: fmt.Sprintf(format, a...)}
}

// Part is where one part (K or V, or K and V of a combined layout) of one
// layer lies: block b is the Bytes bytes at Base + b·Stride of region
// Region.
type Part struct {
	Region int
	Base   int64
	Stride int64
	Bytes  int64
}

// Layout says where every block of every layer of a KV space lies in its
// regions: Layers[l][p] is layer l's part p. Every layer has the same
// number of parts, and a block id names the same block in every part.
type Layout struct {
	Blocks int
	Layers [][]Part
}

// Region is one memory region of a space as readers see it: on "host" or
// on a GPU (by UUID), of Size bytes.
type Region struct {
	Device string
	Size   int64
}

// Desc describes a registered KV space: its name, which registration it
// is, and its regions and layout. It is what an engine hands a reader in
// its own metadata (MarshalText), and what the daemon returns with each of
// the space's regions, so that a reader checks the two agree.
type Desc struct {
	// Name is the space's qualified name (UID:NAME): region i is the
	// registered object Name/i.
	Name string
	// ID is random at each registration: a description of an earlier
	// registration of the name is refused (ErrStale).
	ID [16]byte
	// Node names the node the space is on; empty on one node.
	Node    string
	Regions []Region
	Layout
}

// RegionName returns the name of the registered object of region i.
func (d *Desc) RegionName(i int) string { return d.Name + "/" + strconv.Itoa(i) }

const descMagic = "CKVS"

// descVersion is the encoding's version.
const descVersion = 1

// Encoding (little-endian): magic, u16 version, u16 parts per layer, u32
// layers, u32 blocks, the 16-byte id, u16 regions, u16-prefixed name and
// node; then per region a kind byte (0 host, 1 GPU), the GPU's 16-byte
// UUID (zero for host) and u64 size; then per layer and part u16 region,
// u64 base, u64 stride, u64 bytes.
const (
	descHeader = 4 + 2 + 2 + 4 + 4 + 16 + 2
	regionLen  = 1 + 16 + 8
	partLen    = 2 + 8 + 8 + 8
)

// NewID returns a random description id.
func NewID() [16]byte {
	var id [16]byte
	rand.Read(id[:])
	return id
}

// Validate checks d against the format's rules: bounds, names, and every
// block of every part inside its region without overflow.
func (d *Desc) Validate() error {
	if err := protocol.ValidateName(d.Name); err != nil || len(d.Name) > 0xffff {
		return descErr("name", "%q is no object name: %v", d.Name, err)
	}
	if len(d.Node) > maxNode || !utf8.ValidString(d.Node) {
		return descErr("node", "at most %d bytes of UTF-8", maxNode)
	}
	for _, r := range d.Node {
		if !unicode.IsPrint(r) {
			return descErr("node", "%q has a non-printable character", d.Node)
		}
	}
	if len(d.Regions) == 0 || len(d.Regions) > MaxRegions {
		return descErr("regions", "%d regions, want 1 to %d", len(d.Regions), MaxRegions)
	}
	for i, r := range d.Regions {
		if r.Size <= 0 || r.Size > protocol.MaxObjectSize {
			return descErr("regions", "region %d is %d bytes, want 1 to %d", i, r.Size, int64(protocol.MaxObjectSize))
		}
		if r.Device != "host" {
			if _, err := cudaipc.ParseUUID(r.Device); err != nil {
				return descErr("regions", "region %d is on %q, neither host nor a GPU UUID", i, r.Device)
			}
		}
	}
	return d.Layout.check(func(i int) (int64, bool) {
		if i < 0 || i >= len(d.Regions) {
			return 0, false
		}
		return d.Regions[i].Size, true
	})
}

// check checks the layout against region sizes (size(i) is region i's
// size, false when there is no region i).
func (l *Layout) check(size func(int) (int64, bool)) error {
	if l.Blocks <= 0 || l.Blocks > MaxBlocks {
		return descErr("blocks", "%d blocks, want 1 to %d", l.Blocks, MaxBlocks)
	}
	if len(l.Layers) == 0 || len(l.Layers) > MaxLayers {
		return descErr("layers", "%d layers, want 1 to %d", len(l.Layers), MaxLayers)
	}
	parts := len(l.Layers[0])
	if parts == 0 || parts > MaxParts {
		return descErr("layers", "%d parts a layer, want 1 to %d", parts, MaxParts)
	}
	last := int64(l.Blocks - 1)
	for li, layer := range l.Layers {
		if len(layer) != parts {
			return descErr("layers", "layer %d has %d parts, layer 0 %d: every layer has the same parts", li, len(layer), parts)
		}
		for pi, p := range layer {
			n, ok := size(p.Region)
			switch {
			case !ok:
				return descErr("layers", "layer %d part %d names region %d, which the space does not have", li, pi, p.Region)
			case p.Bytes <= 0 || p.Base < 0 || p.Stride < p.Bytes || p.Stride > protocol.MaxObjectSize:
				// (A stride past any region reaches nothing, but the decoder
				// refuses it: so does the encoder.)
				return descErr("layers", "layer %d part %d: base %d, stride %d, bytes %d: want bytes > 0, base >= 0, bytes <= stride <= %d", li, pi, p.Base, p.Stride, p.Bytes, int64(protocol.MaxObjectSize))
			case p.Base > n || p.Bytes > n-p.Base || last > 0 && last > (n-p.Base-p.Bytes)/p.Stride:
				return descErr("layers", "layer %d part %d: %d blocks of %d bytes every %d bytes from %d pass the end of region %d (%d bytes)", li, pi, l.Blocks, p.Bytes, p.Stride, p.Base, p.Region, n)
			}
		}
	}
	return nil
}

// MarshalBinary encodes a valid d.
func (d *Desc) MarshalBinary() ([]byte, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	b := make([]byte, 0, descHeader+4+len(d.Name)+len(d.Node)+len(d.Regions)*regionLen+len(d.Layers)*len(d.Layers[0])*partLen)
	b = append(b, descMagic...)
	b = binary.LittleEndian.AppendUint16(b, descVersion)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(d.Layers[0])))
	b = binary.LittleEndian.AppendUint32(b, uint32(len(d.Layers)))
	b = binary.LittleEndian.AppendUint32(b, uint32(d.Blocks))
	b = append(b, d.ID[:]...)
	b = binary.LittleEndian.AppendUint16(b, uint16(len(d.Regions)))
	for _, s := range []string{d.Name, d.Node} {
		b = binary.LittleEndian.AppendUint16(b, uint16(len(s)))
		b = append(b, s...)
	}
	for _, r := range d.Regions {
		var kind byte
		var u cudaipc.UUID
		if r.Device != "host" {
			kind, u = 1, mustUUID(r.Device)
		}
		b = append(b, kind)
		b = append(b, u[:]...)
		b = binary.LittleEndian.AppendUint64(b, uint64(r.Size))
	}
	for _, layer := range d.Layers {
		for _, p := range layer {
			b = binary.LittleEndian.AppendUint16(b, uint16(p.Region))
			b = binary.LittleEndian.AppendUint64(b, uint64(p.Base))
			b = binary.LittleEndian.AppendUint64(b, uint64(p.Stride))
			b = binary.LittleEndian.AppendUint64(b, uint64(p.Bytes))
		}
	}
	if len(b) > protocol.MaxSpaceSize {
		return nil, descErr("size", "%d bytes encoded, at most %d: fewer layers, parts or regions", len(b), protocol.MaxSpaceSize)
	}
	return b, nil
}

func mustUUID(s string) cudaipc.UUID {
	u, err := cudaipc.ParseUUID(s)
	if err != nil {
		panic(err) // Validate checked it
	}
	return u
}

// UnmarshalBinary decodes and validates a description; every error
// matches ErrInvalidDesc.
func (d *Desc) UnmarshalBinary(b []byte) error {
	if len(b) > protocol.MaxSpaceSize {
		return descErr("size", "%d bytes, at most %d", len(b), protocol.MaxSpaceSize)
	}
	if len(b) < descHeader || string(b[:4]) != descMagic {
		return descErr("magic", "not a space description")
	}
	if v := binary.LittleEndian.Uint16(b[4:]); v != descVersion {
		return descErr("version", "version %d, this build reads %d", v, descVersion)
	}
	parts := int(binary.LittleEndian.Uint16(b[6:]))
	layers := int(binary.LittleEndian.Uint32(b[8:]))
	blocks := binary.LittleEndian.Uint32(b[12:])
	var out Desc
	copy(out.ID[:], b[16:32])
	regions := int(binary.LittleEndian.Uint16(b[32:]))
	if parts == 0 || parts > MaxParts || layers == 0 || layers > MaxLayers || regions == 0 || regions > MaxRegions || blocks == 0 || blocks > MaxBlocks {
		return descErr("header", "%d layers of %d parts, %d regions, %d blocks: out of bounds", layers, parts, regions, blocks)
	}
	out.Blocks = int(blocks)
	rest := b[descHeader:]
	str := func(field string) (string, error) {
		if len(rest) < 2 {
			return "", descErr(field, "truncated")
		}
		n := int(binary.LittleEndian.Uint16(rest))
		if len(rest) < 2+n {
			return "", descErr(field, "truncated")
		}
		s := string(rest[2 : 2+n])
		rest = rest[2+n:]
		return s, nil
	}
	var err error
	if out.Name, err = str("name"); err != nil {
		return err
	}
	if out.Node, err = str("node"); err != nil {
		return err
	}
	if len(rest) != regions*regionLen+layers*parts*partLen {
		return descErr("size", "%d bytes of regions and parts, want %d", len(rest), regions*regionLen+layers*parts*partLen)
	}
	out.Regions = make([]Region, regions)
	for i := range out.Regions {
		r := rest[i*regionLen:]
		var u cudaipc.UUID
		copy(u[:], r[1:17])
		switch {
		case r[0] == 0 && u.IsZero():
			out.Regions[i].Device = "host"
		case r[0] == 1 && !u.IsZero():
			out.Regions[i].Device = u.String()
		default:
			return descErr("regions", "region %d: kind %d with a UUID that does not fit it", i, r[0])
		}
		size := binary.LittleEndian.Uint64(r[17:])
		if size > protocol.MaxObjectSize {
			return descErr("regions", "region %d is %d bytes, at most %d", i, size, uint64(protocol.MaxObjectSize))
		}
		out.Regions[i].Size = int64(size)
	}
	rest = rest[regions*regionLen:]
	out.Layers = make([][]Part, layers)
	for l := range out.Layers {
		out.Layers[l] = make([]Part, parts)
		for p := range out.Layers[l] {
			e := rest[(l*parts+p)*partLen:]
			var v [3]uint64
			for k := range v {
				if v[k] = binary.LittleEndian.Uint64(e[2+8*k:]); v[k] > protocol.MaxObjectSize {
					return descErr("layers", "layer %d part %d: a value of %d, past any region", l, p, v[k])
				}
			}
			out.Layers[l][p] = Part{Region: int(binary.LittleEndian.Uint16(e)), Base: int64(v[0]), Stride: int64(v[1]), Bytes: int64(v[2])}
		}
	}
	if err := out.Validate(); err != nil {
		return err
	}
	*d = out
	return nil
}

// MarshalText encodes d as base64 of its binary encoding, for an engine's
// own metadata (vLLM's kv_transfer_params, a JSON string).
func (d *Desc) MarshalText() ([]byte, error) {
	b, err := d.MarshalBinary()
	if err != nil {
		return nil, err
	}
	return base64.StdEncoding.AppendEncode(nil, b), nil
}

// UnmarshalText decodes MarshalText's encoding.
func (d *Desc) UnmarshalText(t []byte) error {
	if len(t) > base64.StdEncoding.EncodedLen(protocol.MaxSpaceSize) {
		return descErr("size", "%d bytes of base64, at most %d", len(t), base64.StdEncoding.EncodedLen(protocol.MaxSpaceSize))
	}
	b, err := base64.StdEncoding.DecodeString(string(t))
	if err != nil {
		return descErr("text", "not base64: %v", err)
	}
	return d.UnmarshalBinary(b)
}
