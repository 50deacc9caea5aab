package cudaipc

import (
	"encoding/binary"
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

// crcRawWords advances c over p (a multiple of 4 bytes) as the kernel
// does, a word at a time through crcTables.
func crcRawWords(c uint32, p []byte) uint32 {
	for ; len(p) >= 4; p = p[4:] {
		x := c ^ binary.LittleEndian.Uint32(p)
		c = crcTables[3][x&255] ^ crcTables[2][x>>8&255] ^ crcTables[1][x>>16&255] ^ crcTables[0][x>>24]
	}
	return c
}

// TestCRCTables checks the kernel's slicing-by-4 tables without a GPU: a
// word at a time through them gives the register a byte at a time through
// hash/crc32's table gives, from random registers over random bytes, and
// the first table is that table.
func TestCRCTables(t *testing.T) {
	if crcTables[0] != *castagnoli {
		t.Fatal("crcTables[0] is not hash/crc32's Castagnoli table")
	}
	rng := rand.New(rand.NewPCG(4, 19))
	data := make([]byte, 64<<10)
	for i := range data {
		data[i] = byte(rng.Uint32())
	}
	for range 200 {
		c := rng.Uint32()
		n := 4 * rng.IntN(len(data)/4+1)
		if got, want := crcRawWords(c, data[:n]), crcRaw(c, data[:n]); got != want {
			t.Fatalf("register %#x over %d bytes: words give %#x, bytes %#x", c, n, got, want)
		}
	}
}
