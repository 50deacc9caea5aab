// Package alloc is the store's space allocator: it places objects inside
// arenas, keeps the freed space of each arena coalesced, grows the set of
// arenas up to a capacity and, when space runs out, evicts the least recently
// used evictable blocks.
//
// An arena that becomes empty is given back at once, unless Config.KeepEmpty
// lets the allocator keep it, still reserved, for the next blocks of its
// pool: a kept arena costs its pool's next block of that size no new
// memory, and costs clients that mapped it no new import.
//
// The allocator only does bookkeeping. It never touches memory: it asks its
// caller for arenas (Config.NewArena) and gives them back (Config.FreeArena).
// Arenas belong to a pool (a comparable key chosen by the caller, for the
// store the owner and sharing of the objects inside); a block is only ever
// placed in an arena of its own pool.
//
// An Allocator is not safe for concurrent use; the store serialises calls.
package alloc

import (
	"container/list"
	"errors"
	"fmt"
	"slices"
	"sort"
)

// Alignment is the alignment of every block's offset and size inside its
// arena. 256 bytes matches what CUDA guarantees for cudaMalloc, so a block is
// good for any vector load on both the CPU and a GPU.
const Alignment = 256

// DefaultArenaSize is the largest size of a new arena when
// Config.ArenaSize is zero. A larger block gets an arena of its own size.
const DefaultArenaSize = 64 << 20

// DefaultMinArenaSize is the size of a pool's first arena when
// Config.MinArenaSize is zero.
const DefaultMinArenaSize = 1 << 20

// DefaultGranularity is the granularity of arena sizes when
// Config.Granularity is zero: a page.
const DefaultGranularity = 4096

// ErrFull reports that a block cannot be placed, even after evicting every
// evictable block that could have made room.
var ErrFull = errors.New("alloc: no space left")

// Config configures an Allocator.
type Config[P comparable, V any] struct {
	// Capacity bounds the sum of the sizes of all arenas.
	Capacity int64
	// MinArenaSize and ArenaSize bound the size of new arenas
	// (DefaultMinArenaSize and DefaultArenaSize when zero): a pool's first
	// arena is MinArenaSize, each further one twice the previous, up to
	// ArenaSize, so that a pool with few objects does not take a large
	// share of the capacity from the others. A block larger than that gets
	// an arena of its own size. Sizes are clipped to what is left of
	// Capacity.
	MinArenaSize, ArenaSize int64
	// Granularity is the unit of arena sizes (DefaultGranularity when zero);
	// a power of two and a multiple of Alignment.
	Granularity int64
	// NoEvict turns eviction off: Alloc fails with ErrFull instead.
	NoEvict bool
	// NewArena creates the memory of a new arena of size bytes for pool and
	// returns its id, which must be unique for the life of the allocator.
	NewArena func(pool P, size int64) (id uint64, err error)
	// FreeArena gives back the memory of an arena that has become empty.
	FreeArena func(id uint64)
	// Evict is called for each block evicted to make room, before the
	// block is freed. It must not call back into the Allocator.
	Evict func(b *Block[P, V])
	// Owner, when set, says whose a pool's arenas are. Blocks are then only
	// evicted to make room for blocks of the same owner, and Quota bounds
	// the sum of the sizes of each owner's arenas.
	Owner func(pool P) uint32
	// Quota bounds each owner's arenas (with Owner set); 0 means no bound
	// but Capacity.
	Quota int64
	// KeepEmpty bounds the bytes of empty arenas kept for later blocks of
	// their own pool instead of being given back (FreeArena); 0 keeps
	// none. A kept arena is only ever reused by its pool, still counts
	// against Capacity and its owner's Quota, and is given back, least
	// recently emptied first, beyond the bound, whenever a new arena would
	// not fit otherwise, and when NewArena fails. Arenas of Exclusive pools
	// are never kept.
	KeepEmpty int64
}

// Exclusive is implemented by pool keys whose pools hold one block at
// most: their arenas are sized to the block, not by MinArenaSize.
type Exclusive interface {
	Exclusive() bool
}

// Allocator places blocks in arenas. See the package documentation.
type Allocator[P comparable, V any] struct {
	cfg      Config[P, V]
	pools    map[P][]*Arena[P, V] // arenas of each pool, by ascending id
	reserved int64                // sum of arena sizes
	owned    map[uint32]int64     // sum of arena sizes by owner (Config.Owner)
	used     int64                // sum of block sizes
	blocks   int
	lru      list.List // of *Block, evictable blocks, least recently used first
	evicted  uint64
	kept     list.List // of *Arena, kept empty arenas, least recently emptied first
	keptSize int64     // sum of the sizes of kept arenas
	reused   uint64    // blocks placed in a kept arena
}

// Arena is a contiguous range of memory, split into blocks and free extents.
type Arena[P comparable, V any] struct {
	// ID is the id NewArena returned.
	ID uint64
	// Pool is the pool whose blocks the arena holds.
	Pool P
	// Size is the arena's size in bytes.
	Size int64

	free   []extent // sorted by offset, never adjacent (always coalesced)
	blocks []*Block[P, V]
	kept   *list.Element // in Allocator.kept while the arena is empty and kept
}

type extent struct{ off, size int64 }

// Block is an allocated, aligned range of an arena.
type Block[P comparable, V any] struct {
	// Offset is the block's offset inside its arena, a multiple of Alignment.
	Offset int64
	// Size is the size the caller asked for.
	Size int64
	// Value is the caller's data, given to Alloc.
	Value V

	arena *Arena[P, V]
	span  int64 // Size rounded up to Alignment: the space the block takes
	index int   // position in arena.blocks
	lru   *list.Element
	freed bool
}

// Arena returns the arena the block lies in.
func (b *Block[P, V]) Arena() *Arena[P, V] { return b.arena }

// New returns an allocator. NewArena and FreeArena must be set.
func New[P comparable, V any](cfg Config[P, V]) (*Allocator[P, V], error) {
	if cfg.Capacity <= 0 {
		return nil, fmt.Errorf("alloc: capacity %d is not positive", cfg.Capacity)
	}
	if cfg.Granularity == 0 {
		cfg.Granularity = DefaultGranularity
	}
	if g := cfg.Granularity; g < Alignment || g&(g-1) != 0 {
		return nil, fmt.Errorf("alloc: granularity %d is not a power of two of at least %d", g, Alignment)
	}
	if cfg.ArenaSize == 0 {
		cfg.ArenaSize = DefaultArenaSize
	}
	if cfg.MinArenaSize == 0 {
		cfg.MinArenaSize = DefaultMinArenaSize
	}
	if cfg.ArenaSize < 0 || cfg.MinArenaSize < 0 {
		return nil, fmt.Errorf("alloc: arena sizes %d and %d must not be negative", cfg.MinArenaSize, cfg.ArenaSize)
	}
	cfg.ArenaSize = roundUp(cfg.ArenaSize, cfg.Granularity)
	cfg.MinArenaSize = min(roundUp(cfg.MinArenaSize, cfg.Granularity), cfg.ArenaSize)
	if cfg.NewArena == nil || cfg.FreeArena == nil {
		return nil, errors.New("alloc: NewArena and FreeArena must be set")
	}
	if cfg.Quota < 0 {
		return nil, fmt.Errorf("alloc: quota %d is negative", cfg.Quota)
	}
	if cfg.KeepEmpty < 0 {
		return nil, fmt.Errorf("alloc: KeepEmpty %d is negative", cfg.KeepEmpty)
	}
	return &Allocator[P, V]{cfg: cfg, pools: make(map[P][]*Arena[P, V]), owned: make(map[uint32]int64)}, nil
}

// Alloc places a block of size bytes in an arena of pool. It tries, in
// order: the best-fitting free extent of the pool's arenas, a new arena
// within capacity, and (unless NoEvict) evicting least recently used
// evictable blocks whose eviction can make room. It fails with ErrFull, and
// evicts nothing, when even evicting all of them would not make room.
func (a *Allocator[P, V]) Alloc(pool P, size int64, value V) (*Block[P, V], error) {
	return a.alloc(pool, size, value, !a.cfg.NoEvict, nil)
}

// AllocNoEvict is Alloc without eviction: it fails with ErrFull when the
// block fits neither a free extent nor a new arena.
func (a *Allocator[P, V]) AllocNoEvict(pool P, size int64, value V) (*Block[P, V], error) {
	return a.alloc(pool, size, value, false, nil)
}

// AllocWhere is Alloc that evicts only the evictable blocks may allows:
// the others stay, in their place in the eviction order, as if pinned for
// this call.
func (a *Allocator[P, V]) AllocWhere(pool P, size int64, value V, may func(*Block[P, V]) bool) (*Block[P, V], error) {
	return a.alloc(pool, size, value, !a.cfg.NoEvict, may)
}

func (a *Allocator[P, V]) alloc(pool P, size int64, value V, evict bool, may func(*Block[P, V]) bool) (*Block[P, V], error) {
	if size <= 0 {
		return nil, fmt.Errorf("alloc: size %d is not positive", size)
	}
	if size > a.cfg.Capacity {
		return nil, fmt.Errorf("%w: %d bytes exceed the capacity of %d", ErrFull, size, a.cfg.Capacity)
	}
	span := roundUp(size, Alignment)
	if b := a.fit(pool, span); b != nil {
		return a.place(b, size, value), nil
	}
	b, err := a.grow(pool, span)
	if err != nil {
		return nil, err
	}
	if b != nil {
		return a.place(b, size, value), nil
	}
	if !evict {
		return nil, fmt.Errorf("%w: %d bytes requested, %d of %d reserved and eviction is off", ErrFull, size, a.reserved, a.cfg.Capacity)
	}
	if may == nil {
		may = func(*Block[P, V]) bool { return true }
	}
	helpful, ok := a.plan(pool, span, may)
	if !ok {
		return nil, fmt.Errorf("%w: %d bytes requested and evicting every unused object would not make room", ErrFull, size)
	}
	for e := a.lru.Front(); e != nil; {
		next := e.Next()
		victim := e.Value.(*Block[P, V])
		if helpful[victim.arena] && may(victim) {
			if a.cfg.Evict != nil {
				a.cfg.Evict(victim)
			}
			a.evicted++
			a.Free(victim)
			if b := a.fit(pool, span); b != nil {
				return a.place(b, size, value), nil
			}
			b, err := a.grow(pool, span)
			if err != nil {
				return nil, err
			}
			if b != nil {
				return a.place(b, size, value), nil
			}
		}
		e = next
	}
	// plan promised room; reaching here is a bug in plan.
	return nil, fmt.Errorf("%w: eviction did not make room for %d bytes", ErrFull, size)
}

// candidate is where a block of some span could go: an extent of an arena.
type candidate[P comparable, V any] struct {
	arena *Arena[P, V]
	i     int // index in arena.free
}

// fit finds the smallest free extent of pool's arenas that holds span
// bytes, the lowest arena id and offset winning ties, so that placement is
// deterministic and large extents stay whole for large blocks.
func (a *Allocator[P, V]) fit(pool P, span int64) *candidate[P, V] {
	var best *candidate[P, V]
	var bestSize int64
	for _, ar := range a.pools[pool] {
		for i, f := range ar.free {
			if f.size >= span && (best == nil || f.size < bestSize) {
				best = &candidate[P, V]{ar, i}
				bestSize = f.size
			}
		}
	}
	return best
}

// grow adds an arena to pool if the capacity left allows one that holds
// span bytes, and returns where the block goes; nil when capacity is short.
func (a *Allocator[P, V]) grow(pool P, span int64) (*candidate[P, V], error) {
	need := roundUp(span, a.cfg.Granularity)
	if need > a.left(pool) {
		a.releaseKept(pool, need)
	}
	left := a.left(pool)
	if need > left {
		return nil, nil
	}
	arenas := a.pools[pool]
	want := a.cfg.ArenaSize
	if n := len(arenas); n < 63 && a.cfg.MinArenaSize<<n < want {
		want = a.cfg.MinArenaSize << n
	}
	if x, ok := any(pool).(Exclusive); ok && x.Exclusive() {
		want = need
	}
	size := min(max(want, need), left/a.cfg.Granularity*a.cfg.Granularity)
	id, err := a.cfg.NewArena(pool, size)
	if err != nil && a.kept.Len() > 0 {
		// The memory may have run short outside the allocator's
		// accounting (other users of the device): kept arenas go first.
		for a.kept.Len() > 0 {
			a.dropArena(a.kept.Front().Value.(*Arena[P, V]))
		}
		id, err = a.cfg.NewArena(pool, size)
	}
	if err != nil {
		return nil, fmt.Errorf("alloc: new arena of %d bytes: %w", size, err)
	}
	ar := &Arena[P, V]{ID: id, Pool: pool, Size: size, free: []extent{{0, size}}}
	i, _ := slices.BinarySearchFunc(arenas, id, func(x *Arena[P, V], id uint64) int {
		switch {
		case x.ID < id:
			return -1
		case x.ID > id:
			return 1
		}
		return 0
	})
	a.pools[pool] = slices.Insert(arenas, i, ar)
	a.reserved += size
	if a.cfg.Owner != nil {
		a.owned[a.cfg.Owner(pool)] += size
	}
	return &candidate[P, V]{ar, 0}, nil
}

// place carves a block from the front of the candidate extent.
func (a *Allocator[P, V]) place(c *candidate[P, V], size int64, value V) *Block[P, V] {
	ar := c.arena
	if ar.kept != nil {
		a.unkeep(ar)
		a.reused++
	}
	span := roundUp(size, Alignment)
	f := &ar.free[c.i]
	b := &Block[P, V]{Offset: f.off, Size: size, Value: value, arena: ar, span: span, index: len(ar.blocks)}
	f.off += span
	f.size -= span
	if f.size == 0 {
		ar.free = slices.Delete(ar.free, c.i, c.i+1)
	}
	ar.blocks = append(ar.blocks, b)
	a.used += span
	a.blocks++
	return b
}

// plan reports whether evicting every evictable block would make room for
// span bytes in pool, and which arenas hold blocks worth evicting: the
// pool's own arenas (room inside them) and arenas of any pool whose blocks
// are all evictable (an emptied arena gives its size back to the capacity).
// A block may refuses counts as pinned.
func (a *Allocator[P, V]) plan(pool P, span int64, may func(*Block[P, V]) bool) (map[*Arena[P, V]]bool, bool) {
	helpful := make(map[*Arena[P, V]]bool)
	ok := false
	freeable := a.left(pool)
	for p, arenas := range a.pools {
		if a.cfg.Owner != nil && a.cfg.Owner(p) != a.cfg.Owner(pool) {
			// Another owner's blocks are never evicted for this one.
			continue
		}
		for _, ar := range arenas {
			pinned := ar.pinned(may)
			if len(pinned) == 0 {
				helpful[ar] = true
				freeable += ar.Size
			}
			if p != pool {
				continue
			}
			helpful[ar] = true
			// The largest gap left between blocks that cannot be evicted.
			var end int64
			for _, b := range pinned {
				if b.Offset-end >= span {
					ok = true
				}
				end = b.Offset + b.span
			}
			if ar.Size-end >= span {
				ok = true
			}
		}
	}
	if freeable >= roundUp(span, a.cfg.Granularity) {
		ok = true
	}
	return helpful, ok
}

// pinned returns the arena's blocks that are not evictable, or that may
// refuses, by offset.
func (ar *Arena[P, V]) pinned(may func(*Block[P, V]) bool) []*Block[P, V] {
	var bs []*Block[P, V]
	for _, b := range ar.blocks {
		if b.lru == nil || !may(b) {
			bs = append(bs, b)
		}
	}
	sort.Slice(bs, func(i, j int) bool { return bs[i].Offset < bs[j].Offset })
	return bs
}

// Free returns a block's space to its arena, merging it with free
// neighbours, and gives the arena back (FreeArena) once it is empty. Freeing
// a block twice panics.
func (a *Allocator[P, V]) Free(b *Block[P, V]) {
	if b.freed {
		panic("alloc: block freed twice")
	}
	b.freed = true
	if b.lru != nil {
		a.lru.Remove(b.lru)
		b.lru = nil
	}
	ar := b.arena
	last := len(ar.blocks) - 1
	ar.blocks[b.index] = ar.blocks[last]
	ar.blocks[b.index].index = b.index
	ar.blocks[last] = nil
	ar.blocks = ar.blocks[:last]
	a.used -= b.span
	a.blocks--

	if len(ar.blocks) == 0 {
		if !a.keep(ar) {
			a.dropArena(ar)
		}
		return
	}
	i, _ := slices.BinarySearchFunc(ar.free, b.Offset, func(e extent, off int64) int {
		switch {
		case e.off < off:
			return -1
		case e.off > off:
			return 1
		}
		return 0
	})
	e := extent{b.Offset, b.span}
	mergePrev := i > 0 && ar.free[i-1].off+ar.free[i-1].size == e.off
	mergeNext := i < len(ar.free) && e.off+e.size == ar.free[i].off
	switch {
	case mergePrev && mergeNext:
		ar.free[i-1].size += e.size + ar.free[i].size
		ar.free = slices.Delete(ar.free, i, i+1)
	case mergePrev:
		ar.free[i-1].size += e.size
	case mergeNext:
		ar.free[i].off = e.off
		ar.free[i].size += e.size
	default:
		ar.free = slices.Insert(ar.free, i, e)
	}
}

// keep keeps an arena that just became empty, if Config.KeepEmpty allows,
// giving back the least recently emptied ones beyond the bound.
func (a *Allocator[P, V]) keep(ar *Arena[P, V]) bool {
	if ar.Size > a.cfg.KeepEmpty {
		return false
	}
	if x, ok := any(ar.Pool).(Exclusive); ok && x.Exclusive() {
		return false
	}
	ar.free = append(ar.free[:0], extent{0, ar.Size})
	ar.kept = a.kept.PushBack(ar)
	a.keptSize += ar.Size
	for a.keptSize > a.cfg.KeepEmpty {
		a.dropArena(a.kept.Front().Value.(*Arena[P, V]))
	}
	return true
}

func (a *Allocator[P, V]) unkeep(ar *Arena[P, V]) {
	a.kept.Remove(ar.kept)
	ar.kept = nil
	a.keptSize -= ar.Size
}

// releaseKept gives back kept arenas, least recently emptied first, until a
// new arena of need bytes fits pool or none is left that would help: any
// while the capacity is short, else (the quota is) only the owner's.
func (a *Allocator[P, V]) releaseKept(pool P, need int64) {
	for e := a.kept.Front(); e != nil && need > a.left(pool); {
		next := e.Next()
		ar := e.Value.(*Arena[P, V])
		if a.cfg.Capacity-a.reserved < need || (a.cfg.Owner != nil && a.cfg.Owner(ar.Pool) == a.cfg.Owner(pool)) {
			a.dropArena(ar)
		}
		e = next
	}
}

// ReleaseKept gives back every kept arena and returns their bytes.
func (a *Allocator[P, V]) ReleaseKept() int64 {
	n := a.keptSize
	for a.kept.Len() > 0 {
		a.dropArena(a.kept.Front().Value.(*Arena[P, V]))
	}
	return n
}

func (a *Allocator[P, V]) dropArena(ar *Arena[P, V]) {
	if ar.kept != nil {
		a.unkeep(ar)
	}
	arenas := a.pools[ar.Pool]
	i := slices.Index(arenas, ar)
	arenas = slices.Delete(arenas, i, i+1)
	if len(arenas) == 0 {
		delete(a.pools, ar.Pool)
	} else {
		a.pools[ar.Pool] = arenas
	}
	a.reserved -= ar.Size
	if a.cfg.Owner != nil {
		o := a.cfg.Owner(ar.Pool)
		if a.owned[o] -= ar.Size; a.owned[o] == 0 {
			delete(a.owned, o)
		}
	}
	ar.free = nil
	a.cfg.FreeArena(ar.ID)
}

// left returns how many bytes of new arenas pool may still get: what is
// left of the capacity and, with a quota, of its owner's quota.
func (a *Allocator[P, V]) left(pool P) int64 {
	left := a.cfg.Capacity - a.reserved
	if a.cfg.Owner != nil && a.cfg.Quota > 0 {
		left = min(left, a.cfg.Quota-a.owned[a.cfg.Owner(pool)])
	}
	return max(left, 0)
}

// Owned returns the sum of the sizes of owner's arenas (with Config.Owner).
func (a *Allocator[P, V]) Owned(owner uint32) int64 { return a.owned[owner] }

// QuotaBound reports whether pool's owner's quota limits new arenas of
// pool at least as much as the capacity does.
func (a *Allocator[P, V]) QuotaBound(pool P) bool {
	return a.cfg.Owner != nil && a.cfg.Quota > 0 && a.cfg.Quota-a.owned[a.cfg.Owner(pool)] <= a.cfg.Capacity-a.reserved
}

// SetEvictable marks a block as a candidate for eviction (on) or not. A
// block that becomes evictable is the most recently used one; one already
// evictable keeps its place.
func (a *Allocator[P, V]) SetEvictable(b *Block[P, V], on bool) {
	if b.freed {
		panic("alloc: SetEvictable on a freed block")
	}
	switch {
	case on && b.lru == nil:
		b.lru = a.lru.PushBack(b)
	case !on && b.lru != nil:
		a.lru.Remove(b.lru)
		b.lru = nil
	}
}

// Blocks calls yield with every block of the arenas of pools for which
// match is true, until yield returns false.
func (a *Allocator[P, V]) Blocks(match func(P) bool, yield func(*Block[P, V]) bool) {
	for p, arenas := range a.pools {
		if !match(p) {
			continue
		}
		for _, ar := range arenas {
			for _, b := range ar.blocks {
				if !yield(b) {
					return
				}
			}
		}
	}
}

// Evictable reports whether b is a candidate for eviction.
func (b *Block[P, V]) Evictable() bool { return b.lru != nil }

// Stats describes an allocator's use of its capacity.
type Stats struct {
	Capacity  int64  // the configured capacity
	Reserved  int64  // sum of arena sizes
	Used      int64  // sum of block spans (sizes rounded up to Alignment)
	Arenas    int    // number of arenas
	Blocks    int    // number of blocks
	Evictable int    // number of evictable blocks
	Evicted   uint64 // blocks evicted since New
	Kept      int    // number of empty arenas kept (Config.KeepEmpty)
	KeptBytes int64  // sum of their sizes (part of Reserved)
	Reused    uint64 // blocks placed in a kept arena since New
}

// Stats returns the allocator's current use.
func (a *Allocator[P, V]) Stats() Stats {
	n := 0
	for _, arenas := range a.pools {
		n += len(arenas)
	}
	return Stats{
		Capacity:  a.cfg.Capacity,
		Reserved:  a.reserved,
		Used:      a.used,
		Arenas:    n,
		Blocks:    a.blocks,
		Evictable: a.lru.Len(),
		Evicted:   a.evicted,
		Kept:      a.kept.Len(),
		KeptBytes: a.keptSize,
		Reused:    a.reused,
	}
}

// FreeBytes returns the arena's free space.
func (ar *Arena[P, V]) FreeBytes() int64 {
	var n int64
	for _, f := range ar.free {
		n += f.size
	}
	return n
}

// LargestFree returns the size of the arena's largest free extent: the
// largest block it can still take.
func (ar *Arena[P, V]) LargestFree() int64 {
	var n int64
	for _, f := range ar.free {
		n = max(n, f.size)
	}
	return n
}

// FreeExtents returns the number of free extents: 1 for an empty arena,
// more as it fragments.
func (ar *Arena[P, V]) FreeExtents() int { return len(ar.free) }

func roundUp(n, to int64) int64 { return (n + to - 1) / to * to }
