package blocks

import (
	"math/rand/v2"
	"slices"
	"testing"
)

func key(n int) Key {
	var k Key
	k[0], k[1], k[2] = byte(n), byte(n>>8), byte(n>>16)
	k[31] = 1
	return k
}

func keys(ns ...int) Keys {
	var out []byte
	for _, n := range ns {
		k := key(n)
		out = append(out, k[:]...)
	}
	return Keys{out, KeySize}
}

func list(ks Keys) []Key {
	out := make([]Key, ks.Len())
	for i := range out {
		out[i] = ks.At(i)
	}
	return out
}

func one(k Key) Keys { return Keys{k[:], KeySize} }

func put(t *testing.T, x *Index, ks Keys) ([]int32, []Status) {
	t.Helper()
	slots, st := make([]int32, ks.Len()), make([]Status, ks.Len())
	x.Reserve(ks, slots, st)
	x.Commit(slots)
	if err := x.Check(); err != nil {
		t.Fatal(err)
	}
	return slots, st
}

func TestPrefixAndDuplicates(t *testing.T) {
	x := New(8)
	_, st := put(t, x, keys(1, 2, 3, 2))
	if want := []Status{Reserved, Reserved, Reserved, Existed}; !slices.Equal(st, want) {
		t.Fatalf("statuses %v, want %v", st, want)
	}
	_, st = put(t, x, keys(3, 4))
	if want := []Status{Existed, Reserved}; !slices.Equal(st, want) {
		t.Fatalf("statuses %v, want %v", st, want)
	}
	for _, c := range []struct {
		ks   Keys
		want int
	}{{keys(1, 2, 3, 4), 4}, {keys(1, 2, 9, 4), 2}, {keys(9, 1), 0}, {keys(4), 1}} {
		if n := x.Prefix(c.ks); n != c.want {
			t.Errorf("prefix of %d keys: %d, want %d", c.ks.Len(), n, c.want)
		}
	}
}

func TestWritingIsInvisible(t *testing.T) {
	x := New(4)
	slots, st := make([]int32, 2), make([]Status, 2)
	x.Reserve(keys(1, 2), slots, st)
	if n := x.Prefix(keys(1)); n != 0 {
		t.Fatalf("a block being written is in the prefix")
	}
	got := make([]int32, 1)
	if x.Acquire(keys(1), got) != 0 || got[0] != None {
		t.Fatalf("a block being written was acquired")
	}
	if x.Delete(keys(1)) != 0 || x.Evict(4) != 0 {
		t.Fatalf("a block being written was deleted or evicted")
	}
	// A second put of the key reports it present.
	s2, st2 := make([]int32, 1), make([]Status, 1)
	x.Reserve(keys(1), s2, st2)
	if st2[0] != Existed {
		t.Fatalf("status %v, want Existed", st2[0])
	}
	x.Abort(slots[1:])
	x.Commit(slots[:1])
	if x.Prefix(keys(1, 2)) != 1 {
		t.Fatalf("prefix after commit of 1 and abort of 2")
	}
	x.Reserve(keys(3), s2, st2)
	bits := make([]byte, 1)
	if p, n := x.Present(keys(3, 1, 2), bits); p != 0 || n != 1 || bits[0] != 0b010 {
		t.Fatalf("present with 3 being written, 1 readable, 2 aborted: prefix %d, %d present, bits %08b", p, n, bits[0])
	}
	x.Commit(s2)
	if err := x.Check(); err != nil {
		t.Fatal(err)
	}
}

func TestEvictionOrderAndPins(t *testing.T) {
	x := New(4)
	put(t, x, keys(1, 2, 3, 4))
	// Use 1 (a get and its unpin): it becomes the most recently used.
	s := make([]int32, 1)
	x.Acquire(keys(1), s)
	x.Unpin(s)
	// Pin 2 through a lookup's prefix.
	pinned := x.PinPrefix(keys(2), nil)
	if got, want := x.Order(), list(keys(3, 4, 1)); !slices.Equal(got, want) {
		t.Fatalf("eviction order %v, want %v", got, want)
	}
	_, st := put(t, x, keys(5, 6, 7))
	if want := []Status{Reserved, Reserved, Reserved}; !slices.Equal(st, want) {
		t.Fatalf("statuses %v", st)
	}
	// 3, 4 and 1 went, in that order; 2 stayed pinned.
	if x.Prefix(keys(2)) != 1 || x.Prefix(keys(3)) != 0 || x.Prefix(keys(4)) != 0 || x.Prefix(keys(1)) != 0 {
		t.Fatalf("the wrong blocks were evicted")
	}
	// Everything else pinned: a put finds no room.
	all := make([]int32, 3)
	x.Acquire(keys(5, 6, 7), all)
	_, st = put(t, x, keys(8))
	if st[0] != Full {
		t.Fatalf("status %v with every block pinned, want Full", st[0])
	}
	x.Unpin(pinned)
	x.Unpin(all)
	if got, want := x.Order(), list(keys(2, 5, 6, 7)); !slices.Equal(got, want) {
		t.Fatalf("eviction order after unpins %v, want %v", got, want)
	}
}

func TestDeletePinned(t *testing.T) {
	x := New(2)
	put(t, x, keys(1, 2))
	s := make([]int32, 1)
	x.Acquire(keys(1), s)
	if x.Delete(keys(1, 9)) != 1 {
		t.Fatal("delete of one present key")
	}
	if x.Prefix(keys(1)) != 0 {
		t.Fatal("a deleted block is visible")
	}
	// Its slot is not free while pinned: a put of two keys evicts 2 and
	// finds no second slot.
	_, st := put(t, x, keys(3, 4))
	if want := []Status{Reserved, Full}; !slices.Equal(st, want) {
		t.Fatalf("statuses %v, want %v", st, want)
	}
	x.Unpin(s)
	if x.Stats().Free != 1 || x.Stats().Doomed != 0 {
		t.Fatalf("stats %+v after the last pin of a deleted block", x.Stats())
	}
	if err := x.Check(); err != nil {
		t.Fatal(err)
	}
}

// TestRandomAgainstModel runs random operations against a plain model of
// what must be readable: every readable key is one the model stored, and
// every key the model holds pinned is still readable.
func TestRandomAgainstModel(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	x := New(64)
	type pinSet struct {
		keys  []Key
		slots []int32
	}
	var pins []pinSet
	stored := map[Key]bool{}
	for step := range 20000 {
		switch r.IntN(6) {
		case 0, 1:
			ns := make([]int, 1+r.IntN(8))
			for i := range ns {
				ns[i] = r.IntN(200)
			}
			ks := keys(ns...)
			slots, st := make([]int32, ks.Len()), make([]Status, ks.Len())
			x.Reserve(ks, slots, st)
			if r.IntN(8) == 0 {
				x.Abort(slots)
			} else {
				x.Commit(slots)
				for i, k := range list(ks) {
					if st[i] == Reserved {
						stored[k] = true
					}
				}
			}
		case 2:
			ns := make([]int, 1+r.IntN(8))
			for i := range ns {
				ns[i] = r.IntN(200)
			}
			ks := keys(ns...)
			slots := make([]int32, ks.Len())
			x.Acquire(ks, slots)
			var held pinSet
			for i, j := range slots {
				if j != None {
					held.keys, held.slots = append(held.keys, ks.At(i)), append(held.slots, j)
				}
			}
			pins = append(pins, held)
		case 3:
			if len(pins) > 0 {
				i := r.IntN(len(pins))
				x.Unpin(pins[i].slots)
				pins = slices.Delete(pins, i, i+1)
			}
		case 4:
			for _, k := range list(keys(r.IntN(200))) {
				if x.Delete(one(k)) == 1 {
					// A deleted key held by a pin is no longer required.
					for pi := range pins {
						for ki, pk := range pins[pi].keys {
							if pk == k {
								pins[pi].keys[ki] = Key{}
							}
						}
					}
				}
			}
		case 5:
			x.Evict(r.IntN(4))
		}
		if err := x.Check(); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		for _, p := range pins {
			for _, k := range p.keys {
				if k != (Key{}) && x.Prefix(one(k)) != 1 {
					t.Fatalf("step %d: a pinned key went", step)
				}
			}
		}
		checkPresent(t, x, keys(r.IntN(200), r.IntN(200), r.IntN(200), r.IntN(200), r.IntN(200), r.IntN(200), r.IntN(200), r.IntN(200), r.IntN(200)))
		for k := range x.byKey {
			if !stored[k] && x.slots[x.byKey[k]].state == ready {
				t.Fatalf("step %d: a key never stored is readable", step)
			}
		}
	}
}

// checkPresent checks Present against Prefix and a lookup of each key
// alone.
func checkPresent(t *testing.T, x *Index, ks Keys) {
	t.Helper()
	bits := make([]byte, (ks.Len()+7)/8)
	prefix, count := x.Present(ks, bits)
	if want := x.Prefix(ks); prefix != want {
		t.Fatalf("present's prefix %d, Prefix %d", prefix, want)
	}
	n := 0
	for i := range ks.Len() {
		has := bits[i/8]&(1<<(i%8)) != 0
		if want := x.Prefix(ks.Slice(i, i+1)) == 1; has != want {
			t.Fatalf("key %d of %d: present %v, want %v", i, ks.Len(), has, want)
		}
		if has {
			n++
		}
	}
	if count != n {
		t.Fatalf("present counts %d keys, its bits %d", count, n)
	}
}

func TestPresent(t *testing.T) {
	x := New(8)
	put(t, x, keys(1, 3, 5, 7))
	bits := make([]byte, 2)
	prefix, count := x.Present(keys(1, 3, 2, 5, 9, 7, 1, 4, 3), bits)
	// Keys 0, 1, 3, 5, 6 and 8 are present.
	if prefix != 2 || count != 6 || bits[0] != 0b01101011 || bits[1] != 0b1 {
		t.Fatalf("prefix %d, %d present, bits %08b %08b", prefix, count, bits[1], bits[0])
	}
	checkPresent(t, x, keys(7, 5, 3, 1))
	checkPresent(t, x, keys(8, 6, 4, 2, 0, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23))
	// Present changes nothing: key 1 stays the least recently used.
	if x.Order()[0] != key(1) {
		t.Fatalf("present changed the eviction order: %v", x.Order())
	}
}
