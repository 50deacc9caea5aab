package store

import "github.com/cudaipc/cudaipc/protocol/storev1"

// Arena holds: which connections map which arenas, so that a client may
// keep an arena mapped after its last object or lease in it ends (its next
// get then costs no driver open) while the daemon still frees and reuses
// memory safely.
//
// The rule (docs/architecture.md, "Arena lifetime"): a connection holds
// every arena it was sent a placement of, until it forgets the arena
// (ForgetArenasRequest) or closes. When the allocator gives an empty arena
// back, the store tells every holder (ArenasFreed, id 0). A host arena is
// closed at once: a client's mapping of its memfd stays valid on its own.
// A GPU arena's memory is freed only once no connection holds it any more,
// because freeing device memory that another process has mapped is
// undefined behaviour in CUDA; until then it is outside the allocator's
// accounting (the capacity is given back at once) and counted in the
// metric cudaipc_store_arenas_held_after_free. Clients answer ArenasFreed
// at once, so a freed GPU arena outlives its last object by one round
// trip of each holder; a client that never answers keeps it until its
// connection closes, as it could by holding a lease.

// arenaHold is the set of connections that were sent an arena and have not
// forgotten it.
type arenaHold struct {
	sessions map[*session]struct{}
	freed    arena // set when the allocator gave the arena back; closed with the last holder
	device   string
}

// holdLocked records that ss was sent arena id of device d.
func (ss *session) holdLocked(d *device, id uint64) {
	s := ss.s
	if _, ok := ss.holds[id]; ok {
		return
	}
	h := s.holds[id]
	if h == nil {
		h = &arenaHold{sessions: make(map[*session]struct{}), device: d.name}
		s.holds[id] = h
	}
	h.sessions[ss] = struct{}{}
	ss.holds[id] = struct{}{}
}

// forgetLocked ends ss's hold of arena id; the last holder of a freed GPU
// arena frees its memory. Unknown ids are ignored.
func (ss *session) forgetLocked(id uint64) {
	s := ss.s
	if _, ok := ss.holds[id]; !ok {
		return
	}
	delete(ss.holds, id)
	h := s.holds[id]
	delete(h.sessions, ss)
	if len(h.sessions) > 0 {
		return
	}
	delete(s.holds, id)
	if h.freed != nil {
		s.closeArenaLocked(h.device, id, h.freed)
		s.metrics.heldAfterFree.Dec()
	}
}

// forget ends this session's holds of the arenas ids.
func (ss *session) forget(ids []uint64) error {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return errSessionClosed
	}
	for _, id := range ids {
		ss.forgetLocked(id)
	}
	return nil
}

// arenaFreedLocked handles an arena the allocator gave back: its holders
// are told, and a GPU arena that some still hold stays allocated until
// they forget it.
func (s *Store) arenaFreedLocked(d *device, id uint64, ar arena) {
	h := s.holds[id]
	if h == nil {
		s.closeArenaLocked(d.name, id, ar)
		return
	}
	for ss := range h.sessions {
		ss.freed = append(ss.freed, id)
		select {
		case ss.notify <- struct{}{}:
		default:
		}
	}
	if ar.placementKind() == storev1.Placement_HOST {
		// A host arena: clients' mappings of the memfd stay valid.
		for ss := range h.sessions {
			delete(ss.holds, id)
		}
		delete(s.holds, id)
		s.closeArenaLocked(d.name, id, ar)
		return
	}
	h.freed = ar
	s.metrics.heldAfterFree.Inc()
	s.log.Debug("arena empty; freed once its holders unmap it", "device", d.name, "arena", id, "holders", len(h.sessions))
}

func (s *Store) closeArenaLocked(device string, id uint64, ar arena) {
	if c, ok := s.arenaFDs[id]; ok {
		delete(s.arenaFDs, id)
		s.giveFDsLocked(c.uid, c.n)
	}
	if err := ar.close(); err != nil {
		s.log.Warn("closing arena", "device", device, "arena", id, "err", err)
	}
	s.log.Debug("arena released", "device", device, "arena", id)
}

// takeFreedLocked returns the freed arenas this session has not been told
// of yet.
func (ss *session) takeFreedLocked() []uint64 {
	ids := ss.freed
	ss.freed = nil
	return ids
}
