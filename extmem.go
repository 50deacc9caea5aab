package cudaipc

import (
	"errors"
	"fmt"
	"os"
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

// ExportPointer exports size bytes at ptr on dev, whoever allocated them in
// this process, by asking the driver what the memory is, and returns the
// region and the descriptors to send beside it:
//
//   - VMM memory (cuMemCreate + cuMemMap, e.g. PyTorch with
//     expandable_segments:True) whose allocations allow POSIX
//     file-descriptor handles: every physical allocation under the range is
//     retained (cuMemRetainAllocationHandle) and exported
//     (cuMemExportToShareableHandle). The region is KindVMMFD, of version
//     2 when the range spans several allocations, with a fresh random
//     AllocationID per piece; files holds one descriptor per piece, first
//     piece first (Import takes them with WithFiles). The descriptors work
//     in any container; they keep the memory alive even after this process
//     frees it or exits. Close them once sent.
//   - memory from cuMemAlloc/cudaMalloc: a legacy KindCUDAIPC region
//     (Export) and no files; it opens only in this PID namespace and only
//     while this process lives.
//   - anything else (cudaMallocAsync pools without an IPC handle type, VMM
//     memory without the descriptor handle type, managed or host memory):
//     a *NotExportableError naming what the allocator must be configured
//     with.
//
// Each call draws new allocation ids, so importers of two exports of the
// same memory map it twice: export once and hand the region out.
func ExportPointer(dev *Device, ptr DevicePtr, size int64) (r Region, files []*os.File, err error) {
	switch {
	case dev == nil:
		return Region{}, nil, &ArgError{Op: "ExportPointer", Arg: "device", Reason: "nil"}
	case ptr == 0:
		return Region{}, nil, &ArgError{Op: "ExportPointer", Arg: "pointer", Reason: "nil device pointer"}
	case size <= 0:
		return Region{}, nil, &ArgError{Op: "ExportPointer", Arg: "size", Reason: fmt.Sprintf("%d: must be positive", size)}
	case uint64(ptr)+uint64(size) < uint64(ptr):
		return Region{}, nil, &ArgError{Op: "ExportPointer", Arg: "size", Reason: "the range wraps around the address space"}
	}
	var mtype int32
	if err := dev.do(func() error {
		var e error
		mtype, e = cu.PointerGetAttributeInt32(cu.PointerAttrMemoryType, cu.DevicePtr(ptr))
		return e
	}); err != nil {
		return Region{}, nil, &NotExportableError{Ptr: ptr, Allocator: "not memory the CUDA driver knows", Fix: FixHost, Err: err}
	}
	if cu.MemoryType(mtype) == cu.MemoryTypeHost {
		return Region{}, nil, &NotExportableError{Ptr: ptr, Allocator: "host memory", Fix: FixHost}
	}
	r, files, err = exportVMM(dev, ptr, size)
	if err == nil {
		return r, files, nil
	}
	if !errors.Is(err, errNotVMM) {
		return Region{}, nil, err
	}
	pi, err := dev.PointerInfo(ptr)
	if err != nil {
		return Region{}, nil, fmt.Errorf("cudaipc: ExportPointer: %#x: %w", uint64(ptr), err)
	}
	if pi.Managed {
		return Region{}, nil, &NotExportableError{Ptr: ptr, Allocator: "managed (unified) memory", Fix: FixManaged}
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
		return Region{}, nil, &NotExportableError{Ptr: ptr, Allocator: what, Fix: FixPool}
	}
	r, err = Export(dev, ptr, size)
	return r, nil, err
}

var errNotVMM = errors.New("not VMM memory")

// exportVMM walks the mappings under [ptr, ptr+size) and exports the
// allocation of each, making the KindVMMFD region of the range. It returns
// errNotVMM when ptr is not VMM memory.
func exportVMM(dev *Device, ptr DevicePtr, size int64) (r Region, files []*os.File, err error) {
	defer func() {
		if err != nil {
			for _, f := range files {
				f.Close()
			}
			files = nil
		}
	}()
	self, err := SelfIdentity()
	if err != nil {
		return Region{}, nil, err
	}
	r = Region{Version: RegionVersion, Kind: KindVMMFD, Size: size, Device: dev.uuid,
		ExporterPID: self.PID, PIDNamespace: self.PIDNamespace, BootID: self.BootID}
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
			return Region{}, files, err
		}
		if !first && base != next {
			// cuMemGetAddressRange of the first byte after a mapping gave
			// a range that starts elsewhere: the driver's view changed.
			syscall.Close(fd)
			return Region{}, files, fmt.Errorf("cudaipc: ExportPointer: the mapping at %#x starts at %#x, not where the previous one ended", next, base)
		}
		files = append(files, os.NewFile(uintptr(fd), "cuda-vmm:"+dev.uuid.String()))
		if first {
			r.AllocationID, r.AllocSize, r.ExporterBase = NewAllocationID(), int64(msize), DevicePtr(base)
			r.Offset = int64(uint64(ptr) - base)
		} else {
			if len(r.MorePieces)+1 >= MaxRegionPieces {
				return Region{}, files, &ArgError{Op: "ExportPointer", Arg: "size", Reason: fmt.Sprintf("the range spans more than %d physical allocations; export it in parts", MaxRegionPieces)}
			}
			r.Version = RegionVersionPieces
			r.MorePieces = append(r.MorePieces, Piece{NewAllocationID(), int64(msize)})
		}
		next = base + msize
	}
	return r, files, r.Validate()
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
	m, err := importPieces("ReadOnlyMappingSupported", d, []*os.File{f}, []int64{b.Size()}, ReadOnly)
	f.Close()
	if err != nil {
		return false, nil // the driver refuses PROT_READ mappings
	}
	defer d.do(func() error { return unmapPieces(cu.DevicePtr(m.ptr), m.sizes, m.handles) })
	werr := d.Memset(m.ptr, 0, 4)
	got := make([]byte, 4)
	if _, err := b.ReadAt(got, 0); err != nil {
		return false, err
	}
	return werr != nil && string(got) == string(want), nil
}
