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
