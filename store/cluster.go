package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// ClusterHook connects the store to a cluster of daemons (package
// cluster/node implements it). The store calls it where its own name
// table ends: a get that finds nothing (Fetch), a cluster-visible object or
// shard sealed (Sealed), a cluster-visible name deleted by its owner
// (Deleted) or an object gone otherwise (Dropped). Its methods are called
// without the store's lock held.
type ClusterHook interface {
	// Fetch is called when a get of owner's name by uid reader finds
	// nothing the reader may read here, as sel says (the zero ClusterGet:
	// a plain get, of an object or a versioned name's latest version). It
	// returns nil once a sealed local replica is there, or nothing more can
	// come before ctx ends (the get then goes on: leased, or waiting, or
	// timed out), an error wrapping ErrNotFound when the cluster has
	// nothing under that name either (the get goes on as without a
	// cluster), or another error, which the get returns.
	Fetch(ctx context.Context, reader, owner uint32, name string, sel ClusterGet) error
	// FetchTensors is Fetch for a get that names some tensors of a bundle
	// (GetRequest.tensors; sel.Tensors). It may answer as Fetch does
	// (slice ""), or with the name of a sealed partial replica holding just
	// those tensors (CreateSlice), which the get leases instead. A tensor
	// the bundle lacks, or an object that is no bundle, is an error
	// wrapping ErrInvalid.
	FetchTensors(ctx context.Context, reader, owner uint32, name string, sel ClusterGet) (slice string, err error)
	// Sealed is called when the cluster-visible object or shard obj was
	// sealed on this node, before the seal is answered: it publishes it and
	// returns its cluster incarnation id, or why it could not.
	Sealed(ctx context.Context, obj ClusterObject) (id string, err error)
	// Deleted is called after the owner deleted a cluster-visible name on
	// this node (a plain object, or a versioned name with all its
	// versions): the name goes from the cluster.
	Deleted(obj ClusterObject)
	// Dropped is called after a cluster-visible object or shard left this
	// node otherwise (evicted, a version retired, or removed because the
	// cluster deleted it): the node no longer holds it.
	Dropped(obj ClusterObject)
	// MayEvict is called when a create (a client's, or a replica's) finds
	// no room unless cluster-visible objects sealed here go (objs, each
	// with its incarnation ID). It reports, for each, whether another
	// live node holds that incarnation too, so that this copy may be
	// evicted; one it cannot vouch for (the directory unreachable, say)
	// is a last copy, and stays. Its answer holds for that create only.
	MayEvict(ctx context.Context, objs []ClusterObject) []bool
}

// Replicas is what the cluster side of the daemon (package cluster/node)
// does with this node's store, the other way from ClusterHook: it reads
// cluster-visible objects for peers (Lease), makes replicas and partial
// replicas of other nodes' objects (Create, CreateSlice), removes and
// retires them as the cluster says (Drop, Retire, DropSlices), and leases
// registered memory for reads across nodes (LeaseRegistered). Its methods
// are safe for concurrent use.
type Replicas struct{ s *Store }

// Replicas returns the store's side for the cluster.
func (s *Store) Replicas() *Replicas { return &Replicas{s: s} }

// ClusterGet is what a get asks for: the zero value is a plain get that
// does not wait.
type ClusterGet struct {
	Version   uint64
	Shard     uint32
	NewerThan uint64
	// Wait: the get waits for the name if it is not readable yet: the hook
	// waits for any node to create it, through directory outages, until
	// ctx ends (the store ends ctx at a local seal of the name).
	Wait bool
	// Tensors names the tensors of a bundle the get wants (FetchTensors).
	Tensors []string
}

// ClusterObject names a cluster-visible object of this node: a plain
// object (Version 0) or one shard of a version of a versioned name.
type ClusterObject struct {
	Owner  uint32
	Name   string // in the owner's namespace, without "UID:"
	Size   int64
	Shared bool
	// Version, Shard and Shards place a shard in its version.
	Version       uint64
	Shard, Shards uint32
	// Keep is the keep_last the versioned name was created with here (0
	// when none was given): Sealed records it, so that every node keeps
	// only the name's newest Keep versions; Replicas.Create keeps that many
	// of the replica's versions here.
	Keep uint32
	// ID is its cluster incarnation id ("" until published).
	ID string
	// Manifest is a bundle's manifest (its header bytes), nil for an
	// object without one: Sealed gets the sealed manifest, Replicas.Create
	// makes the replica a bundle with it (validated at its seal).
	Manifest []byte
	// GPU: the object is in GPU memory (Sealed); Replicas.Create makes the
	// replica on this daemon's first GPU, or in host memory where it has
	// none.
	GPU bool
}

// MaxClusterManifest bounds the manifest of a cluster-visible bundle: it
// travels in the bundle's directory record (cluster.MaxManifestLen).
const MaxClusterManifest = 192 << 10

// DefaultClusterFetchTimeout bounds a get's cluster fetch when the get
// itself does not wait.
const DefaultClusterFetchTimeout = 2 * time.Minute

// clusterPart is a cluster-visible object's place in the cluster: created
// cluster-visible, or a replica.
type clusterPart struct {
	// id is its incarnation in the directory once published; "" before,
	// and again once the hook was told it left (told once).
	id string
	// publishing is closed when the publish of this object (clusterSealed)
	// ends, set while it runs: the directory may show the incarnation
	// before id is set, and a holder's Replicas.Lease waits for it.
	publishing chan struct{}
}

// clusterID is o's cluster incarnation: "" for a node-local object, or
// one not (or no longer) published.
func (o *object) clusterID() string {
	if o.cluster == nil {
		return ""
	}
	return o.cluster.id
}

func (o *object) clusterObject() ClusterObject {
	uid, name, _ := protocol.SplitOwner(o.name)
	co := ClusterObject{Owner: uid, Name: name, Size: o.size, Shared: o.shared, ID: o.clusterID(),
		GPU: o.dev != nil && o.dev.name != hostDevice}
	if v := o.ver; v != nil {
		co.Version, co.Shard, co.Shards, co.Keep = v.n, uint32(o.shard), uint32(len(v.shards)), uint32(v.s.keep)
	}
	return co
}

// clusterGoneLocked tells the hook that the cluster-visible object or
// shard o left this node: deleted by its owner (a plain object's name goes
// from the cluster) or not.
func (s *Store) clusterGoneLocked(o *object, deleted bool) {
	h := s.cfg.Cluster
	if h == nil || !o.sealed() || o.clusterID() == "" {
		return
	}
	co := o.clusterObject()
	o.cluster.id = "" // told once
	if deleted && o.ver == nil {
		go h.Deleted(co)
	} else {
		go h.Dropped(co)
	}
}

// clusterSeriesDeletedLocked tells the hook that the owner deleted the
// versioned name sr, if any of its shards is cluster-visible.
func (s *Store) clusterSeriesDeletedLocked(sr *series) {
	h := s.cfg.Cluster
	if h == nil {
		return
	}
	published := false
	for _, v := range sr.versions {
		for _, o := range v.shards {
			if o != nil && o.clusterID() != "" {
				published = true
				o.cluster.id = "" // the whole name goes: no Dropped per shard
			}
		}
	}
	if published {
		uid, name, _ := protocol.SplitOwner(sr.name)
		go h.Deleted(ClusterObject{Owner: uid, Name: name})
	}
}

// clusterObjectLocked finds the object or shard a cluster call names.
func (s *Store) clusterObjectLocked(qname string, version uint64, shard uint32) *object {
	e := s.lookupLocked(qname)
	switch {
	case version == 0 && e.is(kindObject):
		return e.obj
	case version != 0 && e.is(kindSeries):
		if v := e.ser.versions[version]; v != nil && int(shard) < len(v.shards) {
			return v.shards[shard]
		}
	}
	return nil
}

// publishWait bounds how long Replicas.Lease waits for a publish in progress
// of the object asked for; a directory call is bounded by 2 s by default.
const publishWait = 10 * time.Second

// clusterSealed publishes the cluster-visible object or shard just sealed,
// if it is one. When that fails (etcd away, say), the put fails as a whole:
// a plain object is removed, a shard's pending version aborted (a version
// is visible here only once its cluster publish succeeded, so this holds
// for its last shard too, and its number is free again), so that
// the client can simply put it again, and no node holds a cluster-visible
// object the cluster does not know.
func (ss *session) clusterSealed(ctx context.Context, name string, version uint64, shard uint32) error {
	s := ss.s
	h := s.cfg.Cluster
	if h == nil {
		return nil
	}
	s.mu.Lock()
	o := s.clusterObjectLocked(name, version, shard)
	if o == nil || o.cluster == nil || o.state != stateSealed || o.cluster.id != "" {
		s.mu.Unlock()
		return nil
	}
	co := o.clusterObject()
	published := make(chan struct{})
	o.cluster.publishing = published
	defer func() {
		s.mu.Lock()
		o.cluster.publishing = nil
		s.mu.Unlock()
		close(published)
	}()
	var merr error
	if m := o.manifest; m != nil && m.f != nil {
		// Sealed (immutable) and at most MaxClusterManifest bytes.
		co.Manifest = make([]byte, m.size)
		if _, merr = m.f.ReadAt(co.Manifest, 0); merr != nil {
			merr = fmt.Errorf("manifest of %q: read: %w", name, merr)
		}
	}
	s.mu.Unlock()
	id, err := "", merr
	if err == nil {
		id, err = h.Sealed(ctx, co)
	}
	if err != nil {
		s.mu.Lock()
		undone, plain := false, false
		switch {
		case o.state != stateSealed || o.cluster.id != "":
		case o.ver == nil:
			plain = true
		case !o.ver.visible():
			v := o.ver
			s.abortVersionLocked(v)
			v.s.unopenLocked(v.n)
			undone = true
		}
		s.mu.Unlock()
		if plain {
			undone = ss.delete(name) == nil
		}
		if undone {
			return fmt.Errorf("object %q was not published to the cluster, so it was not kept: put it again: %w", name, err)
		}
		return fmt.Errorf("object %q is sealed on this node but not published to the cluster: %w", name, err)
	}
	s.mu.Lock()
	if o.state == stateSealed {
		o.cluster.id = id
		// A version is published here once the cluster has all its shards
		// this node wrote (readyLocked).
		if v := o.ver; v != nil && !v.visible() && v.readyLocked() {
			s.publishLocked(v)
		}
	}
	s.mu.Unlock()
	return nil
}

// ClusterFile is a cluster-visible object's memory as the cluster side of
// the daemon reads or writes it: its host arena's memfd (File: the caller
// closes it) and where the object lies in it; or, for an object in GPU
// memory, GPU (File is nil), which the daemon copies to and from.
type ClusterFile struct {
	File *os.File
	GPU  *ClusterGPU
	// ArenaID names the arena for the life of the store; ArenaSize is its
	// size, Offset and Size the object's range in it.
	ArenaID         uint64
	ArenaSize       int64
	Offset, Size    int64
	release, commit func() error
	detach          func() bool
	ss              *session
}

// Detach gives up the name of a replica made by Replicas.Create that will
// not be sealed, while its memory stays until Release: peers still
// reading what it holds read it, and a new replica of the name can be
// made meanwhile. Subscribers are told of its abort now. A shard's replica
// detaches when it is its version's only shard made here (the version goes
// with it); one beside other shards stays its version's until Release, as
// its abort then frees them all. Detach reports whether it detached. Seal
// fails after it.
func (f *ClusterFile) Detach() bool {
	if f.detach == nil || f.ss == nil {
		return false
	}
	ok := f.detach()
	if ok {
		f.commit = nil
	}
	return ok
}

// ClusterGPU is where a cluster-visible object lies in GPU memory that the
// daemon allocated: valid until the ClusterFile is released.
type ClusterGPU struct {
	Device *cudaipc.Device
	Ptr    cudaipc.DevicePtr
}

// gpuMemoryAt returns where placement p lies in GPU memory, or nil for
// host memory (or a GPU seam without device pointers). The placement's
// session holds the arena, so the address stays valid while it lives.
func (s *Store) gpuMemoryAt(p placement) *ClusterGPU {
	s.mu.Lock()
	defer s.mu.Unlock()
	d := s.devices[p.device]
	if d == nil || p.device == hostDevice {
		return nil
	}
	a, ok := d.arenas[p.arenaID].(*gpuArena)
	if !ok {
		return nil
	}
	m, ok := a.mem.(interface {
		Device() *cudaipc.Device
		Ptr() cudaipc.DevicePtr
	})
	if !ok {
		return nil
	}
	return &ClusterGPU{Device: m.Device(), Ptr: m.Ptr() + cudaipc.DevicePtr(p.offset)}
}

// Release ends a read (Replicas.Lease) or aborts an unsealed replica
// (Replicas.Create). It is idempotent.
func (f *ClusterFile) Release() {
	if f.ss == nil {
		return
	}
	if f.release != nil {
		_ = f.release()
	}
	f.ss.close(errors.New("cluster access done"))
	f.ss = nil
}

// Seal seals a replica made by Replicas.Create: it becomes an ordinary sealed
// local object (or shard: its version is published here once all its
// shards are), cluster-visible, of incarnation id. Release it afterwards.
func (f *ClusterFile) Seal() error {
	if f.commit == nil || f.ss == nil {
		return errors.New("store: seal of a cluster read or of a released replica")
	}
	err := f.commit()
	f.commit, f.release = nil, nil
	return err
}

// Lease gives the cluster side of the daemon read access to owner's
// sealed cluster-visible object name (version 0) or shard of a version, of
// incarnation id ("" for any), and returns its arena's read-only memfd. A
// plain object or a shard of a published version is leased by the daemon
// itself until Release, so it is neither evicted nor its memory reused;
// a shard of a version not yet published (its other shards are being
// written) cannot be evicted either. An object in GPU memory comes as
// ClusterFile.GPU. It fails with ErrNotFound when there is no such
// object.
func (rp *Replicas) Lease(owner uint32, name string, version uint64, shard uint32, id string) (*ClusterFile, error) {
	s := rp.s
	qname := protocol.QualifiedName(owner, name)
	ss, err := s.newSession(context.Background(), peer{uid: owner})
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	o := s.clusterObjectLocked(qname, version, shard)
	// The directory shows an incarnation as soon as its publish wrote it, a
	// moment before clusterSealed sets its id: a reader woken by that
	// write waits for the publish to end (bounded), not a refusal.
	if o != nil && o.cluster != nil && id != "" && o.cluster.id == "" && o.cluster.publishing != nil {
		published := o.cluster.publishing
		s.mu.Unlock()
		select {
		case <-published:
		case <-time.After(publishWait):
		}
		s.mu.Lock()
		o = s.clusterObjectLocked(qname, version, shard)
	}
	if o == nil || o.cluster == nil || o.state != stateSealed || (id != "" && o.cluster.id != id) {
		s.mu.Unlock()
		ss.close(errors.New("cluster read refused"))
		return nil, fmt.Errorf("cluster object %q version %d shard %d (incarnation %s): %w", qname, version, shard, id, ErrNotFound)
	}
	var p placement
	leased := o.ver == nil || o.ver.visible()
	if !leased {
		p, err = ss.placeLocked(o, false)
	}
	s.mu.Unlock()
	if leased {
		p, err = ss.tryGet(qname, versionSel{version: version, shard: shard})
	}
	var gpu *ClusterGPU
	if err == nil && p.kind != storev1.Placement_HOST {
		// The session holds the arena (placeLocked), so gpu stays valid
		// until Release.
		p.closeShare()
		if gpu = s.gpuMemoryAt(p); gpu == nil {
			err = invalidf("cluster object %q is in GPU memory this daemon cannot copy from", qname)
		}
		p.share = nil
	}
	if err == nil && gpu == nil && (p.share == nil || p.share.file == nil) {
		err = fmt.Errorf("%w: no arena descriptor for %q", protocol.ErrInternal, qname)
	}
	if err != nil {
		ss.close(errors.New("cluster read failed"))
		return nil, err
	}
	f := clusterFile(ss, p, gpu)
	if leased {
		lease := p.leaseID
		f.release = func() error { return ss.release(lease) }
	}
	return f, nil
}

// Create makes an unsealed object for a replica of obj (a plain
// object, or a shard of a version) pulled from another node, and returns
// its arena's read-write memfd for the pull to write through; a replica of
// a GPU object goes on this daemon's first GPU where it has one, returned
// as ClusterFile.GPU.
// Seal makes it an ordinary sealed local object, cluster-visible; Release
// before Seal removes it.
func (rp *Replicas) Create(obj ClusterObject) (*ClusterFile, error) {
	s := rp.s
	qname := protocol.QualifiedName(obj.Owner, obj.Name)
	r := createReq{name: qname, size: obj.Size, shared: obj.Shared, cluster: true}
	if obj.Version != 0 {
		r.versioned, r.version, r.shard, r.shards, r.keep = true, obj.Version, obj.Shard, obj.Shards, obj.Keep
	}
	return s.createClusterDraft(obj.Owner, r, obj.GPU, obj.Manifest, fmt.Sprintf("replica %q", qname), func(ss *session, o *object) {
		o.cluster.id = obj.ID
		ss.sealLocked(o)
		// Slices of older versions, and of this shard, are of no use
		// any more.
		s.dropSlicesLocked(qname, func(sl *sliceOf) bool {
			return sl.version < obj.Version || sl.version == obj.Version && sl.shard == obj.Shard
		})
	})
}

// createClusterDraft makes the unsealed object r, in a session of owner,
// that the cluster side fills (a replica, a slice): in host memory it
// returns its arena's read-write memfd, in GPU memory (on this daemon's
// first GPU, where gpu asks and it has one) the address the daemon copies
// to. manifest, where there is one, is written into the object's manifest
// descriptor; what names the object in errors. The ClusterFile's Seal
// finishes the manifest and calls seal, under the store's lock, with the
// draft to seal.
func (s *Store) createClusterDraft(owner uint32, r createReq, gpu bool, manifest []byte, what string, seal func(*session, *object)) (*ClusterFile, error) {
	ss, err := s.newSession(context.Background(), peer{uid: owner})
	if err != nil {
		return nil, err
	}
	r.manifestSize = int64(len(manifest))
	if b, ok := s.backend.(*cudaBackend); ok && gpu && len(b.uuids) > 0 {
		r.device = b.uuids[0]
	}
	p, _, err := ss.create(r)
	var mem *ClusterGPU
	if err == nil && p.kind != storev1.Placement_HOST {
		// The arena's descriptor (vmm-fd) is not needed: the daemon copies
		// into the GPU memory itself. The manifest's is, below.
		if p.share != nil && p.share.file != nil {
			p.share.file.Close()
		}
		p.share = nil
		if mem = s.gpuMemoryAt(p); mem == nil {
			err = fmt.Errorf("%w: %s is in GPU memory this daemon cannot copy to", protocol.ErrInternal, what)
		}
	}
	if err == nil && mem == nil && (p.share == nil || p.share.file == nil) {
		err = fmt.Errorf("%w: no arena descriptor for %s", protocol.ErrInternal, what)
	}
	if err == nil && len(manifest) > 0 {
		if p.manifest == nil {
			err = fmt.Errorf("%w: no manifest descriptor for %s", protocol.ErrInternal, what)
		} else if _, err = p.manifest.WriteAt(manifest, 0); err != nil {
			err = fmt.Errorf("%s: write its manifest: %w", what, err)
		}
	}
	if p.manifest != nil {
		p.manifest.Close()
		p.manifest = nil
	}
	if err != nil {
		p.closeShare()
		ss.close(fmt.Errorf("%s not made", what))
		return nil, err
	}
	f := clusterFile(ss, p, mem)
	f.detach = func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		o, err := ss.draftLocked(r.name, r.version, r.shard)
		return err == nil && s.detachLocked(o)
	}
	f.commit = func() error {
		s.mu.Lock()
		o, err := ss.draftLocked(r.name, r.version, r.shard)
		if err == nil && o.manifest != nil && !o.manifest.sealed {
			// As seal does: the manifest is sealed and checked against the
			// object, outside the lock (only this session seals o).
			s.mu.Unlock()
			err = o.manifest.finish(o.size, &s.manifests)
			s.mu.Lock()
			if err == nil {
				o, err = ss.draftLocked(r.name, r.version, r.shard)
			}
		}
		defer s.mu.Unlock()
		if err == nil {
			seal(ss, o)
		}
		return err
	}
	return f, nil
}

// clusterFile is the ClusterFile of placement p in session ss: gpu where
// it lies in GPU memory, else its arena's descriptor.
func clusterFile(ss *session, p placement, gpu *ClusterGPU) *ClusterFile {
	f := &ClusterFile{GPU: gpu, ArenaID: p.arenaID, ArenaSize: p.arenaSize, Offset: p.offset, Size: p.size, ss: ss}
	if gpu == nil {
		f.File = p.share.file
	}
	return f
}

// Drop removes owner's cluster-visible name from this node (the
// cluster deleted it): a plain object of incarnation id ("" for any), or a
// versioned name with all its versions when one of its shards is of
// incarnation id (or id is ""), as its owner's delete would, without
// telling the cluster again: a name created again here since the cluster
// deleted it stays. Leases held keep the memory until they
// end; its partial replicas (slice.go) go too. It reports whether there
// was such a name or slice.
func (rp *Replicas) Drop(owner uint32, name, id string) bool {
	s := rp.s
	qname := protocol.QualifiedName(owner, name)
	ss, err := s.newSession(context.Background(), peer{uid: owner})
	if err != nil {
		return false
	}
	defer ss.close(errors.New("cluster drop done"))
	s.mu.Lock()
	// Its partial replicas go with it (of incarnation id, or all).
	ok := s.dropSlicesLocked(qname, func(sl *sliceOf) bool { return id == "" || sl.id == id }) > 0
	e := s.lookupLocked(qname)
	whole := false
	switch {
	case e.is(kindObject):
		whole = e.obj.cluster != nil && e.obj.state == stateSealed && (id == "" || e.obj.cluster.id == id)
		if whole {
			e.obj.cluster.id = "" // the cluster knows
		}
	case e.is(kindSeries):
		for _, v := range e.ser.versions {
			for _, o := range v.shards {
				if o != nil && o.cluster != nil && (id == "" || o.cluster.id == id) {
					whole = true
				}
			}
		}
		for _, v := range e.ser.versions {
			for _, o := range v.shards {
				if whole && o != nil && o.cluster != nil {
					o.cluster.id = ""
				}
			}
		}
	}
	s.mu.Unlock()
	if !whole {
		return ok
	}
	return ss.delete(qname) == nil || ok
}

// Retire retires this node's versions up to and including below
// of owner's cluster-visible versioned name (the cluster committed a
// version whose keep_last leaves them out), as local retention retires
// versions beyond keep_last: a version no lease holds goes now, a leased
// one stays readable by its leases until the last ends; either way this
// node withdraws as its holder at once. A version of the name sealed here
// later at or below below is retired as soon as it is published. It
// reports how many versions it retired.
func (rp *Replicas) Retire(owner uint32, name string, below uint64) int {
	s := rp.s
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.lookupLocked(protocol.QualifiedName(owner, name))
	if !e.is(kindSeries) || !e.ser.clusterLocked() {
		return 0
	}
	sr := e.ser
	sr.floor = max(sr.floor, below)
	n := 0
	for _, v := range sr.versions {
		if v.visible() && !v.retired() && v.n <= sr.floor {
			s.retireVersionLocked(v)
			n++
		}
	}
	if n > 0 {
		s.log.Debug("versions retired by the cluster's keep_last", "name", sr.name, "up to", sr.floor, "versions", n)
	}
	return n
}

// clusterLocked reports whether sr is cluster-visible: any of its shards
// here is.
func (sr *series) clusterLocked() bool {
	for _, v := range sr.versions {
		for _, o := range v.shards {
			if o != nil && o.cluster != nil {
				return true
			}
		}
	}
	return false
}

// clusterCreateOK says whether a create may be cluster-visible: the daemon
// must be part of a cluster; objects in host or GPU memory, bundles among
// them with a manifest of at most MaxClusterManifest bytes (it travels in
// the directory record); no-copy versions stay local.
func (s *Store) clusterCreateOK(r createReq, _ string) error {
	switch {
	case s.cfg.Cluster == nil:
		return invalidf("object %q: cluster-visible, but this daemon is not part of a cluster (serve --cluster)", r.name)
	case r.sourcesSize > 0:
		return invalidf("object %q: no-copy versions are not cluster-visible yet", r.name)
	case r.manifestSize > MaxClusterManifest:
		return invalidf("object %q: a cluster-visible bundle's manifest is at most %d bytes (this one %d): split the bundle", r.name, MaxClusterManifest, r.manifestSize)
	}
	return nil
}

// fetchAndGrant answers a get of something this node lacks on a daemon in
// a cluster: the cluster makes it local before the get's deadline
// (makeLocal), then the get goes on as any get does (waitAndGrant):
// granted, failed at once, or waiting what is left of its timeout. A get
// that names tensors of a bundle may be granted a partial replica of just
// those instead.
func (cn *conn) fetchAndGrant(id uint64, name string, sel versionSel, timeoutMs int64, tensors []string) {
	wait := timeoutMs != 0
	ctx, cancel := context.WithTimeout(cn.ss.ctx, DefaultClusterFetchTimeout)
	if wait {
		cancel()
		ctx, cancel = cn.getContext(timeoutMs)
	}
	defer cancel()
	var err error
	for try := 0; try < 2; try++ {
		var slice string
		slice, err = cn.makeLocal(ctx, name, sel, wait, tensors)
		if err != nil || slice == "" || cn.ss.ctx.Err() != nil {
			break
		}
		if cn.grantNow(id, slice, versionSel{}) {
			return
		}
		// Evicted or dropped between its seal and this lease: pull it
		// again, once.
		err = fmt.Errorf("the partial replica of %q was evicted twice before it could be leased: free memory on this node", name)
	}
	if cn.ss.ctx.Err() != nil {
		return
	}
	if err != nil && !errors.Is(err, ErrNotFound) {
		cn.log.Info("cluster fetch failed", "name", name, "err", err)
		if !keepsCode(err) {
			err = fmt.Errorf("%w: %v", protocol.ErrInternal, err)
		}
		cn.reply("get", protocol.ErrorResponse(id, err), nil)
		return
	}
	// Nothing here either, after a NOT_FOUND: the cluster's error says why
	// (not in the directory, or recorded with no live holder).
	cn.waitAndGrant(ctx, id, name, sel, wait, err)
}

// makeLocal has the cluster hook make what a get of name asks for local
// (ClusterHook.Fetch, or FetchTensors where the get names tensors: slice
// is then the partial replica made, if any) until ctx ends. For a get
// that waits, a local seal that makes the name readable ends it early.
func (cn *conn) makeLocal(ctx context.Context, name string, sel versionSel, wait bool, tensors []string) (slice string, err error) {
	if wait {
		var stop context.CancelFunc
		ctx, stop = context.WithCancel(ctx)
		sealed := make(chan struct{})
		go func() {
			defer close(sealed)
			// Readable here, or the get fails here (a limit): either way
			// the cluster need not make it local.
			if err := cn.ss.waitReady(ctx, name, sel); err == nil || ctx.Err() == nil {
				stop()
			}
		}()
		defer func() {
			stop()
			<-sealed
		}()
	}
	owner, bare, _ := protocol.SplitOwner(name)
	cg := ClusterGet{Version: sel.version, Shard: sel.shard, NewerThan: sel.newerThan, Wait: wait, Tensors: tensors}
	if len(tensors) == 0 {
		return "", cn.s.cfg.Cluster.Fetch(ctx, cn.ss.peer.uid, owner, bare, cg)
	}
	return cn.s.cfg.Cluster.FetchTensors(ctx, cn.ss.peer.uid, owner, bare, cg)
}

// keepsCode reports whether a failed cluster fetch reaches the reader with
// its own code: UNAVAILABLE (the directory or every holder unreachable:
// retry), DATA_LOSS (a record or the bytes do not verify), STORE_FULL (a
// replica that did not fit here: the reader may free room), LIMIT, and
// INVALID (a tensor the bundle lacks). Every other failure is INTERNAL, so
// that a code the get cannot mean (EXISTS from a replica's name, say) does
// not reach the reader.
func keepsCode(err error) bool {
	for _, s := range []error{protocol.ErrUnavailable, protocol.ErrDataLoss, ErrStoreFull, protocol.ErrLimit, ErrInvalid} {
		if errors.Is(err, s) {
			return true
		}
	}
	return false
}

// Has reports whether this node holds a sealed copy of owner's
// cluster-visible object name (version 0) or shard of a version, published
// or not: a shard this node published of a version whose other shards come
// from other nodes is one.
func (rp *Replicas) Has(owner uint32, name string, version uint64, shard uint32) bool {
	s := rp.s
	s.mu.Lock()
	defer s.mu.Unlock()
	o := s.clusterObjectLocked(protocol.QualifiedName(owner, name), version, shard)
	return o != nil && o.cluster != nil && o.state == stateSealed
}
