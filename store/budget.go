package store

import (
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// What each uid makes the daemon keep, beyond the bytes Config.Quota
// bounds: objects (each costs the daemon's bookkeeping, whatever its size)
// and descriptors (each host arena keeps two, each VMM GPU arena and each
// manifest one, each registration one per piece). Both are bounded per uid
// and descriptors in all, so that no admitted user can exhaust the
// daemon's memory or descriptor table (docs/hardening.md).

// usage is one uid's count of what it makes the daemon keep.
type usage struct {
	objects int // objects with memory: drafts, sealed, deleted but leased, versions' spares
	fds     int
}

// fdCharge is what an arena's descriptors are charged to.
type fdCharge struct {
	uid uint32
	n   int
}

func (s *Store) usageLocked(uid uint32) *usage {
	u := s.usage[uid]
	if u == nil {
		u = &usage{}
		s.usage[uid] = u
	}
	return u
}

// forgetUsageLocked drops a uid's record once it holds nothing.
func (s *Store) forgetUsageLocked(uid uint32) {
	if u := s.usage[uid]; u != nil && u.objects == 0 && u.fds == 0 {
		delete(s.usage, uid)
	}
}

// objectRoomForLocked fails with a LIMIT error when uid may make no more
// objects.
func (s *Store) objectRoomForLocked(uid uint32) error {
	if u := s.usage[uid]; u != nil && u.objects >= s.cfg.MaxObjectsPerUID {
		return protocol.LimitErrorf(storev1.Error_OBJECTS_PER_UID,
			"uid %d has %d objects (drafts, sealed, and deleted ones still leased), the daemon's limit per uid (its max-objects-per-uid setting): delete or abort some",
			uid, u.objects)
	}
	return nil
}

// objectMadeLocked counts a new object's memory against its owner.
func (s *Store) objectMadeLocked(o *object) { s.usageLocked(o.owner).objects++ }

// objectGoneLocked uncounts an object whose memory was given back.
func (s *Store) objectGoneLocked(o *object) {
	if u := s.usage[o.owner]; u != nil {
		u.objects--
		s.forgetUsageLocked(o.owner)
	}
}

// takeFDsLocked charges n descriptors to uid, or fails with a LIMIT error
// saying which bound they would break.
func (s *Store) takeFDsLocked(uid uint32, n int) error {
	if n == 0 {
		return nil
	}
	u := s.usageLocked(uid)
	if u.fds+n > s.cfg.MaxFDsPerUID {
		s.forgetUsageLocked(uid)
		return protocol.LimitErrorf(storev1.Error_DESCRIPTORS_PER_UID,
			"uid %d has the daemon keep %d descriptors (arenas, manifests, registrations' pieces) and %d more would pass its limit per uid, %d (its max-fds-per-uid setting): delete objects or registrations",
			uid, u.fds, n, s.cfg.MaxFDsPerUID)
	}
	if s.fds+n > s.cfg.MaxFDs {
		s.forgetUsageLocked(uid)
		return protocol.LimitErrorf(storev1.Error_DESCRIPTORS,
			"the daemon keeps %d descriptors for objects and %d more would pass its limit, %d (its max-fds setting): try again once objects are deleted",
			s.fds, n, s.cfg.MaxFDs)
	}
	u.fds += n
	s.fds += n
	return nil
}

// giveFDsLocked returns n descriptors charged to uid.
func (s *Store) giveFDsLocked(uid uint32, n int) {
	if n == 0 {
		return
	}
	s.fds -= n
	if u := s.usage[uid]; u != nil {
		u.fds -= n
		s.forgetUsageLocked(uid)
	}
}

// fdBudget returns the defaults of Config.MaxFDs and MaxFDsPerUID: half of
// the descriptors the process may open beyond those its connections may
// take, shared fairly among the uids named (as Config.Quota is).
func fdBudget(rlimit uint64, maxConns, uids int) (total, perUID int) {
	left := int(min(rlimit, 1<<24)) - maxConns
	total = max(64, left/2)
	return total, max(16, total/max(uids, 1))
}

// uidsNamed counts the uids the daemon admits by name (its own and
// Config.AllowUIDs), plus one for all those Config.AllowGIDs admits: the
// shares that fair defaults divide among.
func (s *Store) uidsNamed() int {
	uids := map[uint32]bool{s.uid: true}
	for _, u := range s.cfg.AllowUIDs {
		uids[u] = true
	}
	n := len(uids)
	if len(s.cfg.AllowGIDs) > 0 {
		n++
	}
	return n
}
