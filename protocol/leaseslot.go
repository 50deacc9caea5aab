package protocol

// Lease slot words (docs/protocol.md 6.7). Each slot of a connection's
// lease table is one 64-bit word, written with atomic operations by the
// daemon and by that connection's client:
//
//	bits 63..3  generation (the daemon's count of grants in this slot)
//	bit  2      doomed: the object was deleted; the lease must not be
//	            taken back, and is released through the socket
//	bits 1..0   state: 0 free, 1 held, 2 idle (released by the client,
//	            not yet reclaimed by the daemon)

// SlotState is the state field of a lease slot word.
type SlotState uint8

// Lease slot states.
const (
	SlotFree SlotState = 0 // no lease; the daemon's
	SlotHeld SlotState = 1 // the client holds the lease
	SlotIdle SlotState = 2 // the client released it; it may take it back until the daemon reclaims it
)

const (
	slotStateMask = 3
	slotDoomed    = 1 << 2
	slotGenShift  = 3
	// MaxSlotGen is the largest generation a slot word holds.
	MaxSlotGen = 1<<61 - 1
	// MaxLeaseSlots bounds a lease table.
	MaxLeaseSlots = 1 << 16
)

// SlotWord encodes a lease slot word.
func SlotWord(gen uint64, st SlotState, doomed bool) uint64 {
	w := gen<<slotGenShift | uint64(st)&slotStateMask
	if doomed {
		w |= slotDoomed
	}
	return w
}

// DecodeSlot splits a lease slot word. A state of 3 is invalid (only a
// misbehaving client writes it): neither side treats it as idle.
func DecodeSlot(w uint64) (gen uint64, st SlotState, doomed bool) {
	return w >> slotGenShift, SlotState(w & slotStateMask), w&slotDoomed != 0
}

// SlotRelease is the client's release of lease gen in a slot holding w: the
// word to swap in (state idle), or ok false when the lease must be released
// through the socket instead (doomed, or the word is not this held lease).
func SlotRelease(w, gen uint64) (next uint64, ok bool) {
	if w != SlotWord(gen, SlotHeld, false) {
		return 0, false
	}
	return SlotWord(gen, SlotIdle, false), true
}

// SlotRetake is the client's taking back of the idle lease gen: the word
// expected and the word to swap in (held). The swap succeeds only while the
// daemon has neither reclaimed nor doomed the lease.
func SlotRetake(gen uint64) (old, next uint64) {
	return SlotWord(gen, SlotIdle, false), SlotWord(gen, SlotHeld, false)
}

// SlotReclaim is the daemon's reclaiming of an idle lease gen in a slot
// holding w: the word to swap in (free, same generation), or ok false when
// the client holds the lease (or wrote something else).
func SlotReclaim(w, gen uint64) (next uint64, ok bool) {
	g, st, _ := DecodeSlot(w)
	if g != gen || st != SlotIdle {
		return 0, false
	}
	return SlotWord(gen, SlotFree, false), true
}
