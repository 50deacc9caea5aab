package cluster

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/bundle"
)

// Partial reads: a reader that needs only some of an object (the tensors
// of its slice of a bundle, named in the bundle's manifest) reads only the
// chunks that hold them, from the holders, checks each against the
// checksums recorded at seal, and copies the ranges out. It advertises
// nothing: the bytes are the reader's alone (in the daemon, a partial
// replica that no other node reads: cluster/node/partial.go).
//
// What a partial read costs beyond its ranges is at most the two chunks a
// range starts and ends in (ranges in one chunk share it): the price of
// checking every byte against the recorded checksums.

// Range is the byte range [Off, Off+Len) of an object, read to
// [At, At+Len) of a partial read's destination.
type Range struct {
	Off, Len, At int64
}

// MaxRanges bounds the ranges of one partial read.
const MaxRanges = 1 << 16

// ErrNoTensor is wrapped by TensorSlice's error for a tensor the bundle
// lacks or one named twice.
var ErrNoTensor = errors.New("no such tensor")

// TensorSlice lays out the named tensors of a bundle with manifest m in an
// object of their own: in m's order (by offset), each at a multiple of
// bundle.Alignment, with m's metadata. It returns that object's manifest
// and size, and the ranges of the bundle that fill it (each read to its
// tensor's place), for PullRanges. A name the manifest lacks, or one named
// twice, is an error wrapping ErrNoTensor and naming it.
func TensorSlice(m *bundle.Manifest, names []string) (*bundle.Manifest, int64, []Range, error) {
	want := make(map[string]bool, len(names))
	for _, name := range names {
		if want[name] {
			return nil, 0, nil, fmt.Errorf("%w: tensor %q named twice", ErrNoTensor, name)
		}
		want[name] = true
	}
	specs := make([]bundle.Spec, 0, len(names))
	src := make(map[string]int64, len(names))
	for _, t := range m.Tensors {
		if want[t.Name] {
			specs = append(specs, bundle.Spec{Name: t.Name, DType: t.DType, Shape: t.Shape})
			src[t.Name] = t.Begin
			delete(want, t.Name)
		}
	}
	for _, name := range names {
		if want[name] {
			return nil, 0, nil, fmt.Errorf("%w: tensor %q is not in the bundle (%d tensors)", ErrNoTensor, name, len(m.Tensors))
		}
	}
	sm, size, err := bundle.Layout(specs, bundle.Alignment, m.Metadata)
	if err != nil {
		return nil, 0, nil, err
	}
	ranges := make([]Range, len(sm.Tensors))
	for i, t := range sm.Tensors {
		ranges[i] = Range{Off: src[t.Name], Len: t.Size(), At: t.Begin}
	}
	return sm, size, ranges, nil
}

// chunk returns the memory of chunk i of t: in dst, or its slot.
func (t *transfer) chunk(i int) []byte {
	if t.slots != nil {
		return t.slots[i]
	}
	off := int64(i) * t.e.ChunkSize
	return t.dst[off:min(off+t.e.ChunkSize, t.e.Size)]
}

// PullRanges reads ranges of the object ref from its holders into dst,
// each at its At (which must lie in dst). It reads, striped over the
// holders, only the chunks the ranges touch, checks each against its
// checksum and fails over as Pull does, and returns the object's entry and
// how many bytes it read. Errors are Pull's, and a range outside the
// object is an error wrapping ErrBadRecord.
func (p *Puller) PullRanges(ctx context.Context, ref Ref, ranges []Range, dst []byte) (e Entry, read int64, err error) {
	e, err = p.Dir.Lookup(ctx, ref)
	if err != nil {
		return e, 0, fmt.Errorf("pull %s: %w", ref, err)
	}
	read, err = p.PullRangesEntry(ctx, e, ranges, dst)
	return e, read, err
}

// PullRangesEntry is PullRanges of e's object with e as the directory's
// answer, just read by the caller, so that the read does not look it up
// again (it does when every holder failed, as Pull does).
func (p *Puller) PullRangesEntry(ctx context.Context, e Entry, ranges []Range, dst []byte) (read int64, err error) {
	ref := e.Ref()
	if len(ranges) > MaxRanges {
		return 0, fmt.Errorf("%w: pull %s: %d ranges, at most %d", ErrBadRecord, ref, len(ranges), MaxRanges)
	}
	var chunks []int
	for _, r := range ranges {
		if r.Off < 0 || r.Len < 0 || r.Off > e.Size-r.Len {
			return 0, fmt.Errorf("%w: pull %s: range [%d, +%d) outside its %d bytes", ErrBadRecord, ref, r.Off, r.Len, e.Size)
		}
		if r.At < 0 || r.At > int64(len(dst))-r.Len {
			return 0, fmt.Errorf("pull %s: range of %d bytes to %d of a destination of %d", ref, r.Len, r.At, len(dst))
		}
		if r.Len > 0 {
			for i := r.Off / e.ChunkSize; i <= (r.Off+r.Len-1)/e.ChunkSize; i++ {
				chunks = append(chunks, int(i))
			}
		}
	}
	slices.Sort(chunks)
	chunks = slices.Compact(chunks)
	t := &transfer{e: e, slots: make(map[int][]byte, len(chunks)), want: len(chunks), pending: chunks,
		bad: map[int]int{}, failed: map[string]string{}, start: time.Now()}
	t.cond = sync.NewCond(&t.mu)
	// A chunk that lies wholly inside a range is read straight to its
	// place in dst (and checked there); the others into buffers of their
	// own, copied out after.
	inPlace := make(map[int]int, len(chunks)) // chunk -> the range it was read to
	for k, r := range ranges {
		for i := (r.Off + e.ChunkSize - 1) / e.ChunkSize; i*e.ChunkSize < r.Off+r.Len; i++ {
			off := i * e.ChunkSize
			end := min(off+e.ChunkSize, e.Size)
			if end > r.Off+r.Len {
				break
			}
			if _, ok := t.slots[int(i)]; !ok {
				at := r.At + off - r.Off
				t.slots[int(i)] = dst[at : at+end-off : at+end-off]
				inPlace[int(i)] = k
			}
		}
	}
	for _, i := range chunks {
		if _, ok := t.slots[i]; !ok {
			off := int64(i) * e.ChunkSize
			t.slots[i] = make([]byte, min(e.ChunkSize, e.Size-off))
		}
		read += int64(len(t.slots[i]))
	}
	if len(chunks) > 0 {
		if err := p.readChunks(ctx, t); err != nil {
			return 0, err
		}
	}
	for k, r := range ranges {
		at := r.At
		for off := r.Off; off < r.Off+r.Len; {
			i := off / e.ChunkSize
			in := off - i*e.ChunkSize
			n := min(int64(len(t.slots[int(i)]))-in, r.Off+r.Len-off)
			if j, ok := inPlace[int(i)]; !ok || j != k {
				copy(dst[at:at+n], t.slots[int(i)][in:])
			}
			at += n
			off += n
		}
	}
	p.partial.Add(uint64(read))
	return read, nil
}

// readChunks reads t's pending chunks from e's holders, looking for new
// holders once when every one failed.
func (p *Puller) readChunks(ctx context.Context, t *transfer) error {
	ref := t.e.Ref()
	tried := map[string]bool{p.Dir.NodeName(): true}
	var sources []*source
	defer func() {
		for _, s := range sources {
			s.close()
		}
	}()
	for round := 0; ; round++ {
		if round > 0 {
			if e2, err := p.Dir.Lookup(ctx, ref); err == nil && e2.ID == t.e.ID {
				t.e.Holders = e2.Holders
			}
		}
		var fresh []*source
		for _, h := range t.e.Holders {
			if tried[h] {
				continue
			}
			tried[h] = true
			s, err := p.open(ctx, t.e, h, false)
			if err != nil {
				t.holderFailed(h, err)
				if errors.Is(err, ErrUnavailable) {
					return fmt.Errorf("pull %s: %w", ref, err)
				}
				continue
			}
			fresh = append(fresh, s)
		}
		sources = append(sources, fresh...)
		if len(fresh) == 0 {
			if round == 0 && len(t.failed) == 0 {
				return fmt.Errorf("pull %s: %w (holders in the directory: %s)", ref, ErrNoHolder, holderList(t.e.Holders))
			}
			return t.failure(ref)
		}
		p.run(ctx, t, fresh)
		switch {
		case t.done == t.want:
			return nil
		case t.fatal != nil:
			return t.fatal
		case ctx.Err() != nil:
			return fmt.Errorf("pull %s: %w after %d of %d chunks (%s)", ref, ctx.Err(), t.done, t.want, t.why())
		case round+1 >= maxRounds:
			return t.failure(ref)
		}
	}
}
