package ucxperf_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/cudaipc/cudaipc/transport/ucx"
)

// BenchmarkGetChunks pulls 256 MiB with several chunk sizes and depths.
func BenchmarkGetChunks(b *testing.B) {
	const size = 256 << 20
	ep, key := connect(b, size)
	dst := make([]byte, size)
	ctx := context.Background()
	if err := ucx.Get(ctx, ep, key, key.Key().Addr, dst); err != nil {
		b.Fatal(err)
	}
	for _, o := range []ucx.GetOptions{{Chunk: 256 << 10, Depth: 16}, {Chunk: 1 << 20, Depth: 8}, {Chunk: 1 << 20, Depth: 2}, {Chunk: 4 << 20, Depth: 4}, {Chunk: 16 << 20, Depth: 2}, {Chunk: size, Depth: 1}} {
		b.Run(fmt.Sprintf("chunk=%dKiB,depth=%d", o.Chunk>>10, o.Depth), func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				if err := ucx.GetWith(ctx, ep, key, key.Key().Addr, dst, o); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkGetPatterns pulls 256 MiB in 4 MiB pieces (the cluster's
// chunk) the ways a pull can: N goroutines each doing one Get of a piece
// at a time on one endpoint (they contend for the worker, as the cluster's
// pull does), and one Get of the whole range with 4 MiB x 4 in flight (the transport alone). Run
// them in one process, alternating with -count, to compare.
func BenchmarkGetPatterns(b *testing.B) {
	const size, piece = 256 << 20, 4 << 20
	ep, key := connect(b, size)
	dst := make([]byte, size)
	ctx := context.Background()
	base := key.Key().Addr
	if err := ucx.Get(ctx, ep, key, base, dst); err != nil {
		b.Fatal(err)
	}
	for _, n := range []int{4, 8} {
		b.Run(fmt.Sprintf("goroutines=%d", n), func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				var next atomic.Int64
				var wg sync.WaitGroup
				errs := make(chan error, n)
				for range n {
					wg.Go(func() {
						for {
							off := next.Add(piece) - piece
							if off >= size {
								return
							}
							if err := ucx.Get(ctx, ep, key, base+uint64(off), dst[off:off+piece]); err != nil {
								errs <- err
								return
							}
						}
					})
				}
				wg.Wait()
				close(errs)
				if err := <-errs; err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("get,chunk=4MiB,depth=4", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			if err := ucx.GetWith(ctx, ep, key, base, dst, ucx.GetOptions{Chunk: piece, Depth: 4}); err != nil {
				b.Fatal(err)
			}
		}
	})
}
