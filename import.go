package cudaipc

import (
	"fmt"
	"log/slog"
	"runtime"
	"sync"
)

// ImportOption changes how Import and ImportEvent pick the device.
type ImportOption func(*importConfig)

type importConfig struct {
	fallback        *Device
	anyPIDNamespace bool
}

// WithAnyPIDNamespace lets Import try a region or event exported in another
// PID namespace instead of refusing it with ErrOtherPIDNamespace. Measured
// on driver 580: an importer in a PID namespace nested inside the
// exporter's (a container started by the exporter's host) opens legacy
// handles fine; between sibling containers the driver cannot find the
// exporter and the open fails. The driver's error is returned then.
func WithAnyPIDNamespace() ImportOption {
	return func(c *importConfig) { c.anyPIDNamespace = true }
}

func configure(opts []ImportOption) importConfig {
	var cfg importConfig
	for _, o := range opts {
		o(&cfg)
	}
	return cfg
}

// WithFallbackDevice names the device to map through when the exporter's
// GPU is not visible to this process (CUDA_VISIBLE_DEVICES hides it). The
// default is the first visible device; either reaches the memory through
// peer access (NVLink or PCIe). When the exporter's GPU is visible it is
// always used, whatever this option says.
func WithFallbackDevice(d *Device) ImportOption {
	return func(c *importConfig) { c.fallback = d }
}

// Mapping is a Region imported into this process: device memory readable
// and writable at Ptr, through Device. Close it when done. Mappings of one
// allocation share one driver mapping, which the last Close unmaps.
//
// A Mapping that becomes unreachable without Close is closed by a cleanup
// and the leak is logged; the pointer must not be used after that, so keep
// the Mapping reachable (runtime.KeepAlive) while kernels use Ptr.
type Mapping struct {
	ref     *mappingRef
	cleanup runtime.Cleanup
}

// mappingRef is what a Mapping releases. It is separate from the Mapping so
// that the cleanup backstop can hold it without keeping the Mapping alive.
type mappingRef struct {
	dev    *Device
	ptr    DevicePtr // the region's first byte
	mu     sync.Mutex
	closed bool
	cache  *importCache
	entry  *memEntry // nil for a same-process import
	local  *Buffer   // the Buffer of a same-process import, if this package allocated it
	region Region
}

func (r *mappingRef) release() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	live.mappings.Add(-1)
	if r.local != nil {
		r.local.dropLocalRef()
	}
	if r.entry != nil {
		return r.cache.releaseMem(r.entry)
	}
	return nil
}

func (r *mappingRef) isClosed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.closed
}

func releaseLeakedMapping(r *mappingRef) {
	slog.Warn("cudaipc: Mapping garbage-collected without Close; closing it", "region", r.region.String())
	if err := r.release(); err != nil {
		slog.Warn("cudaipc: closing leaked Mapping failed", "err", err)
	}
}

func newMapping(r Region, dev *Device, ptr DevicePtr, ref *mappingRef) *Mapping {
	ref.region, ref.dev, ref.ptr = r, dev, ptr
	m := &Mapping{ref: ref}
	live.mappings.Add(1)
	m.cleanup = runtime.AddCleanup(m, releaseLeakedMapping, ref)
	return m
}

// Import maps the memory r describes into this process, through the
// process-wide cache: the first import of an allocation opens it
// (cuIpcOpenMemHandle, 40 µs to 13 ms), later imports of the same
// allocation at any offset share that mapping, and the last Close unmaps
// it. Concurrent first imports open once.
//
// The device is the visible one with r.Device's UUID, else the one
// WithFallbackDevice names, else the first visible device. In the process
// that exported r, Import makes no IPC call and returns the exporter's own
// memory (a Buffer of this package then refuses Free until the Mapping is
// closed).
//
// Errors: *RegionError for an invalid r; ErrOtherHost and
// ErrOtherPIDNamespace when the exporter is out of reach; ErrStaleMapping
// when r's allocation was freed and the handle now names another one that
// this process still maps; the driver's errors otherwise
// (ErrInvalidResourceHandle: the exporter freed the memory or exited).
func Import(r Region, opts ...ImportOption) (*Mapping, error) {
	return defaultCache.importMem(r, opts...)
}

func (c *importCache) importMem(r Region, opts ...ImportOption) (*Mapping, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	self, err := c.self()
	if err != nil {
		return nil, err
	}
	cfg := configure(opts)
	if err := checkReach("region", r.BootID, r.PIDNamespace, self, cfg.anyPIDNamespace); err != nil {
		return nil, err
	}
	if r.ExporterPID == self.PID && r.PIDNamespace == self.PIDNamespace {
		return c.importLocal(r)
	}
	dev, err := c.target(r.Device, cfg)
	if err != nil {
		return nil, err
	}
	e, err := c.acquireMem(memKey{r.Handle, dev.uuid}, r.BufferID, dev)
	if err != nil {
		return nil, err
	}
	return newMapping(r, dev, e.base+DevicePtr(r.Offset), &mappingRef{cache: c, entry: e}), nil
}

// importLocal serves a region exported by this very process: the driver
// refuses to open a handle in its exporter, and the memory is right here.
func (c *importCache) importLocal(r Region) (*Mapping, error) {
	l, err := c.drv.devices()
	if err != nil {
		return nil, err
	}
	var dev *Device
	for _, d := range l {
		if d.uuid == r.Device {
			dev = d
		}
	}
	if dev == nil {
		return nil, fmt.Errorf("cudaipc: region exported by this process names %s, which it does not see: %w", r.Device, ErrDeviceNotVisible)
	}
	idOf := func() (uint64, error) { return c.drv.bufferID(dev, r.ExporterBase) }
	ref := &mappingRef{cache: c}
	if b := lookupBuffer(r.ExporterBase); b != nil {
		if err := b.addLocalRef(r.BufferID, idOf); err != nil {
			return nil, fmt.Errorf("cudaipc: Import of a region of this process: %w", err)
		}
		ref.local = b
	} else {
		// Not a Buffer of this package (PyTorch, CuPy, ...): check that the
		// allocation exported is still the one at that address.
		id, err := idOf()
		if err != nil {
			return nil, fmt.Errorf("%w: the allocation this process exported at %#x is gone: %v", ErrStaleMapping, uint64(r.ExporterBase), err)
		}
		if id != r.BufferID {
			return nil, fmt.Errorf("%w: the allocation this process exported at %#x (buffer id %d) was freed; buffer %d is there now", ErrStaleMapping, uint64(r.ExporterBase), r.BufferID, id)
		}
	}
	return newMapping(r, dev, r.ExporterBase+DevicePtr(r.Offset), ref), nil
}

// Ptr returns the device address of the region's first byte, valid in
// Device's context and, with peer access, in other devices' contexts.
func (m *Mapping) Ptr() DevicePtr { return m.ref.ptr }

// Size returns the region's size in bytes.
func (m *Mapping) Size() int64 { return m.ref.region.Size }

// Device returns the device the memory is mapped through.
func (m *Mapping) Device() *Device { return m.ref.dev }

// Region returns the region the mapping was imported from.
func (m *Mapping) Region() Region { return m.ref.region }

// Local reports whether the mapping is the exporting process's own memory
// (no driver mapping).
func (m *Mapping) Local() bool { return m.ref.entry == nil }

// ReadAt copies len(p) bytes at offset off of the region into p.
func (m *Mapping) ReadAt(p []byte, off int64) (int, error) {
	if m.ref.isClosed() {
		return 0, fmt.Errorf("ReadAt: %w", ErrClosed)
	}
	return readAt(m.ref.dev, m.ref.ptr, m.ref.region.Size, p, off)
}

// WriteAt copies p into the region at offset off.
func (m *Mapping) WriteAt(p []byte, off int64) (int, error) {
	if m.ref.isClosed() {
		return 0, fmt.Errorf("WriteAt: %w", ErrClosed)
	}
	return writeAt(m.ref.dev, m.ref.ptr, m.ref.region.Size, p, off)
}

// Close releases the mapping; the last Close of an allocation's mappings
// unmaps it. Closing twice is not an error.
func (m *Mapping) Close() error {
	m.cleanup.Stop()
	return m.ref.release()
}
