package staging

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// TestSealGPU checks CopyOut against a real device→host copy of a GPU
// object (random bytes, every chunk distinct, a size that is no multiple
// of the chunk or the slice): its sums equal copy-then-checksum's, for
// three slice sizes and buffers from AllocPinned. It logs, in one run, the
// time of each way to stage the seal (copy then checksums, and CopyOut
// alternated with it) and of each way to get a pinned buffer of the
// object's size (allocation, the first copy into it, its UCX
// registration, its free), each twice, the second round in the opposite
// order. CUDAIPC_SEAL_GIB sets the object's size (1
// GiB by default); the numbers in docs/lab/cluster-measured.md come from
//
//	CUDAIPC_SEAL_GIB=16 ./cluster_staging.test -test.run SealGPU -test.v
func TestSealGPU(t *testing.T) {
	dev := testutil.RequireGPU(t)
	gib := testutil.PositiveEnv(t, "CUDAIPC_SEAL_GIB", 1)
	size := gib<<30 + 12345
	chunk := cluster.ChunkSizeFor(size)
	thp, _ := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
	var uts unix.Utsname
	_ = unix.Uname(&uts)
	t.Logf("object %d bytes, chunk %d, GOMAXPROCS %d, kernel %s, THP %s", size, chunk, runtime.GOMAXPROCS(0),
		unix.ByteSliceToString(uts.Release[:]), strings.TrimSpace(string(thp)))
	src, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Free()
	fillGPU(t, dev, src, chunk)

	tr, err := ucxtransport.New("seal")
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	copyAll := func(mem []byte) error { return dev.CopyFromDevice(mem[:size], src.Ptr()) }
	ways := []struct {
		name  string
		alloc func() ([]byte, func() error, error)
	}{
		{"cuMemAllocHost", func() ([]byte, func() error, error) {
			hb, err := dev.AllocHost(size)
			if err != nil {
				return nil, nil, err
			}
			return hb.Bytes(), hb.Free, nil
		}},
		{"mmap+cuMemHostRegister", func() ([]byte, func() error, error) {
			mem, err := unix.Mmap(-1, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
			if err != nil {
				return nil, nil, err
			}
			reg, err := dev.RegisterHost(mem)
			if err != nil {
				unix.Munmap(mem)
				return nil, nil, err
			}
			return mem, func() error { reg.Unregister(); return unix.Munmap(mem) }, nil
		}},
		{"mmap+populate+cuMemHostRegister (AllocPinned, 4 KiB pages)", func() ([]byte, func() error, error) { return allocPinned(dev, size, false) }},
		{"mmap+THP+populate+cuMemHostRegister", func() ([]byte, func() error, error) { return allocPinned(dev, size, true) }},
	}
	// Two rounds in opposite orders: the first use of a VM's memory may
	// cost the hypervisor's faults too, which would favour whichever way
	// comes later.
	defer slog.SetDefault(slog.Default())
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})))
	for i := range 2 * len(ways) {
		round, k := i/len(ways), i%len(ways)
		if round == 1 {
			k = len(ways) - 1 - k
		}
		a := ways[k]
		t0 := time.Now()
		mem, free, err := a.alloc()
		if err != nil {
			t.Fatalf("%s: %v", a.name, err)
		}
		tAlloc := time.Since(t0)
		t0 = time.Now()
		if err := copyAll(mem); err != nil {
			t.Fatalf("%s: copy: %v", a.name, err)
		}
		tCopy := time.Since(t0)
		t0 = time.Now()
		if err := copyAll(mem); err != nil {
			t.Fatalf("%s: copy: %v", a.name, err)
		}
		tCopy2 := time.Since(t0)
		t0 = time.Now()
		reg, err := tr.Register(mem)
		if err != nil {
			t.Fatalf("%s: UCX register: %v", a.name, err)
		}
		tReg := time.Since(t0)
		reg.Close()
		t0 = time.Now()
		if err := free(); err != nil {
			t.Fatalf("%s: free: %v", a.name, err)
		}
		t.Logf("pinned, round %d, %-58s alloc %8.3f s, first copy %.3f s (%.1f GB/s), again %.3f s (%.1f GB/s), UCX register %.3f s, free %.3f s",
			round+1, a.name, tAlloc.Seconds(), tCopy.Seconds(), float64(size)/tCopy.Seconds()/1e9, tCopy2.Seconds(),
			float64(size)/tCopy2.Seconds()/1e9, tReg.Seconds(), time.Since(t0).Seconds())
	}

	mem, free, err := AllocPinned(dev, size)
	if err != nil {
		t.Fatal(err)
	}
	defer free()
	mem = mem[:size]
	var want []uint32
	times := map[string][]time.Duration{}
	for round := range 3 {
		t0 := time.Now()
		if err := copyAll(mem); err != nil {
			t.Fatal(err)
		}
		tc := time.Since(t0)
		sums := cluster.ChecksumsParallel(mem, chunk)
		ts := time.Since(t0) - tc
		if round == 0 {
			want = sums
		} else if !slices.Equal(sums, want) {
			t.Fatal("copy then checksums: the sums changed between rounds")
		}
		times["copy"] = append(times["copy"], tc)
		times["checksums"] = append(times["checksums"], ts)
		times["copy then checksums"] = append(times["copy then checksums"], tc+ts)
		for _, c := range []struct {
			slice   int64
			workers int
		}{{16 << 20, 0}, {DefaultSealSlice, 0}, {256 << 20, 0}, {DefaultSealSlice, runtime.GOMAXPROCS(0) - 1}} {
			slice := c.slice
			clear(mem[:min(int64(len(mem)), 1<<20)]) // a copy that did nothing shows
			t0 := time.Now()
			sums, err := CopyOut(context.Background(), mem, chunk, slice, c.workers, func(off int64, b []byte) error {
				return dev.CopyFromDevice(b, src.Ptr()+cudaipc.DevicePtr(off))
			})
			d := time.Since(t0)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(sums, want) {
				t.Fatalf("CopyOut, %d MiB slices: sums differ from copy then checksums", slice>>20)
			}
			k := fmt.Sprintf("CopyOut, %d MiB slices", slice>>20)
			if c.workers > 0 {
				k += fmt.Sprintf(", %d workers", c.workers)
			}
			times[k] = append(times[k], d)
		}
	}
	for _, k := range slices.Sorted(maps.Keys(times)) {
		var s []string
		for _, d := range times[k] {
			s = append(s, fmt.Sprintf("%.3f", d.Seconds()))
		}
		t.Logf("seal staging %-36s %s s (%.1f GB/s best)", k, strings.Join(s, " / "), float64(size)/slices.Min(times[k]).Seconds()/1e9)
	}
}

// fillGPU fills buf with random bytes: a random 256 MiB block copied over
// the whole buffer on the device, then a random 8 bytes written into each
// chunk (at an offset that varies), so that no two chunks are equal.
func fillGPU(t *testing.T, dev *cudaipc.Device, buf *cudaipc.Buffer, chunk int64) {
	t.Helper()
	size := buf.Size()
	rng := rand.NewChaCha8([32]byte{byte(size), 3})
	block := make([]byte, min(size, 256<<20))
	rng.Read(block)
	if err := dev.CopyToDevice(buf.Ptr(), block); err != nil {
		t.Fatal(err)
	}
	for off := int64(len(block)); off < size; off += int64(len(block)) {
		if err := dev.Copy(buf.Ptr()+cudaipc.DevicePtr(off), buf.Ptr(), min(int64(len(block)), size-off)); err != nil {
			t.Fatal(err)
		}
	}
	var mark [8]byte
	for i := int64(0); i*chunk < size; i++ {
		off := i*chunk + (i*4099)%min(chunk, size-i*chunk)
		rng.Read(mark[:])
		n := min(int64(len(mark)), size-off)
		if err := dev.CopyToDevice(buf.Ptr()+cudaipc.DevicePtr(off), mark[:n]); err != nil {
			t.Fatal(err)
		}
	}
}
