package cudaipc_test

import (
	"bytes"
	"errors"
	"fmt"
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

// TestCopyToDeviceCRC32C: random bytes copied to the device from pinned
// and from pageable memory, at offsets and with chunk sizes from 256 B to
// 16 MiB, land intact and come back with hash/crc32's sums of each chunk;
// sixteen goroutines landing disjoint ranges at once all land right; bad
// arguments are ArgErrors that copy nothing.
func TestCopyToDeviceCRC32C(t *testing.T) {
	dev := testutil.RequireGPU(t)
	if err := dev.CRC32CSupported(); err != nil {
		t.Fatalf("the driver does not run the CRC-32C kernel: %v", err)
	}
	const size = 64<<20 + 4096
	buf, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	pin, err := dev.AllocHost(size)
	if err != nil {
		t.Fatal(err)
	}
	defer pin.Free()
	rng := rand.New(rand.NewPCG(11, 23))
	src := pin.Bytes()[:size]
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	pageable := append([]byte(nil), src...)
	tab := crc32.MakeTable(crc32.Castagnoli)
	// land copies host[off:off+n] to the same offset on the device and
	// checks the sums and the bytes that landed.
	land := func(host []byte, off, n, chunk int64) error {
		got, err := dev.CopyToDeviceCRC32C(buf.Ptr()+cudaipc.DevicePtr(off), host[off:off+n], chunk)
		if err != nil {
			return err
		}
		var want []uint32
		for o := off; o < off+n; o += chunk {
			want = append(want, crc32.Checksum(host[o:min(o+chunk, off+n)], tab))
		}
		if len(got) != len(want) {
			return fmt.Errorf("off %d n %d chunk %d: %d sums, want %d", off, n, chunk, len(got), len(want))
		}
		for i := range want {
			if got[i] != want[i] {
				return fmt.Errorf("off %d n %d chunk %d: chunk %d sum %08x, want %08x", off, n, chunk, i, got[i], want[i])
			}
		}
		back := make([]byte, n)
		if err := dev.CopyFromDevice(back, buf.Ptr()+cudaipc.DevicePtr(off)); err != nil {
			return err
		}
		if !bytes.Equal(back, host[off:off+n]) {
			return fmt.Errorf("off %d n %d: the bytes on the device are not the bytes copied", off, n)
		}
		return nil
	}
	type tc struct{ off, n, chunk int64 }
	cases := []tc{{0, 1, 256}, {16, 4<<20 + 7, 4 << 20}, {0, size, 16 << 20}, {4096, 1 << 20, 256}}
	for range 8 {
		off := 16 * rng.Int64N(size/16)
		cases = append(cases, tc{off, 1 + rng.Int64N(size-off), 256 << rng.IntN(17)})
	}
	for _, c := range cases {
		for _, host := range [][]byte{src, pageable} {
			if err := land(host, c.off, c.n, c.chunk); err != nil {
				t.Fatal(err)
			}
		}
	}
	// Sixteen goroutines, each landing its own 4 MiB pieces of fresh bytes.
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	var wg sync.WaitGroup
	const piece = 4 << 20
	for g := range 16 {
		wg.Go(func() {
			for off := int64(g) * piece; off+piece <= size; off += 16 * piece {
				if err := land(src, off, piece, 1<<20); err != nil {
					t.Errorf("goroutine %d: %v", g, err)
					return
				}
			}
		})
	}
	wg.Wait()

	before := make([]byte, 4096)
	if err := dev.CopyFromDevice(before, buf.Ptr()); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []tc{{8, 64, 256}, {0, 64, 100}, {0, 64, 0}} {
		if _, err := dev.CopyToDeviceCRC32C(buf.Ptr()+cudaipc.DevicePtr(bad.off), pageable[:bad.n], bad.chunk); !errors.Is(err, cudaipc.ErrInvalidValue) {
			t.Fatalf("%+v: %v, want an ArgError", bad, err)
		}
	}
	after := make([]byte, 4096)
	if err := dev.CopyFromDevice(after, buf.Ptr()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(before, after) {
		t.Fatal("a refused CopyToDeviceCRC32C changed device memory")
	}
	if s, err := dev.CopyToDeviceCRC32C(buf.Ptr(), nil, 256); err != nil || len(s) != 0 {
		t.Fatalf("0 bytes: %v %v", s, err)
	}
}

// BenchmarkLandChunks: 1 GiB from pinned memory to the device in 4 MiB
// chunks on 8 goroutines (as a pull lands them), each chunk checksummed
// on the device: CopyToDevice then ChunkCRC32C (the legacy default
// stream's serial copies, the way pulls landed before) against
// CopyToDeviceCRC32C, beside CopyToDevice alone as the reference.
func BenchmarkLandChunks(b *testing.B) {
	dev := testutil.RequireGPU(b)
	const size, chunk, workers = 1 << 30, 4 << 20, 8
	buf, err := dev.Alloc(size)
	if err != nil {
		b.Fatal(err)
	}
	defer buf.Free()
	pin, err := dev.AllocHost(size)
	if err != nil {
		b.Fatal(err)
	}
	defer pin.Free()
	src := pin.Bytes()[:size]
	for i := range src {
		src[i] = byte(i*7 + i>>9)
	}
	each := func(b *testing.B, land func(off int64) error) {
		b.SetBytes(size)
		for b.Loop() {
			var wg sync.WaitGroup
			for g := range workers {
				wg.Go(func() {
					for off := int64(g) * chunk; off < size; off += workers * chunk {
						if err := land(off); err != nil {
							b.Error(err)
							return
						}
					}
				})
			}
			wg.Wait()
		}
	}
	b.Run("copy-only", func(b *testing.B) {
		each(b, func(off int64) error { return dev.CopyToDevice(buf.Ptr()+cudaipc.DevicePtr(off), src[off:off+chunk]) })
	})
	b.Run("copy-then-sum", func(b *testing.B) {
		each(b, func(off int64) error {
			if err := dev.CopyToDevice(buf.Ptr()+cudaipc.DevicePtr(off), src[off:off+chunk]); err != nil {
				return err
			}
			_, err := dev.ChunkCRC32C(buf.Ptr()+cudaipc.DevicePtr(off), chunk, chunk)
			return err
		})
	})
	b.Run("copy-and-sum", func(b *testing.B) {
		each(b, func(off int64) error {
			_, err := dev.CopyToDeviceCRC32C(buf.Ptr()+cudaipc.DevicePtr(off), src[off:off+chunk], chunk)
			return err
		})
	})
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
