package cu

// Virtual memory management (cuMem* with generic allocation handles): the
// allocation path whose memory can be exported as a POSIX file descriptor
// and imported by a process in another PID namespace.

// MemAllocationType is a CUmemAllocationType.
type MemAllocationType int32

// MemAllocationTypePinned is CU_MEM_ALLOCATION_TYPE_PINNED.
const MemAllocationTypePinned MemAllocationType = 1

// MemHandleType is a CUmemAllocationHandleType: the kinds of OS handle an
// allocation can be exported as (a bit set).
type MemHandleType int32

// Handle types.
const (
	MemHandleTypeNone    MemHandleType = 0 // CU_MEM_HANDLE_TYPE_NONE
	MemHandleTypePosixFD MemHandleType = 1 // CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
)

// MemLocationType is a CUmemLocationType.
type MemLocationType int32

// MemLocationTypeDevice is CU_MEM_LOCATION_TYPE_DEVICE.
const MemLocationTypeDevice MemLocationType = 1

// MemAccessFlags is a CUmemAccess_flags.
type MemAccessFlags int32

// Access flags.
const (
	MemAccessFlagsProtNone      MemAccessFlags = 0 // CU_MEM_ACCESS_FLAGS_PROT_NONE
	MemAccessFlagsProtRead      MemAccessFlags = 1 // CU_MEM_ACCESS_FLAGS_PROT_READ
	MemAccessFlagsProtReadWrite MemAccessFlags = 3 // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
)

// MemAllocGranularityFlags is a CUmemAllocationGranularity_flags.
type MemAllocGranularityFlags int32

// Granularity options.
const (
	MemAllocGranularityMinimum   MemAllocGranularityFlags = 0 // CU_MEM_ALLOC_GRANULARITY_MINIMUM
	MemAllocGranularityRecommend MemAllocGranularityFlags = 1 // CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
)

// MemLocation is CUmemLocation: {CUmemLocationType type; int id;}, 8 bytes.
type MemLocation struct {
	Type MemLocationType
	ID   int32 // the device ordinal (CUdevice) for MemLocationTypeDevice
}

// MemAllocFlags is the anonymous allocFlags member of CUmemAllocationProp:
// {unsigned char compressionType; unsigned char gpuDirectRDMACapable;
// unsigned short usage; unsigned char reserved[4];}, 8 bytes.
type MemAllocFlags struct {
	CompressionType      uint8
	GPUDirectRDMACapable uint8
	Usage                uint16
	Reserved             [4]uint8
}

// MemAllocationProp is CUmemAllocationProp on LP64, 32 bytes:
//
//	offset  0: CUmemAllocationType type
//	offset  4: CUmemAllocationHandleType requestedHandleTypes
//	offset  8: CUmemLocation location
//	offset 16: void *win32HandleMetaData (must be NULL on Linux)
//	offset 24: allocFlags
type MemAllocationProp struct {
	Type                 MemAllocationType
	RequestedHandleTypes MemHandleType
	Location             MemLocation
	Win32HandleMetaData  uintptr
	AllocFlags           MemAllocFlags
}

// MemAccessDesc is CUmemAccessDesc: {CUmemLocation location;
// CUmemAccess_flags flags;}, 12 bytes.
type MemAccessDesc struct {
	Location MemLocation
	Flags    MemAccessFlags
}

// DevicePinnedProp returns the properties of pinned device memory on d
// that can be exported with the given handle types.
func DevicePinnedProp(d Device, handleTypes MemHandleType) MemAllocationProp {
	return MemAllocationProp{
		Type:                 MemAllocationTypePinned,
		RequestedHandleTypes: handleTypes,
		Location:             MemLocation{Type: MemLocationTypeDevice, ID: int32(d)},
	}
}

// MemGetAllocationGranularity returns the size and alignment unit of
// allocations with prop.
func MemGetAllocationGranularity(prop MemAllocationProp, option MemAllocGranularityFlags) (uint64, error) {
	var g uint64
	err := callMemGetAllocationGranularity(&g, &prop, option)
	return g, err
}

// MemCreate allocates size bytes of physical memory with prop; size must
// be a multiple of the granularity.
func MemCreate(size uint64, prop MemAllocationProp) (MemGenericAllocationHandle, error) {
	var h MemGenericAllocationHandle
	err := callMemCreate(&h, size, &prop, 0)
	return h, err
}

// MemRelease drops this handle's reference to the physical memory; the
// memory is freed when no handle, mapping or exported file refers to it.
func MemRelease(h MemGenericAllocationHandle) error { return callMemRelease(h) }

// MemExportToShareableHandleFD exports h as a new POSIX file descriptor
// (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR): the driver writes an int
// through the void* argument. The caller owns the returned descriptor.
func MemExportToShareableHandleFD(h MemGenericAllocationHandle) (int, error) {
	fd := int32(-1)
	if err := callMemExportToShareableHandle(&fd, h, MemHandleTypePosixFD, 0); err != nil {
		return -1, err
	}
	return int(fd), nil
}

// MemImportFromShareableHandleFD imports the allocation behind the POSIX
// file descriptor fd. For this handle type the driver takes the descriptor
// itself in the void* argument, (void *)(uintptr_t)fd, not a pointer to
// it. The descriptor is not consumed: the caller still closes it.
func MemImportFromShareableHandleFD(fd int) (MemGenericAllocationHandle, error) {
	var h MemGenericAllocationHandle
	err := callMemImportFromShareableHandle(&h, uintptr(fd), MemHandleTypePosixFD)
	return h, err
}

// MemGetAllocationPropertiesFromHandle returns the properties the
// allocation behind h was created with (optional entry point).
func MemGetAllocationPropertiesFromHandle(h MemGenericAllocationHandle) (MemAllocationProp, error) {
	var prop MemAllocationProp
	err := callMemGetAllocationPropertiesFromHandle(&prop, h)
	return prop, err
}

// MemAddressReserve reserves size bytes of virtual address space aligned
// to alignment (0: the granularity), anywhere.
func MemAddressReserve(size, alignment uint64) (DevicePtr, error) {
	var p DevicePtr
	err := callMemAddressReserve(&p, size, alignment, 0, 0)
	return p, err
}

// MemAddressFree returns a reservation made by MemAddressReserve.
func MemAddressFree(p DevicePtr, size uint64) error { return callMemAddressFree(p, size) }

// MemMap maps the first size bytes of the allocation h at p (the driver
// requires offset 0).
func MemMap(p DevicePtr, size uint64, h MemGenericAllocationHandle) error {
	return callMemMap(p, size, 0, h, 0)
}

// MemUnmap unmaps [p, p+size).
func MemUnmap(p DevicePtr, size uint64) error { return callMemUnmap(p, size) }

// MemSetAccess grants device d the access flags on [p, p+size).
func MemSetAccess(p DevicePtr, size uint64, d Device, flags MemAccessFlags) error {
	desc := MemAccessDesc{Location: MemLocation{Type: MemLocationTypeDevice, ID: int32(d)}, Flags: flags}
	return callMemSetAccess(p, size, &desc, 1)
}
