package kv

import (
	"fmt"
	"sort"
)

// Staging is where the blocks of a staged read lie in one contiguous
// buffer (docs/kv.md, "Across nodes"): layer by layer from First, in each
// layer part by part, in each part the blocks in the request's order. The
// source's daemon gathers a read's blocks into such a buffer and the
// reader's fetches it in large pieces and scatters them, where many small
// transfers would cost more than two copies (UCX over tcp). Both sides
// compute it from the layouts' block bytes, which a Plan has checked equal.
type Staging struct {
	n            int // blocks a part
	first, count int
	// layer[i] is the offset of layer first+i, layer[count] the size;
	// part[i][p] the offset of part p of layer first+i.
	layer []int64
	part  [][]int64
	bytes [][]int64 // block bytes of each part
}

// MaxStaging bounds a staging buffer: NewStaging refuses larger ones (a
// read is staged in groups of layers that fit).
const MaxStaging = 1 << 40

// NewStaging returns the staging of n blocks a part of layers [first,
// first+count) of layout l.
func NewStaging(l *Layout, n, first, count int) (*Staging, error) {
	if n <= 0 || first < 0 || count <= 0 || first > len(l.Layers) || count > len(l.Layers)-first {
		return nil, fmt.Errorf("%w: staging of %d blocks of layers [%d, %d) of %d", ErrMismatch, n, first, first+count, len(l.Layers))
	}
	s := &Staging{n: n, first: first, count: count, layer: make([]int64, count+1), part: make([][]int64, count), bytes: make([][]int64, count)}
	var off int64
	for i := range count {
		s.layer[i] = off
		parts := l.Layers[first+i]
		s.part[i], s.bytes[i] = make([]int64, len(parts)), make([]int64, len(parts))
		for p, pt := range parts {
			s.part[i][p], s.bytes[i][p] = off, pt.Bytes
			if pt.Bytes <= 0 || int64(n) > (MaxStaging-off)/pt.Bytes {
				return nil, fmt.Errorf("%w: a staging of more than %d bytes", ErrMismatch, int64(MaxStaging))
			}
			off += int64(n) * pt.Bytes
		}
	}
	s.layer[count] = off
	return s, nil
}

// Size is the buffer's size.
func (s *Staging) Size() int64 { return s.layer[s.count] }

// Layer returns where layer l lies in the buffer.
func (s *Staging) Layer(l int) (off, n int64) {
	i := l - s.first
	return s.layer[i], s.layer[i+1] - s.layer[i]
}

// Block returns where block k (the k-th of the request) of part p of
// layer l lies in the buffer.
func (s *Staging) Block(l, p, k int) (off, n int64) {
	i := l - s.first
	return s.part[i][p] + int64(k)*s.bytes[i][p], s.bytes[i][p]
}

// Piece is a stretch of the buffer inside one block: Bytes bytes from byte
// Skip of block K of part P of layer L.
type Piece struct {
	L, P, K     int
	Skip, Bytes int64
}

// Pieces calls fn with the pieces of [off, off+n) of the buffer, in order.
func (s *Staging) Pieces(off, n int64, fn func(Piece)) {
	end := min(off+n, s.Size())
	i := sort.Search(s.count, func(i int) bool { return s.layer[i+1] > off })
	for ; i < s.count && off < end; i++ {
		for p := range s.part[i] {
			b := s.bytes[i][p]
			pstart, pend := s.part[i][p], s.part[i][p]+int64(s.n)*b
			if pend <= off {
				continue
			}
			for off < end && off < pend {
				k := (off - pstart) / b
				skip := off - pstart - k*b
				m := min(b-skip, end-off)
				fn(Piece{L: s.first + i, P: p, K: int(k), Skip: skip, Bytes: m})
				off += m
			}
			if off >= end {
				return
			}
		}
	}
}
