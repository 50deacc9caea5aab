package client

import (
	"context"
	"sync"

	"github.com/cudaipc/cudaipc/internal/shm"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// The lease fast path (docs/protocol.md 6.7; the memory-ordering argument
// in docs/architecture.md, "Lease fast path"). At Dial the client asks for
// its connection's lease table, a shared memory file of one word per lease
// slot. A lease of a plain object granted with a slot is released by one
// compare-and-swap (held -> idle): no system call, and the daemon counts it
// released from then on. The client keeps the released lease's mapping,
// and a later Get of the same name takes the lease back with one
// compare-and-swap (idle -> held), which fails once the daemon reclaimed
// the lease (it needed the memory) or the object was deleted; the Get then
// goes through the socket.

// leaseTable is the client's mapping of its connection's lease table.
type leaseTable struct {
	words *shm.Words

	mu     sync.Mutex              // guards idle, closed, and words against unmapping
	idle   map[string][]*idleLease // released leases that may be taken back, by object name
	closed bool
}

// idleLease is a lease released through the table, with its view kept.
type idleLease struct {
	key   string // the name a Get takes it back by
	id    uint64
	slot  int
	gen   uint64
	arena uint64
	info  ObjectInfo
	v     view
	m     *mapping
}

// openLeaseTable asks the daemon for the lease table; without one (an
// older daemon, or Options.NoFastPath) every lease goes through the socket.
func (c *Client) openLeaseTable(ctx context.Context) {
	req := &storev1.Request{Body: &storev1.Request_LeaseTable{LeaseTable: &storev1.LeaseTableRequest{}}}
	r, err := c.roundTrip(ctx, "lease_table", "", req)
	if err != nil {
		return
	}
	if len(r.files) != 1 {
		closeFiles(r.files)
		return
	}
	defer r.files[0].Close()
	n := int(r.resp.GetLeaseTable().GetSlots())
	w, err := shm.Map(r.files[0], n)
	if err != nil {
		return
	}
	c.table = &leaseTable{words: w, idle: make(map[string][]*idleLease)}
}

// retake takes back an idle lease of name, if there is one the daemon has
// not reclaimed.
func (c *Client) retake(name string) *Lease {
	t := c.table
	if t == nil {
		return nil
	}
	var stale []*idleLease
	defer func() { c.dropIdle(stale) }()
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil
	}
	for list := t.idle[name]; len(list) > 0; list = t.idle[name] {
		e := list[len(list)-1]
		if len(list) == 1 {
			delete(t.idle, name)
		} else {
			t.idle[name] = list[:len(list)-1]
		}
		old, next := protocol.SlotRetake(e.gen)
		if t.words.CompareAndSwap(e.slot-1, old, next) {
			l := &Lease{c: c, id: e.id, info: e.info, v: e.v, m: e.m, slot: e.slot, gen: e.gen, arena: e.arena, key: e.key}
			if l.v.gpu != nil && !c.trackGPU(l) {
				stale = append(stale, e)
				return nil
			}
			return l
		}
		stale = append(stale, e) // reclaimed or doomed: the daemon ended it
	}
	return nil
}

// releaseFast releases l through the table, keeping its view for a later
// retake; false when it must go through the socket. l.mu is held.
func (l *Lease) releaseFast() bool {
	t := l.c.table
	if t == nil || l.slot == 0 {
		return false
	}
	if l.v.gpu != nil && l.c.parked.max < 0 {
		// A client that keeps no idle GPU mappings keeps no idle GPU
		// leases either: their views are mappings.
		return false
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return false
	}
	i := l.slot - 1
	w := t.words.Load(i)
	next, ok := protocol.SlotRelease(w, l.gen)
	if !ok || !t.words.CompareAndSwap(i, w, next) {
		t.mu.Unlock()
		return false
	}
	e := &idleLease{key: l.key, id: l.id, slot: l.slot, gen: l.gen, arena: l.arena, info: l.info, v: l.v, m: l.m}
	t.idle[l.key] = append(t.idle[l.key], e)
	t.mu.Unlock()
	l.c.untrackGPU(l)
	l.v, l.m = view{device: l.v.device, size: l.v.size}, nil
	return true
}

// dropIdle closes the views of idle leases that ended.
func (c *Client) dropIdle(list []*idleLease) {
	for _, e := range list {
		_ = e.v.close()
		if e.m != nil {
			c.unref(e.m)
		}
	}
}

// dropIdleArenas forgets the idle leases in arenas the daemon freed (their
// leases were reclaimed), or all of them (arenas nil: Close).
func (c *Client) dropIdleArenas(arenas []uint64) {
	t := c.table
	if t == nil {
		return
	}
	var out []*idleLease
	t.mu.Lock()
	for name, list := range t.idle {
		keep := list[:0]
		for _, e := range list {
			if arenas == nil || containsID(arenas, e.arena) {
				out = append(out, e)
			} else {
				keep = append(keep, e)
			}
		}
		if len(keep) == 0 {
			delete(t.idle, name)
		} else {
			t.idle[name] = keep
		}
	}
	t.mu.Unlock()
	c.dropIdle(out)
}

func containsID(ids []uint64, id uint64) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

// closeLeaseTable unmaps the table (Close, once the reader has stopped).
func (c *Client) closeLeaseTable() {
	if t := c.table; t != nil {
		t.mu.Lock()
		t.closed = true
		_ = t.words.Close()
		t.mu.Unlock()
	}
}
