package store

import (
	"fmt"
	"slices"
)

// The states of the name table's entries and their transitions: objects
// (objState), versions (verState) and registrations (extState). Each
// state changes only by its type's to, which refuses a transition the
// tables of doc.go ("States") do not list, and each transition is one
// function below that does the bookkeeping belonging to it.

// objState is where an object is in its life.
type objState uint8

const (
	// stateDraft: created, writable by its creator, seen by it alone.
	stateDraft objState = iota
	// stateSealed: immutable and readable (a shard: once its version is
	// published).
	stateSealed
	// stateDetached: a draft whose name went while its memory stays its
	// creator's (ClusterFile.Detach); no one is told of its abort.
	stateDetached
	// stateDeleted: a sealed object whose name went; leases keep its
	// memory.
	stateDeleted
	// stateAborted: a draft discarded; its memory is freed.
	stateAborted
)

func (st objState) String() string {
	switch st {
	case stateDraft:
		return "draft"
	case stateSealed:
		return "sealed"
	case stateDetached:
		return "detached"
	case stateDeleted:
		return "deleted"
	case stateAborted:
		return "aborted"
	}
	return fmt.Sprintf("objState(%d)", uint8(st))
}

// mayBecome reports whether an object in state st may go to next.
func (st objState) mayBecome(next objState) bool {
	switch st {
	case stateDraft:
		return next == stateSealed || next == stateDetached || next == stateAborted
	case stateDetached:
		return next == stateAborted
	case stateSealed:
		return next == stateDeleted
	}
	return false
}

// end is the state an object in state st goes to when it ends: deleted
// when sealed (its leases keep its memory), else aborted.
func (st objState) end() objState {
	if st == stateSealed {
		return stateDeleted
	}
	return stateAborted
}

// to moves o to state next. A transition the table above does not have is
// a bug of the store, and panics. An object that ends (deleted, aborted)
// no longer counts against its creator's limit.
func (o *object) to(next objState) {
	if !o.state.mayBecome(next) {
		panic(fmt.Sprintf("store: object %q: no transition from %s to %s", o.name, o.state, next))
	}
	o.state = next
	if next == stateDeleted || next == stateAborted {
		if c := o.creator; c != nil {
			delete(c.created, o)
			o.creator = nil
		}
	}
}

// sealed reports whether o was sealed: its bytes can no longer change
// (sealed, or deleted since).
func (o *object) sealed() bool { return o.state == stateSealed || o.state == stateDeleted }

// sealLocked seals a draft: draft → sealed. A plain object becomes
// readable (and evictable while unleased), and the gets waiting on its
// name wake; a shard counts towards its version, which is published once
// ready (readyLocked).
func (ss *session) sealLocked(o *object) {
	s := ss.s
	o.to(stateSealed)
	if ar := o.arenaLocked(); o.shared && ar != nil {
		// Its arena is its own: sealed against writes where the kernel
		// lets it (docs/hardening.md, "Sealed objects").
		ar.sealWrites()
	}
	if v := o.ver; v != nil {
		v.sealed++
		s.log.Debug("shard sealed", "session", ss.id, "name", v.s.name, "version", v.n, "shard", o.shard, "sealed", v.sealed, "shards", len(v.shards))
		if v.readyLocked() {
			s.publishLocked(v)
		}
		return
	}
	o.dev.alloc.SetEvictable(o.block, true)
	s.wakeLocked(o.name)
	s.emitObjectLocked(eventSealed, o)
	s.log.Debug("object sealed", "session", ss.id, "name", o.name)
}

// abortLocked discards a draft or detached object of this session: →
// aborted, its memory freed at once. A shard's abort aborts its whole
// version.
func (ss *session) abortLocked(o *object) {
	s := ss.s
	if o.ver != nil {
		s.abortVersionLocked(o.ver)
		return
	}
	detached := o.state == stateDetached
	s.unclaimLocked(o.name, o.entry())
	o.to(stateAborted)
	if !detached {
		s.emitObjectLocked(eventAborted, o)
	}
	s.freeLocked(o)
	s.log.Debug("object aborted", "session", ss.id, "name", o.name)
}

// detachLocked gives up the name of the unsealed replica o (draft →
// detached) while its memory stays its creator's until it aborts it, and
// reports whether it did. A slice does not detach, nor a shard beside
// other shards of its version: their drafts or seals keep the version
// pending, and without this one's abort nothing would free them.
func (s *Store) detachLocked(o *object) bool {
	if o.slice != nil {
		return false
	}
	v := o.ver
	if v != nil && slices.ContainsFunc(v.shards, func(x *object) bool { return x != nil && x != o }) {
		return false
	}
	s.emitObjectLocked(eventAborted, o)
	if v != nil {
		v.shards[o.shard] = nil
		s.dropEmptyVersionLocked(v, false)
		o.ver = nil
	} else {
		s.unclaimLocked(o.name, o.entry())
	}
	o.to(stateDetached)
	return true
}

// deleteLocked takes the sealed plain object (or slice) o's name at once:
// sealed → deleted. kind tells subscribers and the cluster why:
// eventDeleted for a delete (the owner's, or the cluster's), eventEvicted
// for an eviction, where the allocator frees the block once its Evict
// returns. Otherwise its memory goes now or with its last lease, and its
// idle leases go now.
func (s *Store) deleteLocked(o *object, kind eventKind) {
	s.clusterGoneLocked(o, kind == eventDeleted)
	s.unclaimLocked(o.name, o.entry())
	o.to(stateDeleted)
	s.emitObjectLocked(kind, o)
	switch {
	case kind == eventEvicted:
		o.manifest.close()
		s.objectGoneLocked(o)
		o.discardLocked()
	case o.leases == 0:
		s.freeLocked(o)
	default:
		o.dev.deleted++
		s.doomLocked(o) // idle leases go now, held ones through the socket
	}
}

// lastLeaseLocked frees the memory of the deleted plain object o, whose
// last lease just ended.
func (s *Store) lastLeaseLocked(o *object) {
	o.dev.deleted--
	s.freeLocked(o)
}

// endShardLocked ends shard i of v, whose version is freed: a sealed shard
// is deleted, a draft aborted. Its memory is kept as the series' spare for
// the next version's shard i where it may be reused, else freed.
func (s *Store) endShardLocked(v *version, i int) {
	o, sr := v.shards[i], v.s
	s.clusterGoneLocked(o, false)
	o.to(o.state.end())
	if o.src == nil && v.visible() && s.lookupLocked(sr.name) == sr.entry() && sr.spare[i] == nil && !o.writeSealedLocked() {
		// Keep the memory for the next version's shard i.
		o.manifest.close()
		o.manifest = nil
		if sr.spare == nil {
			sr.spare = make(map[int]*object)
		}
		sr.spare[i] = o
	} else {
		s.freeLocked(o)
	}
	v.shards[i] = nil
}

// verState is where a version of a versioned name is in its life.
type verState uint8

const (
	// verPending: some shard is not sealed yet, or not published in the
	// cluster (readyLocked); no reader sees it.
	verPending verState = iota
	// verVisible: published here; readers get its shards.
	verVisible
	// verRetired: beyond its name's keep_last (or the cluster's): no
	// longer the latest for a get, readable by version while leased.
	verRetired
	// verWithdrawn: a no-copy version its publisher withdrew (sources.go):
	// no new lease at all.
	verWithdrawn
	// verFreed: its shards ended and it left its series.
	verFreed
)

func (st verState) String() string {
	switch st {
	case verPending:
		return "pending"
	case verVisible:
		return "visible"
	case verRetired:
		return "retired"
	case verWithdrawn:
		return "withdrawn"
	case verFreed:
		return "freed"
	}
	return fmt.Sprintf("verState(%d)", uint8(st))
}

// mayBecome reports whether a version in state st may go to next.
func (st verState) mayBecome(next verState) bool {
	switch st {
	case verPending:
		return next == verVisible || next == verFreed
	case verVisible:
		return next == verRetired || next == verWithdrawn
	case verRetired:
		return next == verWithdrawn || next == verFreed
	case verWithdrawn:
		return next == verFreed
	}
	return false
}

// to moves v to state next; a transition the table lacks panics.
func (v *version) to(next verState) {
	if !v.state.mayBecome(next) {
		panic(fmt.Sprintf("store: version %d of %q: no transition from %s to %s", v.n, v.s.name, v.state, next))
	}
	v.state = next
}

// visible reports whether v was published here (retired and withdrawn
// versions were).
func (v *version) visible() bool {
	return v.state == verVisible || v.state == verRetired || v.state == verWithdrawn
}

// retired reports whether v was retired (withdrawn versions are).
func (v *version) retired() bool { return v.state == verRetired || v.state == verWithdrawn }

// withdrawn reports whether v was withdrawn by its no-copy publisher.
func (v *version) withdrawn() bool { return v.state == verWithdrawn }

// publishLocked makes a version whose shards are all sealed visible
// (pending → visible), and retires the versions beyond the series' keep.
func (s *Store) publishLocked(v *version) {
	sr := v.s
	v.to(verVisible)
	if v.n > sr.latest {
		sr.latest = v.n
	}
	s.retireLocked(sr)
	if v.n <= sr.floor && !v.retired() {
		s.retireVersionLocked(v)
	}
	s.wakeLocked(sr.name)
	if v.state == verVisible { // not retired (nor freed) at once
		s.emitObjectLocked(eventSealed, v.shards[0])
	}
	s.log.Debug("version published", "name", sr.name, "version", v.n, "shards", len(v.shards))
}

// retireVersionLocked ends a visible version's life as the latest
// (visible → retired); its memory goes now or with its last lease.
func (s *Store) retireVersionLocked(v *version) {
	v.to(verRetired)
	s.leaveVersionLocked(v)
}

// withdrawVersionLocked grants no new lease of the visible or retired
// no-copy version v (→ withdrawn); its memory goes now or with its last
// lease.
func (s *Store) withdrawVersionLocked(v *version) {
	v.to(verWithdrawn)
	s.emitObjectLocked(eventDeleted, v.shards[0])
	s.leaveVersionLocked(v)
}

// leaveVersionLocked tells the cluster at once that this node no longer
// holds v's shards, and frees v unless it is leased.
func (s *Store) leaveVersionLocked(v *version) {
	for _, o := range v.shards {
		if o != nil {
			s.clusterGoneLocked(o, false)
		}
	}
	if v.leases == 0 {
		s.freeVersionLocked(v)
	}
}

// freeVersionLocked ends every shard of a version and forgets it (→
// freed): a retired or withdrawn version once unleased, or an aborted
// one.
func (s *Store) freeVersionLocked(v *version) {
	sr := v.s
	for i, o := range v.shards {
		if o != nil {
			s.endShardLocked(v, i)
		}
	}
	v.to(verFreed)
	delete(sr.versions, v.n)
	s.log.Debug("version freed", "name", sr.name, "version", v.n)
}

// abortVersionLocked discards a pending version: every shard, sealed or
// not. A shard's creator that dies before sealing aborts the version this
// way, so that no reader ever sees it.
func (s *Store) abortVersionLocked(v *version) {
	for _, o := range v.shards {
		if o != nil {
			s.emitObjectLocked(eventAborted, o)
			break
		}
	}
	s.freeVersionLocked(v)
	s.logFor(v.s.owner).Info("version aborted", "name", v.s.name, "version", v.n)
}

// extState is where a registration of external memory is in its life
// (external.go).
type extState uint8

const (
	// extRegistered: named and readable; its registering connection lives.
	extRegistered extState = iota
	// extOrphaned: its registering connection ended; readable while
	// leased, dropped with its last lease.
	extOrphaned
	// extDropped: its name went; its descriptors close with its last
	// lease.
	extDropped
)

func (st extState) String() string {
	switch st {
	case extRegistered:
		return "registered"
	case extOrphaned:
		return "orphaned"
	case extDropped:
		return "dropped"
	}
	return fmt.Sprintf("extState(%d)", uint8(st))
}

// to moves e to state next: registered → orphaned → dropped, or
// registered → dropped. Another transition panics.
func (e *external) to(next extState) {
	if next <= e.state {
		panic(fmt.Sprintf("store: registration %q: no transition from %s to %s", e.name, e.state, next))
	}
	e.state = next
}

// dropExternalLocked forgets e's name (→ dropped), telling subscribers
// kind, and closes its descriptors once no lease is left: at once, or
// at its last lease's release.
func (s *Store) dropExternalLocked(e *external, kind eventKind) {
	if e.state != extDropped {
		e.to(extDropped)
		s.unclaimLocked(e.name, e.entry())
		s.emitLocked(event{kind: kind, name: e.name}, readers(e.owner, e.shared))
		// Idle leases go now (a later get finds no name), held ones through
		// the socket; either may bring the count to zero and come back here.
		doomSlotsLocked(e.slotted)
	}
	if e.leases == 0 && e.files != nil {
		for _, f := range e.files {
			f.Close()
		}
		s.giveFDsLocked(e.owner, len(e.files))
		e.files = nil
		s.pools.forgetSourceLocked(e)
	}
}

// unregisterLocked handles the registering connection's end: a legacy
// registration is dropped, another orphaned (registered → orphaned), and
// dropped with its last lease.
func (ss *session) unregisterLocked(e *external) {
	s := ss.s
	e.registrar = nil
	if e.state == extDropped {
		return
	}
	if e.legacy != nil {
		s.logFor(e.owner).Info("external memory removed: its exporter disconnected (a legacy region is valid only while the exporter lives)", "name", e.name, "leases", e.leases)
		s.dropExternalLocked(e, eventDeleted)
		return
	}
	e.to(extOrphaned)
	s.logFor(e.owner).Info("external memory orphaned: its exporter disconnected; readers keep their mappings", "name", e.name, "leases", e.leases)
	// An idle lease is no reader: it goes now, so that the memory goes with
	// the last lease held; a held one is released through the socket.
	doomSlotsLocked(e.slotted)
	if e.leases == 0 {
		s.dropExternalLocked(e, eventDeleted)
	}
}
