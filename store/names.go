package store

import "fmt"

// entryKind says what a name of the store's name table holds. Every kind
// goes through the same claim, lookup, create/seal/abort and get/wait path
// (doc.go, "Names and their lifecycle"); what differs between kinds is data
// handled inside that path, so a new kind is a new constant and a case in
// each switch on it, not a parallel path.
type entryKind uint8

const (
	// kindObject is an object the store holds the memory of: a draft
	// until its creator seals it.
	kindObject entryKind = iota + 1
	// kindExternal is memory a client registered (external.go): sealed
	// from the start; the store holds its descriptors only.
	kindExternal
	// kindSeries is a versioned name (versions.go): its versions' shards
	// are objects that the name table does not hold themselves.
	kindSeries
)

// noun names the kind in error messages.
func (k entryKind) noun() string {
	switch k {
	case kindExternal:
		return "registered object"
	case kindSeries:
		return "versioned object"
	default:
		return "object"
	}
}

// entry is what one name holds: exactly one of obj, ext and ser, as kind
// says. The zero entry is no entry. Entries compare equal when they hold
// the same thing.
type entry struct {
	kind entryKind
	obj  *object
	ext  *external
	ser  *series
}

func (o *object) entry() entry      { return entry{kind: kindObject, obj: o} }
func (e *external) entry() entry    { return entry{kind: kindExternal, ext: e} }
func (sr *series) entry() entry     { return entry{kind: kindSeries, ser: sr} }
func (e entry) exists() bool        { return e.kind != 0 }
func (e entry) is(k entryKind) bool { return e.kind == k }

// owner returns the uid whose namespace the entry is in.
func (e entry) owner() uint32 {
	switch e.kind {
	case kindObject:
		return e.obj.owner
	case kindExternal:
		return e.ext.owner
	case kindSeries:
		return e.ser.owner
	}
	return 0
}

// lookupLocked returns what name holds; the zero entry when nothing.
func (s *Store) lookupLocked(name string) entry { return s.names[name] }

// claimLocked gives name to e, or fails with ErrExists when the name is
// taken, by whatever kind. It is the only place a name is taken, so that no
// kind can take a name another holds.
func (s *Store) claimLocked(name string, e entry) error {
	if old, ok := s.names[name]; ok {
		return fmt.Errorf("%s %q: %w", old.kind.noun(), name, ErrExists)
	}
	s.names[name] = e
	return nil
}

// unclaimLocked frees name if it still holds e (a name deleted and taken
// again is left to its new holder).
func (s *Store) unclaimLocked(name string, e entry) {
	if s.names[name] == e {
		delete(s.names, name)
	}
}

// infoLocked describes what name holds for this session's list and stat,
// and reports false when the session may not see it: a sealed or
// registered object it may read, its own drafts, and a versioned name with
// a visible version it may read.
func (ss *session) infoLocked(e entry) (info, bool) {
	switch e.kind {
	case kindObject:
		if ss.seesLocked(e.obj) && e.obj.slice == nil {
			return e.obj.info(), true
		}
	case kindExternal:
		if e.ext.readableBy(ss.peer.uid) {
			return e.ext.info(), true
		}
	case kindSeries:
		return ss.seriesInfoLocked(e.ser)
	}
	return info{}, false
}

// audience is who is told of an event: the subscribers to whom list would
// show the name. A draft's name is shown to its owner only, so events
// about drafts (a draft's abort) go to the owner's uid alone; a sealed
// name's events go to everyone who may read it.
type audience struct {
	owner  uint32
	shared bool // every uid
	root   bool // root as well as the owner
}

func (a audience) includes(uid uint32) bool {
	return a.shared || uid == a.owner || a.root && uid == 0
}

// readers is the audience of a sealed name of owner, shared or not.
func readers(owner uint32, shared bool) audience {
	return audience{owner: owner, shared: shared, root: true}
}

// emitLocked queues ev for every subscriber in to. A subscriber whose
// queue is full misses it.
func (s *Store) emitLocked(ev event, to audience) {
	for ss := range s.subscribers {
		if !to.includes(ss.peer.uid) {
			continue
		}
		select {
		case ss.events <- ev:
			ss.dropping = false
		default:
			if !ss.dropping {
				ss.dropping = true
				ss.log.Warn("dropping events for a subscriber that does not read them", "session", ss.id, "pid", ss.peer.pid, "queued", eventQueue)
			}
			s.metrics.eventsDropped.Inc()
		}
	}
}
