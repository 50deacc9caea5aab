package cudaipc

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"runtime"
	"sync"
	"syscall"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// This file shares memory that someone else allocated (PyTorch, CuPy, a
// custom allocator): ExportPointer asks the driver what the memory is and
// exports it the way that memory allows. docs/containers.md has the table
// of allocators and what they give.

// ErrNotExportable matches a *NotExportableError.
var ErrNotExportable = errors.New("cudaipc: memory cannot be exported")

// NotExportableError says why ExportPointer cannot share memory and what
// the allocator must be configured with so that it can.
type NotExportableError struct {
	Ptr       DevicePtr
	Allocator string // what the driver says the memory is, e.g. "a cudaMallocAsync pool without an IPC handle type"
	Fix       string // what to change
	Err       error  // the driver's answer, if any
}

func (e *NotExportableError) Error() string {
	s := fmt.Sprintf("cudaipc: cannot export %#x: it is %s; %s", uint64(e.Ptr), e.Allocator, e.Fix)
	if e.Err != nil {
		s += " (" + e.Err.Error() + ")"
	}
	return s
}

// Is reports whether target is ErrNotExportable.
func (e *NotExportableError) Is(target error) bool { return target == ErrNotExportable }

// Unwrap returns the driver's error.
func (e *NotExportableError) Unwrap() error { return e.Err }

// Fixes named by NotExportableError, also used by the Python client's
// messages (docs/containers.md).
const (
	FixPool    = "allocate from a pool created with the POSIX file-descriptor handle type (cudaMemPoolCreate with handleTypes = cudaMemHandleTypePosixFileDescriptor), or in PyTorch set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead of backend:cudaMallocAsync"
	FixVMMNoFD = "create it with cuMemCreate and requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (PyTorch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True does)"
	FixManaged = "allocate it with cudaMalloc/cuMemAlloc (same PID namespace only) or with cuMemCreate and the POSIX file-descriptor handle type (any container); managed memory cannot be shared between processes"
	FixHost    = "put host data in the store as a host object (Client.Create on \"host\", cudaipc put)"
)

// PieceLayout says how an exported byte range lies in the physical
// allocations that back it. A VA range of an expandable allocator (PyTorch's
// expandable segments) is backed by several allocations mapped back to
// back; Pieces lists the size of each mapping, in address order, and the
// range starts Offset bytes into the first. One descriptor per piece
// travels beside it, in the same order.
type PieceLayout struct {
	Offset int64   // start of the range from the start of the first piece
	Size   int64   // length of the range
	Pieces []int64 // size of each mapped allocation, in address order
}

// MaxPieces bounds PieceLayout.Pieces: the store's protocol passes one
// descriptor per piece in one packet.
const MaxPieces = 64

// Validate checks that the range lies within the pieces.
func (l PieceLayout) Validate() error {
	bad := func(field, format string, a ...any) error {
		return &ArgError{Op: "PieceLayout", Arg: field, Reason: fmt.Sprintf(format, a...)}
	}
	if len(l.Pieces) == 0 || len(l.Pieces) > MaxPieces {
		return bad("pieces", "%d: want 1..%d", len(l.Pieces), MaxPieces)
	}
	var total int64
	for i, p := range l.Pieces {
		if p <= 0 || p > math.MaxInt64/2-total {
			return bad("pieces", "piece %d has size %d", i, p)
		}
		total += p
	}
	switch {
	case l.Size <= 0:
		return bad("size", "%d: must be positive", l.Size)
	case l.Offset < 0 || l.Offset >= l.Pieces[0]:
		return bad("offset", "%d: must lie in the first piece (%d bytes)", l.Offset, l.Pieces[0])
	case l.Size > total-l.Offset:
		return bad("size", "%d bytes from offset %d run past the pieces' %d bytes", l.Size, l.Offset, total)
	}
	return nil
}

// Total returns the sum of the pieces' sizes.
func (l PieceLayout) Total() int64 {
	var t int64
	for _, p := range l.Pieces {
		t += p
	}
	return t
}

// PointerExport is what ExportPointer made of someone else's memory:
// either a legacy region (cuMemAlloc memory: Legacy is set, same PID
// namespace only) or VMM memory as descriptors (Files, one per piece of
// Layout: any container). Close closes the descriptors; send them first.
type PointerExport struct {
	Device UUID
	Legacy *Region
	Layout PieceLayout
	Files  []*os.File
}

// VMM reports whether the export is descriptors (true) or a legacy region.
func (e *PointerExport) VMM() bool { return e.Legacy == nil }

// Close closes the exported descriptors. The memory stays with its
// allocator; importers keep their own references.
func (e *PointerExport) Close() error {
	var errs []error
	for _, f := range e.Files {
		errs = append(errs, f.Close())
	}
	e.Files = nil
	return errors.Join(errs...)
}

// ExportPointer exports size bytes at ptr on dev, whoever allocated them in
// this process, by asking the driver what the memory is:
//
//   - VMM memory (cuMemCreate + cuMemMap, e.g. PyTorch with
//     expandable_segments:True) whose allocations allow POSIX
//     file-descriptor handles: every physical allocation under the range is
//     retained (cuMemRetainAllocationHandle) and exported
//     (cuMemExportToShareableHandle), giving Files and Layout. The
//     descriptors work in any container; they keep the memory alive even
//     after this process frees it or exits.
//   - memory from cuMemAlloc/cudaMalloc: a legacy KindCUDAIPC region
//     (Export), which opens only in this PID namespace and only while this
//     process lives.
//   - anything else (cudaMallocAsync pools without an IPC handle type, VMM
//     memory without the descriptor handle type, managed or host memory):
//     a *NotExportableError naming what the allocator must be configured
//     with.
func ExportPointer(dev *Device, ptr DevicePtr, size int64) (*PointerExport, error) {
	switch {
	case dev == nil:
		return nil, &ArgError{Op: "ExportPointer", Arg: "device", Reason: "nil"}
	case ptr == 0:
		return nil, &ArgError{Op: "ExportPointer", Arg: "pointer", Reason: "nil device pointer"}
	case size <= 0:
		return nil, &ArgError{Op: "ExportPointer", Arg: "size", Reason: fmt.Sprintf("%d: must be positive", size)}
	case uint64(ptr)+uint64(size) < uint64(ptr):
		return nil, &ArgError{Op: "ExportPointer", Arg: "size", Reason: "the range wraps around the address space"}
	}
	var mtype int32
	if err := dev.do(func() error {
		var e error
		mtype, e = cu.PointerGetAttributeInt32(cu.PointerAttrMemoryType, cu.DevicePtr(ptr))
		return e
	}); err != nil {
		return nil, &NotExportableError{Ptr: ptr, Allocator: "not memory the CUDA driver knows", Fix: FixHost, Err: err}
	}
	if cu.MemoryType(mtype) == cu.MemoryTypeHost {
		return nil, &NotExportableError{Ptr: ptr, Allocator: "host memory", Fix: FixHost}
	}
	files, layout, err := exportVMM(dev, ptr, size)
	if err == nil {
		return &PointerExport{Device: dev.uuid, Layout: layout, Files: files}, nil
	}
	if !errors.Is(err, errNotVMM) {
		return nil, err
	}
	pi, err := dev.PointerInfo(ptr)
	if err != nil {
		return nil, fmt.Errorf("cudaipc: ExportPointer: %#x: %w", uint64(ptr), err)
	}
	if pi.Managed {
		return nil, &NotExportableError{Ptr: ptr, Allocator: "managed (unified) memory", Fix: FixManaged}
	}
	if !pi.IPC {
		var pool uint64
		dev.do(func() error {
			pool, _ = cu.PointerGetAttributeUint64(cu.PointerAttrMempoolHandle, cu.DevicePtr(ptr))
			return nil
		})
		what := "memory that is neither VMM nor legacy-IPC capable"
		if pool != 0 {
			what = "memory of a stream-ordered pool (cudaMallocAsync) without an IPC handle type"
		}
		return nil, &NotExportableError{Ptr: ptr, Allocator: what, Fix: FixPool}
	}
	r, err := Export(dev, ptr, size)
	if err != nil {
		return nil, err
	}
	return &PointerExport{Device: dev.uuid, Legacy: &r}, nil
}

var errNotVMM = errors.New("not VMM memory")

// exportVMM walks the mappings under [ptr, ptr+size) and exports the
// allocation of each. It returns errNotVMM when ptr is not VMM memory.
func exportVMM(dev *Device, ptr DevicePtr, size int64) (files []*os.File, layout PieceLayout, err error) {
	defer func() {
		if err != nil {
			for _, f := range files {
				f.Close()
			}
			files = nil
		}
	}()
	layout.Size = size
	end := uint64(ptr) + uint64(size)
	next := uint64(ptr)
	for first := true; next < end; first = false {
		var (
			base, msize uint64
			fd          = -1
		)
		err = dev.do(func() error {
			h, e := cu.MemRetainAllocationHandle(cu.DevicePtr(next))
			if e != nil {
				if first && (errors.Is(e, ErrInvalidValue) || errors.Is(e, ErrNotSupported)) {
					return errNotVMM
				}
				return fmt.Errorf("cudaipc: ExportPointer: %#x: %w", next, e)
			}
			defer cu.MemRelease(h)
			b, s, e := cu.MemGetAddressRange(cu.DevicePtr(next))
			if e != nil {
				return e
			}
			base, msize = uint64(b), s
			prop, e := cu.MemGetAllocationPropertiesFromHandle(h)
			if e != nil {
				return e
			}
			if prop.RequestedHandleTypes&cu.MemHandleTypePosixFD == 0 {
				return &NotExportableError{Ptr: DevicePtr(next), Allocator: fmt.Sprintf("VMM memory allocated without the POSIX file-descriptor handle type (requestedHandleTypes %#x)", prop.RequestedHandleTypes), Fix: FixVMMNoFD}
			}
			syscall.ForkLock.RLock()
			defer syscall.ForkLock.RUnlock()
			if fd, e = cu.MemExportToShareableHandleFD(h); e != nil {
				return e
			}
			syscall.CloseOnExec(fd)
			return nil
		})
		if err != nil {
			return nil, layout, err
		}
		switch {
		case first:
			layout.Offset = int64(uint64(ptr) - base)
		case base != next:
			// cuMemGetAddressRange of the first byte after a mapping gave
			// a range that starts elsewhere: the driver's view changed.
			syscall.Close(fd)
			return nil, layout, fmt.Errorf("cudaipc: ExportPointer: the mapping at %#x starts at %#x, not where the previous one ended", next, base)
		}
		files = append(files, os.NewFile(uintptr(fd), "cuda-vmm:"+dev.uuid.String()))
		layout.Pieces = append(layout.Pieces, int64(msize))
		if len(layout.Pieces) > MaxPieces {
			return nil, layout, &ArgError{Op: "ExportPointer", Arg: "size", Reason: fmt.Sprintf("the range spans more than %d physical allocations; export it in parts", MaxPieces)}
		}
		next = base + msize
	}
	return files, layout, layout.Validate()
}

// Access is how an importer may touch memory it maps.
type Access int

const (
	// ReadOnly maps with CU_MEM_ACCESS_FLAGS_PROT_READ: a write through the
	// mapping fails (a memset with ErrInvalidValue, a kernel's store with
	// an illegal-address fault that ruins the writer's context) and the
	// memory is unchanged. The default for leases.
	ReadOnly Access = iota
	// ReadWrite maps with CU_MEM_ACCESS_FLAGS_PROT_READWRITE.
	ReadWrite
)

func (a Access) flags() cu.MemAccessFlags {
	if a == ReadWrite {
		return cu.MemAccessFlagsProtReadWrite
	}
	return cu.MemAccessFlagsProtRead
}

func (a Access) String() string {
	if a == ReadWrite {
		return "read-write"
	}
	return "read-only"
}

// PieceMapping is memory exported by ExportPointer (in this or another
// process) mapped into this process: one reserved range with each piece
// mapped in order. Ptr is the exported range's first byte. It implements
// io.ReaderAt (and io.WriterAt, which fails on a read-only mapping). A
// PieceMapping keeps the physical memory alive until Close, whatever the
// exporter does.
type PieceMapping struct {
	dev     *Device
	layout  PieceLayout
	access  Access
	base    cu.DevicePtr
	handles []cu.MemGenericAllocationHandle

	mu      sync.Mutex
	closed  bool
	cleanup runtime.Cleanup
}

type pieceLeak struct {
	dev     *Device
	base    cu.DevicePtr
	pieces  []int64
	handles []cu.MemGenericAllocationHandle
}

func freeLeakedPieces(l pieceLeak) {
	slog.Warn("cudaipc: PieceMapping garbage-collected without being closed; releasing it", "device", l.dev.ordinal, "pieces", len(l.pieces))
	if err := l.dev.do(func() error { return unmapPieces(l.base, l.pieces, l.handles) }); err != nil {
		slog.Warn("cudaipc: releasing a leaked PieceMapping failed", "err", err)
	}
	live.pieceMappings.Add(-1)
}

// unmapPieces unmaps each piece mapped at base (cuMemUnmap takes whole
// mappings), frees the reservation and drops the handles. base 0 means
// nothing is mapped.
func unmapPieces(base cu.DevicePtr, pieces []int64, handles []cu.MemGenericAllocationHandle) error {
	var errs []error
	if base != 0 {
		at, total := base, uint64(0)
		for _, n := range pieces {
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

// ImportPieces maps memory exported by ExportPointer: files[i] is the
// descriptor of layout.Pieces[i]. It does not take the files; close them
// after the call. Each import costs milliseconds: keep mappings.
func (d *Device) ImportPieces(files []*os.File, layout PieceLayout, access Access) (*PieceMapping, error) {
	if err := layout.Validate(); err != nil {
		return nil, err
	}
	if len(files) != len(layout.Pieces) {
		return nil, &ArgError{Op: "ImportPieces", Arg: "files", Reason: fmt.Sprintf("%d descriptors for %d pieces", len(files), len(layout.Pieces))}
	}
	if access != ReadOnly && access != ReadWrite {
		return nil, &ArgError{Op: "ImportPieces", Arg: "access", Reason: fmt.Sprintf("unknown access %d", access)}
	}
	for i, f := range files {
		if f == nil {
			return nil, &ArgError{Op: "ImportPieces", Arg: "files", Reason: fmt.Sprintf("descriptor %d is nil", i)}
		}
	}
	if !d.VMMFDSupported() {
		return nil, notSupported("ImportPieces", d)
	}
	total := layout.Total()
	m := &PieceMapping{dev: d, layout: layout, access: access}
	err := d.do(func() error {
		var gran uint64
		for i, f := range files {
			rc, err := f.SyscallConn()
			if err != nil {
				return &ArgError{Op: "ImportPieces", Arg: "files", Reason: err.Error()}
			}
			var h cu.MemGenericAllocationHandle
			var e error
			if cerr := rc.Control(func(fd uintptr) { h, e = cu.MemImportFromShareableHandleFD(int(fd)) }); cerr != nil {
				return &ArgError{Op: "ImportPieces", Arg: "files", Reason: fmt.Sprintf("descriptor %d: %v", i, cerr)}
			}
			if e != nil {
				return fmt.Errorf("cudaipc: ImportPieces: piece %d: %w", i, e)
			}
			m.handles = append(m.handles, h)
			prop, e := cu.MemGetAllocationPropertiesFromHandle(h)
			if e != nil {
				prop = cu.DevicePinnedProp(d.dev, cu.MemHandleTypePosixFD)
			}
			g, e := cu.MemGetAllocationGranularity(prop, cu.MemAllocGranularityMinimum)
			if e != nil {
				return e
			}
			if layout.Pieces[i]%int64(g) != 0 {
				return &ArgError{Op: "ImportPieces", Arg: "pieces", Reason: fmt.Sprintf("piece %d: %d bytes is not a multiple of the %d-byte granularity", i, layout.Pieces[i], g)}
			}
			gran = max(gran, g)
		}
		p, e := cu.MemAddressReserve(uint64(total), gran)
		if e != nil {
			return e
		}
		at := p
		for i, h := range m.handles {
			if e := cu.MemMap(at, uint64(layout.Pieces[i]), h); e != nil {
				unmapPieces(p, layout.Pieces[:i], nil)
				if errors.Is(e, ErrInvalidValue) || errors.Is(e, ErrNotSupported) {
					e = fmt.Errorf("%w (is piece %d, %d bytes, larger than its allocation?)", e, i, layout.Pieces[i])
				}
				return e
			}
			at += cu.DevicePtr(layout.Pieces[i])
		}
		// Access per mapping: a range that spans several mappings is not
		// documented to work in one call.
		at = p
		for _, n := range layout.Pieces {
			if e := cu.MemSetAccess(at, uint64(n), d.dev, access.flags()); e != nil {
				unmapPieces(p, layout.Pieces, nil)
				return e
			}
			at += cu.DevicePtr(n)
		}
		m.base = p
		return nil
	})
	if err != nil {
		d.do(func() error { return unmapPieces(0, nil, m.handles) })
		return nil, err
	}
	live.pieceMappings.Add(1)
	m.cleanup = runtime.AddCleanup(m, freeLeakedPieces, pieceLeak{d, m.base, layout.Pieces, m.handles})
	return m, nil
}

// Device returns the device the memory is mapped for.
func (m *PieceMapping) Device() *Device { return m.dev }

// Ptr returns the address of the exported range's first byte here.
func (m *PieceMapping) Ptr() DevicePtr { return DevicePtr(m.base) + DevicePtr(m.layout.Offset) }

// Size returns the exported range's length.
func (m *PieceMapping) Size() int64 { return m.layout.Size }

// Access returns how the memory is mapped.
func (m *PieceMapping) Access() Access { return m.access }

// Layout returns the pieces the mapping was made from.
func (m *PieceMapping) Layout() PieceLayout { return m.layout }

func (m *PieceMapping) check(op string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return closedErr("PieceMapping", op)
	}
	return nil
}

// ReadAt copies len(p) bytes at offset off of the range into p.
func (m *PieceMapping) ReadAt(p []byte, off int64) (int, error) {
	if err := m.check("ReadAt"); err != nil {
		return 0, err
	}
	return readAt(m.dev, m.Ptr(), m.layout.Size, p, off)
}

// WriteAt copies p into the range at offset off; on a read-only mapping
// the driver refuses it.
func (m *PieceMapping) WriteAt(p []byte, off int64) (int, error) {
	if err := m.check("WriteAt"); err != nil {
		return 0, err
	}
	return writeAt(m.dev, m.Ptr(), m.layout.Size, p, off)
}

// Close unmaps the range and drops this process's references to the
// pieces. Closing twice is not an error.
func (m *PieceMapping) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	m.cleanup.Stop()
	live.pieceMappings.Add(-1)
	return m.dev.do(func() error { return unmapPieces(m.base, m.layout.Pieces, m.handles) })
}

var roProbe sync.Map // *Device -> roResult

type roResult struct {
	ok  bool
	err error
}

// ReadOnlyMappingSupported probes, once per device, whether the driver
// maps shared memory read-only and refuses writes through such a mapping:
// it exports a granule to itself, maps it with ReadOnly, and checks that a
// memset through the mapping fails and leaves the bytes unchanged.
func ReadOnlyMappingSupported(d *Device) (bool, error) {
	if v, ok := roProbe.Load(d); ok {
		r := v.(roResult)
		return r.ok, r.err
	}
	ok, err := probeReadOnly(d)
	roProbe.Store(d, roResult{ok, err})
	return ok, err
}

func probeReadOnly(d *Device) (bool, error) {
	if !d.VMMFDSupported() {
		return false, nil
	}
	b, err := d.AllocShareable(1)
	if err != nil {
		return false, err
	}
	defer b.Free()
	want := []byte{0x5a, 0xa5, 0x3c, 0xc3}
	if _, err := b.WriteAt(want, 0); err != nil {
		return false, err
	}
	f, err := b.ExportFD()
	if err != nil {
		return false, err
	}
	m, err := d.ImportPieces([]*os.File{f}, PieceLayout{Size: b.Size(), Pieces: []int64{b.Size()}}, ReadOnly)
	f.Close()
	if err != nil {
		return false, nil // the driver refuses PROT_READ mappings
	}
	defer m.Close()
	werr := d.Memset(m.Ptr(), 0, 4)
	got := make([]byte, 4)
	if _, err := b.ReadAt(got, 0); err != nil {
		return false, err
	}
	return werr != nil && string(got) == string(want), nil
}
