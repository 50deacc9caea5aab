package store

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"time"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// ClusterHook connects the store to a cluster of daemons (package
// cluster/node implements it). The store calls it where its own name
// table ends: a get that finds nothing (Fetch), a cluster-visible object
// sealed (Sealed), deleted by its owner (Deleted) or gone otherwise
// (Dropped). Its methods are called without the store's lock held.
type ClusterHook interface {
	// Fetch is called when a get of owner's name by uid reader finds
	// nothing the reader may read here. It returns nil once a sealed local
	// replica is there (the get then leases it), an error wrapping
	// ErrNotFound when the cluster has nothing under that name either (the
	// get goes on as without a cluster), or another error, which the get
	// returns. ctx bounds it.
	Fetch(ctx context.Context, reader, owner uint32, name string) error
	// Sealed is called when the cluster-visible object obj was sealed on
	// this node, before the seal is answered: it publishes the object and
	// returns its cluster incarnation id, or why it could not.
	Sealed(ctx context.Context, obj ClusterObject) (id string, err error)
	// Deleted is called after the owner deleted a cluster-visible object on
	// this node: the name goes from the cluster.
	Deleted(obj ClusterObject)
	// Dropped is called after a cluster-visible object left this node
	// otherwise (evicted, or removed because the cluster deleted it): the
	// node no longer holds it.
	Dropped(obj ClusterObject)
}

// ClusterObject names a cluster-visible object of this node.
type ClusterObject struct {
	Owner  uint32
	Name   string // in the owner's namespace, without "UID:"
	Size   int64
	Shared bool
	// ID is its cluster incarnation id ("" until published).
	ID string
}

// DefaultClusterFetchTimeout bounds a get's cluster fetch when the get
// itself does not wait.
const DefaultClusterFetchTimeout = 2 * time.Minute

func (o *object) clusterObject() ClusterObject {
	uid, name, _ := protocol.SplitOwner(o.name)
	return ClusterObject{Owner: uid, Name: name, Size: o.size, Shared: o.shared, ID: o.clusterID}
}

// clusterGoneLocked tells the hook that the cluster-visible object o left
// this node: deleted by its owner (the cluster name goes) or not.
func (s *Store) clusterGoneLocked(o *object, deleted bool) {
	h := s.cfg.Cluster
	if h == nil || !o.cluster || !o.sealed || o.clusterID == "" || o.ver != nil {
		return
	}
	co := o.clusterObject()
	o.clusterID = "" // told once
	if deleted {
		go h.Deleted(co)
	} else {
		go h.Dropped(co)
	}
}

// clusterSealed publishes the cluster-visible object just sealed under
// name (qualified), if it is one.
func (ss *session) clusterSealed(ctx context.Context, name string) error {
	s := ss.s
	h := s.cfg.Cluster
	if h == nil {
		return nil
	}
	s.mu.Lock()
	e := s.lookupLocked(name)
	if !e.is(kindObject) || !e.obj.cluster || !e.obj.sealed || e.obj.clusterID != "" {
		s.mu.Unlock()
		return nil
	}
	o := e.obj
	co := o.clusterObject()
	s.mu.Unlock()
	id, err := h.Sealed(ctx, co)
	if err != nil {
		return fmt.Errorf("object %q is sealed on this node but not published to the cluster: %w", name, err)
	}
	s.mu.Lock()
	if !o.deleted {
		o.clusterID = id
	}
	s.mu.Unlock()
	return nil
}

// ClusterFile is a cluster-visible object's memory as the cluster side of
// the daemon reads or writes it: its host arena's memfd (File: the caller
// closes it) and where the object lies in it.
type ClusterFile struct {
	File *os.File
	// ArenaID names the arena for the life of the store; ArenaSize is its
	// size, Offset and Size the object's range in it.
	ArenaID         uint64
	ArenaSize       int64
	Offset, Size    int64
	release, commit func() error
	ss              *session
}

// Release ends a read (LeaseCluster) or aborts an unsealed replica
// (CreateReplica). It is idempotent.
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

// Seal seals a replica made by CreateReplica: it becomes an ordinary sealed
// local object, cluster-visible, of incarnation id. Release it afterwards.
func (f *ClusterFile) Seal() error {
	if f.commit == nil || f.ss == nil {
		return errors.New("store: seal of a cluster read or of a released replica")
	}
	err := f.commit()
	f.commit, f.release = nil, nil
	return err
}

// LeaseCluster takes a daemon-side lease on owner's sealed cluster-visible
// object name of incarnation id ("" for any), which keeps it from being
// evicted or its memory reused until Release, and returns its arena's
// read-only memfd. It fails with ErrNotFound when there is no such object.
func (s *Store) LeaseCluster(owner uint32, name, id string) (*ClusterFile, error) {
	qname := protocol.QualifiedName(owner, name)
	ss, err := s.newSession(context.Background(), peer{uid: owner})
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	e := s.lookupLocked(qname)
	if !e.is(kindObject) || !e.obj.cluster || !e.obj.sealed || (id != "" && e.obj.clusterID != id) {
		s.mu.Unlock()
		ss.close(errors.New("cluster read refused"))
		return nil, fmt.Errorf("cluster object %q (incarnation %s): %w", qname, id, ErrNotFound)
	}
	s.mu.Unlock()
	p, err := ss.tryGet(qname, versionSel{})
	if err == nil && p.kind != storev1.Placement_HOST {
		p.closeShare()
		err = invalidf("cluster object %q is not in host memory", qname)
	}
	if err == nil && (p.share == nil || p.share.file == nil) {
		err = fmt.Errorf("%w: no arena descriptor for %q", protocol.ErrInternal, qname)
	}
	if err != nil {
		ss.close(errors.New("cluster read failed"))
		return nil, err
	}
	f := &ClusterFile{File: p.share.file, ArenaID: p.arenaID, ArenaSize: p.arenaSize, Offset: p.offset, Size: p.size, ss: ss}
	lease := p.leaseID
	f.release = func() error { return ss.release(lease) }
	return f, nil
}

// CreateReplica makes an unsealed host object for a replica of owner's
// cluster object name pulled from another node, and returns its arena's
// read-write memfd for the pull to write through. Seal makes it an
// ordinary sealed local object, cluster-visible; Release before Seal
// removes it.
func (s *Store) CreateReplica(owner uint32, name string, size int64, shared bool, id string) (*ClusterFile, error) {
	qname := protocol.QualifiedName(owner, name)
	ss, err := s.newSession(context.Background(), peer{uid: owner})
	if err != nil {
		return nil, err
	}
	p, _, err := ss.create(createReq{name: qname, size: size, shared: shared, cluster: true})
	if err == nil && (p.share == nil || p.share.file == nil) {
		err = fmt.Errorf("%w: no arena descriptor for replica %q", protocol.ErrInternal, qname)
	}
	if err != nil {
		ss.close(errors.New("replica not made"))
		return nil, err
	}
	f := &ClusterFile{File: p.share.file, ArenaID: p.arenaID, ArenaSize: p.arenaSize, Offset: p.offset, Size: p.size, ss: ss}
	f.commit = func() error {
		s.mu.Lock()
		o, err := ss.draftLocked(qname, 0, 0)
		if err == nil {
			o.clusterID = id
			ss.sealLocked(o)
		}
		s.mu.Unlock()
		return err
	}
	return f, nil
}

// DropCluster removes owner's cluster-visible object name of incarnation id
// ("" for any) from this node (the cluster deleted it), as its owner's delete would,
// without telling the cluster again. Leases held keep its memory until they
// end. It reports whether there was such an object.
func (s *Store) DropCluster(owner uint32, name, id string) bool {
	qname := protocol.QualifiedName(owner, name)
	ss, err := s.newSession(context.Background(), peer{uid: owner})
	if err != nil {
		return false
	}
	defer ss.close(errors.New("cluster drop done"))
	s.mu.Lock()
	e := s.lookupLocked(qname)
	ok := e.is(kindObject) && e.obj.cluster && e.obj.sealed && (id == "" || e.obj.clusterID == id)
	if ok {
		e.obj.clusterID = "" // the cluster knows
	}
	s.mu.Unlock()
	if !ok {
		return false
	}
	return ss.delete(qname) == nil
}

// clusterCreateOK says whether a create may be cluster-visible: the daemon
// must be part of a cluster, and for now such objects are plain host
// objects (UCX reads host memory; GPU objects, versions and bundles do not
// cross nodes yet).
func (s *Store) clusterCreateOK(r createReq, device string) error {
	switch {
	case s.cfg.Cluster == nil:
		return invalidf("object %q: cluster-visible, but this daemon is not part of a cluster (serve --cluster)", r.name)
	case r.versioned || r.manifestSize > 0:
		return invalidf("object %q: versioned names and bundles are not cluster-visible yet: make a plain object", r.name)
	case device != hostDevice:
		return invalidf("object %q: cluster-visible objects live in host memory (device %q)", r.name, device)
	}
	return nil
}

// fetchAndGrant answers a get of a name this node lacks on a daemon in a
// cluster: the hook may pull a replica; then the get goes on as it would
// have (granted, failed at once, or waiting up to timeoutMs).
func (cn *conn) fetchAndGrant(id uint64, name string, timeoutMs int64) {
	ctx := cn.ss.ctx
	var cancel context.CancelFunc
	if timeoutMs > 0 && timeoutMs <= math.MaxInt64/int64(time.Millisecond) {
		ctx, cancel = context.WithTimeout(ctx, time.Duration(timeoutMs)*time.Millisecond)
	} else {
		ctx, cancel = context.WithTimeout(ctx, DefaultClusterFetchTimeout)
	}
	owner, bare, _ := protocol.SplitOwner(name)
	err := cn.s.cfg.Cluster.Fetch(ctx, cn.ss.peer.uid, owner, bare)
	cancel()
	if cn.ss.ctx.Err() != nil {
		return
	}
	if err != nil && !errors.Is(err, ErrNotFound) {
		cn.log.Info("cluster fetch failed", "name", name, "err", err)
		cn.reply("get", protocol.ErrorResponse(id, fmt.Errorf("%w: %v", protocol.ErrInternal, err)), nil)
		return
	}
	if timeoutMs != 0 {
		cn.waitAndGrant(id, name, versionSel{}, timeoutMs)
		return
	}
	cn.order.Lock()
	cn.grant(id, name, versionSel{}, false)
	cn.order.Unlock()
}
