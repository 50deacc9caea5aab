package cudaipc_test

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// TestGather: groups of copies of random bytes (aligned and misaligned,
// one byte, several chunks, empty groups) land where a copy puts them, and
// nowhere else; done is called once a group, in order; four goroutines at
// once; bad copies are ArgErrors.
func TestGather(t *testing.T) {
	dev := testutil.RequireGPU(t)
	const size = 8 << 20
	src, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Free()
	dst, err := dev.Alloc(4 * size)
	if err != nil {
		t.Fatal(err)
	}
	defer dst.Free()
	host := testutil.RandomBytes(3, size)
	if err := dev.CopyToDevice(src.Ptr(), host); err != nil {
		t.Fatal(err)
	}
	before := testutil.RandomBytes(4, 4*size)
	if err := dev.CopyToDevice(dst.Ptr(), before); err != nil {
		t.Fatal(err)
	}
	// Goroutine g writes into its quarter of dst.
	var wg sync.WaitGroup
	errs := make([]error, 4)
	wants := make([][]byte, 4)
	for g := range 4 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 9))
			base := int64(g) * size
			want := bytes.Clone(before[base : base+size])
			var groups [][]cudaipc.Copy
			at := int64(0)
			for i := range 6 {
				var grp []cudaipc.Copy
				for j := range 1 + rng.IntN(40) {
					if i == 2 {
						break // an empty group
					}
					n := int64(1 + rng.IntN(64<<10))
					switch j % 4 {
					case 0:
						n = 1
					case 1:
						n = 300<<10 + 3 // several chunks
					}
					so := rng.Int64N(size - n)
					if j%2 == 0 {
						so &^= 15
					}
					if at+n > size {
						break
					}
					grp = append(grp, cudaipc.Copy{Dst: dst.Ptr() + cudaipc.DevicePtr(base+at), Src: src.Ptr() + cudaipc.DevicePtr(so), Bytes: n})
					copy(want[at:at+n], host[so:so+n])
					at += n + int64(rng.IntN(40))
				}
				groups = append(groups, grp)
			}
			var seen []int
			errs[g] = dev.Gather(groups, func(i int) { seen = append(seen, i) })
			if errs[g] == nil && len(seen) != len(groups) {
				errs[g] = errors.New("done was not called once a group")
			}
			for i, s := range seen {
				if s != i {
					errs[g] = errors.New("done was called out of order")
				}
			}
			wants[g] = want
		})
	}
	wg.Wait()
	got := make([]byte, 4*size)
	if err := dev.CopyFromDevice(got, dst.Ptr()); err != nil {
		t.Fatal(err)
	}
	for g := range 4 {
		if errs[g] != nil {
			t.Fatalf("goroutine %d: %v", g, errs[g])
		}
		if !bytes.Equal(got[int64(g)*size:int64(g+1)*size], wants[g]) {
			t.Errorf("goroutine %d: the destination is not what the copies give", g)
		}
	}
	var ae *cudaipc.ArgError
	if err := dev.Gather([][]cudaipc.Copy{{{Dst: dst.Ptr(), Src: 0, Bytes: 4}}}, nil); !errors.As(err, &ae) {
		t.Errorf("a copy from address 0: %v, want an ArgError", err)
	}
	if err := dev.Gather([][]cudaipc.Copy{{{Dst: dst.Ptr(), Src: src.Ptr(), Bytes: -1}}}, nil); !errors.As(err, &ae) {
		t.Errorf("a copy of -1 bytes: %v, want an ArgError", err)
	}
}

// TestGatherMappedHost: host memory registered with RegisterHostMapped is
// a gather's destination (device → host across the bus, as a KV read's
// source gathers its blocks) and its source (host → device, as the
// reader scatters them); Unregister gives the memory back.
func TestGatherMappedHost(t *testing.T) {
	dev := testutil.RequireGPU(t)
	const size = 1 << 20
	gpu, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer gpu.Free()
	data := testutil.RandomBytes(11, size)
	if err := dev.CopyToDevice(gpu.Ptr(), data); err != nil {
		t.Fatal(err)
	}
	host := make([]byte, 2*size)
	reg, ptr, err := dev.RegisterHostMapped(host)
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Unregister()
	// Odd pieces of the device's bytes, reversed, into the host's first half.
	var copies []cudaipc.Copy
	want := make([]byte, 2*size)
	for i, off := 0, int64(0); off < size; i++ {
		n := min(int64(4096+i*517), size-off)
		dst := size - off - n
		copies = append(copies, cudaipc.Copy{Dst: ptr + cudaipc.DevicePtr(dst), Src: gpu.Ptr() + cudaipc.DevicePtr(off), Bytes: n})
		copy(want[dst:dst+n], data[off:off+n])
		off += n
	}
	if err := dev.Gather([][]cudaipc.Copy{copies}, nil); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(host[:size], want[:size]) {
		t.Fatal("device → mapped host: the bytes differ")
	}
	// And back: the host's first half into the device, shifted by one byte.
	if err := dev.Gather([][]cudaipc.Copy{{{Dst: gpu.Ptr() + 1, Src: ptr, Bytes: size - 1}}}, nil); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if err := dev.CopyFromDevice(got, gpu.Ptr()); err != nil {
		t.Fatal(err)
	}
	if got[0] != data[0] || !bytes.Equal(got[1:], host[:size-1]) {
		t.Fatal("mapped host → device: the bytes differ")
	}
	if _, _, err := dev.RegisterHostMapped(nil); err == nil {
		t.Error("RegisterHostMapped of no memory succeeded")
	}
}
