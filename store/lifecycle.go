package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// The one lifecycle of every entry of the name table (names.go): create a
// draft, seal or abort it, get (waiting if need be) and release leases,
// delete. What differs between kinds is data inside these functions.

// createReq is a create of any kind: a plain object, or one shard of a
// version of a versioned name; either may carry a bundle's manifest.
type createReq struct {
	name   string // qualified
	size   int64
	device string
	shared bool
	// tensor is the object's typed-array descriptor, nil for none, already
	// validated against size by protocol.ValidateRequest.
	tensor *storev1.TensorDesc

	versioned    bool
	version      uint64 // 0: the oldest pending version lacking the shard, or the next
	shards       uint32 // 0 means 1
	shard        uint32
	keep         uint32
	manifestSize int64
	noEvict      bool // evict nothing to make room (CreateRequest.no_evict)
	// sourcesSize and files make a no-copy version (sources.go): files
	// belong to create from the moment it is called.
	sourcesSize int64
	nfiles      uint32
	files       []*os.File
	// like republishes version like of the name (sources.go, likeLocked).
	like uint64
	// cluster makes the object cluster-visible (store/cluster.go).
	cluster bool
	// slice makes the object a partial replica (slice.go), its name the
	// store's own.
	slice *sliceOf
	// vouched is what the cluster said may be evicted for this create
	// (room.go): nil before it was asked.
	vouched map[*object]string
}

func createReqOf(r *storev1.CreateRequest) createReq {
	return createReq{
		name: r.GetName(), size: int64(r.GetSize()), device: r.GetDevice(), shared: r.GetShared(), tensor: r.GetTensor(),
		versioned: r.GetVersioned(), version: r.GetVersion(), shards: r.GetShards(), shard: r.GetShard(),
		keep: r.GetKeepLast(), manifestSize: int64(r.GetManifestSize()), noEvict: r.GetNoEvict(), sourcesSize: int64(r.GetSourcesSize()), nfiles: r.GetFiles(),
		cluster: r.GetCluster(), like: r.GetLikeVersion(),
	}
}

// create makes a draft: a writable object that only this session sees until
// it seals it, under a name of its own or as a shard of a version. It
// returns the draft's placement and, for a shard, its version.
func (ss *session) create(r createReq) (placement, uint64, error) {
	var src *sources
	if r.sourcesSize > 0 || len(r.files) > 0 {
		var err error
		if src, err = newSources(r); err != nil {
			return placement{}, 0, err
		}
	}
	p, n, err := ss.createIn(r, src)
	var ask *roomAsk
	if errors.As(err, &ask) {
		// Room only evicting cluster-visible objects can make: those the
		// cluster vouches for may go, asked without the store's lock.
		r.vouched = ss.s.vouch(ss.ctx, ask)
		p, n, err = ss.createIn(r, src)
	}
	if err != nil {
		src.close()
	}
	return p, n, err
}

// creation is one create as it passes through createIn's steps: what each
// step resolved or made for the ones after it.
type creation struct {
	r   createReq
	src *sources // the publisher's memory of a no-copy version, or nil
	// shards is r.shards with 0 read as 1.
	shards uint32
	// devName and dev are the device of the store's memory; "" and nil
	// for a no-copy version.
	devName string
	dev     *device
	man     *manifest // nil for none; createIn closes it on failure
	o       *object
	// v is the version o is a shard of, nil for a plain object;
	// newSeries says v's series was made for this create.
	v         *version
	newSeries bool
}

// createIn makes the draft of one create, in steps: prepareCreate checks
// the request without the store's lock; under it, admitCreateLocked checks
// room, claimDraftLocked claims the draft's name or slot, backDraftLocked
// gives it memory, placeDraftLocked describes it for the caller and
// recordDraftLocked files it. A step that fails undoes the steps before it.
// It returns a *roomAsk where only evicting cluster-visible objects could
// make room (create asks the cluster and calls it again).
func (ss *session) createIn(r createReq, src *sources) (placement, uint64, error) {
	c := &creation{r: r, src: src}
	if err := ss.prepareCreate(c); err != nil {
		return placement{}, 0, err
	}
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	p, err := ss.createLocked(c)
	if err != nil {
		c.man.close()
		return placement{}, 0, err
	}
	n := ss.recordDraftLocked(c)
	s.log.Debug("object created", "session", ss.id, "name", r.name, "size", r.size, "device", c.devName, "shared", r.shared,
		"version", n, "shard", r.shard, "shards", c.shards, "manifest", r.manifestSize)
	return p, n, nil
}

// prepareCreate is what a create checks and makes before it takes the
// store's lock: the name, the sizes and the versioned fields are valid, the
// device exists (a no-copy version has none of the store's), the cluster
// may take a cluster-visible object, and a new manifest's memfd is made
// (a republish takes its earlier version's under the lock).
func (ss *session) prepareCreate(c *creation) error {
	r := c.r
	if r.slice == nil {
		if err := checkName(r.name); err != nil {
			return err
		}
	}
	if r.size <= 0 {
		return invalidf("object size %d is not positive", r.size)
	}
	if r.manifestSize < 0 || r.manifestSize > bundle.MaxHeaderSize {
		return invalidf("manifest size %d is outside 0..%d", r.manifestSize, bundle.MaxHeaderSize)
	}
	c.shards = max(r.shards, 1)
	if !r.versioned && (r.version != 0 || r.shards > 1 || r.shard != 0 || r.keep != 0) {
		return invalidf("version, shards, shard and keep_last need versioned")
	}
	if c.shards > MaxShards || r.shard >= c.shards {
		return invalidf("shard %d of %d: want shard < shards <= %d", r.shard, c.shards, MaxShards)
	}
	var err error
	if c.src == nil {
		if c.devName, err = ss.s.backend.device(r.device); err != nil {
			return err
		}
	} else if r.sourcesSize > protocol.MaxSourcesSize {
		return invalidf("sources table of %d bytes, at most %d", r.sourcesSize, protocol.MaxSourcesSize)
	}
	if r.cluster {
		if err := ss.s.clusterCreateOK(r, c.devName); err != nil {
			return err
		}
	}
	if r.manifestSize > 0 && r.like == 0 {
		if c.man, err = newManifest(r.manifestSize, r.sourcesSize); err != nil {
			return err
		}
	}
	return nil
}

// createLocked runs the steps of a create that need the store's lock, up
// to the placement it returns; on failure it has undone them all but the
// manifest, which createIn closes.
func (ss *session) createLocked(c *creation) (placement, error) {
	if err := ss.admitCreateLocked(c); err != nil {
		return placement{}, err
	}
	if err := ss.claimDraftLocked(c); err != nil {
		return placement{}, err
	}
	if err := ss.s.backDraftLocked(c); err != nil {
		ss.s.unclaimDraftLocked(c)
		return placement{}, fmt.Errorf("object %q: %w", c.r.name, err)
	}
	p, err := ss.placeDraftLocked(c)
	if err != nil {
		c.o.manifest, c.o.src = nil, nil // createIn and create close them
		if c.src == nil {
			ss.s.freeLocked(c.o)
		}
		ss.s.unclaimDraftLocked(c)
		return placement{}, err
	}
	return p, nil
}

// admitCreateLocked checks that the create may go ahead: the session is
// open and it and its uid have room for another object. It settles the
// manifest (a republish shares its earlier version's), charges it as a
// descriptor of the uid's, and looks up the device.
func (ss *session) admitCreateLocked(c *creation) error {
	s, r := ss.s, c.r
	if ss.closed {
		return errSessionClosed
	}
	if err := ss.objectRoomLocked(); err != nil {
		return err
	}
	if err := s.objectRoomForLocked(ss.peer.uid); err != nil {
		return err
	}
	var err error
	if r.like != 0 {
		if c.src == nil {
			return invalidf("like_version is for a no-copy version: set sources_size")
		}
		if c.man, err = ss.likeLocked(r, c.src); err != nil {
			return err
		}
	}
	if c.man != nil {
		if err := s.takeFDsLocked(ss.peer.uid, 1); err != nil {
			return err
		}
		c.man.charged, c.man.owner = s, ss.peer.uid
	}
	if c.src == nil {
		if c.dev, err = s.deviceLocked(c.devName); err != nil {
			return err
		}
	}
	return nil
}

// claimDraftLocked makes the draft object and claims its name, or for a
// versioned create finds or opens the version it is a shard of.
func (ss *session) claimDraftLocked(c *creation) error {
	s, r := ss.s, c.r
	o := &object{name: r.name, size: r.size, shared: r.shared, owner: ss.peer.uid, created: time.Now(),
		dev: c.dev, creator: ss, objKind: objKind{manifest: c.man, tensor: r.tensor, src: c.src, slice: r.slice}}
	if r.cluster {
		o.cluster = &clusterPart{}
	}
	var err error
	if r.versioned {
		c.v, c.newSeries, err = ss.versionForCreateLocked(r, c.shards)
	} else {
		err = s.claimLocked(r.name, o.entry())
	}
	if err != nil {
		return err
	}
	c.o = o
	return nil
}

// unclaimDraftLocked undoes claimDraftLocked.
func (s *Store) unclaimDraftLocked(c *creation) {
	if c.v != nil {
		s.dropEmptyVersionLocked(c.v, c.newSeries)
	} else {
		s.unclaimLocked(c.r.name, c.o.entry())
	}
}

// backDraftLocked gives the draft its memory: none of the store's for a
// no-copy version (the publisher's own, sources.go), else a spare of the
// version's (versions.go) or an allocation, which may evict to make room
// (room.go).
func (s *Store) backDraftLocked(c *creation) error {
	o := c.o
	if c.src != nil {
		return nil
	}
	if sp := s.takeSpareLocked(c.v, int(c.r.shard), o); sp != nil {
		o.block = sp.block
		o.block.Value = o
		return nil
	}
	b, err := s.allocLocked(c.dev, o, c.r.noEvict, c.r.vouched)
	if err != nil {
		return err
	}
	o.block = b
	s.objectMadeLocked(o)
	return nil
}

// placeDraftLocked describes the draft for its creator, writable, with a
// share of a new manifest's memfd, and charges a no-copy version's
// descriptors to the uid, as a registration's are. On failure it has
// closed what the placement held.
func (ss *session) placeDraftLocked(c *creation) (placement, error) {
	s := ss.s
	p, err := ss.placeLocked(c.o, true)
	if err == nil && c.man != nil && c.r.like == 0 {
		p.manifest, err = c.man.dup()
	}
	if err == nil && c.src != nil {
		if err = s.takeFDsLocked(ss.peer.uid, len(c.src.files)); err == nil {
			c.src.charged, c.src.owner = s, ss.peer.uid
		}
	}
	if err != nil {
		p.closeShare()
		return placement{}, err
	}
	return p, nil
}

// recordDraftLocked files the placed draft: a no-copy version's
// bookkeeping counts against the uid like any object's, a shard takes its
// slot in its version, the session lists it among its creations, and a
// republish, whose manifest and sources are sealed and checked already,
// is sealed at once. It returns the draft's version, 0 for a plain object.
func (ss *session) recordDraftLocked(c *creation) uint64 {
	o := c.o
	if c.src != nil {
		ss.s.objectMadeLocked(o)
		c.src.counted = true
	}
	var n uint64
	if c.v != nil {
		o.ver, o.shard = c.v, int(c.r.shard)
		c.v.shards[c.r.shard] = o
		n = c.v.n
	}
	ss.created[o] = struct{}{}
	if c.r.like != 0 {
		ss.sealLocked(o)
		ss.rememberLocked(o)
	}
	return n
}

// objectRoomLocked fails with ErrLimit when this connection may hold no
// more objects: drafts, sealed objects it created and registrations count
// alike.
func (ss *session) objectRoomLocked() error {
	if n := len(ss.created) + len(ss.registered); n >= ss.s.cfg.MaxObjectsPerClient {
		return protocol.LimitErrorf(storev1.Error_OBJECTS_PER_CONNECTION,
			"this connection already has %d objects (drafts, objects it created and registrations), the daemon's limit per connection (its max-objects setting): delete or abort some, or use another connection", n)
	}
	return nil
}

// leaseRoomLocked fails with ErrLimit when this connection may hold no
// more leases: leases of every kind and waiting gets count alike.
func (ss *session) leaseRoomLocked() error {
	if len(ss.leases)+ss.waiting >= ss.s.cfg.MaxLeasesPerClient {
		return protocol.LimitErrorf(storev1.Error_LEASES_PER_CONNECTION,
			"this connection already holds %d leases and %d waiting gets, the daemon's limit per connection (its max-leases setting): release some", len(ss.leases), ss.waiting)
	}
	return nil
}

// draftLocked returns the draft this session created that a seal or abort
// names: a plain object (ver 0) or shard of version ver of a versioned name.
func (ss *session) draftLocked(name string, ver uint64, shard uint32) (*object, error) {
	if ss.closed {
		return nil, errSessionClosed
	}
	e := ss.s.lookupLocked(name)
	var o *object
	switch {
	case ver == 0 && e.is(kindObject):
		o = e.obj
	case ver != 0 && e.is(kindSeries):
		if v := e.ser.versions[ver]; v != nil && int(shard) < len(v.shards) {
			o = v.shards[shard]
		}
	}
	switch {
	case o == nil:
	case o.state == stateDraft && o.creator == ss:
		return o, nil
	case o.state == stateSealed && o.readableBy(ss.peer.uid):
		return nil, draftErr(name, ver, shard, ErrSealed)
	}
	return nil, draftErr(name, ver, shard, ErrNotFound)
}

func draftErr(name string, ver uint64, shard uint32, err error) error {
	if ver == 0 {
		return fmt.Errorf("object %q: %w", name, err)
	}
	return fmt.Errorf("shard %d of version %d of %q: %w", shard, ver, name, err)
}

// sealReq is a seal of any draft: a plain object, optionally renamed and
// given a tensor descriptor, or a shard of a version.
type sealReq struct {
	name    string // qualified
	version uint64
	shard   uint32
	rename  string              // qualified; "" keeps the name
	tensor  *storev1.TensorDesc // replaces create's descriptor when not nil
}

func sealReqOf(r *storev1.SealRequest) sealReq {
	sr := sealReq{name: r.GetName(), version: r.GetVersion(), shard: r.GetShard(), rename: r.GetRename(), tensor: r.GetTensor()}
	if sr.rename == sr.name {
		sr.rename = ""
	}
	return sr
}

// seal makes a draft this session created immutable and visible: a plain
// object under its name (or, atomically, under r.rename: a taken name is
// ErrExists and the draft stays as it was), a shard as part of its version,
// which is published when its last shard is sealed (a cluster-visible one
// once the cluster has it too: clusterSealed). A bundle's manifest is
// sealed and checked first.
func (ss *session) seal(r sealReq) error {
	s := ss.s
	s.mu.Lock()
	o, err := ss.draftLocked(r.name, r.version, r.shard)
	if err == nil {
		err = checkSeal(o, r)
	}
	if err == nil && o.manifest != nil && !o.manifest.sealed {
		s.mu.Unlock()
		// Parsing a large manifest takes a while: not under the lock. Only
		// this session may seal o, and its requests are handled in order.
		err = o.manifest.finish(o.size, &s.manifests)
		if err == nil && o.src != nil {
			err = o.src.check(o.manifest.table, o.size, &s.sourcesChecked)
			o.manifest.table = nil
		}
		s.mu.Lock()
		if err == nil {
			o, err = ss.draftLocked(r.name, r.version, r.shard)
		}
	}
	defer s.mu.Unlock()
	if err != nil {
		return err
	}
	if r.rename != "" {
		if err := s.claimLocked(r.rename, o.entry()); err != nil {
			return err
		}
		s.unclaimLocked(o.name, o.entry())
		o.name = r.rename
	}
	if r.tensor != nil {
		o.tensor = r.tensor
	}
	ss.sealLocked(o)
	ss.rememberLocked(o)
	return nil
}

// checkSeal checks what a seal asks of draft o beyond sealing it.
func checkSeal(o *object, r sealReq) error {
	if r.rename == "" && r.tensor == nil {
		return nil
	}
	if o.ver != nil {
		return invalidf("%q is versioned: rename and tensor at seal are for plain objects", r.name)
	}
	if o.manifest != nil {
		return invalidf("object %q is a bundle: seal it under its own name, without a tensor", r.name)
	}
	if r.tensor != nil {
		return protocol.ValidateTensor(r.tensor, uint64(o.size))
	}
	return nil
}

// abort discards a draft this session created; for a shard, its whole
// version.
func (ss *session) abort(name string, ver uint64, shard uint32) error {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	o, err := ss.draftLocked(name, ver, shard)
	if errors.Is(err, ErrNotFound) && ver != 0 {
		// Aborting any shard aborts the version: a client that lost track
		// of its shard index (an abandoned create) may name another.
		if e := s.lookupLocked(name); e.is(kindSeries) && e.ser.versions[ver] != nil {
			for _, x := range e.ser.versions[ver].shards {
				if x != nil && x.creator == ss && x.state == stateDraft {
					o, err = x, nil
				}
			}
		}
	}
	if err != nil {
		return err
	}
	ss.abortLocked(o)
	return nil
}

// wakeLocked wakes the gets waiting for name: something under it may have
// become readable.
func (s *Store) wakeLocked(name string) {
	if w := s.waiters[name]; w != nil {
		close(w.ch)
		delete(s.waiters, name)
	}
}

// emitObjectLocked tells subscribers that kind happened to o, a plain
// object or a shard of a version, if list would show them its name.
func (s *Store) emitObjectLocked(kind eventKind, o *object) {
	if o.slice != nil {
		return // its name is the store's own
	}
	to := readers(o.owner, o.shared)
	switch {
	case o.ver != nil:
		if sr := o.ver.s; kind == eventAborted && sr.latest == 0 {
			// A series without a visible version is in no one's list.
			to = audience{owner: sr.owner}
		}
	case !o.sealed() && kind == eventAborted:
		to = audience{owner: o.owner}
	case !o.sealed():
		return
	}
	s.emitLocked(o.event(kind), to)
}

// versionSel says which version and shard a get wants; the zero value is a
// plain get (a versioned name's latest version, shard 0).
type versionSel struct {
	version   uint64 // 0: the latest
	shard     uint32
	newerThan uint64
}

// resolveLocked finds what a get of name with sel leases: an object (plain,
// or a shard) or a registration. ErrTimeout means nothing readable is
// there yet (the get may wait); other errors are final.
func (ss *session) resolveLocked(name string, sel versionSel) (*object, *external, error) {
	uid := ss.peer.uid
	e := ss.s.lookupLocked(name)
	if sel != (versionSel{}) {
		switch e.kind {
		case kindSeries:
			o, err := ss.versionShardLocked(e.ser, sel)
			return o, nil, err
		case kindObject:
			if e.obj.readableBy(uid) {
				return nil, nil, invalidf("object %q is not versioned", name)
			}
		case kindExternal:
			if e.ext.readableBy(uid) {
				return nil, nil, invalidf("registered object %q is not versioned", name)
			}
		}
		return nil, nil, fmt.Errorf("no version of %q yet: %w", name, ErrTimeout)
	}
	switch e.kind {
	case kindExternal:
		if e.ext.readableBy(uid) {
			return nil, e.ext, nil
		}
	case kindObject:
		if o := e.obj; o.state == stateSealed && o.readableBy(uid) {
			return o, nil, nil
		}
	case kindSeries:
		if sr := e.ser; sr.readableBy(uid) && sr.latest != 0 {
			if v := sr.versions[sr.latest]; v != nil && !v.withdrawn() {
				return v.shards[0], nil, nil
			}
		}
	}
	return nil, nil, fmt.Errorf("object %q is not sealed: %w", name, ErrTimeout)
}

// get returns a read-only lease on what name holds, as sel says. With wait,
// it waits until it is readable, or ctx ends (ErrTimeout when its deadline
// passed); without, it fails at once with ErrTimeout.
func (ss *session) get(ctx context.Context, name string, sel versionSel, wait bool) (placement, error) {
	for {
		p, err := ss.tryGet(name, sel)
		if !wait || !errors.Is(err, ErrTimeout) {
			return p, err
		}
		if err := ss.waitReady(ctx, name, sel); err != nil {
			return placement{}, err
		}
	}
}

// tryGet returns a read-only lease on what name holds, or ErrTimeout at
// once when nothing this session may read is there.
func (ss *session) tryGet(name string, sel versionSel) (placement, error) {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return placement{}, errSessionClosed
	}
	o, x, err := ss.resolveLocked(name, sel)
	if err == nil {
		err = ss.leaseRoomLocked()
	}
	if err != nil {
		return placement{}, err
	}
	if x != nil {
		return ss.leaseExternalLocked(x)
	}
	return ss.leaseLocked(o)
}

// waitReady returns once a get of name with sel could be answered (a lease
// or a final error), possibly at once, or fails when ctx or the session
// ends: ErrTimeout when ctx's deadline passed. A waiting get counts against
// the lease limit.
func (ss *session) waitReady(ctx context.Context, name string, sel versionSel) error {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return errSessionClosed
	}
	if _, _, err := ss.resolveLocked(name, sel); !errors.Is(err, ErrTimeout) {
		return nil
	}
	if err := ss.leaseRoomLocked(); err != nil {
		return err
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
		if !errors.Is(err, context.DeadlineExceeded) {
			return err
		}
		if sel == (versionSel{}) {
			return fmt.Errorf("object %q was not sealed in time: %w", name, ErrTimeout)
		}
		return fmt.Errorf("no version of %q above %d was published in time: %w", name, max(sel.newerThan, sel.version), ErrTimeout)
	}
	if ss.ctx.Err() != nil {
		return errSessionClosed
	}
	return nil
}

// leaseLocked grants a read lease on the sealed object o.
func (ss *session) leaseLocked(o *object) (placement, error) {
	p, err := ss.placeLocked(o, false)
	if err != nil {
		return placement{}, err
	}
	if o.manifest != nil {
		if p.manifest, err = o.manifest.dup(); err != nil {
			p.closeShare()
			return placement{}, err
		}
	}
	l := ss.addLeaseLocked(o, nil)
	ss.slotLocked(l)
	o.leases++
	if o.ver != nil {
		o.ver.leases++
	}
	if o.src == nil {
		o.dev.alloc.SetEvictable(o.block, false)
	}
	p.leaseID, p.leaseSlot, p.leaseGen = l.id, l.slot, l.gen
	p.info = o.info()
	return p, nil
}

// addLeaseLocked records a new lease of this session on o or e.
func (ss *session) addLeaseLocked(o *object, e *external) *lease {
	s := ss.s
	s.nextLease++
	l := &lease{id: s.nextLease, obj: o, ext: e}
	ss.leases[l.id] = l
	s.leases++
	return l
}

// release ends a lease of this session.
func (ss *session) release(id uint64) error {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return errSessionClosed
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
	if e := l.ext; e != nil {
		if e.leases--; e.leases == 0 && e.state != extRegistered {
			s.dropExternalLocked(e, eventDeleted)
		}
		return
	}
	o := l.obj
	o.leases--
	if v := o.ver; v != nil {
		// A version lives as long as any of its shards is leased.
		if v.leases--; v.leases > 0 {
			return
		}
		if v.released != nil {
			close(v.released)
			v.released = nil
		}
		switch {
		case v.retired():
			s.freeVersionLocked(v)
		case o.src != nil && o.src.orphaned:
			s.withdrawVersionLocked(v)
		}
		return
	}
	if o.leases > 0 {
		return
	}
	if o.state == stateDeleted {
		s.lastLeaseLocked(o)
		return
	}
	// The most recently used object is the last to be evicted.
	o.dev.alloc.SetEvictable(o.block, true)
}

// delete removes a name at once; the memory behind it is freed when its
// last lease ends. Deleting a draft of this session aborts it. Only the
// owner (or root) may delete what others may read.
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
	e := s.lookupLocked(name)
	if _, sees := ss.infoLocked(e); !sees && !(e.is(kindSeries) && e.ser.owner == ss.peer.uid) {
		return fmt.Errorf("object %q: %w", name, ErrNotFound)
	}
	if e.is(kindObject) && e.obj.state == stateDraft {
		ss.abortLocked(e.obj)
		return nil
	}
	if owner := e.owner(); owner != ss.peer.uid && ss.peer.uid != 0 {
		return fmt.Errorf("%s %q belongs to uid %d: %w", e.kind.noun(), name, owner, ErrPermission)
	}
	switch e.kind {
	case kindExternal:
		s.dropExternalLocked(e.ext, eventDeleted)
	case kindSeries:
		ss.deleteSeriesLocked(e.ser)
	case kindObject:
		s.deleteLocked(e.obj, eventDeleted)
		s.log.Debug("object deleted", "session", ss.id, "name", name, "leases", e.obj.leases)
	}
	return nil
}

// seesLocked reports whether o shows in this session's list and stat:
// sealed objects it may read, and the drafts it created.
func (ss *session) seesLocked(o *object) bool {
	if o.state == stateDraft {
		return o.creator == ss
	}
	return o.readableBy(ss.peer.uid)
}

// list returns what this session sees under names that sort after
// startAfter, sorted by name.
func (ss *session) list(startAfter string) []info {
	s := ss.s
	s.mu.Lock()
	var infos []info
	for name, e := range s.names {
		if name > startAfter {
			if in, ok := ss.infoLocked(e); ok {
				infos = append(infos, in)
			}
		}
	}
	s.mu.Unlock()
	sortInfos(infos)
	return infos
}

// stat describes what name holds, if this session sees it.
func (ss *session) stat(name string) (info, error) {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if in, ok := ss.infoLocked(s.lookupLocked(name)); ok {
		return in, nil
	}
	return info{}, fmt.Errorf("object %q: %w", name, ErrNotFound)
}
