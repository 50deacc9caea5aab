package staging

import (
	"context"
	"fmt"
	"runtime"
	"sync"

	"github.com/cudaipc/cudaipc/cluster"
)

// DefaultSealSlice is the bytes CopyOut copies at a time: small enough that
// the pipeline's fill and drain (one slice's copy and one slice's
// checksums) are short, large enough that the copy calls' fixed cost is
// small beside a slice's copy; slices of 16 to 256 MiB measured alike.
const DefaultSealSlice = 64 << 20

// CopyOut fills dst with copyOut, slice bytes at a time, and returns the
// CRC-32C of dst's chunks: cluster.Checksums(dst, chunk). Workers compute
// the checksums of the chunks of each slice copied while the next slices
// copy, so the seal of a GPU object (a device→host copy and the checksums
// of every chunk) costs about the longer of the two, not their sum.
//
// copyOut(off, b) must fill b with the object's bytes [off, off+len(b));
// it is called from the calling goroutine, in order of off, one slice at a
// time. slice is rounded up to a multiple of chunk (slice <= 0 means
// DefaultSealSlice); workers <= 0 means GOMAXPROCS.
//
// The first error of copyOut, or ctx's, stops the copy and is returned
// naming the slice's offset; the workers are done with dst when CopyOut
// returns, whatever it returns, so the caller may reuse or free it.
func CopyOut(ctx context.Context, dst []byte, chunk, slice int64, workers int, copyOut func(off int64, b []byte) error) ([]uint32, error) {
	if chunk <= 0 {
		return nil, fmt.Errorf("staging: chunk size %d", chunk)
	}
	if slice <= 0 {
		slice = DefaultSealSlice
	}
	slice = (slice + chunk - 1) / chunk * chunk
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	size := int64(len(dst))
	chunks := int((size + chunk - 1) / chunk)
	sums := make([]uint32, chunks)
	workers = min(workers, chunks)
	// ready carries the numbers of the chunks copied so far; it holds
	// every chunk, so the copy never waits for the workers.
	ready := make(chan int, chunks)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range ready {
				off := int64(i) * chunk
				sums[i] = cluster.Checksum(dst[off:min(off+chunk, size)])
			}
		})
	}
	var err error
	for off := int64(0); off < size; off += slice {
		if err = ctx.Err(); err != nil {
			err = fmt.Errorf("staging: copy out at %d of %d bytes: %w", off, size, err)
			break
		}
		end := min(off+slice, size)
		if err = copyOut(off, dst[off:end]); err != nil {
			err = fmt.Errorf("staging: copy out [%d, %d) of %d bytes: %w", off, end, size, err)
			break
		}
		for i := off / chunk; i < (end+chunk-1)/chunk; i++ {
			ready <- int(i)
		}
	}
	// On an error the workers finish the chunks queued (they keep pace
	// with the copy, so little is left) before dst goes back.
	close(ready)
	wg.Wait()
	if err != nil {
		return nil, err
	}
	return sums, nil
}

// CopyOutOnly is CopyOut without the checksums (the caller has them from
// elsewhere: the device's, cudaipc.Device.ChunkCRC32C): it fills dst with
// copyOut, slice bytes at a time (slice <= 0 means DefaultSealSlice),
// checking ctx between slices.
func CopyOutOnly(ctx context.Context, dst []byte, slice int64, copyOut func(off int64, b []byte) error) error {
	if slice <= 0 {
		slice = DefaultSealSlice
	}
	size := int64(len(dst))
	for off := int64(0); off < size; off += slice {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("staging: copy out at %d of %d bytes: %w", off, size, err)
		}
		end := min(off+slice, size)
		if err := copyOut(off, dst[off:end]); err != nil {
			return fmt.Errorf("staging: copy out [%d, %d) of %d bytes: %w", off, end, size, err)
		}
	}
	return nil
}

// CopyOutQueued fills dst slice bytes at a time (slice <= 0 means
// DefaultSealSlice), keeping up to depth slices' copies queued at once
// (depth <= 0 means one), so that a copy engine never idles while a
// goroutine waits for the scheduler. start(off, b) queues the copy that
// fills b with the object's bytes [off, off+len(b)) and returns wait,
// which returns once they have landed; start is called from the calling
// goroutine in order of off, and may block (to pace the copy) while the
// slices queued before land. A goroutine of CopyOutQueued's waits for the
// slices in the same order and calls landed(k) as the first k bytes of dst
// have landed.
//
// The first error of start or wait, or ctx's (checked before each start),
// stops the copy and is returned naming the slice; every slice queued is
// waited for first, so the caller may reuse or free dst when it returns.
// Nothing landed past a failed slice is reported.
func CopyOutQueued(ctx context.Context, dst []byte, slice int64, depth int, start func(off int64, b []byte) (wait func() error, err error), landed func(k int64)) error {
	if slice <= 0 {
		slice = DefaultSealSlice
	}
	depth = max(depth, 1)
	size := int64(len(dst))
	type queued struct {
		off, end int64
		wait     func() error
	}
	sem := make(chan struct{}, depth) // a slot per slice queued and not yet waited for
	work := make(chan queued, depth)
	failed := make(chan struct{}) // closed at the waiter's first error
	var werr error                // the waiter's first error, read after done
	done := make(chan struct{})
	go func() {
		defer close(done)
		for s := range work {
			if err := s.wait(); err != nil && werr == nil {
				werr = fmt.Errorf("staging: copy out [%d, %d) of %d bytes: %w", s.off, s.end, size, err)
				close(failed)
			}
			if werr == nil {
				landed(s.end)
			}
			<-sem
		}
	}()
	var err error
	for off := int64(0); off < size && err == nil; {
		select {
		case sem <- struct{}{}:
		case <-failed:
		}
		select {
		case <-failed:
			off = size // the waiter's error is returned
			continue
		default:
		}
		end := min(off+slice, size)
		if err = ctx.Err(); err != nil {
			err = fmt.Errorf("staging: copy out at %d of %d bytes: %w", off, size, err)
			continue
		}
		wait, serr := start(off, dst[off:end])
		if serr != nil {
			err = fmt.Errorf("staging: copy out [%d, %d) of %d bytes: %w", off, end, size, serr)
			continue
		}
		work <- queued{off, end, wait}
		off = end
	}
	close(work)
	<-done
	if err == nil {
		err = werr
	}
	return err
}
