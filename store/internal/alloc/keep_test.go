package alloc

import (
	"errors"
	"testing"
)

// keepHarness is an allocator with owners and KeepEmpty, recording which
// arenas are live.
type keepHarness struct {
	a     *Allocator[ownedPool, string]
	live  map[uint64]int64
	next  uint64
	fail  bool // NewArena fails once when set
	freed []uint64
}

func newKeep(t *testing.T, capacity, quota, keep int64) *keepHarness {
	t.Helper()
	h := &keepHarness{live: map[uint64]int64{}}
	a, err := New(Config[ownedPool, string]{
		Capacity:     capacity,
		MinArenaSize: 64 << 10,
		ArenaSize:    64 << 10,
		Owner:        func(p ownedPool) uint32 { return p.owner },
		Quota:        quota,
		KeepEmpty:    keep,
		NewArena: func(_ ownedPool, size int64) (uint64, error) {
			if h.fail {
				h.fail = false
				return 0, errors.New("out of memory")
			}
			h.next++
			h.live[h.next] = size
			return h.next, nil
		},
		FreeArena: func(id uint64) {
			if _, ok := h.live[id]; !ok {
				t.Errorf("FreeArena(%d) of an arena that is not live", id)
			}
			delete(h.live, id)
			h.freed = append(h.freed, id)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	h.a = a
	return h
}

func (h *keepHarness) alloc(t *testing.T, p ownedPool, size int64) *Block[ownedPool, string] {
	t.Helper()
	b, err := h.a.Alloc(p, size, "x")
	if err != nil {
		t.Fatalf("Alloc(%v, %d): %v", p, size, err)
	}
	return b
}

// TestKeepReusesEmptyArena: an emptied arena is kept, still reserved and
// counted against its owner, and the pool's next block of a fitting size
// lands in it, whole, at offset 0.
func TestKeepReusesEmptyArena(t *testing.T) {
	h := newKeep(t, 1<<20, 0, 1<<20)
	p := ownedPool{owner: 7}
	big := h.alloc(t, p, 200<<10) // its own arena: larger than ArenaSize
	small := h.alloc(t, p, 1000)  // a 64 KiB arena
	id := big.Arena().ID
	h.a.Free(big)
	if len(h.freed) != 0 {
		t.Fatalf("arenas given back: %v, want none (kept)", h.freed)
	}
	st := h.a.Stats()
	if st.Kept != 1 || st.KeptBytes != big.Arena().Size || st.Reserved != big.Arena().Size+small.Arena().Size || h.a.Owned(7) != st.Reserved {
		t.Fatalf("stats %+v, owned %d", st, h.a.Owned(7))
	}
	again := h.alloc(t, p, 150<<10)
	if again.Arena().ID != id || again.Offset != 0 {
		t.Fatalf("next block in arena %d at %d, want the kept arena %d at 0", again.Arena().ID, again.Offset, id)
	}
	if st := h.a.Stats(); st.Kept != 0 || st.KeptBytes != 0 || st.Reused != 1 || st.Arenas != 2 {
		t.Fatalf("stats after reuse %+v", st)
	}
	// Emptied again and refilled: still the same arena, free space whole.
	h.a.Free(again)
	b := h.alloc(t, p, 200<<10)
	if b.Arena().ID != id || b.Arena().LargestFree() != b.Arena().Size-200<<10 {
		t.Fatalf("refill: arena %d, largest free %d", b.Arena().ID, b.Arena().LargestFree())
	}
}

// TestKeepNeverCrossesPools: a kept arena serves only its own pool; another
// owner's block gets an arena of its own, and exclusive pools keep nothing.
func TestKeepNeverCrossesPools(t *testing.T) {
	h := newKeep(t, 4<<20, 0, 4<<20)
	mine := h.alloc(t, ownedPool{owner: 1}, 100<<10)
	kept := mine.Arena().ID
	h.a.Free(mine)
	other := h.alloc(t, ownedPool{owner: 2}, 100<<10)
	if other.Arena().ID == kept {
		t.Fatal("another owner's block was placed in a kept arena")
	}
	solo := h.alloc(t, ownedPool{owner: 1, solo: 1}, 100<<10)
	if solo.Arena().ID == kept {
		t.Fatal("an exclusive pool's block was placed in a kept arena")
	}
	soloID := solo.Arena().ID
	h.a.Free(solo)
	if _, ok := h.live[soloID]; ok {
		t.Fatal("an exclusive pool's empty arena was kept")
	}
	if _, ok := h.live[kept]; !ok {
		t.Fatal("the kept arena was given back without need")
	}
}

// TestKeepBound: kept arenas beyond KeepEmpty go back, least recently
// emptied first, and arenas larger than the bound are never kept.
func TestKeepBound(t *testing.T) {
	h := newKeep(t, 8<<20, 0, 128<<10)
	p := ownedPool{owner: 1}
	var bs []*Block[ownedPool, string]
	for range 3 {
		bs = append(bs, h.alloc(t, p, 64<<10)) // three 64 KiB arenas
	}
	huge := h.alloc(t, p, 1<<20)
	h.a.Free(huge)
	if _, ok := h.live[huge.Arena().ID]; ok {
		t.Fatal("an arena larger than KeepEmpty was kept")
	}
	for _, b := range bs {
		h.a.Free(b)
	}
	if st := h.a.Stats(); st.Kept != 2 || st.KeptBytes != 128<<10 {
		t.Fatalf("stats %+v, want 2 kept arenas of 64 KiB", st)
	}
	if _, ok := h.live[bs[0].Arena().ID]; ok {
		t.Fatal("the least recently emptied arena was kept beyond the bound")
	}
}

// TestKeepReleasedUnderPressure: kept arenas give their room back when a
// new arena would not fit the capacity (any owner's) or the quota (only
// the owner's), before anything is evicted, and when NewArena fails.
func TestKeepReleasedUnderPressure(t *testing.T) {
	h := newKeep(t, 512<<10, 384<<10, 512<<10)
	a1 := h.alloc(t, ownedPool{owner: 1}, 256<<10)
	h.a.Free(a1)
	// Owner 1's quota: a block of another pool of owner 1 needs the room.
	b := h.alloc(t, ownedPool{owner: 1, solo: 1}, 200<<10)
	if _, ok := h.live[a1.Arena().ID]; ok || h.a.Owned(1) != b.Arena().Size {
		t.Fatalf("owner 1's kept arena not given back for its own quota (owned %d)", h.a.Owned(1))
	}
	h.a.Free(b)
	// Owner 2's emptied arena is kept; owner 3's second block needs the
	// capacity it holds.
	c := h.alloc(t, ownedPool{owner: 2}, 256<<10)
	h.a.Free(c)
	d := h.alloc(t, ownedPool{owner: 3}, 200<<10)
	e := h.alloc(t, ownedPool{owner: 3}, 100<<10)
	if st := h.a.Stats(); st.Reserved > 512<<10 {
		t.Fatalf("reserved %d beyond the capacity", st.Reserved)
	}
	if _, ok := h.live[c.Arena().ID]; ok {
		t.Fatal("owner 2's kept arena not given back when the capacity ran short")
	}
	// A failing NewArena: kept arenas go, and it is tried again.
	h.a.Free(d)
	h.a.Free(e)
	if h.a.Stats().Kept == 0 {
		t.Fatal("nothing kept")
	}
	h.fail = true
	f := h.alloc(t, ownedPool{owner: 4}, 10<<10)
	if st := h.a.Stats(); st.Kept != 0 || f == nil {
		t.Fatalf("stats %+v after a failed NewArena", st)
	}
}

func TestKeepEmptyNegative(t *testing.T) {
	_, err := New(Config[ownedPool, string]{Capacity: 1, KeepEmpty: -1, NewArena: func(ownedPool, int64) (uint64, error) { return 1, nil }, FreeArena: func(uint64) {}})
	if err == nil {
		t.Fatal("negative KeepEmpty accepted")
	}
}
