package store

import (
	"fmt"
	"os"

	"github.com/cudaipc/cudaipc/internal/shm"
	"github.com/cudaipc/cudaipc/protocol"
)

// Lease tables: the fast path of release and re-get (docs/protocol.md 6.7,
// the memory-ordering argument in docs/architecture.md, "Lease fast path").
//
// A connection that asks for one gets a shared memory file of one 64-bit
// word per slot. Each lease of a plain (unversioned) object granted to it
// takes a slot, whose word the daemon sets to (gen, held). The client
// releases the lease by swapping (gen, held) for (gen, idle) and takes it
// back by swapping (gen, idle) for (gen, held), both without a system call.
// The daemon treats an idle lease as released whenever it observes leases
// (Stat, List: the count leaves idle ones out) and reclaims idle leases
// (swapping (gen, idle) for (gen, free), then releasing the lease as a
// socket release would) when it needs their memory: before a create that
// did not fit, and for a deleted object at once. Deletion also sets the
// doomed bit of the object's held slots, so that their client releases them
// through the socket and the memory is freed when Release returns.
//
// Every transition is one compare-and-swap on one word, so each side sees
// a single order of them. A client that writes anything else into its
// table harms only its own leases: the daemon reclaims only the exact word
// it expects, keeps its own record of each slot's generation and lease,
// and never frees memory except through its own lease accounting.

// leaseTableSlots is the size of a connection's lease table: leases beyond
// it work through the socket only.
const leaseTableSlots = 4096

type leaseTable struct {
	words *shm.Words
	gens  []uint64 // the generation last granted in each slot
	free  []int    // free slot indices
	used  map[*lease]struct{}
}

func newLeaseTable(n int) (*leaseTable, *os.File, error) {
	w, f, err := shm.Create("cudaipc-leases", n)
	if err != nil {
		return nil, nil, err
	}
	t := &leaseTable{words: w, gens: make([]uint64, n), free: make([]int, n), used: make(map[*lease]struct{})}
	for i := range t.free {
		t.free[i] = n - 1 - i // slot 0 first
	}
	return t, f, nil
}

// leaseTable creates this session's lease table and returns its file and
// slot count; the caller sends and closes the file.
func (ss *session) leaseTable() (*os.File, int, error) {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return nil, 0, errSessionClosed
	}
	if ss.table != nil {
		return nil, 0, invalidf("this connection already has a lease table")
	}
	t, f, err := newLeaseTable(leaseTableSlots)
	if err != nil {
		return nil, 0, fmt.Errorf("lease table: %w", err)
	}
	ss.table = t
	s.tables[ss] = struct{}{}
	return f, leaseTableSlots, nil
}

// slotLocked gives l a slot of the session's table, when it has one with
// room and l is of a plain object or of registered memory.
func (ss *session) slotLocked(l *lease) {
	t := ss.table
	if t == nil || len(t.free) == 0 || (l.obj != nil && l.obj.ver != nil) {
		return
	}
	i := t.free[len(t.free)-1]
	t.free = t.free[:len(t.free)-1]
	t.gens[i]++
	if t.gens[i] > protocol.MaxSlotGen {
		t.gens[i] = 1
	}
	l.slot, l.gen = i+1, t.gens[i]
	t.words.Store(i, protocol.SlotWord(l.gen, protocol.SlotHeld, false))
	t.used[l] = struct{}{}
	m := l.slotted()
	if *m == nil {
		*m = make(map[*lease]*session)
	}
	(*m)[l] = ss
}

// slotted is the record of slotted leases of l's object or registered
// memory.
func (l *lease) slotted() *map[*lease]*session {
	if l.ext != nil {
		return &l.ext.slotted
	}
	return &l.obj.slotted
}

// unslotLocked frees l's slot (the lease ends).
func (ss *session) unslotLocked(l *lease) {
	if l.slot == 0 {
		return
	}
	t := ss.table
	i := l.slot - 1
	t.words.Store(i, protocol.SlotWord(l.gen, protocol.SlotFree, false))
	t.free = append(t.free, i)
	delete(t.used, l)
	delete(*l.slotted(), l)
	l.slot = 0
}

// idleLocked reports whether the client released l through its table.
func (ss *session) idleLocked(l *lease) bool {
	if l.slot == 0 {
		return false
	}
	g, st, _ := protocol.DecodeSlot(ss.table.words.Load(l.slot - 1))
	return g == l.gen && st == protocol.SlotIdle
}

// reclaimLocked releases l if the client released it through its table,
// and reports whether it did.
func (ss *session) reclaimLocked(l *lease) bool {
	if l.slot == 0 {
		return false
	}
	i := l.slot - 1
	w := ss.table.words.Load(i)
	next, ok := protocol.SlotReclaim(w, l.gen)
	if !ok || !ss.table.words.CompareAndSwap(i, w, next) {
		return false
	}
	ss.releaseLocked(l)
	if e := l.ext; e != nil {
		// The client keeps an idle lease's mapping of registered memory
		// until told, and that mapping keeps the memory (a VMM allocation,
		// a memfd): tell it as for an arena freed.
		ss.freed = append(ss.freed, e.id)
		select {
		case ss.notify <- struct{}{}:
		default:
		}
	}
	return true
}

// idleLeasesLocked counts the leases of slotted (an object's or registered
// memory's) released through a lease table and not reclaimed yet: Stat and
// List leave them out.
func idleLeasesLocked(slotted map[*lease]*session) int {
	n := 0
	for l, ss := range slotted {
		if ss.idleLocked(l) {
			n++
		}
	}
	return n
}

// doomLocked marks o's slotted leases doomed (o was deleted).
func (s *Store) doomLocked(o *object) { doomSlotsLocked(o.slotted) }

// doomSlotsLocked marks the slotted leases doomed (their object was
// deleted, or their registered memory's exporter ended): held ones are
// released through the socket, never taken back; idle ones are reclaimed
// now, so that the memory goes with the last lease held.
func doomSlotsLocked(slotted map[*lease]*session) {
	for l, ss := range slotted {
		i := l.slot - 1
		for {
			w := ss.table.words.Load(i)
			g, st, doomed := protocol.DecodeSlot(w)
			if g != l.gen || doomed || st == protocol.SlotIdle {
				break
			}
			if ss.table.words.CompareAndSwap(i, w, protocol.SlotWord(g, st, true)) {
				break
			}
		}
		ss.reclaimLocked(l)
	}
}

// sweepLocked reclaims every idle lease of every connection, and reports
// whether it reclaimed any: before retrying a create that did not fit.
func (s *Store) sweepLocked() bool {
	any := false
	for ss := range s.tables {
		for l := range ss.table.used {
			if l.ext != nil {
				continue // registered memory holds none of the store's
			}
			if ss.reclaimLocked(l) {
				any = true
			}
		}
	}
	return any
}

// closeTableLocked unmaps the session's table once its leases are gone.
func (ss *session) closeTableLocked() {
	if ss.table == nil {
		return
	}
	_ = ss.table.words.Close()
	delete(ss.s.tables, ss)
	ss.table = nil
}
