package cudaipc_test

import (
	"errors"
	"hash/crc32"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// TestChunkCRC32C: the device's chunk checksums of random bytes equal
// hash/crc32's over the same bytes, for sizes with and without tails,
// chunk sizes from 256 B to 64 MiB, offsets into the buffer, and eight
// goroutines at once; a changed byte changes its chunk's sum only; bad
// arguments are ArgErrors.
func TestChunkCRC32C(t *testing.T) {
	dev := testutil.RequireGPU(t)
	if err := dev.CRC32CSupported(); err != nil {
		t.Fatalf("the driver does not run the CRC-32C kernel: %v", err)
	}
	const size = 96<<20 + 4096
	buf, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	rng := rand.New(rand.NewPCG(7, 19))
	host := make([]byte, size)
	for i := range host {
		host[i] = byte(rng.Uint32())
	}
	if err := dev.CopyToDevice(buf.Ptr(), host); err != nil {
		t.Fatal(err)
	}
	tab := crc32.MakeTable(crc32.Castagnoli)
	want := func(off, n, chunk int64) []uint32 {
		var s []uint32
		for o := off; o < off+n; o += chunk {
			s = append(s, crc32.Checksum(host[o:min(o+chunk, off+n)], tab))
		}
		return s
	}
	type tc struct{ off, n, chunk int64 }
	cases := []tc{{0, 1, 256}, {16, 15, 256}, {0, 4 << 20, 4 << 20}, {4096, 4<<20 + 5, 4 << 20}, {0, size, 4 << 20},
		{48, 64<<20 + 1, 64 << 20}, {0, 1 << 20, 256}, {1 << 20, 33<<20 + 4095, 1 << 20}}
	for range 12 {
		off := 16 * rng.Int64N(size/16)
		cases = append(cases, tc{off, 1 + rng.Int64N(size-off), 256 << rng.IntN(15)})
	}
	check := func(c tc) error {
		got, err := dev.ChunkCRC32C(buf.Ptr()+cudaipc.DevicePtr(c.off), c.n, c.chunk)
		if err != nil {
			return err
		}
		w := want(c.off, c.n, c.chunk)
		if len(got) != len(w) {
			return errors.New("wrong number of sums")
		}
		for i := range w {
			if got[i] != w[i] {
				t.Errorf("off %d n %d chunk %d: chunk %d sum %08x, want %08x", c.off, c.n, c.chunk, i, got[i], w[i])
				return nil
			}
		}
		return nil
	}
	for _, c := range cases {
		if err := check(c); err != nil {
			t.Fatalf("%+v: %v", c, err)
		}
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			if err := check(cases[(g*3)%len(cases)]); err != nil {
				t.Errorf("concurrent %d: %v", g, err)
			}
		})
	}
	wg.Wait()

	// One byte changed: its chunk's sum changes, no other.
	before, err := dev.ChunkCRC32C(buf.Ptr(), size, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	at := int64(37<<20 + 12345)
	if err := dev.CopyToDevice(buf.Ptr()+cudaipc.DevicePtr(at), []byte{host[at] ^ 0x40}); err != nil {
		t.Fatal(err)
	}
	after, err := dev.ChunkCRC32C(buf.Ptr(), size, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	for i := range before {
		if changed := before[i] != after[i]; changed != (int64(i) == at>>20) {
			t.Fatalf("chunk %d changed %v after a byte of chunk %d changed", i, changed, at>>20)
		}
	}

	for _, bad := range []tc{{8, 64, 256}, {0, 64, 100}, {0, 64, 0}, {0, -1, 256}} {
		if _, err := dev.ChunkCRC32C(buf.Ptr()+cudaipc.DevicePtr(bad.off), bad.n, bad.chunk); !errors.Is(err, cudaipc.ErrInvalidValue) {
			t.Fatalf("%+v: %v, want an ArgError", bad, err)
		}
	}
	if s, err := dev.ChunkCRC32C(buf.Ptr(), 0, 256); err != nil || len(s) != 0 {
		t.Fatalf("0 bytes: %v %v", s, err)
	}
}

// BenchmarkChunkCRC32C: the device's checksums of 1 GiB in 4 MiB chunks
// against hash/crc32 over the same bytes in host memory, one core.
func BenchmarkChunkCRC32C(b *testing.B) {
	dev := testutil.RequireGPU(b)
	const size = 1 << 30
	buf, err := dev.Alloc(size)
	if err != nil {
		b.Fatal(err)
	}
	defer buf.Free()
	host := make([]byte, size)
	for i := range host {
		host[i] = byte(i*7 + i>>9)
	}
	if err := dev.CopyToDevice(buf.Ptr(), host); err != nil {
		b.Fatal(err)
	}
	b.Run("device", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			if _, err := dev.ChunkCRC32C(buf.Ptr(), size, 4<<20); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("device-4MiB-calls", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			for off := int64(0); off < size; off += 4 << 20 {
				if _, err := dev.ChunkCRC32C(buf.Ptr()+cudaipc.DevicePtr(off), 4<<20, 4<<20); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
	// Beside a device→host copy into pinned memory, as a GPU object's
	// staging runs (the copy goes on, 256 MiB at a time, until the
	// sub-benchmark ends).
	b.Run("device-beside-copy", func(b *testing.B) {
		src, err := dev.Alloc(1 << 30)
		if err != nil {
			b.Fatal(err)
		}
		defer src.Free()
		pin, err := dev.AllocHost(256 << 20)
		if err != nil {
			b.Fatal(err)
		}
		defer pin.Free()
		stop := make(chan struct{})
		var copies sync.WaitGroup
		copies.Go(func() {
			for off := int64(0); ; off = (off + 256<<20) % (1 << 30) {
				select {
				case <-stop:
					return
				default:
				}
				if err := dev.CopyFromDevice(pin.Bytes(), src.Ptr()+cudaipc.DevicePtr(off)); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.SetBytes(size)
		for b.Loop() {
			if _, err := dev.ChunkCRC32C(buf.Ptr(), size, 4<<20); err != nil {
				b.Fatal(err)
			}
		}
		close(stop)
		copies.Wait()
	})
	tab := crc32.MakeTable(crc32.Castagnoli)
	b.Run("host-one-core", func(b *testing.B) {
		b.SetBytes(size)
		for b.Loop() {
			for off := 0; off < size; off += 4 << 20 {
				crc32.Checksum(host[off:off+4<<20], tab)
			}
		}
	})
}
