package cudaipc

import (
	"hash/crc32"
	"math/rand/v2"
	"testing"
)

// TestCombineCRC32C checks the host half of ChunkCRC32C without a GPU: the
// blocks' raw CRCs, computed here as the kernel computes them, combine into
// each chunk's crc32.Checksum, for random bytes, sizes (tails included) and
// chunk sizes.
func TestCombineCRC32C(t *testing.T) {
	rng := rand.New(rand.NewPCG(19, 20))
	data := make([]byte, 9<<20+77)
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	cases := []struct{ n, chunk int64 }{
		{1, 256}, {255, 256}, {256, 256}, {257, 256}, {4 << 20, 4 << 20}, {4<<20 + 3, 64 << 10},
		{9<<20 + 77, 1 << 20}, {9 << 20, 8 << 20}, {1000, 4 << 20}, {3<<20 + 16, 256 << 10},
	}
	for range 20 {
		chunk := int64(256) << rng.IntN(12)
		cases = append(cases, struct{ n, chunk int64 }{1 + rng.Int64N(int64(len(data))), chunk})
	}
	for _, c := range cases {
		block := crcBlockFor(c.n, c.chunk)
		if block < crcMinBlock || block > crcMaxBlock || c.chunk%block != 0 || block&(block-1) != 0 {
			t.Fatalf("n %d chunk %d: block %d", c.n, c.chunk, block)
		}
		var raw []uint32
		for off := int64(0); off < c.n; off += block {
			raw = append(raw, crcRaw(0, data[off:min(off+block, c.n)]))
		}
		got := combineCRC32C(raw, c.n, block, c.chunk)
		var want []uint32
		for off := int64(0); off < c.n; off += c.chunk {
			want = append(want, crc32.Checksum(data[off:min(off+c.chunk, c.n)], castagnoli))
		}
		if len(got) != len(want) {
			t.Fatalf("n %d chunk %d: %d sums, want %d", c.n, c.chunk, len(got), len(want))
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("n %d chunk %d block %d: chunk %d sum %08x, want %08x", c.n, c.chunk, block, i, got[i], want[i])
			}
		}
	}
}
