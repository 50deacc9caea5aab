package store

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
	"github.com/cudaipc/cudaipc/store/internal/blocks"
)

// KV block pools (docs/kv.md, "Block pools"; docs/protocol.md section
// 6.10). A pool is a named set of fixed-size blocks in memory of the
// store: its capacity is one allocation of the device's allocator, in an
// arena of its own, charged to its owner's quota when it is made and never
// evicted (pool eviction is of blocks, inside the pool). An index
// (store/internal/blocks) says which key each block slot holds.
//
// The daemon writes blocks (a put copies from registered host memory the
// caller may read, a KV space's regions, which the daemon maps read-only
// while it copies) and readers copy them out of their own read-only
// mapping of the pool's memfd (a get pins the blocks meanwhile). So no
// client ever holds a writable mapping of a pool, and a block is
// immutable from its commit until its slot is reused, which pins prevent
// while anyone reads it.
//
// Locks: Store.mu, then poolTable.mu, then blockPool.mu; poolTable.pinMu
// is taken alone. Lookups and gets take poolTable.mu for reading and the
// pool's lock only, never Store.mu.

// poolTable is the store's pools and the state that goes with them.
type poolTable struct {
	mu     sync.RWMutex
	byName map[string]*blockPool // by qualified name; guarded by mu (and changed under Store.mu too)
	nextID uint64                // guarded by Store.mu

	pinMu sync.Mutex
	pins  map[*session]*sessionPins

	// sources are registered host memory mapped for puts, by registration;
	// guarded by Store.mu.
	sources map[*external]*sourceMap
}

// blockPool is one pool.
type blockPool struct {
	id         uint64
	name       string // qualified
	owner      uint32
	shared     bool
	device     string
	blockBytes int64
	slotBytes  int64
	keyBytes   int
	created    time.Time
	// cluster: the pool is cluster-wide (kvcluster.go); capacity is the
	// capacity it was asked for, which other nodes make theirs with.
	cluster  bool
	capacity int64
	obj      *object // the pool's memory in the device's allocator
	ar       arena
	mem      []byte // the daemon's read-write mapping of the memory
	memSize  int64

	mu    sync.Mutex
	idx   *blocks.Index
	users int  // puts copying into mem
	gone  bool // deleted: its memory goes when users reaches 0
	// counters since it was made
	hits, misses, stored, evictions uint64
}

// sourceMap is registered host memory the daemon mapped read-only for
// puts: kept while the registration's descriptors are, so that a space's
// pages are faulted in once, not at every put.
type sourceMap struct {
	mem   []byte
	users int  // puts copying from it
	dead  bool // its registration dropped its descriptors: unmap at the last user
}

func (p *blockPool) readableBy(uid uint32) bool { return p.shared || p.owner == uid || uid == 0 }
func (p *blockPool) writableBy(uid uint32) bool { return p.owner == uid || uid == 0 }

// info describes p for the client of uid.
func (p *blockPool) info() *storev1.PoolInfo {
	p.mu.Lock()
	st := p.idx.Stats()
	in := &storev1.PoolInfo{
		Name: p.name, OwnerUid: p.owner, Shared: p.shared, Device: p.device, Id: p.id,
		BlockBytes: uint64(p.blockBytes), KeyBytes: uint32(p.keyBytes), SlotBytes: uint64(p.slotBytes),
		CapacityBlocks: uint64(p.idx.Len()), MemorySize: uint64(p.memSize),
		Blocks: uint64(st.Ready), Writing: uint64(st.Writing), Pinned: uint64(st.Pinned),
		Hits: p.hits, Misses: p.misses, Stored: p.stored, Evictions: p.evictions,
		CreatedUnixNano: p.created.UnixNano(), Cluster: p.cluster,
	}
	p.mu.Unlock()
	return in
}

// enter registers a put that copies into p's memory; false when p is gone.
func (p *blockPool) enter() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.gone {
		return false
	}
	p.users++
	return true
}

// leave ends a put's use of p's memory, freeing it after the last put of a
// deleted pool.
func (s *Store) leavePool(p *blockPool) {
	p.mu.Lock()
	p.users--
	last := p.gone && p.users == 0
	p.mu.Unlock()
	if last {
		s.mu.Lock()
		s.freePoolLocked(p)
		s.mu.Unlock()
	}
}

// freePoolLocked unmaps a deleted pool's memory and gives it back to its
// device; clients that mapped it keep their mappings.
func (s *Store) freePoolLocked(p *blockPool) {
	if p.mem == nil {
		return
	}
	if err := unix.Munmap(p.mem); err != nil {
		s.log.Warn("unmapping a KV block pool", "pool", p.name, "err", err)
	}
	p.mem = nil
	if !s.closed { // Close freed every arena
		s.freeLocked(p.obj)
	}
}

// createPool makes the pool r describes, owned by this session's uid.
func (ss *session) createPool(r *storev1.PoolCreateRequest) (*blockPool, error) {
	return ss.s.createPool(ss.peer.uid, r, func() bool { return ss.closed }, ss.log.With("session", ss.id))
}

// createPool makes the pool r describes, owned by uid owner, unless
// closed says (under Store.mu) that its asker went. A cluster-wide pool
// of that name made already, of r's shape, is returned as it is.
func (s *Store) createPool(owner uint32, r *storev1.PoolCreateRequest, closed func() bool, log *slog.Logger) (*blockPool, error) {
	if _, ok := s.cfg.Cluster.(PoolCluster); r.GetCluster() && !ok {
		return nil, invalidf("pool_create: this daemon is not part of a cluster: a cluster-wide pool needs one")
	}
	dev, err := s.backend.device(r.GetDevice())
	if err != nil {
		return nil, err
	}
	if dev != hostDevice {
		return nil, invalidf("pool_create: device %s: KV block pools live in host memory only (the GPU tier is not built)", dev)
	}
	slot := roundUp(int64(r.GetBlockBytes()), protocol.BlockSlotAlign)
	n := min(int64(r.GetCapacity())/slot, protocol.MaxPoolBlocks)
	if n == 0 {
		return nil, invalidf("pool_create: a capacity of %d bytes holds no block of %d bytes (%d with its alignment)", r.GetCapacity(), r.GetBlockBytes(), slot)
	}
	size := roundUp(n*slot, int64(os.Getpagesize()))
	s.mu.Lock()
	defer s.mu.Unlock()
	if closed() {
		return nil, errSessionClosed
	}
	s.pools.mu.RLock()
	old := s.pools.byName[r.GetName()]
	s.pools.mu.RUnlock()
	if old != nil {
		if r.GetCluster() && old.cluster && old.owner == owner && old.blockBytes == int64(r.GetBlockBytes()) &&
			old.keyBytes == int(r.GetKeyBytes()) && old.shared == r.GetShared() {
			return old, nil
		}
		return nil, fmt.Errorf("KV block pool %q: %w", r.GetName(), ErrExists)
	}
	if err := s.objectRoomForLocked(owner); err != nil {
		return nil, err
	}
	d, err := s.deviceLocked(dev)
	if err != nil {
		return nil, err
	}
	s.pools.nextID++
	p := &blockPool{
		id: s.pools.nextID, name: r.GetName(), owner: owner, shared: r.GetShared(), device: dev,
		blockBytes: int64(r.GetBlockBytes()), slotBytes: slot, keyBytes: int(r.GetKeyBytes()), created: time.Now(),
		memSize: size, cluster: r.GetCluster(), capacity: int64(r.GetCapacity()),
	}
	o := &object{name: r.GetName(), size: size, shared: r.GetShared(), owner: owner, created: p.created, dev: d, objKind: objKind{kvpool: p}}
	// No cluster object goes for a pool: the empty vouched map says so.
	b, err := s.allocLocked(d, o, false, map[*object]string{})
	if err != nil {
		return nil, fmt.Errorf("KV block pool %q of %d bytes: %w", r.GetName(), size, err)
	}
	o.block = b
	s.objectMadeLocked(o)
	p.obj = o
	p.ar = d.arenas[b.Arena().ID]
	ha, ok := p.ar.(*hostArena)
	if !ok || b.Offset != 0 {
		s.freeLocked(o)
		return nil, fmt.Errorf("KV block pool %q: not an arena of its own in host memory", r.GetName())
	}
	p.mem, err = unix.Mmap(int(ha.rw.Fd()), 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		s.freeLocked(o)
		return nil, fmt.Errorf("KV block pool %q: mapping its memory: %w", r.GetName(), err)
	}
	p.idx = blocks.New(int(n))
	s.pools.mu.Lock()
	if s.pools.byName == nil {
		s.pools.byName = make(map[string]*blockPool)
	}
	s.pools.byName[p.name] = p
	s.pools.mu.Unlock()
	log.Info("KV block pool created", "pool", p.name, "blocks", n, "block_bytes", p.blockBytes,
		"key_bytes", p.keyBytes, "bytes", size, "shared", p.shared, "cluster", p.cluster)
	return p, nil
}

func roundUp(n, to int64) int64 { return (n + to - 1) / to * to }

// poolFor returns the pool name (qualified) as this session may use it:
// readable, and with write its owner's uid or root. A pool the session
// may not read is ErrNotFound, as an object is.
func (ss *session) poolFor(name string, write bool) (*blockPool, error) {
	return ss.s.poolFor(ss.peer.uid, name, write)
}

// poolFor returns the pool name (qualified) as uid may use it.
func (s *Store) poolFor(uid uint32, name string, write bool) (*blockPool, error) {
	s.pools.mu.RLock()
	p := s.pools.byName[name]
	s.pools.mu.RUnlock()
	switch {
	case p == nil || !p.readableBy(uid):
		return nil, fmt.Errorf("no KV block pool %q: %w", name, ErrNotFound)
	case write && !p.writableBy(uid):
		return nil, fmt.Errorf("KV block pool %q is uid %d's: only its uid and root put, delete and evict blocks: %w", name, p.owner, ErrPermission)
	}
	return p, nil
}

// deletePool removes a pool: its name at once, its memory once no put
// writes into it.
func (ss *session) deletePool(name string) error {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	p, err := ss.poolFor(name, true)
	if err != nil {
		return err
	}
	s.pools.mu.Lock()
	delete(s.pools.byName, name)
	s.pools.mu.Unlock()
	p.mu.Lock()
	p.gone = true
	free := p.users == 0
	p.mu.Unlock()
	if free {
		s.freePoolLocked(p)
	}
	ss.log.Info("KV block pool deleted", "session", ss.id, "pool", name)
	return nil
}

// maxPoolsListed bounds a pool_list page: a PoolInfo takes at most a few
// hundred bytes.
const maxPoolsListed = 128

// listPools returns the pools this session may read after startAfter, in
// qualified name order, and whether more follow.
func (ss *session) listPools(startAfter string) ([]*storev1.PoolInfo, bool) {
	s := ss.s
	s.pools.mu.RLock()
	var ps []*blockPool
	for name, p := range s.pools.byName {
		if name > startAfter && p.readableBy(ss.peer.uid) {
			ps = append(ps, p)
		}
	}
	s.pools.mu.RUnlock()
	slices.SortFunc(ps, func(a, b *blockPool) int { return cmp.Compare(a.name, b.name) })
	more := len(ps) > maxPoolsListed
	ps = ps[:min(len(ps), maxPoolsListed)]
	out := make([]*storev1.PoolInfo, len(ps))
	for i, p := range ps {
		out[i] = p.info()
	}
	return out, more
}

// closePools unmaps every pool's memory (Store.Close frees the arenas).
func (s *Store) closePools() {
	s.pools.mu.Lock()
	defer s.pools.mu.Unlock()
	for name, p := range s.pools.byName {
		p.mu.Lock()
		p.gone = true
		if p.mem != nil && p.users == 0 {
			unix.Munmap(p.mem)
			p.mem = nil
		}
		p.mu.Unlock()
		delete(s.pools.byName, name)
	}
}

// Sources of puts.

// mapSources maps the registered host memory names (qualified) for a put
// of this session's: memory the session's uid may read, registered with
// the space description space when it is not empty. release ends the
// put's use of the mappings.
func (ss *session) mapSources(names []string, space []byte) (mems [][]byte, release func(), err error) {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	var used []*sourceMap
	release = func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		for _, m := range used {
			if m.users--; m.users == 0 && m.dead {
				unix.Munmap(m.mem)
			}
		}
	}
	fail := func(err error) ([][]byte, func(), error) {
		for _, m := range used {
			if m.users--; m.users == 0 && m.dead {
				unix.Munmap(m.mem)
			}
		}
		return nil, nil, err
	}
	for _, name := range names {
		e := s.lookupLocked(name)
		x := e.ext
		switch {
		case !e.is(kindExternal) || !x.readableBy(ss.peer.uid) || x.files == nil:
			return fail(fmt.Errorf("block_put: no registered memory %q to copy from (the space's engine ended or closed it, or it was never registered): %w", name, ErrNotFound))
		case x.device != hostDevice:
			return fail(invalidf("block_put: %q is memory of %s: puts copy from host memory only", name, x.device))
		case len(space) > 0 && !bytes.Equal(space, x.space):
			return fail(fmt.Errorf("block_put: %q is not of the registration the space description names (registered again since): %w", name, ErrNotFound))
		}
		m := s.pools.sources[x]
		if m == nil {
			mem, err := unix.Mmap(int(x.files[0].Fd()), 0, int(x.size), unix.PROT_READ, unix.MAP_SHARED)
			if err != nil {
				return fail(fmt.Errorf("block_put: mapping %q: %w", name, err))
			}
			m = &sourceMap{mem: mem}
			if s.pools.sources == nil {
				s.pools.sources = make(map[*external]*sourceMap)
			}
			s.pools.sources[x] = m
		}
		m.users++
		used = append(used, m)
		mems = append(mems, m.mem)
	}
	return mems, release, nil
}

// forgetSourceLocked unmaps e's memory, mapped for puts, now that its
// registration dropped its descriptors (at the last put's end if one
// copies from it).
func (t *poolTable) forgetSourceLocked(e *external) {
	m := t.sources[e]
	if m == nil {
		return
	}
	delete(t.sources, e)
	m.dead = true
	if m.users == 0 {
		unix.Munmap(m.mem)
	}
}

// Pins.

// maxPinsPerConn bounds the pins one connection holds: each keeps a list
// of its blocks.
const maxPinsPerConn = 1024

// sessionPins are one connection's pins.
type sessionPins struct {
	next uint64
	byID map[uint64]*blockPin
}

// blockPin keeps blocks of a pool from eviction and reuse.
type blockPin struct {
	pool  *blockPool
	slots []int32
	timer *time.Timer // a lookup's pin's timeout; nil for a get's
}

// addPin records a pin of slots of p (pinned in p's index already) for
// this session, ending by itself after timeout when it is not 0. When the
// session has ended, or holds maxPinsPerConn pins, the blocks are unpinned
// and it fails.
func (ss *session) addPin(p *blockPool, slots []int32, timeout time.Duration) (uint64, error) {
	t := &ss.s.pools
	t.pinMu.Lock()
	sp := t.pins[ss]
	var err error
	switch {
	case ss.ctx.Err() != nil:
		err = errSessionClosed
	case sp != nil && len(sp.byID) >= maxPinsPerConn:
		err = protocol.LimitErrorf(storev1.Error_LEASES_PER_CONNECTION,
			"this connection holds %d pins of KV blocks, the most it may: unpin some (a get's pin once its copy is done)", len(sp.byID))
	}
	if err != nil {
		t.pinMu.Unlock()
		p.unpin(slots)
		return 0, err
	}
	if sp == nil {
		sp = &sessionPins{byID: make(map[uint64]*blockPin)}
		if t.pins == nil {
			t.pins = make(map[*session]*sessionPins)
		}
		t.pins[ss] = sp
		context.AfterFunc(ss.ctx, func() { ss.endPins() })
	}
	sp.next++
	id := sp.next
	bp := &blockPin{pool: p, slots: slots}
	if timeout > 0 {
		bp.timer = time.AfterFunc(timeout, func() { ss.unpin(id) })
	}
	sp.byID[id] = bp
	t.pinMu.Unlock()
	return id, nil
}

// unpin ends pin id of this session; ErrNotFound when there is none.
func (ss *session) unpin(id uint64) error {
	t := &ss.s.pools
	t.pinMu.Lock()
	var bp *blockPin
	if sp := t.pins[ss]; sp != nil {
		bp = sp.byID[id]
		delete(sp.byID, id)
	}
	t.pinMu.Unlock()
	if bp == nil {
		return fmt.Errorf("no pin %d on this connection (unpinned already, or its timeout passed): %w", id, ErrNotFound)
	}
	if bp.timer != nil {
		bp.timer.Stop()
	}
	bp.pool.unpin(bp.slots)
	return nil
}

// endPins ends every pin of a session that ended.
func (ss *session) endPins() {
	t := &ss.s.pools
	t.pinMu.Lock()
	sp := t.pins[ss]
	delete(t.pins, ss)
	t.pinMu.Unlock()
	if sp == nil {
		return
	}
	for _, bp := range sp.byID {
		if bp.timer != nil {
			bp.timer.Stop()
		}
		bp.pool.unpin(bp.slots)
	}
}

func (p *blockPool) unpin(slots []int32) {
	p.mu.Lock()
	p.idx.Unpin(slots)
	p.mu.Unlock()
}

// Bulk files (docs/protocol.md section 6.10).

// checkBulk checks that a request's bulk file is a memfd: the daemon
// reads and writes it with pread and pwrite, which on a memfd never block
// on a device or a network.
func checkBulk(f *os.File) error {
	if _, err := unix.FcntlInt(f.Fd(), unix.F_GET_SEALS, 0); err != nil {
		return invalidf("the bulk file is not a memfd (%v)", err)
	}
	return nil
}

// bulkBufs are buffers for arrays read from bulk files: a lookup of 10⁴
// keys reads 320 KB, which a fresh allocation would zero and the garbage
// collector would chase at every call.
var bulkBufs sync.Pool

// readBlob returns a request's array: inline, or read from the bulk file
// into a buffer that done gives back (call it once the array is not used
// any more).
func readBlob(what string, b *storev1.Blob, bulk *os.File) (data []byte, done func(), err error) {
	if bulk == nil {
		return b.GetData(), func() {}, nil
	}
	n := int(b.GetLength())
	bp, _ := bulkBufs.Get().(*[]byte)
	if bp == nil || cap(*bp) < n {
		buf := make([]byte, n)
		bp = &buf
	}
	buf := (*bp)[:n]
	done = func() { bulkBufs.Put(bp) }
	if got, err := bulk.ReadAt(buf, int64(b.GetOffset())); got < n {
		done()
		return nil, nil, invalidf("%s: %d bytes at %d of the bulk file: got %d (%v)", what, n, b.GetOffset(), got, err)
	}
	return buf, done, nil
}

// writeBlob returns a response's array: inline, or written into the bulk
// file at at.
func writeBlob(what string, data []byte, bulk *os.File, at uint64) (*storev1.Blob, error) {
	if bulk == nil {
		return &storev1.Blob{Data: data}, nil
	}
	if uint64(len(data)) > protocol.MaxBulkSize || at > protocol.MaxBulkSize-uint64(len(data)) {
		return nil, invalidf("%s: %d bytes at %d would pass %d bytes of the bulk file", what, len(data), at, protocol.MaxBulkSize)
	}
	if _, err := bulk.WriteAt(data, int64(at)); err != nil {
		return nil, invalidf("%s: writing %d bytes at %d of the bulk file: %v", what, len(data), at, err)
	}
	return &storev1.Blob{Offset: at, Length: uint64(len(data))}, nil
}

// parseKeys checks a request's keys against the pool's key size.
func (p *blockPool) parseKeys(data []byte, count uint32) (blocks.Keys, error) {
	if len(data) != int(count)*p.keyBytes {
		return blocks.Keys{}, invalidf("%d bytes of keys for %d keys: the pool's keys are %d bytes", len(data), count, p.keyBytes)
	}
	return blocks.Keys{Data: data, Size: p.keyBytes}, nil
}

var errPoolGone = errors.New("the pool was deleted")
