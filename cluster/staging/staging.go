// Package staging moves GPU objects between nodes whose UCX cannot
// register GPU memory (Debian's and Ubuntu's builds: ucx.Context reports
// host memory only): through rings of pinned host buffers, in three
// stages that overlap — device→host on the holder, the UCX transfer, and
// host→device on the reader — with several chunks in flight.
//
// Run is the pipeline; Copy puts one together from a source, a wire and
// a sink. The chunk size and the depth are parameters to be measured on
// the machine (BenchmarkStagedCopy sweeps them), not guessed.
//
// CopyOut is the holder's seal of a GPU object: the device→host copy into
// a pinned buffer, slice by slice, with the checksums of each slice's
// chunks computed while the next slice copies. AllocPinned makes the
// pinned buffers, faster than cuMemAllocHost for gigabytes.
package staging

import (
	"context"
	"fmt"
	"sync"
)

// Stage does its part for chunk i (of the chunks Run was given), whose
// buffers are slot i % depth of the rings.
type Stage func(ctx context.Context, i int) error

// Run passes chunks 0 … chunks-1 through stages in order. Each stage takes
// the chunks one at a time, in order, and the stages run at once, so the
// work of different stages overlaps; at most depth chunks are between the
// start of the first stage and the end of the last, so that slot i % depth
// of a ring is free when chunk i reaches it. The first error, or ctx's,
// ends every stage and is returned with the stage and chunk it came from.
func Run(ctx context.Context, chunks, depth int, stages ...Stage) error {
	if chunks < 0 || depth < 1 || len(stages) == 0 {
		return fmt.Errorf("staging: %d chunks, depth %d, %d stages", chunks, depth, len(stages))
	}
	if chunks == 0 {
		return nil
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	slots := make(chan struct{}, depth)
	for range depth {
		slots <- struct{}{}
	}
	// links[k] carries chunk numbers from stage k-1 to stage k.
	links := make([]chan int, len(stages))
	for k := range links {
		links[k] = make(chan int, depth)
	}
	var (
		wg      sync.WaitGroup
		errOnce sync.Once
		first   error
	)
	fail := func(err error) {
		errOnce.Do(func() { first = err })
		cancel(err)
	}
	wg.Go(func() { // feeds stage 0 as slots free up
		defer close(links[0])
		for i := range chunks {
			select {
			case <-slots:
			case <-ctx.Done():
				return
			}
			select {
			case links[0] <- i:
			case <-ctx.Done():
				return
			}
		}
	})
	for k, stage := range stages {
		wg.Go(func() {
			if k+1 < len(stages) {
				defer close(links[k+1])
			}
			for i := range links[k] {
				if ctx.Err() != nil {
					return
				}
				if err := stage(ctx, i); err != nil {
					fail(fmt.Errorf("staging: stage %d, chunk %d: %w", k, i, err))
					return
				}
				if k+1 == len(stages) {
					slots <- struct{}{} // never blocks: at most depth are out
					continue
				}
				select {
				case links[k+1] <- i:
				case <-ctx.Done():
					return
				}
			}
		})
	}
	wg.Wait()
	if first != nil {
		return first
	}
	if err := ctx.Err(); err != nil { // the caller's ctx ended
		return fmt.Errorf("staging: %w", err)
	}
	return nil
}

// Layout is how an object of Size bytes is cut: chunks of Chunk bytes
// (the last shorter), Depth of them in flight.
type Layout struct {
	Size, Chunk int64
	Depth       int
}

// Chunks is the number of chunks.
func (l Layout) Chunks() int { return int((l.Size + l.Chunk - 1) / l.Chunk) }

// Span returns chunk i's offset in the object, its length, and its
// slot's offset in a ring of Depth × Chunk bytes.
func (l Layout) Span(i int) (off, n, slot int64) {
	off = int64(i) * l.Chunk
	return off, min(l.Chunk, l.Size-off), int64(i%l.Depth) * l.Chunk
}

// Check reports whether the layout can run.
func (l Layout) Check() error {
	if l.Size < 0 || l.Chunk <= 0 || l.Depth < 1 {
		return fmt.Errorf("staging: size %d, chunk %d, depth %d", l.Size, l.Chunk, l.Depth)
	}
	return nil
}

// Ends are what Copy moves bytes with, chunk by chunk: Out stages chunk
// [off, off+n) of the source into the source ring at slot (device→host on
// the holder), Wire moves n bytes from the source ring's slot to the
// destination ring's slot (a UCX GET, on the reader), In copies the
// destination ring's slot to [off, off+n) of the destination (host→device
// on the reader). Each returns once its bytes are where they go.
type Ends struct {
	Out, Wire, In func(ctx context.Context, off, n, slot int64) error
}

// Copy moves l.Size bytes through the three stages of e, pipelined.
func Copy(ctx context.Context, l Layout, e Ends) error {
	if err := l.Check(); err != nil {
		return err
	}
	stage := func(f func(ctx context.Context, off, n, slot int64) error) Stage {
		return func(ctx context.Context, i int) error {
			off, n, slot := l.Span(i)
			return f(ctx, off, n, slot)
		}
	}
	return Run(ctx, l.Chunks(), l.Depth, stage(e.Out), stage(e.Wire), stage(e.In))
}
