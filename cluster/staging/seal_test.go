package staging_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/staging"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// memcpyFrom is a copyOut reading src, as the holder's device→host copy
// reads the GPU object, recording the spans it was asked for.
func memcpyFrom(src []byte, spans *[][2]int64) func(off int64, b []byte) error {
	return func(off int64, b []byte) error {
		*spans = append(*spans, [2]int64{off, off + int64(len(b))})
		copy(b, src[off:])
		return nil
	}
}

func TestCopyOutSums(t *testing.T) {
	const chunk = 4 << 10
	for _, c := range []struct {
		size, slice int64
		workers     int
	}{
		{0, 16 << 10, 0},
		{1, 16 << 10, 3},
		{chunk - 1, 16 << 10, 0},
		{chunk + 1, 16 << 10, 2},
		{5*16<<10 + 2*chunk + 77, 16 << 10, 0}, // five whole slices, a short sixth ending mid-chunk
		{5*16<<10 + 2*chunk + 77, 10 << 10, 1}, // a slice not a multiple of the chunk: rounded up to 12 KiB
		{1<<20 + 12345, 1, 4},                  // a slice below a chunk: one chunk at a time
		{1<<20 + 12345, 8 << 20, 0},            // one slice for the whole object
		{3 * 16 << 10, 16 << 10, 0},            // whole slices only
	} {
		t.Run(fmt.Sprintf("%d_%d_%d", c.size, c.slice, c.workers), func(t *testing.T) {
			src := make([]byte, c.size)
			rand.NewChaCha8([32]byte{byte(c.size), byte(c.slice)}).Read(src)
			dst := make([]byte, c.size)
			var spans [][2]int64
			sums, err := staging.CopyOut(context.Background(), dst, chunk, c.slice, c.workers, memcpyFrom(src, &spans))
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst, src) {
				t.Fatal("the copy differs from the source")
			}
			if want := cluster.Checksums(src, chunk); !slices.Equal(sums, want) {
				t.Fatalf("%d sums differ from cluster.Checksums' %d", len(sums), len(want))
			}
			// The copies cover the object in order, each a whole number of
			// chunks (but the last) of at most the rounded slice.
			slice := max((c.slice+chunk-1)/chunk*chunk, chunk)
			var next int64
			for i, s := range spans {
				if s[0] != next || s[1] <= s[0] || s[1]-s[0] > slice || (s[1] < c.size && (s[1]-s[0])%chunk != 0) {
					t.Fatalf("copy %d is [%d, %d), after %d (slice %d)", i, s[0], s[1], next, slice)
				}
				next = s[1]
			}
			if next != c.size {
				t.Fatalf("the copies ended at %d of %d", next, c.size)
			}
		})
	}
}

// A copy that fails mid-way ends CopyOut with an error naming where,
// wrapping the copy's own; no copy follows it, and no worker is left
// touching the buffer (-race watches the writes after the return).
func TestCopyOutCopyFails(t *testing.T) {
	const chunk, slice = 4 << 10, 16 << 10
	size := int64(10*slice + 999)
	src := make([]byte, size)
	rand.NewChaCha8([32]byte{7}).Read(src)
	dst := make([]byte, size)
	before := runtime.NumGoroutine()
	errDMA := errors.New("DMA failed")
	calls := 0
	_, err := staging.CopyOut(context.Background(), dst, chunk, slice, 4, func(off int64, b []byte) error {
		calls++
		if off == 6*slice {
			return errDMA
		}
		copy(b, src[off:])
		return nil
	})
	if !errors.Is(err, errDMA) || !strings.Contains(err.Error(), fmt.Sprintf("[%d, %d)", 6*slice, 7*slice)) {
		t.Fatalf("CopyOut: %v, want the copy's error naming [%d, %d)", err, 6*slice, 7*slice)
	}
	if calls != 7 {
		t.Fatalf("%d copies, want 7 (none after the failing one)", calls)
	}
	for i := range dst { // a worker still reading would race with this
		dst[i] = 0
	}
	testutil.Eventually(t, 5*time.Second, func() error {
		if n := runtime.NumGoroutine(); n > before {
			return fmt.Errorf("%d goroutines, %d before CopyOut", n, before)
		}
		return nil
	})
}

func TestCopyOutContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	dst := make([]byte, 100<<10)
	calls := 0
	_, err := staging.CopyOut(ctx, dst, 4<<10, 16<<10, 0, func(off int64, b []byte) error {
		if calls++; calls == 2 {
			cancel()
		}
		return nil
	})
	if !errors.Is(err, context.Canceled) || calls != 2 {
		t.Fatalf("CopyOut after a cancel: %v after %d copies, want context.Canceled after 2", err, calls)
	}
	if _, err := staging.CopyOut(context.Background(), dst, 0, 0, 0, nil); err == nil {
		t.Fatal("CopyOut with chunk size 0 did not fail")
	}
}

// BenchmarkSeal compares, in one run, the seal's staging as CopyOut does
// it (the chunk checksums of each slice on workers while the next slice
// copies) with copy-then-checksum (the whole copy, then
// cluster.ChecksumsParallel), for two stand-ins of the device→host copy:
//
//	go test -run '^$' -bench 'Seal$' -benchtime 10x ./cluster/staging/
//
// "memcpy" copies with the CPU, competing with the checksums for the same
// cores and memory: no gain is expected. "dma" leaves the CPUs free for
// the time a copy at 4 GB/s takes (the bytes are in place beforehand), as
// the GPU's DMA engine does: the pipeline should take about the longer of
// the copy and the checksums, copy-then-checksum their sum.
// BenchmarkSealGPU measures the real copy on the GPU machine.
func BenchmarkSeal(b *testing.B) {
	const size, chunk, dmaRate = 256 << 20, 4 << 20, 4e9
	src := make([]byte, size)
	rand.NewChaCha8([32]byte{9}).Read(src)
	dst := make([]byte, size)
	want := cluster.Checksums(src, chunk)
	copies := map[string]func(off int64, p []byte) error{
		"memcpy": func(off int64, p []byte) error { copy(p, src[off:]); return nil },
		"dma": func(off int64, p []byte) error {
			time.Sleep(time.Duration(float64(len(p)) / dmaRate * 1e9))
			return nil
		},
	}
	b.SetBytes(size)
	for _, kind := range []string{"memcpy", "dma"} {
		copyOut := copies[kind]
		copy(dst, src)
		b.Run(kind+"/pipelined", func(b *testing.B) {
			for range b.N {
				sums, err := staging.CopyOut(context.Background(), dst, chunk, 0, 0, copyOut)
				if err != nil || !slices.Equal(sums, want) {
					b.Fatalf("sums wrong (%v)", err)
				}
			}
		})
		b.Run(kind+"/copy_then_sum", func(b *testing.B) {
			for range b.N {
				if err := copyOut(0, dst); err != nil {
					b.Fatal(err)
				}
				if !slices.Equal(cluster.ChecksumsParallel(dst, chunk), want) {
					b.Fatal("sums wrong")
				}
			}
		})
	}
}

// queuedCopier is an asynchronous copy engine for CopyOutQueued: each
// start copies src into b on a goroutine of its own after a random delay
// (the slices may finish out of order) and counts the copies queued at
// once; failAt's wait fails.
type queuedCopier struct {
	src            []byte
	failAt         int64
	queued, most   int
	started, waits int
	mu             chan struct{} // a lock the test's goroutines share
}

func (c *queuedCopier) start(off int64, b []byte) (func() error, error) {
	c.mu <- struct{}{}
	c.queued++
	c.started++
	c.most = max(c.most, c.queued)
	<-c.mu
	done := make(chan struct{})
	go func() {
		time.Sleep(time.Duration(rand.IntN(300)) * time.Microsecond)
		copy(b, c.src[off:])
		close(done)
	}()
	return func() error {
		<-done
		c.mu <- struct{}{}
		c.queued--
		c.waits++
		<-c.mu
		if off == c.failAt {
			return errors.New("injected copy failure")
		}
		return nil
	}, nil
}

// TestCopyOutQueued: CopyOutQueued fills dst with the source's bytes,
// keeping at most depth slices queued, says the bytes landed in order and
// as a prefix; a failing wait stops it, names its slice, reports nothing
// landed past the slice before, and every slice queued is waited for; so
// does a cancelled context.
func TestCopyOutQueued(t *testing.T) {
	const size, slice = 10<<20 + 777, 1 << 20
	src := testutil.RandomBytes(1941, size)
	for _, depth := range []int{1, 3, 8} {
		t.Run(fmt.Sprintf("depth=%d", depth), func(t *testing.T) {
			c := &queuedCopier{src: src, failAt: -1, mu: make(chan struct{}, 1)}
			dst := make([]byte, size)
			var marks []int64
			err := staging.CopyOutQueued(context.Background(), dst, slice, depth, c.start, func(k int64) { marks = append(marks, k) })
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst, src) {
				t.Fatal("dst differs from the source")
			}
			if c.most > depth || (depth > 1 && c.most < 2) {
				t.Fatalf("%d slices queued at most, want 2 to %d", c.most, depth)
			}
			if len(marks) != 11 || marks[10] != size || !slices.IsSorted(marks) {
				t.Fatalf("landed marks %v, want 11 rising to %d", marks, size)
			}
			for i, k := range marks[:10] {
				if k != int64(i+1)*slice {
					t.Fatalf("landed mark %d is %d, want %d", i, k, int64(i+1)*slice)
				}
			}
		})
	}

	c := &queuedCopier{src: src, failAt: 3 * slice, mu: make(chan struct{}, 1)}
	var last int64
	err := staging.CopyOutQueued(context.Background(), make([]byte, size), slice, 4, c.start, func(k int64) { last = k })
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("[%d, %d)", 3*slice, 4*slice)) || !strings.Contains(err.Error(), "injected") {
		t.Fatalf("a failing slice: %v, want its range and cause", err)
	}
	if last != 3*slice {
		t.Fatalf("landed up to %d with slice 3 failing, want %d", last, 3*slice)
	}
	if c.waits != c.started {
		t.Fatalf("%d slices queued, %d waited for", c.started, c.waits)
	}

	ctx, cancel := context.WithCancel(context.Background())
	c = &queuedCopier{src: src, failAt: -1, mu: make(chan struct{}, 1)}
	err = staging.CopyOutQueued(ctx, make([]byte, size), slice, 4, func(off int64, b []byte) (func() error, error) {
		if off == 5*slice {
			cancel()
		}
		return c.start(off, b)
	}, func(int64) {})
	if !errors.Is(err, context.Canceled) || c.waits != c.started || c.started != 6 {
		t.Fatalf("cancelled at slice 5: %v, %d queued and %d waited for; want Canceled, 6 and 6", err, c.started, c.waits)
	}
}
