package cudaipc

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// driver is the seam between the import cache and the CUDA driver: the
// cache's logic (reference counts, single flights, stale entries) is tested
// on a CPU with a fake; cudaDriver is the real thing.
type driver interface {
	devices() ([]*Device, error)
	openMem(d *Device, h MemHandle) (DevicePtr, error)
	closeMem(d *Device, base DevicePtr) error
	bufferID(d *Device, p DevicePtr) (uint64, error)
	openEvent(d *Device, h EventHandle) (*Event, error)
	closeEvent(e *Event) error
}

type cudaDriver struct{}

func (cudaDriver) devices() ([]*Device, error) { return devices() }
func (cudaDriver) openMem(d *Device, h MemHandle) (DevicePtr, error) {
	return d.OpenMemHandle(h, LazyEnablePeerAccess)
}
func (cudaDriver) closeMem(d *Device, base DevicePtr) error { return d.CloseMemHandle(base) }
func (cudaDriver) bufferID(d *Device, p DevicePtr) (uint64, error) {
	pi, err := d.PointerInfo(p)
	return pi.BufferID, err
}
func (cudaDriver) openEvent(d *Device, h EventHandle) (*Event, error) { return d.OpenEventHandle(h) }
func (cudaDriver) closeEvent(e *Event) error                          { return e.Close() }

// memKey names one driver mapping: the allocation's handle bytes, mapped
// through one device of this process.
type memKey struct {
	handle MemHandle
	dev    UUID
}

// memEntry is one driver open of an allocation, shared by every Mapping of
// that allocation through that device.
type memEntry struct {
	key      memKey
	bufferID uint64
	dev      *Device
	base     DevicePtr
	refs     int
	ready    chan struct{} // closed once the open finished
	err      error         // the open's error, for those that waited on it
	gone     chan struct{} // closed once the driver close returned
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
	Opens  int64 // driver opens of memory handles (cuIpcOpenMemHandle)
	Closes int64 // driver closes of memory handles
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

// acquireMem returns the entry for key holding one more reference, opening
// the allocation if no usable entry exists. Concurrent callers for one key
// share one open; an open's failure is returned to those that waited on it
// and is not remembered.
func (c *importCache) acquireMem(key memKey, bufferID uint64, dev *Device) (*memEntry, error) {
	c.mu.Lock()
	for {
		if cl := c.closing[key]; len(cl) > 0 {
			// A close of this handle is in flight: an open now could be
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
		select {
		case <-e.ready:
		default:
			c.mu.Unlock()
			<-e.ready
			if e.err != nil {
				return nil, e.err
			}
			c.mu.Lock()
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

	base, err := c.drv.openMem(dev, key.handle)
	if err == nil {
		c.memOpens.Add(1)
	}

	c.mu.Lock()
	var stale *memEntry
	if err == nil {
		for _, o := range c.orphans[key] {
			if o.base == base {
				stale = o
			}
		}
	}
	if err != nil || stale != nil {
		if c.mem[key] == e {
			delete(c.mem, key)
		}
	}
	e.base, e.err = base, err
	if stale != nil {
		e.err = fmt.Errorf("%w: the allocation behind handle %s was freed and another exported with the same handle bytes (buffer id %d, was %d) while this process still maps the old one at %#x; close the old Mappings and import again",
			ErrStaleMapping, key.handle, bufferID, stale.bufferID, uint64(base))
	}
	close(e.ready)
	c.mu.Unlock()

	if stale != nil {
		// The driver handed back the old mapping with one more reference:
		// give that reference back, never serve the old memory.
		c.memCloses.Add(1)
		_ = c.drv.closeMem(dev, base)
	}
	if e.err != nil {
		return nil, e.err
	}
	return e, nil
}

// releaseMem drops one reference; the last one closes the driver mapping.
func (c *importCache) releaseMem(e *memEntry) error {
	c.mu.Lock()
	e.refs--
	if e.refs > 0 {
		c.mu.Unlock()
		return nil
	}
	if c.mem[e.key] == e {
		delete(c.mem, e.key)
	}
	c.orphans[e.key] = remove(c.orphans[e.key], e)
	if len(c.orphans[e.key]) == 0 {
		delete(c.orphans, e.key)
	}
	c.closing[e.key] = append(c.closing[e.key], e)
	c.mu.Unlock()

	err := c.drv.closeMem(e.dev, e.base)
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
		select {
		case <-e.ready:
		default:
			c.mu.Unlock()
			<-e.ready
			if e.err != nil {
				return nil, e.err
			}
			c.mu.Lock()
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
	e.refs--
	if e.refs > 0 {
		c.mu.Unlock()
		return nil
	}
	if c.events[e.key] == e {
		delete(c.events, e.key)
	}
	c.mu.Unlock()
	c.evCloses.Add(1)
	return c.drv.closeEvent(e.ev)
}

// target picks the device to map through: the one with the exporter's
// UUID if this process sees it, else the fallback (default: the first
// visible device), which reaches the memory through peer access. Never the
// exporter's ordinal: CUDA_VISIBLE_DEVICES renumbers devices per process.
func (c *importCache) target(u UUID, cfg importConfig) (*Device, error) {
	l, err := c.drv.devices()
	if err != nil {
		return nil, err
	}
	for _, d := range l {
		if d.uuid == u {
			return d, nil
		}
	}
	if cfg.fallback != nil {
		return cfg.fallback, nil
	}
	if len(l) == 0 {
		return nil, fmt.Errorf("cudaipc: no visible GPU to map %s through: %w", u, ErrNoDevice)
	}
	return l[0], nil
}

// checkReach says why a handle from identity (boot, pidns) cannot work in
// this process, if it cannot.
func checkReach(what string, boot BootID, pidns uint64, self Identity, anyPIDNamespace bool) error {
	if boot != self.BootID {
		return fmt.Errorf("%w: the %s was exported under boot id %s, this process runs under %s; a CUDA IPC handle works only on the machine (and boot) that made it: copy the bytes instead",
			ErrOtherHost, what, boot, self.BootID)
	}
	if pidns != self.PIDNamespace && !anyPIDNamespace {
		return fmt.Errorf("%w: the %s was exported in PID namespace %d, this process is in %d; legacy CUDA IPC cannot cross PID namespaces (containers): use the VMM POSIX-fd path through the store daemon (cudaipc serve --gpu-share fd), or run both processes in one PID namespace (e.g. docker --pid=host); WithAnyPIDNamespace tries anyway (nested namespaces work)",
			ErrOtherPIDNamespace, what, pidns, self.PIDNamespace)
	}
	return nil
}
