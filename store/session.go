package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

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

	ctx    context.Context // ends when the session closes
	cancel context.CancelCauseFunc

	closed     bool
	created    map[*object]struct{}   // live objects it created, sealed or not
	registered map[*external]struct{} // external memory it registered (external.go)
	extLeases  map[uint64]*external   // its leases on external memory
	leases     map[uint64]*lease
	waiting    int                 // gets waiting for an object
	sent       map[sentKey]bool    // arenas (and modes) already sent
	holds      map[uint64]struct{} // arenas this connection maps (hold.go)
	freed      []uint64            // arenas given back that it has not been told of
	notify     chan struct{}       // signalled when freed grows
	table      *leaseTable         // nil until asked for (leasetable.go)
	events     chan event          // nil until subscribed
	// dropping is set while events are dropped for want of queue space,
	// so that an episode is logged once.
	dropping bool
}

// lease is a read-only hold on a sealed object.
type lease struct {
	id  uint64
	obj *object
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
	region     []byte     // GPU arenas: the whole arena's region, in every placement; a legacy registration's region
	external   bool       // registered memory (external.go): no arena
	pieces     []int64    // its VMM pieces
	pieceFiles []*os.File // duplicates of their descriptors, sent with the placement; the caller closes them
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
		ctx:        ctx,
		cancel:     cancel,
		created:    make(map[*object]struct{}),
		registered: make(map[*external]struct{}),
		extLeases:  make(map[uint64]*external),
		leases:     make(map[uint64]*lease),
		sent:       make(map[sentKey]bool),
		holds:      make(map[uint64]struct{}),
		notify:     make(chan struct{}, 1),
	}
	s.sessions[ss] = struct{}{}
	return ss, nil
}

// create allocates a writable object that only this session sees until it
// seals it.
func (ss *session) create(name string, size int64, dev string, shared bool) (placement, error) {
	return ss.createTyped(name, size, dev, shared, nil)
}

// createTyped is create with the object's typed-array descriptor (nil for
// none), already validated against size by protocol.ValidateRequest.
func (ss *session) createTyped(name string, size int64, dev string, shared bool, tensor *storev1.TensorDesc) (placement, error) {
	s := ss.s
	if err := checkName(name); err != nil {
		return placement{}, err
	}
	if size <= 0 {
		return placement{}, invalidf("object size %d is not positive", size)
	}
	devName, err := s.backend.device(dev)
	if err != nil {
		return placement{}, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return placement{}, errSessionClosed
	}
	if _, ok := s.objects[name]; ok || s.series[name] != nil || s.externals[name] != nil {
		return placement{}, fmt.Errorf("object %q: %w", name, ErrExists)
	}
	if len(ss.created) >= s.cfg.MaxObjectsPerClient {
		return placement{}, fmt.Errorf("%w: this connection already has %d objects", ErrLimit, len(ss.created))
	}
	d, err := s.deviceLocked(devName)
	if err != nil {
		return placement{}, err
	}
	o := &object{
		name:    name,
		size:    size,
		shared:  shared,
		owner:   ss.peer.uid,
		created: time.Now(),
		dev:     d,
		creator: ss,
		tensor:  tensor,
	}
	b, err := s.allocLocked(d, o)
	if err != nil {
		return placement{}, fmt.Errorf("object %q: %w", name, err)
	}
	o.block = b
	p, err := ss.placeLocked(o, true)
	if err != nil {
		s.freeLocked(o)
		return placement{}, err
	}
	s.objects[name] = o
	ss.created[o] = struct{}{}
	s.log.Debug("object created", "session", ss.id, "name", name, "size", size, "device", devName, "shared", shared)
	return p, nil
}

// placeLocked describes where o lives, with the arena's share attached the
// first time this session is sent that arena in that mode.
func (ss *session) placeLocked(o *object, writable bool) (placement, error) {
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

// unsealedLocked returns the unsealed object name this session created, or
// the error for an operation that needs one.
func (ss *session) unsealedLocked(name string) (*object, error) {
	o := ss.s.objects[name]
	switch {
	case o == nil:
	case !o.sealed && o.creator == ss:
		return o, nil
	case o.sealed && o.readableBy(ss.peer.uid):
		return nil, fmt.Errorf("object %q: %w", name, ErrSealed)
	}
	return nil, fmt.Errorf("object %q: %w", name, ErrNotFound)
}

// seal makes an object this session created immutable and visible.
func (ss *session) seal(name string) error {
	return ss.onUnsealed(name, func(o *object) error { ss.sealLocked(o); return nil })
}

// sealAs seals the plain object name this session created under the
// (qualified) name to, atomically, recording tensor in place of create's
// descriptor when not nil. A taken name is ErrExists, and the object stays
// unsealed under its own name. It is how a client puts in one round trip:
// it creates an object ahead of time under a name of its own, writes it
// when the data comes, and publishes it here.
func (ss *session) sealAs(name, to string, tensor *storev1.TensorDesc) error {
	s := ss.s
	return ss.onUnsealed(name, func(o *object) error {
		if o.manifest != nil {
			return invalidf("object %q is a bundle: seal it under its own name", name)
		}
		if tensor != nil {
			if err := protocol.ValidateTensor(tensor, uint64(o.size)); err != nil {
				return err
			}
		}
		if to != name {
			if _, ok := s.objects[to]; ok || s.series[to] != nil || s.externals[to] != nil {
				return fmt.Errorf("object %q: %w", to, ErrExists)
			}
			delete(s.objects, name)
			o.name = to
			s.objects[to] = o
		}
		if tensor != nil {
			o.tensor = tensor
		}
		ss.sealLocked(o)
		return nil
	})
}

// onUnsealed runs f, under the store's lock, on the unsealed object name
// this session created, and returns f's error.
func (ss *session) onUnsealed(name string, f func(*object) error) error {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return errSessionClosed
	}
	o, err := ss.unsealedLocked(name)
	if err != nil {
		return err
	}
	return f(o)
}

// sealLocked seals a plain object.
func (ss *session) sealLocked(o *object) {
	s := ss.s
	name := o.name
	o.sealed = true
	o.dev.alloc.SetEvictable(o.block, true)
	if w := s.waiters[name]; w != nil {
		close(w.ch)
		delete(s.waiters, name)
	}
	s.emitLocked(eventSealed, o)
	s.log.Debug("object sealed", "session", ss.id, "name", name)
}

// abort discards an object this session created and has not sealed.
func (ss *session) abort(name string) error {
	return ss.onUnsealed(name, func(o *object) error { ss.abortLocked(o); return nil })
}

func (ss *session) abortLocked(o *object) {
	s := ss.s
	if o.ver != nil {
		s.abortVersionLocked(o.ver)
		return
	}
	delete(s.objects, o.name)
	o.deleted = true
	s.forgetCreatorLocked(o)
	s.emitLocked(eventAborted, o)
	s.freeLocked(o)
	s.log.Debug("object aborted", "session", ss.id, "name", o.name)
}

// get returns a read-only lease on the sealed object name. With wait, it
// waits until such an object exists and is sealed, or ctx ends (ErrTimeout
// when its deadline passed); without, it fails at once with ErrTimeout.
func (ss *session) get(ctx context.Context, name string, wait bool) (placement, error) {
	for {
		p, err := ss.tryGet(name)
		if !wait || !errors.Is(err, ErrTimeout) {
			return p, err
		}
		if err := ss.waitSealed(ctx, name); err != nil {
			return placement{}, err
		}
	}
}

// tryGet returns a read-only lease on the sealed object name, or
// ErrTimeout at once when there is no such object this session may read.
func (ss *session) tryGet(name string) (placement, error) {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return placement{}, errSessionClosed
	}
	if e := s.externals[name]; e != nil && e.readableBy(ss.peer.uid) {
		if len(ss.leases)+len(ss.extLeases)+ss.waiting >= s.cfg.MaxLeasesPerClient {
			return placement{}, fmt.Errorf("%w: this connection already holds %d leases and %d waiting gets", ErrLimit, len(ss.leases)+len(ss.extLeases), ss.waiting)
		}
		return ss.leaseExternalLocked(e)
	}
	o := s.objects[name]
	if o == nil {
		// A versioned name: its latest version's first shard.
		if sr := s.series[name]; sr != nil && sr.latest != 0 {
			if v := sr.versions[sr.latest]; v != nil {
				o = v.shards[0]
			}
		}
	}
	if o == nil || !o.sealed || !o.readableBy(ss.peer.uid) {
		return placement{}, fmt.Errorf("object %q is not sealed: %w", name, ErrTimeout)
	}
	if len(ss.leases)+ss.waiting >= s.cfg.MaxLeasesPerClient {
		return placement{}, fmt.Errorf("%w: this connection already holds %d leases and %d waiting gets", ErrLimit, len(ss.leases), ss.waiting)
	}
	return ss.leaseLocked(o)
}

// waitSealed returns once an object name this session may read is sealed
// (possibly already), or fails when ctx or the session ends: ErrTimeout when
// ctx's deadline passed. A waiting get counts against the lease limit.
func (ss *session) waitSealed(ctx context.Context, name string) error {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return errSessionClosed
	}
	if o := s.objects[name]; o != nil && o.sealed && o.readableBy(ss.peer.uid) {
		return nil
	}
	if e := s.externals[name]; e != nil && e.readableBy(ss.peer.uid) {
		return nil
	}
	if sr := s.series[name]; sr != nil && sr.latest != 0 {
		return nil
	}
	if len(ss.leases)+ss.waiting >= s.cfg.MaxLeasesPerClient {
		return fmt.Errorf("%w: this connection already holds %d leases and %d waiting gets", ErrLimit, len(ss.leases), ss.waiting)
	}
	w := s.waiters[name]
	if w == nil {
		w = &waiter{ch: make(chan struct{})}
		s.waiters[name] = w
	}
	w.n++
	ss.waiting++
	s.mu.Unlock()
	select {
	case <-w.ch:
	case <-ctx.Done():
	case <-ss.ctx.Done():
	}
	s.mu.Lock()
	ss.waiting--
	if w.n--; w.n == 0 && s.waiters[name] == w {
		delete(s.waiters, name)
	}
	if err := ctx.Err(); err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("object %q was not sealed in time: %w", name, ErrTimeout)
		}
		return err
	}
	if ss.ctx.Err() != nil {
		return errSessionClosed
	}
	return nil
}

func (ss *session) leaseLocked(o *object) (placement, error) {
	s := ss.s
	p, err := ss.placeLocked(o, false)
	if err != nil {
		return placement{}, err
	}
	s.nextLease++
	l := &lease{id: s.nextLease, obj: o}
	if o.manifest != nil {
		if p.manifest, err = o.manifest.dup(); err != nil {
			p.closeShare()
			return placement{}, err
		}
	}
	ss.leases[l.id] = l
	ss.slotLocked(l)
	o.leases++
	if o.ver != nil {
		o.ver.leases++
	}
	s.leases++
	o.dev.alloc.SetEvictable(o.block, false)
	p.leaseID, p.leaseSlot, p.leaseGen = l.id, l.slot, l.gen
	p.info = o.info()
	return p, nil
}

// release ends a lease of this session.
func (ss *session) release(id uint64) error {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return errSessionClosed
	}
	if e := ss.extLeases[id]; e != nil {
		ss.releaseExternalLocked(id, e)
		return nil
	}
	l := ss.leases[id]
	if l == nil {
		return fmt.Errorf("lease %d: %w", id, ErrNotFound)
	}
	ss.releaseLocked(l)
	return nil
}

func (ss *session) releaseLocked(l *lease) {
	s := ss.s
	ss.unslotLocked(l)
	delete(ss.leases, l.id)
	s.leases--
	o := l.obj
	o.leases--
	if v := o.ver; v != nil {
		// A version lives as long as any of its shards is leased.
		if v.leases--; v.leases == 0 && v.retired {
			s.freeVersionLocked(v)
		}
		return
	}
	if o.leases > 0 {
		return
	}
	if o.deleted {
		o.dev.deleted--
		s.freeLocked(o)
		return
	}
	// The most recently used object is the last to be evicted.
	o.dev.alloc.SetEvictable(o.block, true)
}

// delete removes an object's name at once; its memory is freed when its
// last lease ends. Deleting an unsealed object of this session aborts it.
func (ss *session) delete(name string) error {
	s := ss.s
	if err := checkName(name); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return errSessionClosed
	}
	if e := s.externals[name]; e != nil && e.readableBy(ss.peer.uid) {
		return ss.deleteExternalLocked(e)
	}
	o := s.objects[name]
	if sr := s.series[name]; o == nil && sr != nil {
		if _, ok := ss.seriesInfoLocked(sr); ok || sr.owner == ss.peer.uid {
			return ss.deleteSeriesLocked(sr)
		}
	}
	if o == nil || !ss.seesLocked(o) {
		return fmt.Errorf("object %q: %w", name, ErrNotFound)
	}
	if !o.sealed {
		ss.abortLocked(o)
		return nil
	}
	if o.owner != ss.peer.uid && ss.peer.uid != 0 {
		return fmt.Errorf("object %q belongs to uid %d: %w", name, o.owner, ErrPermission)
	}
	delete(s.objects, name)
	o.deleted = true
	s.forgetCreatorLocked(o)
	s.emitLocked(eventDeleted, o)
	if o.leases == 0 {
		s.freeLocked(o)
	} else {
		o.dev.deleted++
		s.doomLocked(o) // idle leases go now, held ones through the socket
	}
	s.log.Debug("object deleted", "session", ss.id, "name", name, "leases", o.leases)
	return nil
}

// seesLocked reports whether o shows in this session's list and stat:
// sealed objects it may read, and the unsealed ones it created.
func (ss *session) seesLocked(o *object) bool {
	if !o.sealed {
		return o.creator == ss
	}
	return o.readableBy(ss.peer.uid)
}

// list returns the objects this session sees whose names sort after
// startAfter, sorted by name.
func (ss *session) list(startAfter string) []info {
	s := ss.s
	s.mu.Lock()
	var infos []info
	for name, o := range s.objects {
		if name > startAfter && ss.seesLocked(o) {
			infos = append(infos, o.info())
		}
	}
	for name, e := range s.externals {
		if name > startAfter && e.readableBy(ss.peer.uid) {
			infos = append(infos, e.info())
		}
	}
	for name, sr := range s.series {
		if name > startAfter {
			if in, ok := ss.seriesInfoLocked(sr); ok {
				infos = append(infos, in)
			}
		}
	}
	s.mu.Unlock()
	sortInfos(infos)
	return infos
}

// stat describes one object this session sees.
func (ss *session) stat(name string) (info, error) {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.externals[name]; e != nil && e.readableBy(ss.peer.uid) {
		return e.info(), nil
	}
	o := s.objects[name]
	if sr := s.series[name]; o == nil && sr != nil {
		if in, ok := ss.seriesInfoLocked(sr); ok {
			return in, nil
		}
	}
	if o == nil || !ss.seesLocked(o) {
		return info{}, fmt.Errorf("object %q: %w", name, ErrNotFound)
	}
	return o.info(), nil
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

// emitLocked queues an event for every subscriber that may read o.
func (s *Store) emitLocked(kind eventKind, o *object) {
	for ss := range s.subscribers {
		if !o.readableBy(ss.peer.uid) || !o.sealed && kind != eventAborted {
			continue
		}
		select {
		case ss.events <- o.event(kind):
			ss.dropping = false
		default:
			if !ss.dropping {
				ss.dropping = true
				s.log.Warn("dropping events for a subscriber that does not read them", "session", ss.id, "pid", ss.peer.pid, "queued", eventQueue)
			}
			s.metrics.eventsDropped.Inc()
		}
	}
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
		if !o.sealed {
			ss.abortLocked(o)
			aborted++
		} else {
			o.creator = nil
		}
	}
	clear(ss.created)
	for _, l := range ss.leases {
		ss.releaseLocked(l)
	}
	released += len(ss.extLeases)
	for id, e := range ss.extLeases {
		ss.releaseExternalLocked(id, e)
	}
	for e := range ss.registered {
		ss.unregisterLocked(e)
	}
	clear(ss.registered)
	ss.closeTableLocked()
	for id := range ss.holds {
		ss.forgetLocked(id)
	}
	if aborted > 0 || released > 0 {
		s.log.Info("connection closed: cleaned up", "session", ss.id, "pid", ss.peer.pid, "uid", ss.peer.uid,
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
