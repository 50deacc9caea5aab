package store

import (
	"context"
	"errors"
	"log/slog"
	"os"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// peer identifies the process at the other end of a connection, as the
// kernel reported it (SO_PEERCRED).
type peer struct {
	pid      int32
	uid, gid uint32
}

// session is the store's state for one client connection: what it created,
// the leases it holds and the arenas it has been sent. Everything in it is
// guarded by Store.mu. Closing a session aborts its unsealed objects and
// releases its leases, which is what makes a killed client harmless.
type session struct {
	s    *Store
	id   uint64
	peer peer
	log  *slog.Logger // lines this client causes, rate-limited per uid (Store.logFor)

	ctx    context.Context // ends when the session closes
	cancel context.CancelCauseFunc

	closed     bool
	created    map[*object]struct{}   // live objects it created, sealed or not
	registered map[*external]struct{} // external memory it registered (external.go)
	staged     []*os.File             // descriptors for its next register (stage.go)
	leases     map[uint64]*lease
	waiting    int                 // gets waiting for an object
	sent       map[sentKey]bool    // arenas (and modes) already sent
	holds      map[uint64]struct{} // arenas this connection maps (hold.go)
	freed      []uint64            // arenas given back that it has not been told of
	notices    []*storev1.Notice   // readers' notices not sent yet (notice.go)
	notify     chan struct{}       // signalled when freed or notices grow
	table      *leaseTable         // nil until asked for (leasetable.go)
	events     chan event          // nil until subscribed
	// republish holds, per name, the last no-copy version it sealed, for a
	// republish (sources.go).
	republish map[string]*republishable
	// dropping is set while events are dropped for want of queue space,
	// so that an episode is logged once.
	dropping bool
}

// lease is a read-only hold on a sealed object (obj) or on registered
// memory (ext): exactly one of them is set.
type lease struct {
	id  uint64
	obj *object
	ext *external
	// slot is the lease's slot in the session's table (1-based; 0: none),
	// gen the generation granted in it (leasetable.go).
	slot int
	gen  uint64
}

type sentKey struct {
	arena    uint64
	writable bool
}

// eventKind is what happened to an object, for subscribers: the protocol's
// kinds, one definition.
type eventKind = storev1.Event_Kind

const (
	eventSealed  = storev1.Event_SEALED
	eventDeleted = storev1.Event_DELETED
	eventEvicted = storev1.Event_EVICTED
	eventAborted = storev1.Event_ABORTED
)

// event is a notification for subscribers.
type event struct {
	kind    eventKind
	name    string
	version uint64 // for a versioned name
}

// eventQueue is how many events a subscriber may fall behind before it
// misses events: a client that does not read must neither make the daemon
// buffer without bound nor block it. Dropping (as docs/protocol.md says)
// rather than disconnecting keeps its leases and objects alive.
const eventQueue = 4096

// placement tells a client where an object lives. share is set when the
// session is sent the arena for the first time in this mode, and in every
// placement of a descriptor-shared GPU arena; the caller must close
// share.file.
type placement struct {
	arenaID    uint64
	device     string
	offset     int64
	size       int64
	arenaSize  int64
	writable   bool
	kind       storev1.Placement_Kind
	region     []byte     // GPU arenas: the whole arena's region, in every placement; registered memory: its region
	external   bool       // registered memory (external.go): no arena
	pieceFiles []*os.File // registered VMM memory: duplicates of its first descriptors (at most protocol.MaxFiles), sent with the placement; the caller closes them
	files      int        // registered VMM memory: all its descriptors (stage.go sends the rest)
	leaseID    uint64     // gets only
	leaseSlot  int        // gets only: the lease's slot in the session's table, or 0
	leaseGen   uint64
	share      *arenaShare
	manifest   *os.File // a bundle's manifest, sent after the arena's file; the caller closes it
	info       info     // gets only
}

// newSession starts a session for a peer. ctx bounds its life.
func (s *Store) newSession(ctx context.Context, p peer) (*session, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		cancel(errStoreClosed)
		return nil, errStoreClosed
	}
	s.nextSession++
	ss := &session{
		s:          s,
		id:         s.nextSession,
		peer:       p,
		log:        s.logFor(p.uid),
		ctx:        ctx,
		cancel:     cancel,
		created:    make(map[*object]struct{}),
		registered: make(map[*external]struct{}),
		leases:     make(map[uint64]*lease),
		sent:       make(map[sentKey]bool),
		holds:      make(map[uint64]struct{}),
		notify:     make(chan struct{}, 1),
	}
	s.sessions[ss] = struct{}{}
	return ss, nil
}

// placeLocked describes where o lives, with the arena's share attached the
// first time this session is sent that arena in that mode.
func (ss *session) placeLocked(o *object, writable bool) (placement, error) {
	if o.src != nil {
		return ss.placeSourcesLocked(o, writable)
	}
	ar := o.block.Arena()
	p := placement{
		arenaID:   ar.ID,
		device:    o.dev.name,
		offset:    o.block.Offset,
		size:      o.size,
		arenaSize: ar.Size,
		writable:  writable,
	}
	a := o.dev.arenas[ar.ID]
	ss.holdLocked(o.dev, ar.ID)
	p.kind = a.placementKind()
	if p.kind != storev1.Placement_HOST {
		// A GPU arena: its region (and descriptor) travels in every
		// placement, so that clients need no per-connection state for it.
		sh, err := a.share(writable)
		if err != nil {
			return placement{}, err
		}
		p.region = sh.region
		if sh.file != nil {
			p.share = &sh
		}
		return p, nil
	}
	k := sentKey{ar.ID, writable}
	if !ss.sent[k] {
		sh, err := a.share(writable)
		if err != nil {
			return placement{}, err
		}
		p.share = &sh
		ss.sent[k] = true
	}
	return p, nil
}

// subscribe starts the delivery of events for the objects this session may
// read, and returns the channel they arrive on. A subscriber that falls
// eventQueue events behind misses the events that do not fit.
func (ss *session) subscribe() (<-chan event, error) {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return nil, errSessionClosed
	}
	if ss.events == nil {
		ss.events = make(chan event, eventQueue)
		s.subscribers[ss] = struct{}{}
	}
	return ss.events, nil
}

var errSessionClosed = errors.New("connection closed")

// close ends the session: its unsealed objects are aborted, its leases
// released, its waiting gets woken. cause says why, for the session's
// context. It is idempotent.
func (ss *session) close(cause error) {
	s := ss.s
	ss.cancel(cause)
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return
	}
	ss.closed = true
	delete(s.sessions, ss)
	delete(s.subscribers, ss)
	aborted, released := 0, len(ss.leases)
	for o := range ss.created {
		if !o.sealed() {
			ss.abortLocked(o)
			aborted++
		} else {
			o.creator = nil
			if o.src != nil {
				s.publisherGoneLocked(o)
			}
		}
	}
	clear(ss.created)
	for _, l := range ss.leases {
		ss.releaseLocked(l)
	}
	for e := range ss.registered {
		ss.unregisterLocked(e)
	}
	clear(ss.registered)
	ss.unstageLocked()
	for name := range ss.republish {
		ss.forgetRepublishLocked(name)
	}
	ss.closeTableLocked()
	for id := range ss.holds {
		ss.forgetLocked(id)
	}
	if aborted > 0 || released > 0 {
		ss.log.Info("connection closed: cleaned up", "session", ss.id, "pid", ss.peer.pid, "uid", ss.peer.uid,
			"aborted", aborted, "released", released)
	}
}

// checkName rejects names the protocol does not allow. The server validates
// every request once (protocol.ValidateRequest) before a session sees it:
// the hot paths (get, its wait, stat) do not check again; operations that
// make names (create) do.
func checkName(name string) error { return protocol.ValidateName(name) }

// closeShare closes the file of a placement that will not be sent.
func (p *placement) closeShare() {
	if p.share != nil && p.share.file != nil {
		p.share.file.Close()
	}
	if p.manifest != nil {
		p.manifest.Close()
	}
	for _, f := range p.pieceFiles {
		f.Close()
	}
}
