package bundle

import (
	"encoding/binary"
	"fmt"
)

// A no-copy version's bytes are memory its publisher holds: one region
// (docs/region.md) per CUDA allocation its tensors live in. Its sources
// table lists those regions; the manifest's offsets are offsets into the
// regions laid end to end, region i starting at SourceStarts' i-th value
// (docs/protocol.md section 6.8).

// MaxSources bounds the regions of one sources table.
const MaxSources = 1 << 16

// maxSourceLen bounds one encoded region: a version 2 region over 60
// pieces is well below it.
const maxSourceLen = 1 << 16

// EncodeSources encodes a sources table: each region (its binary
// encoding) preceded by its length, a little-endian uint32.
func EncodeSources(regions [][]byte) []byte {
	n := 0
	for _, r := range regions {
		n += 4 + len(r)
	}
	out := make([]byte, 0, n)
	for _, r := range regions {
		out = binary.LittleEndian.AppendUint32(out, uint32(len(r)))
		out = append(out, r...)
	}
	return out
}

// DecodeSources splits a sources table into its regions' encodings
// (sub-slices of b), which the caller decodes and checks. It fails with
// ErrInvalid on a truncated or empty table, an empty or oversized entry,
// or more than MaxSources entries.
func DecodeSources(b []byte) ([][]byte, error) {
	var out [][]byte
	for len(b) > 0 {
		if len(b) < 4 {
			return nil, fmt.Errorf("%w: sources table: %d stray bytes at its end", ErrInvalid, len(b))
		}
		n := binary.LittleEndian.Uint32(b)
		b = b[4:]
		switch {
		case n == 0 || n > maxSourceLen:
			return nil, fmt.Errorf("%w: sources table: entry %d is %d bytes, want 1..%d", ErrInvalid, len(out), n, maxSourceLen)
		case int64(n) > int64(len(b)):
			return nil, fmt.Errorf("%w: sources table: entry %d of %d bytes runs past the table's end", ErrInvalid, len(out), n)
		case len(out) == MaxSources:
			return nil, fmt.Errorf("%w: sources table: more than %d regions", ErrInvalid, MaxSources)
		}
		out = append(out, b[:n:n])
		b = b[n:]
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: sources table: no region", ErrInvalid)
	}
	return out, nil
}

// SourceStarts places regions of the given sizes end to end: region 0
// at 0, each next one at the first multiple of Alignment after the end of
// the one before, plus Alignment. Regions are never adjacent, so no copy
// merged by adjacent offsets spans two allocations (CUDA refuses such a
// copy). It returns each region's start and the span they cover (the
// version's size), or ErrInvalid for a size that is not positive or a
// span beyond 2^62.
func SourceStarts(sizes []int64) (starts []int64, span int64, err error) {
	const limit = 1 << 62
	starts = make([]int64, len(sizes))
	var at int64
	for i, n := range sizes {
		if n <= 0 || n > limit {
			return nil, 0, fmt.Errorf("%w: sources: region %d of %d bytes (at %d)", ErrInvalid, i, n, at)
		}
		if i > 0 {
			at = (span+Alignment-1)/Alignment*Alignment + Alignment
			if at > limit-n {
				return nil, 0, fmt.Errorf("%w: sources: the regions span more than 2^62 bytes", ErrInvalid)
			}
		}
		starts[i] = at
		span = at + n
	}
	return starts, span, nil
}
