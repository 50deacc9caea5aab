package cudaipc

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"os"
	"sync"
	"sync/atomic"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// This file is the process-wide import cache and its seam to the driver.
// The policy that decides what to import, and through which device, is in
// import.go; the cache only counts references and makes sure that one
// driver mapping serves every import of one allocation and that a stale
// one is never served.

// driver is the seam between the import cache and the CUDA driver: the
// cache's logic (reference counts, single flights, stale entries) is tested
// on a CPU with a fake (cache_test.go); cudaDriver is the real thing. It
// sits below the public API: cudaDriver calls the raw layer in the
// device's context, not Device methods.
type driver interface {
	devices() ([]*Device, error)
	// openIPC maps a legacy IPC handle (cuIpcOpenMemHandle) and returns its
	// base and the size of the allocation as this process's driver reports
	// it (cuMemGetAddressRange of the base).
	openIPC(d *Device, h MemHandle) (base DevicePtr, size int64, err error)
	closeIPC(d *Device, base DevicePtr) error
	// importPieces imports the VMM allocation behind each of files and maps
	// them back to back for d, piece i sizes[i] bytes (one piece is rounded
	// up to its granularity).
	importPieces(d *Device, files []*os.File, sizes []int64, a Access) (vmmMapping, error)
	unmapPieces(d *Device, m vmmMapping) error
	// allocation describes the allocation of this process that holds p.
	allocation(d *Device, p DevicePtr) (base DevicePtr, size int64, bufferID uint64, err error)
	openEvent(d *Device, h EventHandle) (*Event, error)
	closeEvent(e *Event) error
}

// vmmMapping is one import of VMM allocations mapped back to back: the
// process-local handle and mapped size of each, and the range they fill.
type vmmMapping struct {
	handles []cu.MemGenericAllocationHandle
	sizes   []int64
	ptr     DevicePtr
	size    int64
}

type cudaDriver struct{}

func (cudaDriver) devices() ([]*Device, error) { return devices() }

func (cudaDriver) openIPC(d *Device, h MemHandle) (DevicePtr, int64, error) {
	var base cu.DevicePtr
	var size uint64
	err := d.do(func() error {
		var e error
		if base, e = cu.IpcOpenMemHandle(cu.IpcMemHandle{Reserved: h}, cu.IpcMemLazyEnablePeerAccess); e != nil {
			return e
		}
		if _, size, e = cu.MemGetAddressRange(base); e != nil {
			_ = cu.IpcCloseMemHandle(base)
			return e
		}
		return nil
	})
	if err != nil {
		return 0, 0, err
	}
	live.memOpens.Add(1)
	return DevicePtr(base), int64(size), nil
}

func (cudaDriver) closeIPC(d *Device, base DevicePtr) error {
	err := d.do(func() error { return cu.IpcCloseMemHandle(cu.DevicePtr(base)) })
	if err == nil {
		live.memOpens.Add(-1)
	}
	return err
}

func (cudaDriver) importPieces(d *Device, files []*os.File, sizes []int64, a Access) (vmmMapping, error) {
	m, err := importPieces("Import", d, files, sizes, a)
	if err == nil {
		live.fdMappings.Add(1)
	}
	return m, err
}

func (cudaDriver) unmapPieces(d *Device, m vmmMapping) error {
	live.fdMappings.Add(-1)
	return d.do(func() error { return unmapPieces(cu.DevicePtr(m.ptr), m.sizes, m.handles) })
}

func (cudaDriver) allocation(d *Device, p DevicePtr) (DevicePtr, int64, uint64, error) {
	var base cu.DevicePtr
	var size, id uint64
	err := d.do(func() error {
		var e error
		if base, size, e = cu.MemGetAddressRange(cu.DevicePtr(p)); e != nil {
			return e
		}
		id, e = cu.PointerGetAttributeUint64(cu.PointerAttrBufferID, cu.DevicePtr(p))
		return e
	})
	return DevicePtr(base), int64(size), id, err
}

func (cudaDriver) openEvent(d *Device, h EventHandle) (*Event, error) {
	var e cu.Event
	if err := d.do(func() error {
		var err error
		e, err = cu.IpcOpenEventHandle(cu.IpcEventHandle{Reserved: h})
		return err
	}); err != nil {
		return nil, err
	}
	return newEvent(d, e, EventInterprocess|EventDisableTiming, true), nil
}

func (cudaDriver) closeEvent(e *Event) error { return e.Close() }

// memKey names one driver mapping of an allocation through one device of
// this process. It is built so that a key never names two allocations at
// once: for KindCUDAIPC the handle bytes (which hold the exporter's pid and
// address) and the exporter's PID namespace, with the buffer id checked on
// every hit (a freed and re-made allocation can get the same handle bytes);
// for KindVMMFD the allocation id, which its exporter never reuses, or for
// a range over several allocations the SHA-256 of their ids and sizes in
// order (the same pieces in the same order are the same mapping).
type memKey struct {
	kind   Kind
	id     [64]byte // the IPC handle, the allocation id in the first 16 bytes, or the pieces' digest in the first 32
	pieces int      // KindVMMFD: the allocations mapped
	pidns  uint64   // KindCUDAIPC: the exporter's PID namespace
	dev    UUID     // the device of this process it is mapped through
	ro     bool     // KindVMMFD: mapped read-only (WithAccess(ReadOnly)), a mapping of its own
}

func keyOf(r Region, dev *Device, a Access) memKey {
	k := memKey{kind: r.Kind, dev: dev.uuid}
	if r.Kind == KindVMMFD {
		k.pieces = 1 + len(r.MorePieces)
		if len(r.MorePieces) == 0 {
			copy(k.id[:], r.AllocationID[:])
		} else {
			h := sha256.New()
			for _, p := range r.Pieces() {
				h.Write(p.AllocationID[:])
				h.Write(binary.LittleEndian.AppendUint64(nil, uint64(p.Size)))
			}
			h.Sum(k.id[:0])
		}
		k.ro = a == ReadOnly
	} else {
		k.id, k.pidns = r.Handle, r.PIDNamespace
	}
	return k
}

// memEntry is one driver mapping of an allocation, shared by every Mapping
// of that allocation through that device.
type memEntry struct {
	key       memKey
	bufferID  uint64 // KindCUDAIPC: the buffer id the entry was opened for
	dev       *Device
	base      DevicePtr
	allocSize int64      // what the driver mapped: the allocation's size (KindVMMFD: all pieces')
	vmm       vmmMapping // KindVMMFD: what unmapPieces undoes
	refs      int
	ready     chan struct{} // closed once the open finished
	err       error         // the open's error, for those that waited on it
	gone      chan struct{} // closed once the driver close returned
}

type eventKey struct {
	handle EventHandle
	dev    UUID
}

type eventEntry struct {
	key   eventKey
	ev    *Event
	refs  int
	ready chan struct{}
	err   error
}

// importCache is the process-wide cache behind Import and ImportEvent.
type importCache struct {
	drv  driver
	self func() (Identity, error)

	mu      sync.Mutex
	mem     map[memKey]*memEntry   // the entry new imports reuse
	orphans map[memKey][]*memEntry // stale entries dropped from mem but still held
	closing map[memKey][]*memEntry // entries whose driver close is in flight
	events  map[eventKey]*eventEntry

	memOpens, memCloses, memHits, memStale atomic.Int64
	evOpens, evCloses, evHits              atomic.Int64
}

func newImportCache(drv driver, self func() (Identity, error)) *importCache {
	return &importCache{
		drv: drv, self: self,
		mem: map[memKey]*memEntry{}, orphans: map[memKey][]*memEntry{},
		closing: map[memKey][]*memEntry{}, events: map[eventKey]*eventEntry{},
	}
}

var defaultCache = newImportCache(cudaDriver{}, SelfIdentity)

// CacheStats counts what the import cache did since the process started.
type CacheStats struct {
	Opens  int64 // driver opens of allocations (cuIpcOpenMemHandle, or a descriptor's import and map)
	Closes int64 // driver closes of allocations
	Hits   int64 // imports served by an open mapping, without a driver call
	Stale  int64 // entries dropped because the handle now names another allocation
	Mapped int   // allocations mapped now

	EventOpens  int64 // cuIpcOpenEventHandle calls
	EventCloses int64 // imported events destroyed
	EventHits   int64 // event imports served by an open event
	Events      int   // events open now
}

// ImportCacheStats returns the counters of the process-wide import cache.
func ImportCacheStats() CacheStats { return defaultCache.stats() }

func (c *importCache) stats() CacheStats {
	c.mu.Lock()
	mapped, events := len(c.mem), len(c.events)
	for _, l := range c.orphans {
		mapped += len(l)
	}
	c.mu.Unlock()
	return CacheStats{
		Opens: c.memOpens.Load(), Closes: c.memCloses.Load(), Hits: c.memHits.Load(), Stale: c.memStale.Load(), Mapped: mapped,
		EventOpens: c.evOpens.Load(), EventCloses: c.evCloses.Load(), EventHits: c.evHits.Load(), Events: events,
	}
}

// openReq is what the driver needs to map an allocation the cache does
// not hold: the handle (KindCUDAIPC), or the descriptors and the bytes to
// map of each (KindVMMFD). A value, not a closure, so that a cache hit
// allocates nothing for it.
type openReq struct {
	handle MemHandle
	files  []*os.File
	region *Region // KindVMMFD: the sizes of its pieces are mapped
	access Access
}

// open makes the driver mapping of a new entry: it sets e.base,
// e.allocSize and, for descriptors, e.vmm.
func (c *importCache) open(e *memEntry, q openReq) error {
	if e.key.kind == KindVMMFD {
		sizes := make([]int64, 0, 1+len(q.region.MorePieces))
		for _, p := range q.region.Pieces() {
			sizes = append(sizes, p.Size)
		}
		m, err := c.drv.importPieces(e.dev, q.files, sizes, q.access)
		if err != nil {
			return err
		}
		e.base, e.allocSize, e.vmm = m.ptr, m.size, m
		return nil
	}
	var err error
	e.base, e.allocSize, err = c.drv.openIPC(e.dev, q.handle)
	return err
}

// acquireMem returns the entry for key holding one more reference, opening
// the allocation as q says if no usable entry exists. Concurrent callers
// for one key share one open; an open's failure is returned to those that
// waited on it and is not remembered.
func (c *importCache) acquireMem(key memKey, bufferID uint64, dev *Device, q openReq) (*memEntry, error) {
	c.mu.Lock()
	for {
		if cl := c.closing[key]; len(cl) > 0 {
			// A close of this allocation is in flight: an open now could be
			// handed that dying mapping by the driver's refcount. Wait.
			gone := cl[0].gone
			c.mu.Unlock()
			<-gone
			c.mu.Lock()
			continue
		}
		e := c.mem[key]
		if e == nil {
			break
		}
		if waited, err := c.waitOpen(e.ready, &e.err); waited {
			if err != nil {
				return nil, err
			}
			continue
		}
		if e.bufferID != bufferID {
			// Same handle bytes, another allocation: never reuse. Holders
			// keep their mapping until they close it.
			delete(c.mem, key)
			c.orphans[key] = append(c.orphans[key], e)
			c.memStale.Add(1)
			break
		}
		e.refs++
		c.memHits.Add(1)
		c.mu.Unlock()
		return e, nil
	}
	e := &memEntry{key: key, bufferID: bufferID, dev: dev, refs: 1, ready: make(chan struct{}), gone: make(chan struct{})}
	c.mem[key] = e
	c.mu.Unlock()

	err := c.open(e, q)
	if err == nil {
		c.memOpens.Add(1)
	}

	c.mu.Lock()
	var stale *memEntry
	if err == nil {
		for _, o := range c.orphans[key] {
			if o.base == e.base {
				stale = o
			}
		}
	}
	if err != nil || stale != nil {
		if c.mem[key] == e {
			delete(c.mem, key)
		}
	}
	e.err = err
	if stale != nil {
		e.err = fmt.Errorf("%w: the allocation behind handle %s was freed and another exported with the same handle bytes (buffer id %d, was %d) while this process still maps the old one at %#x; close the old Mappings and import again",
			ErrStaleMapping, MemHandle(key.id), bufferID, stale.bufferID, uint64(e.base))
	}
	close(e.ready)
	c.mu.Unlock()

	if stale != nil {
		// The driver handed back the old mapping with one more reference:
		// give that reference back, never serve the old memory.
		c.memCloses.Add(1)
		_ = c.closeDriver(e)
	}
	if e.err != nil {
		return nil, e.err
	}
	return e, nil
}

func (c *importCache) closeDriver(e *memEntry) error {
	if e.key.kind == KindVMMFD {
		return c.drv.unmapPieces(e.dev, e.vmm)
	}
	return c.drv.closeIPC(e.dev, e.base)
}

// waitOpen, called with c.mu held, returns waited == false at once if the
// open that closes ready has finished. Otherwise it waits for that open
// with c.mu released and returns waited == true and the open's error
// (*errp, written before ready closed); c.mu is held again unless that
// error is non-nil.
func (c *importCache) waitOpen(ready chan struct{}, errp *error) (waited bool, err error) {
	select {
	case <-ready:
		return false, nil
	default:
	}
	c.mu.Unlock()
	<-ready
	if *errp != nil {
		return true, *errp
	}
	c.mu.Lock()
	return true, nil
}

// releaseMem drops one reference; the last one closes the driver mapping.
func (c *importCache) releaseMem(e *memEntry) error {
	c.mu.Lock()
	if !unref(c.mem, e.key, e, &e.refs) {
		c.mu.Unlock()
		return nil
	}
	c.orphans[e.key] = remove(c.orphans[e.key], e)
	if len(c.orphans[e.key]) == 0 {
		delete(c.orphans, e.key)
	}
	c.closing[e.key] = append(c.closing[e.key], e)
	c.mu.Unlock()

	err := c.closeDriver(e)
	c.memCloses.Add(1)

	c.mu.Lock()
	c.closing[e.key] = remove(c.closing[e.key], e)
	if len(c.closing[e.key]) == 0 {
		delete(c.closing, e.key)
	}
	close(e.gone)
	c.mu.Unlock()
	return err
}

// unref drops one of *refs, with c.mu held. It reports whether that was
// the last reference, and then forgets e as m's entry for k if it still is.
func unref[K comparable, E any](m map[K]*E, k K, e *E, refs *int) bool {
	*refs--
	if *refs > 0 {
		return false
	}
	if m[k] == e {
		delete(m, k)
	}
	return true
}

func remove[T comparable](l []T, v T) []T {
	for i, x := range l {
		if x == v {
			return append(l[:i:i], l[i+1:]...)
		}
	}
	return l
}

// acquireEvent is acquireMem for events, which have no buffer id: an entry
// is reused while any reference to it is open.
func (c *importCache) acquireEvent(key eventKey, dev *Device) (*eventEntry, error) {
	c.mu.Lock()
	for {
		e := c.events[key]
		if e == nil {
			break
		}
		if waited, err := c.waitOpen(e.ready, &e.err); waited {
			if err != nil {
				return nil, err
			}
			continue
		}
		e.refs++
		c.evHits.Add(1)
		c.mu.Unlock()
		return e, nil
	}
	e := &eventEntry{key: key, refs: 1, ready: make(chan struct{})}
	c.events[key] = e
	c.mu.Unlock()

	ev, err := c.drv.openEvent(dev, key.handle)
	if err == nil {
		c.evOpens.Add(1)
	}
	c.mu.Lock()
	e.ev, e.err = ev, err
	if err != nil && c.events[key] == e {
		delete(c.events, key)
	}
	close(e.ready)
	c.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return e, nil
}

func (c *importCache) releaseEvent(e *eventEntry) error {
	c.mu.Lock()
	if !unref(c.events, e.key, e, &e.refs) {
		c.mu.Unlock()
		return nil
	}
	c.mu.Unlock()
	c.evCloses.Add(1)
	return c.drv.closeEvent(e.ev)
}
