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
// checksums recorded at seal, and copies the ranges out. It makes no
// replica and advertises nothing: the bytes are the reader's alone.
//
// What a partial read costs beyond its ranges is at most the two chunks a
// range starts and ends in (ranges in one chunk share it): the price of
// checking every byte against the recorded checksums.

// Range is the byte range [Off, Off+Len) of an object.
type Range struct {
	Off, Len int64
}

// MaxRanges bounds the ranges of one partial read.
const MaxRanges = 1 << 16

// TensorRanges returns the byte ranges of the named tensors of a bundle
// with manifest m, in the order named, for PullRanges (and the layout of
// its destination). A name the manifest lacks, or one named twice, is an
// error naming it.
func TensorRanges(m *bundle.Manifest, names []string) ([]Range, error) {
	idx := make(map[string]int, len(m.Tensors))
	for i, t := range m.Tensors {
		idx[t.Name] = i
	}
	seen := make(map[string]bool, len(names))
	out := make([]Range, 0, len(names))
	for _, name := range names {
		i, ok := idx[name]
		switch {
		case !ok:
			return nil, fmt.Errorf("tensor %q is not in the bundle (%d tensors)", name, len(m.Tensors))
		case seen[name]:
			return nil, fmt.Errorf("tensor %q named twice", name)
		}
		seen[name] = true
		t := m.Tensors[i]
		out = append(out, Range{Off: t.Begin, Len: t.Size()})
	}
	return out, nil
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
// laid end to end in the order given (len(dst) must be their total). It
// reads, striped over the holders, only the chunks the ranges touch,
// checks each against its checksum and fails over as Pull does, and
// returns the object's entry and how many bytes it read. Errors are Pull's,
// and a range outside the object is an error wrapping ErrBadRecord.
func (p *Puller) PullRanges(ctx context.Context, ref Ref, ranges []Range, dst []byte) (e Entry, read int64, err error) {
	e, err = p.Dir.Lookup(ctx, ref)
	if err != nil {
		return e, 0, fmt.Errorf("pull %s: %w", ref, err)
	}
	if len(ranges) > MaxRanges {
		return e, 0, fmt.Errorf("%w: pull %s: %d ranges, at most %d", ErrBadRecord, ref, len(ranges), MaxRanges)
	}
	var total int64
	var chunks []int
	for _, r := range ranges {
		if r.Off < 0 || r.Len < 0 || r.Off > e.Size-r.Len {
			return e, 0, fmt.Errorf("%w: pull %s: range [%d, +%d) outside its %d bytes", ErrBadRecord, ref, r.Off, r.Len, e.Size)
		}
		total += r.Len
		if r.Len > 0 {
			for i := r.Off / e.ChunkSize; i <= (r.Off+r.Len-1)/e.ChunkSize; i++ {
				chunks = append(chunks, int(i))
			}
		}
	}
	if total != int64(len(dst)) {
		return e, 0, fmt.Errorf("pull %s: %d bytes of ranges into %d", ref, total, len(dst))
	}
	slices.Sort(chunks)
	chunks = slices.Compact(chunks)
	t := &transfer{e: e, slots: make(map[int][]byte, len(chunks)), want: len(chunks), pending: chunks,
		bad: map[int]int{}, failed: map[string]string{}, start: time.Now()}
	t.cond = sync.NewCond(&t.mu)
	for _, i := range chunks {
		off := int64(i) * e.ChunkSize
		t.slots[i] = make([]byte, min(e.ChunkSize, e.Size-off))
		read += int64(len(t.slots[i]))
	}
	if len(chunks) > 0 {
		if err := p.readChunks(ctx, t); err != nil {
			return e, 0, err
		}
	}
	at := 0
	for _, r := range ranges {
		for off := r.Off; off < r.Off+r.Len; {
			i := off / e.ChunkSize
			in := off - i*e.ChunkSize
			n := copy(dst[at:at+int(r.Off+r.Len-off)], t.slots[int(i)][in:])
			at += n
			off += int64(n)
		}
	}
	p.partial.Add(uint64(read))
	return e, read, nil
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
				t.failed[h] = oneLine(err)
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
			return t.failure(ref, ErrNoHolder)
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
			return t.failure(ref, nil)
		}
	}
}
