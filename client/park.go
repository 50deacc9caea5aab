package client

import (
	"container/list"
	"os"
	"sync"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Idle GPU arenas stay mapped. When an Object or Lease ends, its arena's
// driver mapping would go with the last user, and the next Get in that
// arena would pay cuIpcOpenMemHandle + cuIpcCloseMemHandle again (tens of
// µs, docs/driver-facts.md). So the client parks a reference to every GPU arena it
// maps, in an LRU bounded by Options.MaxIdleArenas, and drops it when
//   - the daemon says the arena was freed (ArenasFreed, after its last
//     object went): the client unmaps it and answers ForgetArenas, upon
//     which the daemon frees the memory (docs/architecture.md, "Arena
//     lifetime");
//   - the LRU is over its bound: the client unmaps the least recently used
//     arena and tells the daemon (ForgetArenas);
//   - the client closes.

// DefaultMaxIdleArenas is the default of Options.MaxIdleArenas.
const DefaultMaxIdleArenas = 64

type parkedArena struct {
	id   uint64
	drop func() error // ends the parked reference
	elem *list.Element
}

type parking struct {
	mu   sync.Mutex
	max  int // < 0: nothing is parked
	lru  list.List
	byID map[uint64]*parkedArena
}

// park keeps arena id mapped after its users go. take adds a reference to
// the arena's mapping and returns its release; it is called only when the
// arena is not parked yet. Arenas pushed out of the LRU are unmapped and
// forgotten.
func (c *Client) park(id uint64, take func() (func() error, error)) {
	pk := &c.parked
	pk.mu.Lock()
	if pk.max < 0 {
		pk.mu.Unlock()
		return
	}
	if a := pk.byID[id]; a != nil {
		pk.lru.MoveToBack(a.elem)
		pk.mu.Unlock()
		return
	}
	drop, err := take()
	if err != nil { // the arena is simply not kept
		pk.mu.Unlock()
		return
	}
	a := &parkedArena{id: id, drop: drop}
	a.elem = pk.lru.PushBack(a)
	pk.byID[id] = a
	var out []*parkedArena
	for pk.lru.Len() > pk.max {
		old := pk.lru.Remove(pk.lru.Front()).(*parkedArena)
		delete(pk.byID, old.id)
		out = append(out, old)
	}
	pk.mu.Unlock()
	if len(out) > 0 {
		ids := make([]uint64, len(out))
		for i, a := range out {
			_ = a.drop()
			ids[i] = a.id
		}
		c.forgetArenas(ids)
	}
}

// unpark drops the parked references of the arenas ids, if parked.
func (c *Client) unpark(ids []uint64) {
	pk := &c.parked
	var out []*parkedArena
	pk.mu.Lock()
	for _, id := range ids {
		if a := pk.byID[id]; a != nil {
			pk.lru.Remove(a.elem)
			delete(pk.byID, id)
			out = append(out, a)
		}
	}
	pk.mu.Unlock()
	for _, a := range out {
		_ = a.drop()
	}
}

// unparkAll drops every parked reference (Close).
func (c *Client) unparkAll() {
	pk := &c.parked
	pk.mu.Lock()
	var ids []uint64
	for id := range pk.byID {
		ids = append(ids, id)
	}
	pk.mu.Unlock()
	c.unpark(ids)
}

// arenasFreed handles the daemon's ArenasFreed: the arenas are unmapped
// (GPU arenas parked here; host arenas no Object or Lease uses) and
// forgotten, which lets the daemon free a GPU arena's memory.
func (c *Client) arenasFreed(ids []uint64) {
	c.dropIdleArenas(ids)
	c.unpark(ids)
	c.mu.Lock()
	for _, id := range ids {
		for _, w := range []bool{false, true} {
			c.dropHostArenaLocked(arenaKey{id, w})
		}
	}
	c.mu.Unlock()
	c.forgetArenas(ids)
}

// forgetArenas tells the daemon this client maps the arenas ids no more;
// the reply is not awaited.
func (c *Client) forgetArenas(ids []uint64) {
	for len(ids) > 0 {
		n := min(len(ids), 1024)
		req := &storev1.Request{Body: &storev1.Request_ForgetArenas{ForgetArenas: &storev1.ForgetArenasRequest{ArenaIds: ids[:n]}}}
		_ = c.sendDetached(req)
		ids = ids[n:]
	}
}

// parkRegion parks GPU arena id, whose whole region is arena: a Mapping of
// it, through the import cache (a cache hit: the object's own import opened
// it; files, the descriptor of a vmm-fd arena, are not used then, but
// Import wants them).
func (c *Client) parkRegion(id uint64, arena cudaipc.Region, files []*os.File, writable bool) {
	c.park(id, func() (func() error, error) {
		m, err := importRegion(arena, files, writable)
		if err != nil {
			return nil, err
		}
		return m.Close, nil
	})
}
