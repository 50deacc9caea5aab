package store

import (
	"fmt"
	"strconv"

	"github.com/cudaipc/cudaipc/protocol"
)

// Partial replicas. A get that names some tensors of a cluster bundle this
// node does not hold (GetRequest.tensors) is answered, when the cluster
// hook chooses to (ClusterHook.FetchTensors), with a slice: an object of
// its own holding only those tensors, laid out anew, with a manifest of
// just them. A slice is an ordinary object of the name table (memory,
// quota, eviction, leases) under a name no client can send or create (the
// bundle's name, a NUL, then what it is a slice of), so that a get, stat or
// list of the bundle's name never finds it: no reader sees a slice as the
// whole bundle. It is not cluster-visible (no node reads from it), its
// events are not sent, and list and stat do not show it; its leases carry
// ObjectInfo.partial with the bundle's name, version and shard.

// ClusterSlice describes a partial replica for CreateSlice.
type ClusterSlice struct {
	// Of is the bundle the tensors are of: its owner, name, sharing,
	// version, shard and shard count, and cluster incarnation ID (a slice
	// of a name deleted and put again is another slice).
	Of ClusterObject
	// Key says which tensors it holds: the same tensors, in any order,
	// must give the same key. At most 64 bytes.
	Key string
	// Size is the slice's size, Manifest its manifest (a bundle's header
	// bytes, checked against Size at its seal).
	Size     int64
	Manifest []byte
}

// sliceOf is what a partial replica is a slice of.
type sliceOf struct {
	bundle  string // the bundle's qualified name
	id      string // its cluster incarnation
	version uint64
	shard   uint32
	shards  uint32
}

// maxSliceKey bounds ClusterSlice.Key.
const maxSliceKey = 64

// sliceName is the name-table key of a slice: it starts with the bundle's
// qualified name and a NUL, which no client's name contains.
func sliceName(sl ClusterSlice) string {
	q := protocol.QualifiedName(sl.Of.Owner, sl.Of.Name)
	return q + "\x00" + strconv.FormatUint(sl.Of.Version, 10) + "/" + strconv.FormatUint(uint64(sl.Of.Shard), 10) + "/" + sl.Of.ID + "/" + sl.Key
}

// CreateSlice returns the name of the sealed partial replica sl if this
// node has it (f nil), or makes it: an unsealed object of sl.Size with
// sl.Manifest, owned and shared as the bundle, in host memory, whose
// arena's read-write memfd f the caller fills, or, for a slice of a GPU
// bundle, on this daemon's first GPU where it has one (f.GPU, as
// Replicas.Create); f.Seal makes it leasable under name
// (ClusterHook.FetchTensors returns it), f.Release before Seal removes it.
// While one is being filled, another CreateSlice of it fails with
// ErrExists.
func (rp *Replicas) CreateSlice(sl ClusterSlice) (name string, f *ClusterFile, err error) {
	s := rp.s
	if sl.Key == "" || len(sl.Key) > maxSliceKey {
		return "", nil, invalidf("slice key of %d bytes: want 1 to %d", len(sl.Key), maxSliceKey)
	}
	name = sliceName(sl)
	bundleName := protocol.QualifiedName(sl.Of.Owner, sl.Of.Name)
	s.mu.Lock()
	if e := s.lookupLocked(name); e.is(kindObject) && e.obj.state == stateSealed && e.obj.slice != nil {
		s.mu.Unlock()
		return name, nil, nil
	}
	s.mu.Unlock()
	r := createReq{name: name, size: sl.Size, shared: sl.Of.Shared,
		slice: &sliceOf{bundle: bundleName, id: sl.Of.ID, version: sl.Of.Version, shard: sl.Of.Shard, shards: sl.Of.Shards}}
	// A slice of a GPU bundle goes where Replicas.Create puts a replica of
	// the whole.
	f, err = s.createClusterDraft(sl.Of.Owner, r, sl.Of.GPU, sl.Manifest, fmt.Sprintf("a slice of %q", bundleName), func(ss *session, o *object) {
		ss.sealLocked(o)
	})
	if err != nil {
		return "", nil, err
	}
	s.mu.Lock()
	s.dropSlicesLocked(bundleName, func(*sliceOf) bool { return false }) // forgets evicted ones
	s.slices[bundleName] = append(s.slices[bundleName], name)
	s.mu.Unlock()
	return name, f, nil
}

// DropSlices removes owner's partial replicas of the versioned bundle name
// whose version is below below (a newer version has come). Leases held
// keep their memory until they end. It returns how many it removed.
func (rp *Replicas) DropSlices(owner uint32, name string, below uint64) int {
	s := rp.s
	bundleName := protocol.QualifiedName(owner, name)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dropSlicesLocked(bundleName, func(sl *sliceOf) bool { return sl.version < below })
}

// dropSlicesLocked removes the slices of the bundle bundleName that drop
// says to, and forgets the names of slices gone otherwise (evicted).
func (s *Store) dropSlicesLocked(bundleName string, drop func(*sliceOf) bool) int {
	names := s.slices[bundleName]
	keep := names[:0]
	n := 0
	for _, name := range names {
		e := s.lookupLocked(name)
		if !e.is(kindObject) || e.obj.slice == nil {
			continue // gone (evicted, or its pull failed)
		}
		o := e.obj
		if o.state != stateSealed || !drop(o.slice) {
			keep = append(keep, name)
			continue
		}
		s.deleteLocked(o, eventDeleted) // no event: a slice's name is the store's own
		n++
	}
	if len(keep) == 0 {
		delete(s.slices, bundleName)
	} else {
		s.slices[bundleName] = keep
	}
	return n
}

// Slices returns how many partial replicas this node keeps (sealed or
// being filled), for tests and metrics.
func (rp *Replicas) Slices() int {
	s := rp.s
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, names := range s.slices {
		for _, name := range names {
			if e := s.lookupLocked(name); e.is(kindObject) && e.obj.slice != nil {
				n++
			}
		}
	}
	return n
}
