// Package blocks is the index of a KV block pool: which key each of a
// fixed number of block slots holds, in which state, how often pinned,
// and in which order unpinned readable blocks are evicted (least recently
// used first).
//
// A slot is free, being written (its key taken, the block invisible to
// lookups and gets), readable, or doomed (deleted while pinned: invisible,
// its memory reused once the last pin ends). Only readable unpinned blocks
// are on the eviction list, so eviction never takes a block pinned or
// being written. The index does bookkeeping only; the caller owns the
// memory and serialises calls.
package blocks

import "fmt"

// KeySize is the largest key; shorter keys are zero-padded (a pool's keys
// all have one size, so padding never makes two keys equal).
const KeySize = 32

// Key is a block's key, zero-padded to KeySize bytes.
type Key [KeySize]byte

// Keys are a request's keys end to end, Size bytes each (at most
// KeySize): the index reads them where they lie, without a copy of the
// list.
type Keys struct {
	Data []byte
	Size int
}

// Len returns the number of keys.
func (ks Keys) Len() int { return len(ks.Data) / ks.Size }

// At returns key i, zero-padded.
func (ks Keys) At(i int) Key {
	var k Key
	copy(k[:], ks.Data[i*ks.Size:(i+1)*ks.Size])
	return k
}

// Slice returns keys [i, j).
func (ks Keys) Slice(i, j int) Keys { return Keys{ks.Data[i*ks.Size : j*ks.Size], ks.Size} }

// None is the slot of no block.
const None int32 = -1

// Status is what a reservation did with one key.
type Status uint8

// The statuses of Reserve, as the protocol numbers them.
const (
	Reserved Status = iota // a slot taken for the key: write it, then Commit
	Existed                // the key is readable or being written already
	Full                   // no slot free and none evictable
)

type state uint8

const (
	free state = iota
	writing
	ready
	doomed
)

type slot struct {
	key        Key
	state      state
	pins       int32
	prev, next int32 // eviction list links while ready and unpinned
}

// Index is a pool's index of n slots. It is not safe for concurrent use.
type Index struct {
	slots []slot
	byKey map[Key]int32 // keys writing or ready
	free  []int32       // free slots, a stack
	// The eviction list: ready, unpinned slots, least recently used at
	// head.
	head, tail int32

	ready, writing, pinned, doomed int
}

// New returns an index of n empty slots.
func New(n int) *Index {
	x := &Index{slots: make([]slot, n), byKey: make(map[Key]int32), free: make([]int32, n), head: None, tail: None}
	for i := range x.free {
		x.free[i] = int32(n - 1 - i) // slot 0 first
		x.slots[i].prev, x.slots[i].next = None, None
	}
	return x
}

// Len returns the number of slots.
func (x *Index) Len() int { return len(x.slots) }

// Stats are an index's counts of blocks by state.
type Stats struct {
	Ready, Writing, Pinned, Doomed, Free int
}

// Stats returns the counts now.
func (x *Index) Stats() Stats {
	return Stats{Ready: x.ready, Writing: x.writing, Pinned: x.pinned, Doomed: x.doomed, Free: len(x.free)}
}

func (x *Index) unlink(i int32) {
	s := &x.slots[i]
	if s.prev != None {
		x.slots[s.prev].next = s.next
	} else {
		x.head = s.next
	}
	if s.next != None {
		x.slots[s.next].prev = s.prev
	} else {
		x.tail = s.prev
	}
	s.prev, s.next = None, None
}

// pushMRU puts slot i at the most recently used end of the eviction list.
func (x *Index) pushMRU(i int32) {
	s := &x.slots[i]
	s.prev, s.next = x.tail, None
	if x.tail != None {
		x.slots[x.tail].next = i
	} else {
		x.head = i
	}
	x.tail = i
}

// release makes slot i free.
func (x *Index) release(i int32) {
	x.slots[i] = slot{prev: None, next: None}
	x.free = append(x.free, i)
}

// evictOne evicts the least recently used evictable block and returns its
// slot, now taken out of the index but not free; None when there is none.
func (x *Index) evictOne() int32 {
	i := x.head
	if i == None {
		return None
	}
	x.unlink(i)
	delete(x.byKey, x.slots[i].key)
	x.ready--
	return i
}

// Reserve takes a slot for each key neither readable nor being written,
// evicting least recently used blocks when no slot is free, and marks it
// being written. slots[i] and status[i] receive each key's slot (None
// unless Reserved) and status; a key given twice is Existed the second
// time. It returns how many were reserved and how many blocks it evicted.
func (x *Index) Reserve(keys Keys, slots []int32, status []Status) (reserved, evicted int) {
	for i := range keys.Len() {
		k := keys.At(i)
		slots[i] = None
		if _, ok := x.byKey[k]; ok {
			status[i] = Existed
			continue
		}
		var j int32
		if n := len(x.free); n > 0 {
			j = x.free[n-1]
			x.free = x.free[:n-1]
		} else if j = x.evictOne(); j == None {
			status[i] = Full
			continue
		} else {
			evicted++
		}
		x.slots[j] = slot{key: k, state: writing, prev: None, next: None}
		x.byKey[k] = j
		x.writing++
		slots[i], status[i] = j, Reserved
		reserved++
	}
	return reserved, evicted
}

// Commit makes reserved slots readable, most recently used; None entries
// are skipped.
func (x *Index) Commit(slots []int32) {
	for _, j := range slots {
		if j == None {
			continue
		}
		s := &x.slots[j]
		if s.state != writing {
			panic(fmt.Sprintf("blocks: commit of slot %d in state %d", j, s.state))
		}
		s.state = ready
		x.writing--
		x.ready++
		x.pushMRU(j)
	}
}

// Abort gives reserved slots back, their keys absent again; None entries
// are skipped.
func (x *Index) Abort(slots []int32) {
	for _, j := range slots {
		if j == None {
			continue
		}
		s := &x.slots[j]
		if s.state != writing {
			panic(fmt.Sprintf("blocks: abort of slot %d in state %d", j, s.state))
		}
		delete(x.byKey, s.key)
		x.writing--
		x.release(j)
	}
}

// readable returns the slot of key k when its block is readable.
func (x *Index) readable(k Key) (int32, bool) {
	j, ok := x.byKey[k]
	if !ok || x.slots[j].state != ready {
		return None, false
	}
	return j, true
}

// Prefix returns how many keys, from the first, are readable: the first
// absent one (or one being written) ends the prefix. It changes nothing.
func (x *Index) Prefix(keys Keys) int {
	n := keys.Len()
	for i := range n {
		if _, ok := x.readable(keys.At(i)); !ok {
			return i
		}
	}
	return n
}

// Present sets bit i%8 of bits[i/8] for every readable key i (bits holds
// at least (keys.Len()+7)/8 bytes, zeroed) and returns the length of the
// readable prefix, as Prefix does, and the count of readable keys. It
// changes nothing.
func (x *Index) Present(keys Keys, bits []byte) (prefix, count int) {
	prefix = -1
	for i := range keys.Len() {
		if _, ok := x.readable(keys.At(i)); ok {
			bits[i>>3] |= 1 << (i & 7)
			count++
		} else if prefix < 0 {
			prefix = i
		}
	}
	if prefix < 0 {
		prefix = keys.Len()
	}
	return prefix, count
}

// pin pins slot j, taking it off the eviction list.
func (x *Index) pin(j int32) {
	s := &x.slots[j]
	if s.pins == 0 {
		x.pinned++
		if s.state == ready {
			x.unlink(j)
		}
	}
	s.pins++
}

// PinPrefix pins the blocks of the first n keys, which must be readable
// (Prefix said so, with no call between), and appends their slots to
// slots.
func (x *Index) PinPrefix(keys Keys, slots []int32) []int32 {
	for i := range keys.Len() {
		j, ok := x.readable(keys.At(i))
		if !ok {
			panic("blocks: PinPrefix of a key not readable")
		}
		x.pin(j)
		slots = append(slots, j)
	}
	return slots
}

// Acquire pins the readable blocks of keys: slots[i] is key i's slot, or
// None. It returns how many it found.
func (x *Index) Acquire(keys Keys, slots []int32) (found int) {
	for i := range keys.Len() {
		j, ok := x.readable(keys.At(i))
		slots[i] = j
		if ok {
			x.pin(j)
			found++
		}
	}
	return found
}

// Unpin ends one pin of each slot (None entries skipped). A block whose
// last pin ends becomes the most recently used (a doomed one, free).
func (x *Index) Unpin(slots []int32) {
	for _, j := range slots {
		if j == None {
			continue
		}
		s := &x.slots[j]
		if s.pins <= 0 {
			panic(fmt.Sprintf("blocks: unpin of slot %d, not pinned", j))
		}
		if s.pins--; s.pins > 0 {
			continue
		}
		x.pinned--
		switch s.state {
		case ready:
			x.pushMRU(j)
		case doomed:
			x.doomed--
			x.release(j)
		}
	}
}

// Delete removes the readable blocks of keys; a pinned one's slot is
// reused once its pins end. It returns how many it removed.
func (x *Index) Delete(keys Keys) int {
	n := 0
	for i := range keys.Len() {
		k := keys.At(i)
		j, ok := x.readable(k)
		if !ok {
			continue
		}
		n++
		delete(x.byKey, k)
		x.ready--
		if s := &x.slots[j]; s.pins > 0 {
			s.state = doomed
			x.doomed++
			continue
		}
		x.unlink(j)
		x.release(j)
	}
	return n
}

// Evict frees up to n least recently used blocks neither pinned nor being
// written, and returns how many it freed.
func (x *Index) Evict(n int) int {
	k := 0
	for ; k < n; k++ {
		j := x.evictOne()
		if j == None {
			break
		}
		x.release(j)
	}
	return k
}

// Check verifies the index's invariants (for tests): counts, list links
// and key table agree with the slots.
func (x *Index) Check() error {
	var st Stats
	for i := range x.slots {
		s := &x.slots[i]
		switch s.state {
		case free:
			st.Free++
		case writing:
			st.Writing++
		case ready:
			st.Ready++
		case doomed:
			st.Doomed++
		}
		if s.pins > 0 {
			st.Pinned++
		}
		if s.pins < 0 || s.pins > 0 && (s.state == free || s.state == writing) {
			return fmt.Errorf("slot %d: %d pins in state %d", i, s.pins, s.state)
		}
		if s.state == writing || s.state == ready {
			if j, ok := x.byKey[s.key]; !ok || j != int32(i) {
				return fmt.Errorf("slot %d: its key maps to %d (%v)", i, j, ok)
			}
		}
	}
	if st.Free != len(x.free) {
		return fmt.Errorf("%d free slots, %d on the free stack", st.Free, len(x.free))
	}
	if st != x.Stats() {
		return fmt.Errorf("counted %+v, kept %+v", st, x.Stats())
	}
	if len(x.byKey) != st.Ready+st.Writing {
		return fmt.Errorf("%d keys, %d blocks ready or being written", len(x.byKey), st.Ready+st.Writing)
	}
	n, prev := 0, None
	for i := x.head; i != None; i = x.slots[i].next {
		s := &x.slots[i]
		if s.state != ready || s.pins != 0 || s.prev != prev {
			return fmt.Errorf("eviction list: slot %d in state %d with %d pins, prev %d (want %d)", i, s.state, s.pins, s.prev, prev)
		}
		prev = i
		if n++; n > len(x.slots) {
			return fmt.Errorf("eviction list: a cycle")
		}
	}
	if prev != x.tail {
		return fmt.Errorf("eviction list: ends at %d, tail %d", prev, x.tail)
	}
	if want := st.Ready - x.pinnedReady(); n != want {
		return fmt.Errorf("eviction list: %d slots, %d ready unpinned", n, want)
	}
	return nil
}

func (x *Index) pinnedReady() int {
	n := 0
	for i := range x.slots {
		if x.slots[i].state == ready && x.slots[i].pins > 0 {
			n++
		}
	}
	return n
}

// Order returns the keys on the eviction list, least recently used first
// (for tests).
func (x *Index) Order() []Key {
	var out []Key
	for i := x.head; i != None; i = x.slots[i].next {
		out = append(out, x.slots[i].key)
	}
	return out
}
