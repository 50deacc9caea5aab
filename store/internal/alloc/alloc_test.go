package alloc

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
)

type pool string

// harness records the arenas the allocator asks for and the blocks it evicts.
type harness struct {
	t       *testing.T
	a       *Allocator[pool, string]
	nextID  uint64
	live    map[uint64]int64
	evicted []string
}

func newHarness(t *testing.T, capacity, arenaSize int64, noEvict bool) *harness {
	t.Helper()
	h := &harness{t: t, live: make(map[uint64]int64)}
	a, err := New(Config[pool, string]{
		Capacity:  capacity,
		ArenaSize: arenaSize,
		NoEvict:   noEvict,
		NewArena: func(p pool, size int64) (uint64, error) {
			h.nextID++
			h.live[h.nextID] = size
			return h.nextID, nil
		},
		FreeArena: func(id uint64) {
			if _, ok := h.live[id]; !ok {
				t.Errorf("FreeArena(%d) of an arena that is not live", id)
			}
			delete(h.live, id)
		},
		Evict: func(b *Block[pool, string]) { h.evicted = append(h.evicted, b.Value) },
	})
	if err != nil {
		t.Fatal(err)
	}
	h.a = a
	return h
}

func (h *harness) alloc(p pool, size int64, name string) *Block[pool, string] {
	h.t.Helper()
	b, err := h.a.Alloc(p, size, name)
	if err != nil {
		h.t.Fatalf("Alloc(%q, %d): %v", p, size, err)
	}
	if b.Offset%Alignment != 0 {
		h.t.Fatalf("block %s at offset %d is not %d-aligned", name, b.Offset, Alignment)
	}
	if b.Offset+b.Size > b.Arena().Size {
		h.t.Fatalf("block %s [%d,+%d) overruns its arena of %d", name, b.Offset, b.Size, b.Arena().Size)
	}
	return b
}

func TestAlignmentAndPacking(t *testing.T) {
	h := newHarness(t, 1<<20, 1<<20, false)
	b1 := h.alloc("p", 1, "a")
	b2 := h.alloc("p", 257, "b")
	b3 := h.alloc("p", 256, "c")
	if b1.Offset != 0 || b2.Offset != 256 || b3.Offset != 768 {
		t.Fatalf("offsets %d %d %d, want 0 256 768", b1.Offset, b2.Offset, b3.Offset)
	}
	if st := h.a.Stats(); st.Used != 1024 || st.Arenas != 1 || st.Reserved != 1<<20 || st.Blocks != 3 {
		t.Fatalf("stats %+v", st)
	}
}

func TestCoalescing(t *testing.T) {
	h := newHarness(t, 4096, 4096, true)
	var bs []*Block[pool, string]
	for i := range 16 { // 16 blocks of 256 fill the 4 KiB arena
		bs = append(bs, h.alloc("p", 256, string(rune('a'+i))))
	}
	ar := bs[0].Arena()
	if ar.FreeBytes() != 0 {
		t.Fatalf("full arena has %d free bytes", ar.FreeBytes())
	}
	// Free every other block: 2 KiB free but fragmented in 256-byte holes.
	for i := 0; i < 16; i += 2 {
		h.a.Free(bs[i])
	}
	if ar.FreeBytes() != 2048 || ar.LargestFree() != 256 || ar.FreeExtents() != 8 {
		t.Fatalf("fragmented arena: free %d largest %d extents %d", ar.FreeBytes(), ar.LargestFree(), ar.FreeExtents())
	}
	if _, err := h.a.Alloc("p", 512, "big"); !errors.Is(err, ErrFull) {
		t.Fatalf("512 bytes in a fragmented arena: err = %v, want ErrFull", err)
	}
	// Freeing the blocks between the holes merges everything back.
	for i := 1; i < 15; i += 2 {
		h.a.Free(bs[i])
	}
	if ar.FreeExtents() != 1 || ar.LargestFree() != 4096-256 {
		t.Fatalf("after freeing all but the last: extents %d largest %d", ar.FreeExtents(), ar.LargestFree())
	}
	b := h.alloc("p", 4096-256, "big")
	if b.Offset != 0 || b.Arena() != ar {
		t.Fatalf("big block at %d of arena %d, want 0 of arena %d", b.Offset, b.Arena().ID, ar.ID)
	}
}

func TestBestFitKeepsLargeExtents(t *testing.T) {
	h := newHarness(t, 8192, 8192, true)
	a := h.alloc("p", 1024, "a")
	h.alloc("p", 256, "sep1")
	b := h.alloc("p", 256, "b")
	h.alloc("p", 256, "sep2")
	h.a.Free(a) // 1024-byte hole at 0
	h.a.Free(b) // 256-byte hole at 1280
	c := h.alloc("p", 200, "c")
	if c.Offset != b.Offset {
		t.Fatalf("small block went to offset %d, want the small hole at %d", c.Offset, b.Offset)
	}
	d := h.alloc("p", 1024, "d")
	if d.Offset != 0 {
		t.Fatalf("1 KiB block at %d, want the 1 KiB hole at 0", d.Offset)
	}
}

func TestArenaGrowthAndRelease(t *testing.T) {
	h := newHarness(t, 3<<20, 1<<20, true)
	x := h.alloc("p", 1<<20, "x")
	y := h.alloc("p", 1<<20, "y")
	if x.Arena() == y.Arena() || len(h.live) != 2 {
		t.Fatalf("two full-arena blocks share an arena or %d arenas live", len(h.live))
	}
	// A block larger than the arena size gets an arena of its own size,
	// only if the capacity left allows.
	if _, err := h.a.Alloc("p", 1<<20+1, "z"); !errors.Is(err, ErrFull) {
		t.Fatalf("err = %v, want ErrFull", err)
	}
	h.a.Free(x)
	if len(h.live) != 1 {
		t.Fatalf("emptied arena not given back: %d live", len(h.live))
	}
	z := h.alloc("p", 1<<20+1, "z")
	if z.Arena().Size != 1<<20+4096 {
		t.Fatalf("arena for a 1 MiB+1 block is %d bytes", z.Arena().Size)
	}
	if st := h.a.Stats(); st.Reserved != 2<<20+4096 {
		t.Fatalf("reserved %d", st.Reserved)
	}
	// Pools never share arenas.
	q := h.alloc("q", 256, "q")
	if q.Arena() == y.Arena() || q.Arena() == z.Arena() {
		t.Fatal("block of pool q placed in an arena of pool p")
	}
}

func TestCapacityClipsArena(t *testing.T) {
	h := newHarness(t, 100<<10, 0, true) // default arena size, clipped to 100 KiB
	b := h.alloc("p", 10, "a")
	if b.Arena().Size != 100<<10 {
		t.Fatalf("arena %d bytes, want capacity", b.Arena().Size)
	}
	if _, err := h.a.Alloc("p", 200<<10, "huge"); !errors.Is(err, ErrFull) {
		t.Fatalf("block over capacity: err = %v", err)
	}
}

func TestEvictionOrder(t *testing.T) {
	h := newHarness(t, 4096, 4096, false)
	var bs []*Block[pool, string]
	for _, n := range []string{"a", "b", "c", "d"} {
		bs = append(bs, h.alloc("p", 1024, n))
	}
	// Evictable order: c, a, d (b stays pinned, as a leased object would).
	h.a.SetEvictable(bs[2], true)
	h.a.SetEvictable(bs[0], true)
	h.a.SetEvictable(bs[3], true)
	h.a.SetEvictable(bs[0], true) // already evictable: keeps its place
	h.alloc("p", 1024, "e")
	if !slices.Equal(h.evicted, []string{"c"}) {
		t.Fatalf("evicted %v, want [c]", h.evicted)
	}
	// 2 KiB needs two adjacent blocks, but b and e are pinned at 1024 and
	// 2048: evicting a and d would leave two 1 KiB holes. Alloc decides that
	// up front and evicts nothing.
	h.evicted = nil
	if _, err := h.a.Alloc("p", 2048, "f"); !errors.Is(err, ErrFull) {
		t.Fatalf("err = %v, want ErrFull", err)
	}
	if len(h.evicted) != 0 {
		t.Fatalf("a failed Alloc evicted %v", h.evicted)
	}
	// Touching moves a block to the back of the LRU list.
	h.a.SetEvictable(bs[0], false)
	h.a.SetEvictable(bs[0], true)
	h.alloc("p", 1024, "g")
	if !slices.Equal(h.evicted, []string{"d"}) {
		t.Fatalf("evicted %v, want [d]", h.evicted)
	}
}

func TestEvictionSkipsUselessVictims(t *testing.T) {
	h := newHarness(t, 8192, 4096, false)
	// Pool q: an arena with a pinned block and an evictable one; evicting
	// the evictable one cannot free q's arena, so it must survive.
	h.alloc("q", 1024, "q-pinned")
	qe := h.alloc("q", 1024, "q-evictable")
	h.a.SetEvictable(qe, true)
	// Pool p: fill its arena with evictable blocks, newer than q's.
	for _, n := range []string{"p1", "p2", "p3", "p4"} {
		h.a.SetEvictable(h.alloc("p", 1024, n), true)
	}
	h.alloc("p", 1024, "p5")
	if !slices.Equal(h.evicted, []string{"p1"}) {
		t.Fatalf("evicted %v, want [p1]", h.evicted)
	}
}

func TestEvictionFreesOtherPoolsArena(t *testing.T) {
	h := newHarness(t, 8192, 4096, false)
	for _, n := range []string{"q1", "q2"} {
		h.a.SetEvictable(h.alloc("q", 2048, n), true)
	}
	h.alloc("p", 4096, "p1")
	// p needs a second arena; only emptying q's arena gives the capacity.
	h.alloc("p", 4096, "p2")
	if !slices.Equal(h.evicted, []string{"q1", "q2"}) {
		t.Fatalf("evicted %v, want [q1 q2]", h.evicted)
	}
	if len(h.live) != 2 {
		t.Fatalf("%d arenas live, want 2", len(h.live))
	}
}

func TestStoreFull(t *testing.T) {
	h := newHarness(t, 4096, 4096, false)
	a := h.alloc("p", 2048, "a")
	h.alloc("p", 2048, "b")
	if _, err := h.a.Alloc("p", 256, "c"); !errors.Is(err, ErrFull) {
		t.Fatalf("nothing evictable: err = %v, want ErrFull", err)
	}
	h.a.SetEvictable(a, true)
	h.alloc("p", 256, "c")
	if !slices.Equal(h.evicted, []string{"a"}) {
		t.Fatalf("evicted %v", h.evicted)
	}
}

func TestNoEvict(t *testing.T) {
	h := newHarness(t, 4096, 4096, true)
	a := h.alloc("p", 4096, "a")
	h.a.SetEvictable(a, true)
	if _, err := h.a.Alloc("p", 256, "b"); !errors.Is(err, ErrFull) {
		t.Fatalf("err = %v, want ErrFull", err)
	}
	if len(h.evicted) != 0 {
		t.Fatalf("NoEvict evicted %v", h.evicted)
	}
}

// TestRandom checks the invariants under random allocation and freeing:
// blocks never overlap, free plus used space adds up, and everything
// coalesces back to nothing once all blocks are gone.
func TestRandom(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	h := newHarness(t, 1<<20, 64<<10, false)
	live := map[*Block[pool, string]]bool{}
	h.a.cfg.Evict = func(b *Block[pool, string]) { delete(live, b) }
	pools := []pool{"a", "b", "c"}
	for range 20000 {
		if len(live) > 0 && r.IntN(3) == 0 {
			for b := range live {
				switch r.IntN(3) {
				case 0:
					h.a.Free(b)
					delete(live, b)
				case 1:
					h.a.SetEvictable(b, true)
				default:
					h.a.SetEvictable(b, false)
				}
				break
			}
			continue
		}
		b, err := h.a.Alloc(pools[r.IntN(len(pools))], 1+r.Int64N(32<<10), "x")
		if errors.Is(err, ErrFull) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		live[b] = true
	}
	checkInvariants(t, h.a)
	for b := range live {
		h.a.Free(b)
	}
	if st := h.a.Stats(); st.Reserved != 0 || st.Used != 0 || st.Arenas != 0 || len(h.live) != 0 {
		t.Fatalf("after freeing everything: %+v, %d arenas live", st, len(h.live))
	}
}

func checkInvariants(t *testing.T, a *Allocator[pool, string]) {
	t.Helper()
	var reserved, used int64
	for _, arenas := range a.pools {
		for _, ar := range arenas {
			reserved += ar.Size
			type span struct{ off, end int64 }
			var spans []span
			for _, b := range ar.blocks {
				spans = append(spans, span{b.Offset, b.Offset + b.span})
				used += b.span
			}
			for _, f := range ar.free {
				spans = append(spans, span{f.off, f.off + f.size})
			}
			slices.SortFunc(spans, func(x, y span) int { return int(x.off - y.off) })
			var end int64
			for _, s := range spans {
				if s.off != end {
					t.Fatalf("arena %d: gap or overlap at %d (next span at %d)", ar.ID, end, s.off)
				}
				end = s.end
			}
			if end != ar.Size {
				t.Fatalf("arena %d: spans end at %d, size %d", ar.ID, end, ar.Size)
			}
			for i := 1; i < len(ar.free); i++ {
				if ar.free[i-1].off+ar.free[i-1].size == ar.free[i].off {
					t.Fatalf("arena %d: adjacent free extents not coalesced", ar.ID)
				}
			}
		}
	}
	if st := a.Stats(); st.Reserved != reserved || st.Used != used || reserved > st.Capacity {
		t.Fatalf("stats %+v, counted reserved %d used %d", st, reserved, used)
	}
}

func TestArenasDoubleFromMinimum(t *testing.T) {
	h := newHarness(t, 1<<30, 0, true)
	var sizes []int64
	for range 9 {
		// Each block fills its arena: 1 MiB, 2, 4, ... up to 64 MiB.
		b := h.alloc("p", 1, "x")
		ar := b.Arena()
		sizes = append(sizes, ar.Size)
		h.alloc("p", ar.LargestFree(), "fill")
	}
	want := []int64{1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20, 64 << 20, 64 << 20}
	if !slices.Equal(sizes, want) {
		t.Fatalf("arena sizes %v, want %v", sizes, want)
	}
	// Another pool starts small again.
	if b := h.alloc("q", 1, "q"); b.Arena().Size != 1<<20 {
		t.Fatalf("first arena of a new pool: %d bytes", b.Arena().Size)
	}
}

// AllocWhere evicts only the blocks its predicate allows, least recently
// used first, keeps the refused ones in the eviction order for later
// calls, and fails without evicting anything when the allowed blocks
// cannot make room.
func TestAllocWhereSparesRefused(t *testing.T) {
	h := newHarness(t, 4096, 4096, false)
	var bs []*Block[pool, string]
	for _, name := range []string{"keep1", "a", "b", "keep2"} {
		b := h.alloc("p", 1024, name)
		h.a.SetEvictable(b, true)
		bs = append(bs, b)
	}
	spare := func(b *Block[pool, string]) bool { return b.Value != "keep1" && b.Value != "keep2" }
	if _, err := h.a.AllocWhere("p", 2048, "c", spare); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(h.evicted, []string{"a", "b"}) {
		t.Fatalf("evicted %v, want a and b", h.evicted)
	}
	// Only the refused blocks are left beside c: nothing more fits.
	if _, err := h.a.AllocWhere("p", 1024, "d", spare); !errors.Is(err, ErrFull) {
		t.Fatalf("AllocWhere with only refused blocks to evict: %v, want ErrFull", err)
	}
	if len(h.evicted) != 2 {
		t.Fatalf("a failed AllocWhere evicted %v", h.evicted[2:])
	}
	if !bs[0].Evictable() || !bs[3].Evictable() {
		t.Fatal("refused blocks left the eviction order")
	}
	// Alloc may evict them: keep1 first, the least recently used.
	h.alloc("p", 1024, "e")
	if !slices.Equal(h.evicted, []string{"a", "b", "keep1"}) {
		t.Fatalf("evicted %v, want keep1 last", h.evicted)
	}
	var n int
	h.a.Blocks(func(pool) bool { return true }, func(*Block[pool, string]) bool { n++; return true })
	if n != 3 {
		t.Fatalf("Blocks yielded %d blocks, want 3 (c, keep2, e)", n)
	}
}
