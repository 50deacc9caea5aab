package ucxperf_test

import (
	"context"
	"fmt"
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
