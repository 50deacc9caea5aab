package cudaipc

import (
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"sync"
	"sync/atomic"
	"weak"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// DevicePtr is a device address in the unified address space (CUdeviceptr).
type DevicePtr uint64

// Live counts the objects of this package that are open in this process:
// a test that ends with a non-zero count leaked.
type Live struct {
	Buffers, HostBuffers, Streams, Events int64
	// HostRegistrations counts host memory registered by RegisterHost and
	// not yet unregistered.
	HostRegistrations int64
	// Mappings counts Mapping values returned by Import and ImportFD and not
	// yet closed.
	Mappings int64
	// MemHandleOpens counts driver-level opens of legacy handles
	// (Device.OpenMemHandle, and the import cache's opens of KindCUDAIPC
	// regions) not yet closed.
	MemHandleOpens int64
	// ShareableBuffers counts VMM allocations; FDMappings counts imports of
	// their descriptors (Device.ImportFD, and the import cache's mappings
	// of KindVMMFD regions, one for all pieces of a region) not yet closed.
	ShareableBuffers, FDMappings int64
}

var live struct {
	buffers, hostBuffers, streams, events, mappings, memOpens atomic.Int64
	shareableBuffers, fdMappings, hostRegs                    atomic.Int64
}

// LiveObjects returns how many objects are open now.
func LiveObjects() Live {
	return Live{
		Buffers: live.buffers.Load(), HostBuffers: live.hostBuffers.Load(),
		Streams: live.streams.Load(), Events: live.events.Load(), Mappings: live.mappings.Load(),
		MemHandleOpens:   live.memOpens.Load(),
		ShareableBuffers: live.shareableBuffers.Load(), FDMappings: live.fdMappings.Load(),
		HostRegistrations: live.hostRegs.Load(),
	}
}

// Buffer is device memory allocated by this process with cuMemAlloc. It
// implements io.ReaderAt and io.WriterAt with synchronous copies.
//
// Free (or Close) releases it. CUDA leaves it undefined what importers in
// other processes see once the exporter frees: free only after they have
// closed their mappings (the object store does this bookkeeping for you).
// A Buffer that becomes unreachable without Free is freed by a cleanup and
// the leak is logged.
type Buffer struct {
	deviceRange

	localRefs int    // mappings of this buffer opened through Import in this process
	bufferID  uint64 // CU_POINTER_ATTRIBUTE_BUFFER_ID, learnt on first Export; 0 until then
	allocSize int64  // cuMemGetAddressRange's size, learnt with bufferID
	cleanup   runtime.Cleanup
}

// localBuffers finds the Buffer of this package at a base address, so that
// a Region imported in its own exporting process takes a reference on the
// Buffer (and Free refuses while it is held). It is keyed by address rather
// than by buffer id because the address is known at Alloc without another
// driver call; the id is checked at import. Weak pointers keep the leak
// backstop of an unreachable Buffer working.
var localBuffers struct {
	mu sync.Mutex
	m  map[DevicePtr]weak.Pointer[Buffer]
}

func registerBuffer(b *Buffer) {
	localBuffers.mu.Lock()
	defer localBuffers.mu.Unlock()
	if localBuffers.m == nil {
		localBuffers.m = map[DevicePtr]weak.Pointer[Buffer]{}
	}
	localBuffers.m[b.ptr] = weak.Make(b)
}

// unregisterBuffer forgets the Buffer at p if it is b, or if it is gone
// (b == nil, from the leak backstop).
func unregisterBuffer(p DevicePtr, b *Buffer) {
	localBuffers.mu.Lock()
	defer localBuffers.mu.Unlock()
	if w, ok := localBuffers.m[p]; ok && w.Value() == b {
		delete(localBuffers.m, p)
	}
}

func lookupBuffer(p DevicePtr) *Buffer {
	localBuffers.mu.Lock()
	defer localBuffers.mu.Unlock()
	return localBuffers.m[p].Value()
}

type bufferLeak struct {
	dev  *Device
	ptr  DevicePtr
	size int64
}

func freeLeakedBuffer(l bufferLeak) {
	unregisterBuffer(l.ptr, nil)
	releaseLeaked("Buffer", l.dev, l.size, &live.buffers, func() error { return cu.MemFree(cu.DevicePtr(l.ptr)) })
}

// releaseLeaked is the end of every leak backstop: it logs that an object
// of type what was garbage-collected without being closed, releases it in
// its device's context (logging a failure: a cleanup has no caller to tell)
// and drops its live count.
func releaseLeaked(what string, dev *Device, size int64, count *atomic.Int64, release func() error) {
	slog.Warn("cudaipc: "+what+" garbage-collected without being closed; releasing it", "device", dev.ordinal, "size", size)
	if err := dev.do(release); err != nil {
		slog.Warn("cudaipc: releasing leaked "+what+" failed", "err", err)
	}
	count.Add(-1)
}

// Alloc allocates size bytes of device memory (cuMemAlloc). The memory is
// not initialized. Allocations are aligned to at least 256 bytes and can be
// exported with MemHandle.
func (d *Device) Alloc(size int64) (*Buffer, error) {
	if size <= 0 {
		return nil, &ArgError{Op: "Alloc", Arg: "size", Reason: fmt.Sprintf("%d: must be positive", size)}
	}
	var p cu.DevicePtr
	err := d.do(func() error {
		var e error
		p, e = cu.MemAlloc(uint64(size))
		return e
	})
	if err != nil {
		return nil, err
	}
	b := &Buffer{deviceRange: deviceRange{what: "Buffer", dev: d, ptr: DevicePtr(p), size: size}}
	live.buffers.Add(1)
	b.cleanup = runtime.AddCleanup(b, freeLeakedBuffer, bufferLeak{d, b.ptr, size})
	registerBuffer(b)
	return b, nil
}

// deviceRange is device memory of this process that stays usable until
// it is closed: what Buffer and ShareableBuffer share, with
// their Device, Ptr, Size, ReadAt and WriteAt.
type deviceRange struct {
	what string // the owning type, for errors
	dev  *Device
	ptr  DevicePtr
	size int64

	mu     sync.Mutex
	closed bool
}

// Device returns the device that holds the memory (or maps it).
func (r *deviceRange) Device() *Device { return r.dev }

// Ptr returns the memory's device address in this process.
func (r *deviceRange) Ptr() DevicePtr { return r.ptr }

// Size returns the size in bytes.
func (r *deviceRange) Size() int64 { return r.size }

func (r *deviceRange) check(op string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return closedErr(r.what, op)
	}
	return nil
}

// closeOnce marks r closed and, the first time only, stops the leak
// backstop, drops the live count and runs release in the device's
// context. A failing release still leaves r closed, since retrying its
// other steps could free what another object now owns.
func (r *deviceRange) closeOnce(cleanup *runtime.Cleanup, count *atomic.Int64, release func() error) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	cleanup.Stop()
	count.Add(-1)
	return r.dev.do(release)
}

// ReadAt copies len(p) bytes at offset off into p, synchronously
// (io.ReaderAt).
func (r *deviceRange) ReadAt(p []byte, off int64) (int, error) {
	if err := r.check("ReadAt"); err != nil {
		return 0, err
	}
	return readAt(r.dev, r.ptr, r.size, p, off)
}

// WriteAt copies p to offset off and returns once the bytes are in device
// memory (io.WriterAt).
func (r *deviceRange) WriteAt(p []byte, off int64) (int, error) {
	if err := r.check("WriteAt"); err != nil {
		return 0, err
	}
	return writeAt(r.dev, r.ptr, r.size, p, off)
}

// Memset sets every byte of the buffer to v.
func (b *Buffer) Memset(v byte) error {
	if err := b.check("Memset"); err != nil {
		return err
	}
	return b.dev.Memset(b.ptr, v, b.size)
}

// MemHandle exports the buffer for other processes (cuIpcGetMemHandle).
// The handle is a bearer capability: any process on this machine in the
// same PID namespace that holds it can map the memory. Keep it secret.
func (b *Buffer) MemHandle() (MemHandle, error) {
	if err := b.check("MemHandle"); err != nil {
		return MemHandle{}, err
	}
	return b.dev.GetMemHandle(b.ptr)
}

// Free releases the memory. It returns ErrInUse while mappings of the buffer
// imported in this same process are open, and nil when already freed.
func (b *Buffer) Free() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	if b.localRefs > 0 {
		return fmt.Errorf("Free: %w (%d open); close them first", ErrInUse, b.localRefs)
	}
	err := b.dev.do(func() error { return cu.MemFree(cu.DevicePtr(b.ptr)) })
	if err != nil {
		return err
	}
	unregisterBuffer(b.ptr, b)
	b.closed = true
	b.cleanup.Stop()
	live.buffers.Add(-1)
	return nil
}

// Close is Free, for io.Closer.
func (b *Buffer) Close() error { return b.Free() }

// addLocalRef records a same-process mapping of the allocation with the
// given buffer id and size; it fails if the buffer is freed, is another
// allocation at the same address, or is smaller than allocSize. describe
// asks the driver when no Export did.
func (b *Buffer) addLocalRef(id uint64, allocSize int64, describe func() (allocInfo, error)) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return &closedError{call: "Import", object: "Buffer that this process exported the region from"}
	}
	if b.bufferID == 0 {
		a, err := describe()
		if err != nil {
			return fmt.Errorf("cudaipc: Import of a region of this process: %w", err)
		}
		b.bufferID, b.allocSize = a.id, a.size
	}
	if b.bufferID != id {
		return fmt.Errorf("%w: the region names buffer id %d at %#x in this process; the allocation there now is buffer %d", ErrStaleMapping, id, uint64(b.ptr), b.bufferID)
	}
	if allocSize > b.allocSize {
		return regionErr("alloc_size", "%d bytes, but the allocation at %#x is %d bytes (cuMemGetAddressRange)", allocSize, uint64(b.ptr), b.allocSize)
	}
	b.localRefs++
	return nil
}

// setExported records what the driver said of the buffer at its Export.
func (b *Buffer) setExported(id uint64, allocSize int64) {
	b.mu.Lock()
	b.bufferID, b.allocSize = id, allocSize
	b.mu.Unlock()
}

func (b *Buffer) dropLocalRef() {
	b.mu.Lock()
	b.localRefs--
	b.mu.Unlock()
}

func checkRange(op string, size int64, n int, off int64) error {
	if off < 0 || off > size || int64(n) > size-off {
		return &ArgError{Op: op, Arg: "offset", Reason: fmt.Sprintf("[%d, %d) is outside the %d-byte range", off, off+int64(n), size)}
	}
	return nil
}

func readAt(d *Device, base DevicePtr, size int64, p []byte, off int64) (int, error) {
	if off >= size && len(p) > 0 && off >= 0 {
		return 0, io.EOF
	}
	n := len(p)
	var short bool
	if off >= 0 && int64(n) > size-off {
		n, short = int(size-off), true
	}
	if err := checkRange("ReadAt", size, n, off); err != nil {
		return 0, err
	}
	if err := d.CopyFromDevice(p[:n], base+DevicePtr(off)); err != nil {
		return 0, err
	}
	if short {
		return n, io.EOF
	}
	return n, nil
}

func writeAt(d *Device, base DevicePtr, size int64, p []byte, off int64) (int, error) {
	if err := checkRange("WriteAt", size, len(p), off); err != nil {
		return 0, err
	}
	if err := d.CopyToDevice(base+DevicePtr(off), p); err != nil {
		return 0, err
	}
	return len(p), nil
}

// CopyToDevice copies src to device address dst and returns once the bytes
// are in device memory (it waits for the DMA, which the driver alone does
// not for pageable src), so the caller may then hand dst to another process.
func (d *Device) CopyToDevice(dst DevicePtr, src []byte) error {
	return d.do(func() error {
		if err := cu.MemcpyHtoD(cu.DevicePtr(dst), src); err != nil {
			return err
		}
		return settle()
	})
}

// settle waits for the legacy default stream, where the driver queues the
// synchronous copy and memset calls. cuMemcpyHtoD from pageable memory
// returns once the bytes are staged, before the DMA reaches device memory;
// device-to-device copies and memsets do not wait at all. Without this, a
// caller that writes, then tells another process (or unmaps) could race
// the DMA: on the H200 an unmap during such a DMA faulted the context
// (CUDA_ERROR_LAUNCH_FAILED at the next call).
func settle() error { return cu.StreamSynchronize(0) }

// CopyFromDevice copies len(dst) bytes from device address src, synchronously.
func (d *Device) CopyFromDevice(dst []byte, src DevicePtr) error {
	return d.do(func() error { return cu.MemcpyDtoH(dst, cu.DevicePtr(src)) })
}

// Copy copies n bytes between two device addresses, which may be on
// different devices or be mappings imported from other processes, and
// returns when the copy has completed. Stream.CopyAsync does not wait.
func (d *Device) Copy(dst, src DevicePtr, n int64) error {
	if n < 0 {
		return &ArgError{Op: "Copy", Arg: "n", Reason: "negative"}
	}
	return d.do(func() error {
		if err := cu.Memcpy(cu.DevicePtr(dst), cu.DevicePtr(src), uint64(n)); err != nil {
			return err
		}
		return settle()
	})
}

// Memset sets n bytes at p to v and returns when they are set.
func (d *Device) Memset(p DevicePtr, v byte, n int64) error {
	if n < 0 {
		return &ArgError{Op: "Memset", Arg: "n", Reason: "negative"}
	}
	return d.do(func() error {
		if err := cu.MemsetD8(cu.DevicePtr(p), v, uint64(n)); err != nil {
			return err
		}
		return settle()
	})
}

// PointerInfo describes the allocation that holds a device address.
type PointerInfo struct {
	Base     DevicePtr // start of the allocation (cuMemGetAddressRange)
	Size     int64     // size of the allocation
	BufferID uint64    // process-unique id of the allocation; a new allocation at the same address gets a new id
	Device   int       // ordinal of the device that holds the memory
	Managed  bool      // managed (unified) memory, which legacy IPC cannot export
	IPC      bool      // the driver reports the allocation as legacy-IPC capable
}

// PointerInfo returns what the driver knows about the allocation holding p.
func (d *Device) PointerInfo(p DevicePtr) (PointerInfo, error) {
	var pi PointerInfo
	err := d.do(func() error {
		base, size, err := cu.MemGetAddressRange(cu.DevicePtr(p))
		if err != nil {
			return err
		}
		pi.Base, pi.Size = DevicePtr(base), int64(size)
		if pi.BufferID, err = cu.PointerGetAttributeUint64(cu.PointerAttrBufferID, cu.DevicePtr(p)); err != nil {
			return err
		}
		ord, err := cu.PointerGetAttributeInt32(cu.PointerAttrDeviceOrdinal, cu.DevicePtr(p))
		if err != nil {
			return err
		}
		pi.Device = int(ord)
		m, err := cu.PointerGetAttributeInt32(cu.PointerAttrIsManaged, cu.DevicePtr(p))
		if err != nil {
			return err
		}
		pi.Managed = m != 0
		ipc, err := cu.PointerGetAttributeInt32(cu.PointerAttrLegacyIPC, cu.DevicePtr(p))
		if err != nil {
			return err
		}
		pi.IPC = ipc != 0
		return nil
	})
	return pi, err
}

// HostBuffer is page-locked (pinned) host memory from cuMemAllocHost: the
// fastest source and destination for copies, and the only host memory that
// asynchronous copies read or write after they return.
type HostBuffer struct {
	dev     *Device
	mu      sync.Mutex
	b       []byte
	cleanup runtime.Cleanup
}

type hostLeak struct {
	dev *Device
	b   []byte
}

func freeLeakedHost(l hostLeak) {
	releaseLeaked("HostBuffer", l.dev, int64(len(l.b)), &live.hostBuffers, func() error { return cu.MemFreeHost(l.b) })
}

// AllocHost allocates size bytes of pinned host memory.
func (d *Device) AllocHost(size int64) (*HostBuffer, error) {
	if size <= 0 {
		return nil, &ArgError{Op: "AllocHost", Arg: "size", Reason: fmt.Sprintf("%d: must be positive", size)}
	}
	var b []byte
	err := d.do(func() error {
		var e error
		b, e = cu.MemAllocHost(uint64(size))
		return e
	})
	if err != nil {
		return nil, err
	}
	h := &HostBuffer{dev: d, b: b}
	live.hostBuffers.Add(1)
	h.cleanup = runtime.AddCleanup(h, freeLeakedHost, hostLeak{d, b})
	return h, nil
}

// Bytes returns the memory. It must not be used after Free.
func (h *HostBuffer) Bytes() []byte {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.b
}

// Free releases the memory; freeing twice is not an error.
func (h *HostBuffer) Free() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.b == nil {
		return nil
	}
	if err := h.dev.do(func() error { return cu.MemFreeHost(h.b) }); err != nil {
		return err
	}
	h.b = nil
	h.cleanup.Stop()
	live.hostBuffers.Add(-1)
	return nil
}

// HostRegistration is host memory the caller allocated (an anonymous
// mapping, say) page-locked and registered with the driver by
// RegisterHost: copies to and from it run as from a HostBuffer's. The
// caller may fill the memory first (in parallel, so that its pages are
// faulted in by many threads) and register it afterwards, where AllocHost
// faults every page in from one thread. A HostRegistration that becomes
// unreachable without Unregister is unregistered by a cleanup and the
// leak is logged; the memory itself stays the caller's.
type HostRegistration struct {
	dev     *Device
	mu      sync.Mutex
	b       []byte
	cleanup runtime.Cleanup
}

type hostRegLeak struct {
	dev *Device
	b   []byte
}

func unregisterLeakedHost(l hostRegLeak) {
	releaseLeaked("HostRegistration", l.dev, int64(len(l.b)), &live.hostRegs, func() error { return cu.MemHostUnregister(l.b) })
}

// RegisterHost page-locks b and registers it with the driver for every
// context (CU_MEMHOSTREGISTER_PORTABLE). b must stay allocated, and must
// not be registered again, until Unregister.
func (d *Device) RegisterHost(b []byte) (*HostRegistration, error) {
	if len(b) == 0 {
		return nil, &ArgError{Op: "RegisterHost", Arg: "b", Reason: "empty"}
	}
	if err := d.do(func() error { return cu.MemHostRegister(b, cu.MemHostRegisterPortable) }); err != nil {
		return nil, err
	}
	h := &HostRegistration{dev: d, b: b}
	live.hostRegs.Add(1)
	h.cleanup = runtime.AddCleanup(h, unregisterLeakedHost, hostRegLeak{d, b})
	return h, nil
}

// RegisterHostMapped is RegisterHost that also maps b for kernels
// (CU_MEMHOSTREGISTER_DEVICEMAP) and returns the device address at which
// kernels of d's context reach it: a kernel (Gather) then reads or writes
// host memory across the bus, with no copy engine between.
func (d *Device) RegisterHostMapped(b []byte) (*HostRegistration, DevicePtr, error) {
	if len(b) == 0 {
		return nil, 0, &ArgError{Op: "RegisterHostMapped", Arg: "b", Reason: "empty"}
	}
	var ptr DevicePtr
	err := d.do(func() error {
		if err := cu.MemHostRegister(b, cu.MemHostRegisterPortable|cu.MemHostRegisterDeviceMap); err != nil {
			return err
		}
		p, err := cu.MemHostGetDevicePointer(b)
		if err != nil {
			cu.MemHostUnregister(b)
		}
		ptr = DevicePtr(p)
		return err
	})
	if err != nil {
		return nil, 0, err
	}
	h := &HostRegistration{dev: d, b: b}
	live.hostRegs.Add(1)
	h.cleanup = runtime.AddCleanup(h, unregisterLeakedHost, hostRegLeak{d, b})
	return h, ptr, nil
}

// Bytes returns the registered memory.
func (h *HostRegistration) Bytes() []byte {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.b
}

// Unregister unpins the memory, which stays the caller's to free;
// unregistering twice is not an error.
func (h *HostRegistration) Unregister() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.b == nil {
		return nil
	}
	if err := h.dev.do(func() error { return cu.MemHostUnregister(h.b) }); err != nil {
		return err
	}
	h.b = nil
	h.cleanup.Stop()
	live.hostRegs.Add(-1)
	return nil
}
