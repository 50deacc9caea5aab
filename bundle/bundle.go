// Package bundle describes many tensors packed into one store object: the
// manifest is the header JSON of Hugging Face's safetensors format, so a
// bundle and a safetensors file convert into each other without
// translation.
//
// A manifest maps each tensor name to its dtype (safetensors names: BF16,
// F32, ...), shape and data_offsets, [begin, end) byte offsets from the
// start of the object; the optional "__metadata__" entry maps strings to
// strings. Bundles the store builds put every tensor at a multiple of
// Alignment, so that device pointers into the object are aligned; such a
// bundle may have padding between tensors, which a safetensors file may
// not (Compact writes one without).
//
// The package has no dependencies on the rest of cudaipc: the daemon
// validates manifests with it, clients decode them with it.
package bundle

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"slices"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Alignment is the byte alignment of every tensor in a bundle laid out by
// Layout: enough for any GPU load or vectorized copy.
const Alignment = 256

// MaxHeaderSize is the largest manifest accepted, in bytes: the limit of
// the safetensors reference implementation (100 MB).
const MaxHeaderSize = 100_000_000

// MaxDims is the most dimensions a tensor may have.
const MaxDims = 32

// ErrInvalid is wrapped by every error about a malformed manifest or file.
var ErrInvalid = errors.New("invalid safetensors manifest")

// DType is a safetensors dtype name, such as "BF16".
type DType string

// The safetensors dtypes.
const (
	BOOL   DType = "BOOL"
	F4     DType = "F4"
	F6E2M3 DType = "F6_E2M3"
	F6E3M2 DType = "F6_E3M2"
	U8     DType = "U8"
	I8     DType = "I8"
	F8E5M2 DType = "F8_E5M2"
	F8E4M3 DType = "F8_E4M3"
	F8E8M0 DType = "F8_E8M0"
	I16    DType = "I16"
	U16    DType = "U16"
	F16    DType = "F16"
	BF16   DType = "BF16"
	I32    DType = "I32"
	U32    DType = "U32"
	F32    DType = "F32"
	C64    DType = "C64"
	F64    DType = "F64"
	I64    DType = "I64"
	U64    DType = "U64"
)

var dtypeBits = map[DType]int64{
	BOOL: 8, F4: 4, F6E2M3: 6, F6E3M2: 6, U8: 8, I8: 8, F8E5M2: 8, F8E4M3: 8, F8E8M0: 8,
	I16: 16, U16: 16, F16: 16, BF16: 16, I32: 32, U32: 32, F32: 32, C64: 64, F64: 64, I64: 64, U64: 64,
}

// DTypes lists every dtype, in the order of the safetensors specification.
var DTypes = []DType{BOOL, F4, F6E2M3, F6E3M2, U8, I8, F8E5M2, F8E4M3, F8E8M0, I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64}

// Bits returns the size of one element in bits, or 0 for an unknown dtype.
func (d DType) Bits() int64 { return dtypeBits[d] }

// Tensor is one entry of a manifest.
type Tensor struct {
	Name  string
	DType DType
	Shape []int64
	// Begin and End are the tensor's bytes within the object (the
	// safetensors data_offsets).
	Begin, End int64
}

// Size returns End - Begin.
func (t Tensor) Size() int64 { return t.End - t.Begin }

// NumElements returns the product of the shape (1 for a scalar).
func (t Tensor) NumElements() int64 {
	n, _ := elements(t.Shape)
	return n
}

// Manifest is the list of a bundle's tensors, sorted by Begin, and its
// metadata.
type Manifest struct {
	Tensors  []Tensor
	Metadata map[string]string
}

// Index returns the position of the tensor name in m.Tensors, or -1.
func (m *Manifest) Index(name string) int {
	for i := range m.Tensors {
		if m.Tensors[i].Name == name {
			return i
		}
	}
	return -1
}

// DataSize returns the end of the last tensor: the smallest object that
// holds them all.
func (m *Manifest) DataSize() int64 {
	var end int64
	for _, t := range m.Tensors {
		end = max(end, t.End)
	}
	return end
}

// Aligned reports whether every tensor begins at a multiple of a.
func (m *Manifest) Aligned(a int64) bool {
	for _, t := range m.Tensors {
		if t.Begin%a != 0 {
			return false
		}
	}
	return true
}

// Dense reports whether the tensors cover [0, DataSize()) without gaps,
// as a safetensors file requires.
func (m *Manifest) Dense() bool {
	var at int64
	for _, t := range m.Tensors { // sorted by Begin
		if t.Begin != at {
			return false
		}
		at = t.End
	}
	return true
}

type entry struct {
	DType       DType    `json:"dtype"`
	Shape       []int64  `json:"shape"`
	DataOffsets [2]int64 `json:"data_offsets"`
}

// Parse decodes a safetensors header (the JSON after the 8-byte length,
// trailing spaces allowed) and checks it: known dtypes, at most MaxDims
// non-negative dimensions, data_offsets that match dtype and shape, tensors
// that do not overlap. It does not require the tensors to be dense.
// Errors wrap ErrInvalid.
func Parse(header []byte) (*Manifest, error) {
	if len(header) > MaxHeaderSize {
		return nil, fmt.Errorf("%w: header of %d bytes exceeds %d", ErrInvalid, len(header), MaxHeaderSize)
	}
	header = bytes.TrimRight(header, " ")
	if len(header) == 0 || header[0] != '{' {
		return nil, fmt.Errorf("%w: header is not a JSON object", ErrInvalid)
	}
	m, ok, err := parseCompact(header)
	if !ok {
		m, err = parseJSON(header)
	}
	if err != nil {
		return nil, err
	}
	m.sort()
	if err := m.checkOverlap(); err != nil {
		return nil, err
	}
	return m, nil
}

// parseJSON decodes any JSON form of a header with encoding/json.
func parseJSON(header []byte) (*Manifest, error) {
	var raw map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(header))
	dec.UseNumber()
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: data after the header's JSON object", ErrInvalid)
	}
	m := &Manifest{Tensors: make([]Tensor, 0, len(raw))}
	for name, v := range raw {
		if name == "__metadata__" {
			if err := json.Unmarshal(v, &m.Metadata); err != nil {
				return nil, fmt.Errorf("%w: __metadata__ must map strings to strings: %v", ErrInvalid, err)
			}
			continue
		}
		var e entry
		d := json.NewDecoder(bytes.NewReader(v))
		d.DisallowUnknownFields()
		if err := d.Decode(&e); err != nil {
			return nil, fmt.Errorf("%w: tensor %q: %v", ErrInvalid, name, err)
		}
		t := Tensor{Name: name, DType: e.DType, Shape: e.Shape, Begin: e.DataOffsets[0], End: e.DataOffsets[1]}
		if t.Shape == nil {
			t.Shape = []int64{}
		}
		if err := t.check(); err != nil {
			return nil, err
		}
		m.Tensors = append(m.Tensors, t)
	}
	return m, nil
}

func (m *Manifest) sort() {
	slices.SortFunc(m.Tensors, func(a, b Tensor) int {
		if a.Begin != b.Begin {
			if a.Begin < b.Begin {
				return -1
			}
			return 1
		}
		if a.End != b.End { // empty tensors first
			if a.End < b.End {
				return -1
			}
			return 1
		}
		return strings.Compare(a.Name, b.Name)
	})
}

func (m *Manifest) checkOverlap() error {
	var prev *Tensor
	for i := range m.Tensors {
		t := &m.Tensors[i]
		if t.Size() == 0 {
			continue
		}
		if prev != nil && t.Begin < prev.End {
			return fmt.Errorf("%w: tensors %q and %q overlap", ErrInvalid, prev.Name, t.Name)
		}
		prev = t
	}
	return nil
}

// elements returns the product of shape; ok is false on a negative
// dimension or overflow beyond 2^62.
func elements(shape []int64) (int64, bool) {
	n := int64(1)
	for _, d := range shape {
		if d < 0 {
			return 0, false
		}
		hi, lo := bits.Mul64(uint64(n), uint64(d))
		if hi != 0 || lo > 1<<62 {
			return 0, false
		}
		n = int64(lo)
	}
	return n, true
}

// ByteSize returns the bytes of a tensor of dtype d and shape: the element
// count times the dtype's bits, which must be a whole number of bytes.
func ByteSize(d DType, shape []int64) (int64, error) {
	b := d.Bits()
	if b == 0 {
		return 0, fmt.Errorf("%w: unknown dtype %q (want one of %s)", ErrInvalid, d, dtypeList())
	}
	if len(shape) > MaxDims {
		return 0, fmt.Errorf("%w: %d dimensions, at most %d", ErrInvalid, len(shape), MaxDims)
	}
	n, ok := elements(shape)
	if !ok || n > math.MaxInt64/b {
		return 0, fmt.Errorf("%w: shape %v is negative or too large", ErrInvalid, shape)
	}
	if n*b%8 != 0 {
		return 0, fmt.Errorf("%w: %d elements of %s are not a whole number of bytes", ErrInvalid, n, d)
	}
	return n * b / 8, nil
}

func (t *Tensor) check() error {
	if !utf8.ValidString(t.Name) {
		return fmt.Errorf("%w: tensor name %q is not valid UTF-8", ErrInvalid, t.Name)
	}
	n, err := ByteSize(t.DType, t.Shape)
	if err != nil {
		return fmt.Errorf("tensor %q: %w", t.Name, err)
	}
	if t.Begin < 0 || t.End < t.Begin {
		return fmt.Errorf("%w: tensor %q: data_offsets [%d, %d] are not an interval", ErrInvalid, t.Name, t.Begin, t.End)
	}
	if t.End-t.Begin != n {
		return fmt.Errorf("%w: tensor %q: data_offsets span %d bytes, %s %v needs %d", ErrInvalid, t.Name, t.End-t.Begin, t.DType, t.Shape, n)
	}
	return nil
}

func dtypeList() string {
	s := make([]string, len(DTypes))
	for i, d := range DTypes {
		s[i] = string(d)
	}
	return strings.Join(s, ", ")
}

// Check reports whether every tensor lies within an object of size bytes.
func (m *Manifest) Check(size int64) error {
	if end := m.DataSize(); end > size {
		return fmt.Errorf("%w: tensors end at byte %d, past the object's %d bytes", ErrInvalid, end, size)
	}
	return nil
}

// Marshal encodes m as a safetensors header: "__metadata__" first, then
// the tensors in offset order, padded with spaces to a multiple of 8 bytes
// (as safetensors writes it, so that the data after it stays aligned).
func (m *Manifest) Marshal() []byte {
	var b bytes.Buffer
	b.Grow(64 + 96*len(m.Tensors))
	b.WriteByte('{')
	first := true
	if len(m.Metadata) > 0 {
		keys := make([]string, 0, len(m.Metadata))
		for k := range m.Metadata {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		b.WriteString(`"__metadata__":{`)
		for i, k := range keys {
			if i > 0 {
				b.WriteByte(',')
			}
			writeString(&b, k)
			b.WriteByte(':')
			writeString(&b, m.Metadata[k])
		}
		b.WriteByte('}')
		first = false
	}
	num := make([]byte, 0, 24)
	for _, t := range m.Tensors {
		if !first {
			b.WriteByte(',')
		}
		first = false
		writeString(&b, t.Name)
		b.WriteString(`:{"dtype":"`)
		b.WriteString(string(t.DType))
		b.WriteString(`","shape":[`)
		for i, d := range t.Shape {
			if i > 0 {
				b.WriteByte(',')
			}
			b.Write(strconv.AppendInt(num[:0], d, 10))
		}
		b.WriteString(`],"data_offsets":[`)
		b.Write(strconv.AppendInt(num[:0], t.Begin, 10))
		b.WriteByte(',')
		b.Write(strconv.AppendInt(num[:0], t.End, 10))
		b.WriteString("]}")
	}
	b.WriteByte('}')
	for b.Len()%8 != 0 {
		b.WriteByte(' ')
	}
	return b.Bytes()
}

func writeString(b *bytes.Buffer, s string) {
	j, _ := json.Marshal(s) // a string always marshals
	b.Write(j)
}

// Spec is a tensor to lay out: its name, dtype and shape.
type Spec struct {
	Name  string
	DType DType
	Shape []int64
}

// Layout places the tensors of specs one after the other, each at the
// next multiple of align (Alignment when 0), in the order given, and
// returns their manifest and the object size they need. Names must be
// unique and not "__metadata__".
func Layout(specs []Spec, align int64, metadata map[string]string) (*Manifest, int64, error) {
	if align <= 0 {
		align = Alignment
	}
	m := &Manifest{Tensors: make([]Tensor, len(specs)), Metadata: metadata}
	seen := make(map[string]bool, len(specs))
	var at int64
	for i, s := range specs {
		if s.Name == "__metadata__" || seen[s.Name] {
			return nil, 0, fmt.Errorf("%w: tensor name %q is reserved or repeated", ErrInvalid, s.Name)
		}
		seen[s.Name] = true
		n, err := ByteSize(s.DType, s.Shape)
		if err != nil {
			return nil, 0, fmt.Errorf("tensor %q: %w", s.Name, err)
		}
		at = (at + align - 1) / align * align
		shape := s.Shape
		if shape == nil {
			shape = []int64{}
		}
		m.Tensors[i] = Tensor{Name: s.Name, DType: s.DType, Shape: shape, Begin: at, End: at + n}
		at += n
	}
	m.sort()
	return m, at, nil
}

// Compact returns a copy of m with the tensors packed densely in offset
// order (what a safetensors file needs), and the data size.
func (m *Manifest) Compact() (*Manifest, int64) {
	c := &Manifest{Tensors: make([]Tensor, len(m.Tensors)), Metadata: m.Metadata}
	var at int64
	for i, t := range m.Tensors {
		t.Begin, t.End = at, at+t.Size()
		c.Tensors[i] = t
		at = t.End
	}
	return c, at
}

// ReadHeader reads the header of a safetensors file: its length prefix and
// JSON. It returns the header bytes as stored (with their padding) and
// the offset of the data section.
func ReadHeader(r io.ReaderAt) (header []byte, dataStart int64, err error) {
	var n [8]byte
	if _, err := r.ReadAt(n[:], 0); err != nil {
		return nil, 0, fmt.Errorf("%w: reading the header length: %v", ErrInvalid, err)
	}
	size := binary.LittleEndian.Uint64(n[:])
	if size == 0 || size > MaxHeaderSize {
		return nil, 0, fmt.Errorf("%w: header length %d is outside 1..%d (not a safetensors file?)", ErrInvalid, size, MaxHeaderSize)
	}
	header = make([]byte, size)
	if _, err := r.ReadAt(header, 8); err != nil {
		return nil, 0, fmt.Errorf("%w: reading the %d-byte header: %v", ErrInvalid, size, err)
	}
	return header, 8 + int64(size), nil
}

// WriteHeader writes the 8-byte length and header, as a safetensors file
// begins.
func WriteHeader(w io.Writer, header []byte) error {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(header)))
	if _, err := w.Write(n[:]); err != nil {
		return err
	}
	_, err := w.Write(header)
	return err
}
