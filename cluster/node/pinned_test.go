package node

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/staging"
)

// fakePinned counts the pool's allocations and frees of Go memory.
type fakePinned struct{ allocs, frees int }

func (f *fakePinned) alloc(_ *cudaipc.Device, n int64) ([]byte, func() error, error) {
	f.allocs++
	return make([]byte, n), func() error { f.frees++; return nil }, nil
}

func TestPinnedPoolReuseAndTags(t *testing.T) {
	f := &fakePinned{}
	pp := &pinnedPool{max: 4 * pinnedUnit, alloc: f.alloc}
	get := func(size int64) *pinned {
		t.Helper()
		b, err := pp.get(nil, size)
		if err != nil {
			t.Fatal(err)
		}
		if b.tag != "" || b.size() < size {
			t.Fatalf("get(%d): a buffer of %d bytes tagged %q", size, b.size(), b.tag)
		}
		return b
	}
	// Sizes round up to the unit, and a buffer comes back for the next
	// object of a nearby size.
	a := get(pinnedUnit + 1)
	if a.size() != 2*pinnedUnit {
		t.Fatalf("a buffer of %d bytes for %d", a.size(), pinnedUnit+1)
	}
	pp.put(a)
	if b := get(2*pinnedUnit - 5); b != a || f.allocs != 1 {
		t.Fatalf("the idle buffer was not reused (%d allocations)", f.allocs)
	}
	// A buffer holding an incarnation is found by its tag, once.
	a.tag = "inc-1"
	pp.put(a)
	if pp.take("inc-2", nil, 10) != nil || pp.take("", nil, 10) != nil {
		t.Fatal("take returned a buffer of another incarnation")
	}
	if b := pp.take("inc-1", nil, 2*pinnedUnit); b != a || b.tag != "inc-1" {
		t.Fatal("take did not return the buffer holding inc-1")
	}
	if pp.take("inc-1", nil, 10) != nil {
		t.Fatal("one buffer taken twice")
	}
	// get prefers an untagged buffer to one holding an incarnation, and
	// clears the tag of one it takes.
	u := get(pinnedUnit)
	pp.put(a) // tagged inc-1, 2 units
	pp.put(u) // untagged, 1 unit
	if b := get(10); b != u {
		t.Fatal("get took the buffer holding an incarnation before an untagged one")
	}
	if b := get(10); b != a || b.tag != "" {
		t.Fatalf("get of the last idle buffer: %p tagged %q", b, b.tag)
	}
	if pp.take("inc-1", nil, 10) != nil {
		t.Fatal("a buffer reused for other bytes is still found by its old tag")
	}
	// Idle buffers beyond max go, the oldest first; close frees the rest
	// and what comes back afterwards.
	c := get(3 * pinnedUnit)
	pp.put(a) // 2 units idle
	pp.put(c) // 5 units: a goes
	if f.frees != 1 || pp.take("", nil, 1) != nil {
		t.Fatalf("%d frees after passing max, want 1", f.frees)
	}
	if b := get(pinnedUnit); b != c {
		t.Fatal("the newest idle buffer was not kept")
	}
	pp.close()
	pp.put(c)
	if f.frees != 2 {
		t.Fatalf("%d frees after close and a put, want 2", f.frees)
	}
}

// stageSums returns the checksums cluster.Checksums gives for the bytes
// copied out, and the buffer holding them; a copy failing mid-way returns
// the buffer to the pool, and the next seal gets it back.
func TestStageSumsCopyFails(t *testing.T) {
	f := &fakePinned{}
	pp := &pinnedPool{max: 4 * pinnedUnit, alloc: f.alloc}
	const chunk = 1 << 20
	size := int64(staging.DefaultSealSlice*2 + 3*chunk + 5) // slices and chunks: neither divides it
	src := make([]byte, size)
	rand.NewChaCha8([32]byte{4}).Read(src)
	memcpy := func(off int64, p []byte) error { copy(p, src[off:]); return nil }
	errDMA := errors.New("DMA failed")
	_, b, err := stageSums(context.Background(), pp, nil, size, chunk, func(off int64, p []byte) error {
		if off > 0 {
			return errDMA
		}
		return memcpy(off, p)
	})
	if !errors.Is(err, errDMA) || b != nil || !strings.Contains(err.Error(), "stage a GPU object device→host") {
		t.Fatalf("stageSums with a failing copy: %v, buffer %v", err, b)
	}
	if len(pp.idle) != 1 || f.allocs != 1 || f.frees != 0 {
		t.Fatalf("after a failed stage: %d idle, %d allocated, %d freed; want the one buffer back in the pool", len(pp.idle), f.allocs, f.frees)
	}
	sums, b, err := stageSums(context.Background(), pp, nil, size, chunk, memcpy)
	if err != nil {
		t.Fatal(err)
	}
	if f.allocs != 1 || len(pp.idle) != 0 {
		t.Fatalf("the seal after a failed one allocated again (%d allocations, %d idle)", f.allocs, len(pp.idle))
	}
	if !bytes.Equal(b.mem[:size], src) || !slices.Equal(sums, cluster.Checksums(src, chunk)) {
		t.Fatal("the staged bytes or their sums differ from the source's")
	}
	pp.put(b)
	pp.close()
	if f.frees != 1 {
		t.Fatalf("%d frees after close, want 1", f.frees)
	}
}
