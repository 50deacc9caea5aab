package cudaipc

import (
	"errors"
	"fmt"
)

// Export describes size bytes at ptr, on dev, for another process: it finds
// the allocation that holds ptr (cuMemGetAddressRange), exports it
// (cuIpcGetMemHandle) and records where ptr lies inside it, so the importer
// maps the right bytes. ptr may be any address inside an allocation made by
// cuMemAlloc or cudaMalloc in this process, including one made by another
// library (PyTorch, CuPy) on dev.
//
// Managed memory, memory from cudaMallocAsync pools and VMM allocations
// cannot be exported this way, and neither can a range that runs past the
// end of its allocation: those are *ArgError (matching ErrInvalidValue).
func Export(dev *Device, ptr DevicePtr, size int64) (Region, error) {
	switch {
	case dev == nil:
		return Region{}, &ArgError{Op: "Export", Arg: "device", Reason: "nil"}
	case ptr == 0:
		return Region{}, &ArgError{Op: "Export", Arg: "pointer", Reason: "nil device pointer"}
	case size <= 0:
		return Region{}, &ArgError{Op: "Export", Arg: "size", Reason: fmt.Sprintf("%d: must be positive", size)}
	}
	pi, err := dev.PointerInfo(ptr)
	if err != nil {
		return Region{}, fmt.Errorf("cudaipc: Export: %#x is not device memory this process can see: %w", uint64(ptr), err)
	}
	switch {
	case pi.Managed:
		return Region{}, &ArgError{Op: "Export", Arg: "pointer", Reason: fmt.Sprintf("%#x is managed (unified) memory, which legacy IPC cannot export; allocate with cuMemAlloc/cudaMalloc", uint64(ptr))}
	case pi.Device != dev.ordinal:
		return Region{}, &ArgError{Op: "Export", Arg: "pointer", Reason: fmt.Sprintf("%#x is memory of GPU %d, not of %s", uint64(ptr), pi.Device, dev)}
	}
	off := int64(ptr - pi.Base)
	if size > pi.Size-off {
		return Region{}, &ArgError{Op: "Export", Arg: "size", Reason: fmt.Sprintf("[%d, %d+%d) runs past the end of the %d-byte allocation at %#x", off, off, size, pi.Size, uint64(pi.Base))}
	}
	h, err := dev.GetMemHandle(pi.Base)
	if err != nil {
		if !pi.IPC && errors.Is(err, ErrInvalidValue) {
			return Region{}, fmt.Errorf("cudaipc: Export: the allocation at %#x is not legacy-IPC capable (memory from cudaMallocAsync pools or cuMemCreate cannot be exported with cuIpcGetMemHandle): %w", uint64(pi.Base), err)
		}
		return Region{}, err
	}
	id, err := SelfIdentity()
	if err != nil {
		return Region{}, err
	}
	if b := lookupBuffer(pi.Base); b != nil {
		b.setExported(pi.BufferID, pi.Size)
	}
	r := Region{
		Version: RegionVersion, Kind: KindCUDAIPC, Handle: h,
		Offset: off, Size: size, AllocSize: pi.Size, Device: dev.uuid,
		ExporterPID: id.PID, PIDNamespace: id.PIDNamespace, BootID: id.BootID,
		BufferID: pi.BufferID, ExporterBase: pi.Base,
	}
	return r, r.Validate()
}

// Export describes size bytes of the buffer, starting off bytes in, for
// another process; see the function Export.
func (b *Buffer) Export(off, size int64) (Region, error) {
	if err := b.check("Export"); err != nil {
		return Region{}, err
	}
	if off < 0 || size <= 0 || off > b.size || size > b.size-off {
		return Region{}, &ArgError{Op: "Buffer.Export", Arg: "range", Reason: fmt.Sprintf("[%d, %d+%d) is outside the %d-byte buffer", off, off, size, b.size)}
	}
	return Export(b.dev, b.ptr+DevicePtr(off), size)
}
