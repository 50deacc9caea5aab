package cudaipc

import (
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"sync/atomic"
	"syscall"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// This file is the file-descriptor path of sharing device memory: memory
// made with the virtual memory management (VMM) API, exported as a POSIX
// file descriptor and sent over a Unix socket with SCM_RIGHTS. Unlike
// legacy IPC handles, which name the exporting process and only open in
// its PID namespace, a descriptor works across PID namespaces, i.e. between
// containers that share the GPU. docs/fd-sharing.md has the rules.

func notSupported(op string, d *Device) error {
	return fmt.Errorf("cudaipc: %s: %s does not support POSIX file-descriptor handles (VMMFDSupported is false): %w", op, d, ErrNotSupported)
}

// VMMGranularity returns the size and alignment unit of shareable
// allocations on this device (the driver's minimum granularity for pinned
// device memory exportable as a POSIX file descriptor; 2 MiB on current
// GPUs). AllocShareable and ImportFD round sizes up to it.
func (d *Device) VMMGranularity() (int64, error) {
	if !d.VMMFDSupported() {
		return 0, notSupported("VMMGranularity", d)
	}
	var g uint64
	err := d.do(func() error {
		var e error
		g, e = cu.MemGetAllocationGranularity(cu.DevicePinnedProp(d.dev, cu.MemHandleTypePosixFD), cu.MemAllocGranularityMinimum)
		return e
	})
	return int64(g), err
}

// roundUp rounds size up to a multiple of gran, or reports overflow.
func roundUp(op string, size, gran int64) (int64, error) {
	if gran <= 0 {
		return 0, fmt.Errorf("cudaipc: %s: the driver reported granularity %d", op, gran)
	}
	if size > math.MaxInt64-(gran-1) {
		return 0, &ArgError{Op: op, Arg: "size", Reason: fmt.Sprintf("%d overflows when rounded up to the %d-byte granularity", size, gran)}
	}
	return (size + gran - 1) / gran * gran, nil
}

// mapHandle reserves address space for size bytes, maps h there and grants
// dev read-write access, undoing what it did if a step fails. It runs in
// Device.do.
func mapHandle(dev cu.Device, h cu.MemGenericAllocationHandle, size, align int64) (cu.DevicePtr, error) {
	return mapHandleAccess(dev, h, size, align, ReadWrite)
}

// mapHandleAccess is mapHandle granting access a instead of read-write.
func mapHandleAccess(dev cu.Device, h cu.MemGenericAllocationHandle, size, align int64, a Access) (cu.DevicePtr, error) {
	p, err := cu.MemAddressReserve(uint64(size), uint64(align))
	if err != nil {
		return 0, err
	}
	if err := cu.MemMap(p, uint64(size), h); err != nil {
		return 0, errors.Join(err, cu.MemAddressFree(p, uint64(size)))
	}
	if err := cu.MemSetAccess(p, uint64(size), dev, a.flags()); err != nil {
		return 0, errors.Join(err, cu.MemUnmap(p, uint64(size)), cu.MemAddressFree(p, uint64(size)))
	}
	return p, nil
}

// unmapRelease undoes mapHandle and drops h. It runs in Device.do and tries
// every step even if one fails.
func unmapRelease(p cu.DevicePtr, size int64, h cu.MemGenericAllocationHandle) error {
	return errors.Join(cu.MemUnmap(p, uint64(size)), cu.MemAddressFree(p, uint64(size)), cu.MemRelease(h))
}

// vmmLeak is what a cleanup backstop needs to tear down a mapping whose
// owner was garbage-collected without Free or Close.
type vmmLeak struct {
	what    string
	dev     *Device
	handle  cu.MemGenericAllocationHandle
	ptr     cu.DevicePtr
	size    int64
	counter *atomic.Int64 // the LiveObjects count to decrement
}

func freeLeakedVMM(l vmmLeak) {
	releaseLeaked(l.what, l.dev, l.size, l.counter, func() error { return unmapRelease(l.ptr, l.size, l.handle) })
}

// ShareableBuffer is device memory allocated with the VMM API (cuMemCreate)
// so that it can be exported as a POSIX file descriptor (ExportFD) and
// imported by another process, in the same container or another one, with
// ImportFD. It is mapped read-write for its device in this process, and
// implements io.ReaderAt and io.WriterAt with synchronous copies.
//
// Free (or Close) unmaps it and drops this process's reference. The
// physical memory lives on while any importer's mapping or any exported
// descriptor still refers to it. A ShareableBuffer that becomes
// unreachable without Free is released by a cleanup and the leak is logged.
type ShareableBuffer struct {
	deviceRange
	handle cu.MemGenericAllocationHandle
	gran   int64
	id     AllocationID // drawn at allocation; names it in every Region

	cleanup runtime.Cleanup
}

// AllocShareable allocates at least size bytes of device memory that can be
// exported as a POSIX file descriptor. The size is rounded up to the
// device's VMM granularity (Granularity reports it, Size the rounded size).
// The memory is not initialized. It returns an error matching
// ErrNotSupported, before any driver call, on a device without POSIX
// file-descriptor handles (see VMMFDSupported).
func (d *Device) AllocShareable(size int64) (*ShareableBuffer, error) {
	if size <= 0 {
		return nil, &ArgError{Op: "AllocShareable", Arg: "size", Reason: fmt.Sprintf("%d: must be positive", size)}
	}
	if !d.VMMFDSupported() {
		return nil, notSupported("AllocShareable", d)
	}
	gran, err := d.VMMGranularity()
	if err != nil {
		return nil, err
	}
	rounded, err := roundUp("AllocShareable", size, gran)
	if err != nil {
		return nil, err
	}
	var h cu.MemGenericAllocationHandle
	var p cu.DevicePtr
	err = d.do(func() error {
		var e error
		if h, e = cu.MemCreate(uint64(rounded), cu.DevicePinnedProp(d.dev, cu.MemHandleTypePosixFD)); e != nil {
			return e
		}
		if p, e = mapHandle(d.dev, h, rounded, gran); e != nil {
			return errors.Join(e, cu.MemRelease(h))
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	b := &ShareableBuffer{deviceRange: deviceRange{what: "ShareableBuffer", dev: d, ptr: DevicePtr(p), size: rounded}, handle: h, gran: gran, id: NewAllocationID()}
	live.shareableBuffers.Add(1)
	b.cleanup = runtime.AddCleanup(b, freeLeakedVMM, vmmLeak{"ShareableBuffer", d, h, p, rounded, &live.shareableBuffers})
	return b, nil
}

// Granularity returns the unit Size was rounded up to.
func (b *ShareableBuffer) Granularity() int64 { return b.gran }

// AllocationID returns the random id that names the allocation in its
// regions: importers share one mapping per id.
func (b *ShareableBuffer) AllocationID() AllocationID { return b.id }

// Export describes size bytes of the buffer, starting off bytes in, for
// another process: a KindVMMFD Region. The region carries no descriptor:
// send one from ExportFD beside it (once per importing process is enough;
// the importer's cache maps an allocation once, keyed by AllocationID),
// and the importer passes it to Import with WithFile.
func (b *ShareableBuffer) Export(off, size int64) (Region, error) {
	if err := b.check("Export"); err != nil {
		return Region{}, err
	}
	if off < 0 || size <= 0 || off > b.size || size > b.size-off {
		return Region{}, &ArgError{Op: "ShareableBuffer.Export", Arg: "range", Reason: fmt.Sprintf("[%d, %d+%d) is outside the %d-byte buffer", off, off, size, b.size)}
	}
	id, err := SelfIdentity()
	if err != nil {
		return Region{}, err
	}
	r := Region{
		Version: RegionVersion, Kind: KindVMMFD, AllocationID: b.id,
		Offset: off, Size: size, AllocSize: b.size, Device: b.dev.uuid,
		ExporterPID: id.PID, PIDNamespace: id.PIDNamespace, BootID: id.BootID,
		ExporterBase: b.ptr,
	}
	return r, r.Validate()
}

// ExportFD exports the memory as a new POSIX file descriptor
// (cuMemExportToShareableHandle), close-on-exec, on every call. Send it to
// the importing process over a Unix socket with SCM_RIGHTS, then close
// this copy: the receiver's descriptor is a reference of its own.
//
// The descriptor is a bearer capability: whoever holds it can map the
// memory read-write. Send it only to peers you trust.
func (b *ShareableBuffer) ExportFD() (*os.File, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, closedErr("ShareableBuffer", "ExportFD")
	}
	fd := -1
	err := b.dev.do(func() error {
		// The driver may not set O_CLOEXEC; hold ForkLock, as the os
		// package does for such descriptors, so that no child started in
		// between inherits it.
		syscall.ForkLock.RLock()
		defer syscall.ForkLock.RUnlock()
		var e error
		if fd, e = cu.MemExportToShareableHandleFD(b.handle); e != nil {
			return e
		}
		syscall.CloseOnExec(fd)
		return nil
	})
	if err != nil {
		return nil, err
	}
	if fd < 0 {
		return nil, fmt.Errorf("cudaipc: ExportFD: cuMemExportToShareableHandle succeeded but returned descriptor %d", fd)
	}
	return os.NewFile(uintptr(fd), "cuda-vmm:"+b.dev.uuid.String()), nil
}

// Free unmaps the memory and releases this process's handle. Importers'
// mappings and descriptors already exported stay valid (each holds its own
// reference to the physical memory). Freeing twice is not an error. If a
// driver step fails the buffer is still marked freed, since retrying the
// other steps could free what another object now owns.
func (b *ShareableBuffer) Free() error {
	return b.closeOnce(&b.cleanup, &live.shareableBuffers, func() error { return unmapRelease(cu.DevicePtr(b.ptr), b.size, b.handle) })
}

// Close is Free, for io.Closer.
func (b *ShareableBuffer) Close() error { return b.Free() }

// ImportFD maps memory exported with ShareableBuffer.ExportFD (in any
// process, in any PID namespace, that shares the GPU) into this device's
// address space, read-write, and returns the mapping: a Mapping of its
// own, outside the import cache (a bare descriptor names no allocation the
// cache could share; Import of a vmm-fd Region with WithFile does), whose
// Region is the zero Region. It calls
// cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap and
// cuMemSetAccess. Importing costs milliseconds on large allocations: keep
// mappings open and reuse them.
//
// size is how many bytes to map from the start of the allocation; it is
// rounded up to the allocation's granularity, and must not exceed the
// exporter's ShareableBuffer.Size (the driver's cuMemMap rejects a larger
// size with ErrInvalidValue; a descriptor carries no size the importer
// could check first). ImportFD does not take ownership of f: the mapping
// holds its own reference to the memory, so close f once ImportFD returns.
//
// A nil or closed f, or size <= 0, is an *ArgError; a descriptor that is not
// a CUDA memory export fails in the driver with an *Error.
func (d *Device) ImportFD(f *os.File, size int64) (*Mapping, error) {
	vm, err := importPieces("ImportFD", d, []*os.File{f}, []int64{size}, ReadWrite)
	if err != nil {
		return nil, err
	}
	live.fdMappings.Add(1)
	return newMapping(Region{}, d, vm.ptr, &mappingRef{own: &vm, size: vm.size}), nil
}

// importPieces imports the allocation behind each of files and maps them
// back to back in one reserved range, piece i sizes[i] bytes, with access
// a for d: the work of ImportFD, and of Import's cache for KindVMMFD
// regions. A single piece is rounded up to its allocation's granularity;
// several must each be a multiple of theirs, since they lie back to back as
// the exporter mapped them. A map larger than an allocation fails with a
// *mapSizeError. It does not take the files.
func importPieces(op string, d *Device, files []*os.File, sizes []int64, a Access) (vmmMapping, error) {
	if len(files) == 0 || len(files) != len(sizes) {
		return vmmMapping{}, &ArgError{Op: op, Arg: "files", Reason: fmt.Sprintf("%d descriptors for %d pieces", len(files), len(sizes))}
	}
	var total int64
	for i, n := range sizes {
		if n <= 0 || n > math.MaxInt64/4-total {
			return vmmMapping{}, &ArgError{Op: op, Arg: "size", Reason: fmt.Sprintf("%d: must be positive (piece %d)", n, i)}
		}
		total += n
	}
	rcs := make([]syscall.RawConn, len(files))
	for i, f := range files {
		if f == nil {
			return vmmMapping{}, &ArgError{Op: op, Arg: "file", Reason: fmt.Sprintf("nil *os.File (piece %d)", i)}
		}
		rc, err := f.SyscallConn()
		if err != nil {
			return vmmMapping{}, &ArgError{Op: op, Arg: "file", Reason: err.Error()}
		}
		// Control keeps f open (and its descriptor number valid) for the call.
		var open bool
		if err := rc.Control(func(fd uintptr) {
			var st syscall.Stat_t
			open = syscall.Fstat(int(fd), &st) == nil
		}); err != nil {
			return vmmMapping{}, &ArgError{Op: op, Arg: "file", Reason: f.Name() + " is closed"}
		}
		if !open {
			return vmmMapping{}, &ArgError{Op: op, Arg: "file", Reason: f.Name() + " is not an open descriptor (EBADF)"}
		}
		rcs[i] = rc
	}
	if !d.VMMFDSupported() {
		return vmmMapping{}, notSupported(op, d)
	}
	m := vmmMapping{sizes: make([]int64, len(sizes))}
	err := d.do(func() error {
		var gran int64
		for i, f := range files {
			var h cu.MemGenericAllocationHandle
			var e error
			if cerr := rcs[i].Control(func(fd uintptr) { h, e = cu.MemImportFromShareableHandleFD(int(fd)) }); cerr != nil {
				return &ArgError{Op: op, Arg: "file", Reason: f.Name() + " was closed during the call"}
			}
			if e != nil {
				if len(files) > 1 {
					e = fmt.Errorf("piece %d: %w", i, e)
				}
				return e
			}
			m.handles = append(m.handles, h)
			// The allocation's own properties give its granularity; should
			// the driver not report them for an imported handle, this
			// device's granularity for the same kind of memory serves.
			prop, e := cu.MemGetAllocationPropertiesFromHandle(h)
			if e != nil {
				prop = cu.DevicePinnedProp(d.dev, cu.MemHandleTypePosixFD)
			}
			g, e := cu.MemGetAllocationGranularity(prop, cu.MemAllocGranularityMinimum)
			if e != nil {
				return e
			}
			n := sizes[i]
			switch {
			case len(files) == 1:
				if n, e = roundUp(op, n, int64(g)); e != nil {
					return e
				}
			case g == 0 || n%int64(g) != 0:
				return &ArgError{Op: op, Arg: "size", Reason: fmt.Sprintf("piece %d: %d bytes is not a multiple of its allocation's %d-byte granularity", i, n, g)}
			}
			m.sizes[i], m.size = n, m.size+n
			gran = max(gran, int64(g))
		}
		p, e := cu.MemAddressReserve(uint64(m.size), uint64(gran))
		if e != nil {
			return e
		}
		// undo unmaps the first mapped pieces and frees the whole range.
		undo := func(mapped int) error {
			var errs []error
			at := p
			for _, n := range m.sizes[:mapped] {
				errs = append(errs, cu.MemUnmap(at, uint64(n)))
				at += cu.DevicePtr(n)
			}
			return errors.Join(append(errs, cu.MemAddressFree(p, uint64(m.size)))...)
		}
		at := p
		for i, h := range m.handles {
			if e := cu.MemMap(at, uint64(m.sizes[i]), h); e != nil {
				// The H200 driver answers a map larger than the allocation
				// with CUDA_ERROR_NOT_SUPPORTED, other drivers with INVALID_VALUE.
				if errors.Is(e, ErrInvalidValue) || errors.Is(e, ErrNotSupported) {
					e = &mapSizeError{piece: i, pieces: len(files), size: sizes[i], rounded: m.sizes[i], err: e}
				}
				return errors.Join(e, undo(i))
			}
			at += cu.DevicePtr(m.sizes[i])
		}
		// Access per mapping: a range over several mappings is not
		// documented to work in one call.
		at = p
		for _, n := range m.sizes {
			if e := cu.MemSetAccess(at, uint64(n), d.dev, a.flags()); e != nil {
				return errors.Join(e, undo(len(m.sizes)))
			}
			at += cu.DevicePtr(n)
		}
		m.ptr = DevicePtr(p)
		return nil
	})
	if err != nil {
		if len(m.handles) > 0 {
			d.do(func() error { return unmapPieces(0, nil, m.handles) })
		}
		return vmmMapping{}, err
	}
	return m, nil
}

// unmapPieces unmaps each piece mapped back to back at base (cuMemUnmap
// takes whole mappings), frees the reservation and drops the handles; it
// tries every step even if one fails. base 0 means nothing is mapped. It
// runs in Device.do.
func unmapPieces(base cu.DevicePtr, sizes []int64, handles []cu.MemGenericAllocationHandle) error {
	var errs []error
	if base != 0 {
		at, total := base, uint64(0)
		for _, n := range sizes {
			errs = append(errs, cu.MemUnmap(at, uint64(n)))
			at += cu.DevicePtr(n)
			total += uint64(n)
		}
		errs = append(errs, cu.MemAddressFree(base, total))
	}
	for _, h := range handles {
		errs = append(errs, cu.MemRelease(h))
	}
	return errors.Join(errs...)
}

// mapSizeError is a map the driver refused as it refuses one larger than
// the allocation.
type mapSizeError struct {
	piece, pieces int // which piece of how many
	size, rounded int64
	err           error
}

func (e *mapSizeError) Error() string {
	if e.pieces > 1 {
		return fmt.Sprintf("%v (is piece %d, %d bytes, larger than its allocation?)", e.err, e.piece, e.size)
	}
	return fmt.Sprintf("%v (is size %d, rounded to %d, larger than the exported allocation?)", e.err, e.size, e.rounded)
}

func (e *mapSizeError) Unwrap() error { return e.err }

func tooLarge(err error) bool {
	var m *mapSizeError
	return errors.As(err, &m)
}
