package alloc

import (
	"errors"
	"testing"
)

// ownedPool is a pool key with an owner, and exclusive when solo.
type ownedPool struct {
	owner uint32
	solo  int
}

func (p ownedPool) Exclusive() bool { return p.solo != 0 }

func newOwned(t *testing.T, capacity, quota int64) (*Allocator[ownedPool, string], *[]string) {
	t.Helper()
	var evicted []string
	var next uint64
	a, err := New(Config[ownedPool, string]{
		Capacity:     capacity,
		MinArenaSize: 64 << 10,
		ArenaSize:    64 << 10,
		Owner:        func(p ownedPool) uint32 { return p.owner },
		Quota:        quota,
		NewArena:     func(ownedPool, int64) (uint64, error) { next++; return next, nil },
		FreeArena:    func(uint64) {},
		Evict:        func(b *Block[ownedPool, string]) { evicted = append(evicted, b.Value) },
	})
	if err != nil {
		t.Fatal(err)
	}
	return a, &evicted
}

// TestOwnerQuota: an owner's arenas stay within the quota, its allocations
// evict only its own blocks, and a full quota is reported as such.
func TestOwnerQuota(t *testing.T) {
	a, evicted := newOwned(t, 512<<10, 256<<10)
	var first []*Block[ownedPool, string]
	for i := range 4 { // owner 1 fills its quota: 4 arenas of 64 KiB
		b, err := a.Alloc(ownedPool{owner: 1}, 64<<10, "one")
		if err != nil {
			t.Fatal(err)
		}
		a.SetEvictable(b, true)
		first = append(first, b)
		_ = i
	}
	if a.Owned(1) != 256<<10 {
		t.Fatalf("owner 1 owns %d", a.Owned(1))
	}
	// Owner 2 fills the rest of the capacity: owner 1 is not evicted.
	for range 4 {
		b, err := a.Alloc(ownedPool{owner: 2}, 64<<10, "two")
		if err != nil {
			t.Fatal(err)
		}
		a.SetEvictable(b, true)
	}
	if len(*evicted) != 0 {
		t.Fatalf("evicted %v before anyone was over", *evicted)
	}
	// Owner 2 goes on: only its own blocks go.
	for range 8 {
		if _, err := a.Alloc(ownedPool{owner: 2}, 64<<10, "two"); err != nil {
			// Its blocks are pinned once allocated here: the quota ends it.
			if !errors.Is(err, ErrFull) {
				t.Fatalf("owner 2: %v", err)
			}
			break
		}
	}
	for _, v := range *evicted {
		if v != "two" {
			t.Fatalf("owner 2's allocations evicted %q", v)
		}
	}
	if a.Owned(2) > 256<<10 || a.Owned(1) != 256<<10 {
		t.Fatalf("owned: 1 %d, 2 %d", a.Owned(1), a.Owned(2))
	}
	// Owner 1 at its quota, everything pinned: ErrFull, quota-bound.
	for _, b := range first {
		a.SetEvictable(b, false)
	}
	if _, err := a.Alloc(ownedPool{owner: 1}, 1, "x"); !errors.Is(err, ErrFull) || !a.QuotaBound(ownedPool{owner: 1}) {
		t.Fatalf("owner 1 over its quota: %v, quota-bound %v", err, a.QuotaBound(ownedPool{owner: 1}))
	}
}

// TestExclusivePool: an exclusive pool's arena is sized to its block.
func TestExclusivePool(t *testing.T) {
	a, _ := newOwned(t, 1<<20, 0)
	b, err := a.Alloc(ownedPool{owner: 1, solo: 1}, 5000, "solo")
	if err != nil {
		t.Fatal(err)
	}
	if b.Arena().Size != DefaultGranularity*2 {
		t.Fatalf("exclusive arena of a 5000-byte block: %d bytes", b.Arena().Size)
	}
	c, err := a.Alloc(ownedPool{owner: 1}, 5000, "packed")
	if err != nil {
		t.Fatal(err)
	}
	if c.Arena() == b.Arena() || c.Arena().Size != 64<<10 {
		t.Fatalf("a plain pool's arena: %d bytes", c.Arena().Size)
	}
}
