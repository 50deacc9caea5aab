package ucx

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	raw "github.com/cudaipc/cudaipc/internal/ucx"
)

// MemRegion is memory registered with UCX once (ucp_mem_map of existing
// memory) so that peers can read any part of it with one-sided GETs, with
// its remote key packed once (ucp_rkey_pack). Register a whole arena, not
// each object in it. The memory must stay mapped, and a Go slice must stay
// referenced, until Close; MemRegion keeps the slice it was given.
type MemRegion struct {
	ctx *Context
	mem []byte

	mu      sync.Mutex
	h       raw.Mem
	memType MemoryType
	closed  bool
	key     RegionKey
	// sending counts the Fetch replies under way from the region's bytes.
	sending atomic.Int64
}

// Register registers mem (host memory: an mmap'd arena, or a Go slice) for
// remote reads and local writes, and packs its key.
func (c *Context) Register(mem []byte) (*MemRegion, error) {
	if len(mem) == 0 {
		return nil, errors.New("ucx: cannot register an empty region")
	}
	r, err := c.register(raw.Addr(mem), uint64(len(mem)), MemoryHost)
	if err != nil {
		return nil, err
	}
	r.mem = mem
	return r, nil
}

// RegisterMemory registers length bytes at addr of memory type t (e.g. a
// GPU arena's device address with MemoryCUDA) that the caller keeps mapped
// until the region is closed. A type the context does not support (see
// Supports) is refused before UCX is asked. Bytes returns nil for such a
// region.
func (c *Context) RegisterMemory(addr, length uint64, t MemoryType) (*MemRegion, error) {
	switch {
	case length == 0:
		return nil, errors.New("ucx: cannot register an empty region")
	case addr+length < addr:
		return nil, fmt.Errorf("ucx: region [%#x, +%d) wraps around the address space", addr, length)
	case !c.Supports(t):
		return nil, fmt.Errorf("ucx: this UCX cannot register %v memory (it supports %v)", t, c.MemoryTypes())
	}
	return c.register(addr, length, t)
}

func (c *Context) register(addr, length uint64, t MemoryType) (*MemRegion, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, ErrClosed
	}
	p := &raw.MemMapParams{
		FieldMask:  raw.MemMapParamFieldAddress | raw.MemMapParamFieldLength | raw.MemMapParamFieldProt | raw.MemMapParamFieldMemoryType,
		Address:    uintptr(addr),
		Length:     length,
		Prot:       raw.MemMapProtLocalRead | raw.MemMapProtLocalWrite | raw.MemMapProtRemoteRead,
		MemoryType: t,
	}
	h, err := raw.MemMap(c.h, p)
	if err != nil {
		return nil, err
	}
	rkey, err := raw.RkeyPack(c.h, h)
	if err != nil {
		_ = raw.MemUnmap(c.h, h)
		return nil, err
	}
	major, minor, _, _ := raw.GetVersion()
	r := &MemRegion{
		ctx:     c,
		h:       h,
		memType: t,
		key:     RegionKey{Addr: addr, Len: length, Rkey: rkey, ucxMajor: uint8(major), ucxMinor: uint8(minor)},
	}
	if err := checkKey(r.key.Addr, r.key.Len, r.key.Rkey); err != nil {
		// This UCX packs keys in a layout the peer-side check rejects:
		// refuse here rather than fail every reader.
		_ = raw.MemUnmap(c.h, h)
		return nil, err
	}
	c.regions[r] = struct{}{}
	c.handles.add(0, h)
	return r, nil
}

// Key returns what a peer needs to read the region: its address, length
// and packed rkey.
func (r *MemRegion) Key() RegionKey { return r.key }

// Bytes returns the registered memory, or nil for a region made by
// RegisterMemory.
func (r *MemRegion) Bytes() []byte { return r.mem }

// Close deregisters the memory (ucp_mem_unmap). Peers' reads in flight
// fail. Fetch replies under way from it are given closeWait to finish,
// then their endpoints are closed forcibly, so that once Close returns UCX
// no longer reads the memory. It is idempotent.
func (r *MemRegion) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	c := r.ctx
	c.mu.Lock()
	delete(c.regions, r)
	c.closeWindowsLocked(r) // no Fetch reply starts from it any more
	workers := make([]*Worker, 0, len(c.workers))
	for w := range c.workers {
		workers = append(workers, w)
	}
	c.mu.Unlock()
	r.drain(workers)
	c.handles.remove(0, r.h)
	return raw.MemUnmap(c.h, r.h)
}

// drain waits for the Fetch replies from r: closeWait, then as long again
// after closing their endpoints forcibly (their served workers complete
// them on the next progress).
func (r *MemRegion) drain(workers []*Worker) {
	wait := func(d time.Duration) bool {
		for deadline := time.Now().Add(d); r.sending.Load() > 0; time.Sleep(100 * time.Microsecond) {
			if time.Now().After(deadline) {
				return false
			}
		}
		return true
	}
	if wait(closeWait) {
		return
	}
	for _, w := range workers {
		w.mu.Lock()
		if w.fetch != nil {
			w.fetch.shutSendsOf(r)
		}
		w.mu.Unlock()
	}
	if !wait(closeWait) {
		slog.Warn("ucx: a region was closed with fetch replies still under way from it", "replies", r.sending.Load())
	}
}
