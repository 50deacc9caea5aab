package cudaipc

import (
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"sync"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// This file is the import policy: which regions and events this process
// may import, through which device, and what a Mapping is. The cache that
// shares driver mappings between imports, and its seam to the driver, are
// in cache.go.

// ImportOption changes how Import and ImportEvent pick the device, and
// gives Import what a region does not carry (its descriptor).
type ImportOption func(*importConfig)

type importConfig struct {
	fallback        *Device
	anyPIDNamespace bool
	files           []*os.File
	readOnly        bool
}

// WithAccess says how a KindVMMFD region is mapped: ReadWrite (the
// default) or ReadOnly (CU_MEM_ACCESS_FLAGS_PROT_READ: a write through the
// mapping fails and changes nothing; docs/containers.md). Read-only and
// read-write imports of one allocation are separate driver mappings, each
// shared by the imports of its kind. Legacy (KindCUDAIPC) mappings are
// always read-write: the driver has no read-only open of an IPC handle.
func WithAccess(a Access) ImportOption {
	return func(c *importConfig) { c.readOnly = a == ReadOnly }
}

// WithAnyPIDNamespace lets Import try a region or event exported in another
// PID namespace instead of refusing it with ErrOtherPIDNamespace. Measured
// on driver 580: an importer in a PID namespace nested inside the
// exporter's (a container started by the exporter's host) opens legacy
// handles fine; between sibling containers the driver cannot find the
// exporter and the open fails. The driver's error is returned then.
// KindVMMFD regions work in any PID namespace without it.
func WithAnyPIDNamespace() ImportOption {
	return func(c *importConfig) { c.anyPIDNamespace = true }
}

// WithFallbackDevice names the device to map through when the exporter's
// GPU is not visible to this process (CUDA_VISIBLE_DEVICES hides it). The
// default is the first visible device; either reaches the memory through
// peer access (NVLink or PCIe). When the exporter's GPU is visible it is
// always used, whatever this option says.
func WithFallbackDevice(d *Device) ImportOption {
	return func(c *importConfig) { c.fallback = d }
}

// WithFile gives Import the POSIX file descriptor of a KindVMMFD region's
// allocation (ShareableBuffer.ExportFD, received over a Unix socket).
// Import does not take ownership of f: close it when Import returns (the
// mapping holds its own reference to the memory). When the allocation is
// already mapped in this process, f is not used at all.
func WithFile(f *os.File) ImportOption {
	return WithFiles(f)
}

// WithFiles is WithFile for a KindVMMFD region over several allocations
// (version 2): one descriptor per piece, in the order of Region.Pieces.
func WithFiles(files ...*os.File) ImportOption {
	return func(c *importConfig) { c.files = files }
}

func (c importConfig) access() Access {
	if c.readOnly {
		return ReadOnly
	}
	return ReadWrite
}

func configure(opts []ImportOption) importConfig {
	var cfg importConfig
	for _, o := range opts {
		o(&cfg)
	}
	return cfg
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
	size   int64
	mu     sync.Mutex
	closed bool
	cache  *importCache
	entry  *memEntry   // nil for a same-process import and for ImportFD
	local  *Buffer     // the Buffer of a same-process import, if this package allocated it
	own    *vmmMapping // ImportFD: the bare descriptor's mapping, this Mapping's alone
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
	if m := r.own; m != nil {
		live.fdMappings.Add(-1)
		return r.dev.do(func() error { return unmapPieces(cu.DevicePtr(m.ptr), m.sizes, m.handles) })
	}
	return nil
}

func (r *mappingRef) isClosed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.closed
}

func releaseLeakedMapping(r *mappingRef) {
	what := r.region.String()
	if r.own != nil {
		what = fmt.Sprintf("a %d-byte descriptor import (ImportFD)", r.size)
	}
	slog.Warn("cudaipc: Mapping garbage-collected without Close; closing it", "region", what)
	if err := r.release(); err != nil {
		slog.Warn("cudaipc: closing leaked Mapping failed", "err", err)
	}
}

func newMapping(r Region, dev *Device, ptr DevicePtr, ref *mappingRef) *Mapping {
	ref.region, ref.dev, ref.ptr = r, dev, ptr
	if ref.own == nil {
		ref.size = r.Size
	}
	m := &Mapping{ref: ref}
	live.mappings.Add(1)
	m.cleanup = runtime.AddCleanup(m, releaseLeakedMapping, ref)
	return m
}

// Import maps the memory r describes into this process, through the
// process-wide cache: the first import of an allocation opens it, later
// imports of the same allocation at any offset share that mapping, and the
// last Close unmaps it. Concurrent first imports open once.
//
// A KindCUDAIPC region is opened with cuIpcOpenMemHandle (40 µs to 13 ms).
// In the process that exported it, Import makes no IPC call and returns the
// exporter's own memory (a Buffer of this package then refuses Free until
// the Mapping is closed).
//
// A KindVMMFD region needs its allocation's descriptor, given with
// WithFile; the first import of the allocation imports the descriptor and
// maps AllocSize bytes (cuMemImportFromShareableHandle, cuMemMap,
// cuMemSetAccess: milliseconds). A region over several allocations
// (version 2, ExportPointer of PyTorch's expandable segments) needs one
// descriptor per piece (WithFiles) and maps them back to back in one
// range, shared by every import of the same pieces in the same order. It
// works in any PID namespace, and in the exporting process too.
//
// The device is the visible one with r.Device's UUID, else the one
// WithFallbackDevice names, else the first visible device.
//
// Errors: *RegionError for an invalid r, and for an r whose AllocSize is
// larger than the allocation the driver finds behind the handle or
// descriptor (field "alloc_size"), before any copy; *ArgError for a
// missing or unexpected WithFile; ErrOtherHost and ErrOtherPIDNamespace
// when the exporter is out of reach; ErrStaleMapping when r's allocation
// was freed and the handle now names another one that this process still
// maps; the driver's errors otherwise (ErrInvalidResourceHandle: the
// exporter freed the memory or exited).
func Import(r Region, opts ...ImportOption) (*Mapping, error) {
	return defaultCache.importMem(r, opts...)
}

func (c *importCache) importMem(r Region, opts ...ImportOption) (*Mapping, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	cfg := configure(opts)
	switch {
	case r.Kind == KindVMMFD && len(cfg.files) == 0:
		return nil, &ArgError{Op: "Import", Arg: "file", Reason: "a vmm-fd region needs its allocation's descriptor: pass WithFile(f) with the descriptor received beside the region (WithFiles for a region of several allocations)"}
	case r.Kind == KindVMMFD && len(cfg.files) != 1+len(r.MorePieces):
		return nil, &ArgError{Op: "Import", Arg: "file", Reason: fmt.Sprintf("%d descriptors for a region of %d allocations: pass one per piece, first piece first", len(cfg.files), 1+len(r.MorePieces))}
	case r.Kind != KindVMMFD && len(cfg.files) != 0:
		return nil, &ArgError{Op: "Import", Arg: "file", Reason: fmt.Sprintf("WithFile is for vmm-fd regions; this one is %s", r.Kind)}
	}
	for i, f := range cfg.files {
		if f == nil {
			return nil, &ArgError{Op: "Import", Arg: "file", Reason: fmt.Sprintf("descriptor %d is nil", i)}
		}
	}
	self, err := c.self()
	if err != nil {
		return nil, err
	}
	if r.Kind == KindVMMFD {
		// A descriptor works in any PID namespace; only another boot (a
		// region that did not come with its descriptor) is out of reach.
		if err := checkReach("region", r.BootID, self.PIDNamespace, self, false); err != nil {
			return nil, err
		}
	} else {
		if err := checkReach("region", r.BootID, r.PIDNamespace, self, cfg.anyPIDNamespace); err != nil {
			return nil, err
		}
		if r.ExporterPID == self.PID && r.PIDNamespace == self.PIDNamespace {
			return c.importLocal(r)
		}
	}
	dev, err := c.target(r.Device, cfg)
	if err != nil {
		return nil, err
	}
	e, err := c.acquireMem(keyOf(r, dev, cfg.access()), r.BufferID, dev, openReq{handle: r.Handle, files: cfg.files, region: &r, access: cfg.access()})
	if err != nil && tooLarge(err) {
		return nil, regionErr("alloc_size", "%d bytes: the driver refuses to map that much of the allocation behind the descriptor (%v): the allocation is smaller, or the descriptor is another allocation's", r.AllocSize, err)
	}
	if err != nil {
		return nil, err
	}
	if r.MappedSize() > e.allocSize {
		// Refuse before any copy: reading past the real allocation fails in
		// the driver with a bare CUDA_ERROR_INVALID_VALUE, or worse, reads
		// a neighbour's memory.
		err := regionErr("alloc_size", "%d bytes, but the allocation mapped for this region is %d bytes (cuMemGetAddressRange): the region was made for another allocation, or is corrupt", r.MappedSize(), e.allocSize)
		return nil, joinRelease(err, c.releaseMem(e))
	}
	return newMapping(r, dev, e.base+DevicePtr(r.Offset), &mappingRef{cache: c, entry: e}), nil
}

// joinRelease returns err, logging a failure to give back what was taken.
func joinRelease(err, releaseErr error) error {
	if releaseErr != nil {
		slog.Warn("cudaipc: releasing a refused import failed", "err", releaseErr)
	}
	return err
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
		return nil, fmt.Errorf("%w: this process exported the region on %s and does not see that GPU now", ErrDeviceNotVisible, r.Device)
	}
	describe := func() (allocInfo, error) {
		_, size, id, err := c.drv.allocation(dev, r.ExporterBase)
		return allocInfo{id: id, size: size}, err
	}
	ref := &mappingRef{cache: c}
	if b := lookupBuffer(r.ExporterBase); b != nil {
		if err := b.addLocalRef(r.BufferID, r.AllocSize, describe); err != nil {
			return nil, err
		}
		ref.local = b
	} else {
		// Not a Buffer of this package (PyTorch, CuPy, ...): check that the
		// allocation exported is still the one at that address.
		a, err := describe()
		if err != nil {
			return nil, fmt.Errorf("%w: the allocation this process exported at %#x is gone: %v", ErrStaleMapping, uint64(r.ExporterBase), err)
		}
		if a.id != r.BufferID {
			return nil, fmt.Errorf("%w: the allocation this process exported at %#x (buffer id %d) was freed; buffer %d is there now", ErrStaleMapping, uint64(r.ExporterBase), r.BufferID, a.id)
		}
		if r.AllocSize > a.size {
			return nil, regionErr("alloc_size", "%d bytes, but the allocation at %#x is %d bytes (cuMemGetAddressRange)", r.AllocSize, uint64(r.ExporterBase), a.size)
		}
	}
	return newMapping(r, dev, r.ExporterBase+DevicePtr(r.Offset), ref), nil
}

// allocInfo is what the driver says of an allocation of this process.
type allocInfo struct {
	id   uint64 // CU_POINTER_ATTRIBUTE_BUFFER_ID
	size int64  // cuMemGetAddressRange
}

// ImportEvent opens the event d describes, through the cache. The device
// is chosen as for Import. In the exporting process it returns the
// exporter's own event.
func ImportEvent(d EventDescriptor, opts ...ImportOption) (*RemoteEvent, error) {
	return defaultCache.importEvent(d, opts...)
}

func (c *importCache) importEvent(d EventDescriptor, opts ...ImportOption) (*RemoteEvent, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	self, err := c.self()
	if err != nil {
		return nil, err
	}
	cfg := configure(opts)
	if len(cfg.files) != 0 {
		return nil, &ArgError{Op: "ImportEvent", Arg: "file", Reason: "WithFile is for vmm-fd regions, not events"}
	}
	if err := checkReach("event", d.BootID, d.PIDNamespace, self, cfg.anyPIDNamespace); err != nil {
		return nil, err
	}
	ref := &eventRef{cache: c, desc: d}
	var ev *Event
	if d.ExporterPID == self.PID && d.PIDNamespace == self.PIDNamespace {
		exportedEvents.mu.Lock()
		ev = exportedEvents.m[d.Handle]
		exportedEvents.mu.Unlock()
		if ev == nil {
			return nil, &closedError{call: "ImportEvent", object: "event this process exported"}
		}
	} else {
		dev, err := c.target(d.Device, cfg)
		if err != nil {
			return nil, err
		}
		e, err := c.acquireEvent(eventKey{d.Handle, dev.uuid}, dev)
		if err != nil {
			return nil, err
		}
		ref.entry, ev = e, e.ev
	}
	re := &RemoteEvent{desc: d, ev: ev, ref: ref}
	re.cleanup = runtime.AddCleanup(re, releaseLeakedEvent, ref)
	return re, nil
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
		return fmt.Errorf("%w: the %s was exported in PID namespace %d, this process is in %d: legacy CUDA IPC reaches the exporter's namespace and those nested in it, not a sibling container's; share through VMM descriptors instead (the store daemon: cudaipc serve --gpu-share fd; a vmm-fd Region) or run both processes in one PID namespace (docker --pid=host)",
			ErrOtherPIDNamespace, what, pidns, self.PIDNamespace)
	}
	return nil
}

// Ptr returns the device address of the region's first byte, valid in
// Device's context and, with peer access, in other devices' contexts.
func (m *Mapping) Ptr() DevicePtr { return m.ref.ptr }

// Size returns the region's size in bytes (for ImportFD: the bytes mapped,
// the size asked for rounded up to the granularity).
func (m *Mapping) Size() int64 { return m.ref.size }

// Device returns the device the memory is mapped through.
func (m *Mapping) Device() *Device { return m.ref.dev }

// Region returns the region the mapping was imported from: the zero
// Region for Device.ImportFD, which imports a bare descriptor.
func (m *Mapping) Region() Region { return m.ref.region }

// Local reports whether the mapping is the exporting process's own memory
// (no driver mapping).
func (m *Mapping) Local() bool { return m.ref.entry == nil && m.ref.own == nil }

// ReadAt copies len(p) bytes at offset off of the region into p.
func (m *Mapping) ReadAt(p []byte, off int64) (int, error) {
	if m.ref.isClosed() {
		return 0, closedErr("Mapping", "ReadAt")
	}
	return readAt(m.ref.dev, m.ref.ptr, m.ref.size, p, off)
}

// WriteAt copies p into the region at offset off.
func (m *Mapping) WriteAt(p []byte, off int64) (int, error) {
	if m.ref.isClosed() {
		return 0, closedErr("Mapping", "WriteAt")
	}
	return writeAt(m.ref.dev, m.ref.ptr, m.ref.size, p, off)
}

// Close releases the mapping; the last Close of an allocation's mappings
// unmaps it. Closing twice is not an error.
func (m *Mapping) Close() error {
	m.cleanup.Stop()
	return m.ref.release()
}
