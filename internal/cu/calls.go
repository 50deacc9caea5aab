package cu

import (
	"bytes"
	"runtime"
	"slices"
	"unsafe"
)

// DeviceAttribute is a CUdevice_attribute.
type DeviceAttribute int32

// Device attributes used by this module.
const (
	AttrMultiprocessorCount        DeviceAttribute = 16
	AttrIntegrated                 DeviceAttribute = 18
	AttrUnifiedAddressing          DeviceAttribute = 41
	AttrComputeCapabilityMajor     DeviceAttribute = 75
	AttrComputeCapabilityMinor     DeviceAttribute = 76
	AttrVirtualMemoryManagement    DeviceAttribute = 102
	AttrHandleTypePosixFDSupported DeviceAttribute = 103
	AttrIPCEventSupported          DeviceAttribute = 125
)

// PointerAttribute is a CUpointer_attribute.
type PointerAttribute int32

// Pointer attributes used by this module.
const (
	PointerAttrMemoryType    PointerAttribute = 2
	PointerAttrBufferID      PointerAttribute = 7
	PointerAttrIsManaged     PointerAttribute = 8
	PointerAttrDeviceOrdinal PointerAttribute = 9
	PointerAttrLegacyIPC     PointerAttribute = 10
)

// MemoryType is a CUmemorytype, the value of PointerAttrMemoryType.
type MemoryType int32

// Memory types.
const (
	MemoryTypeHost    MemoryType = 1
	MemoryTypeDevice  MemoryType = 2
	MemoryTypeArray   MemoryType = 3
	MemoryTypeUnified MemoryType = 4
)

// IpcMemFlags are the flags of cuIpcOpenMemHandle (CUipcMem_flags).
type IpcMemFlags uint32

// IpcMemLazyEnablePeerAccess is CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
const IpcMemLazyEnablePeerAccess IpcMemFlags = 0x1

// EventFlags are the flags of cuEventCreate (CUevent_flags).
type EventFlags uint32

// Event flags.
const (
	EventDefault       EventFlags = 0x0
	EventBlockingSync  EventFlags = 0x1
	EventDisableTiming EventFlags = 0x2
	EventInterprocess  EventFlags = 0x4
)

// StreamFlags are the flags of cuStreamCreate (CUstream_flags).
type StreamFlags uint32

// StreamNonBlocking is CU_STREAM_NON_BLOCKING: no implicit synchronization
// with the legacy default stream.
const StreamNonBlocking StreamFlags = 0x1

// Init calls cuInit(0) (done by Load).
func Init() error { return loaded("cuInit") }

// DriverGetVersion returns the CUDA version the driver supports, e.g. 13000.
func DriverGetVersion() (int, error) {
	var v int32
	err := callDriverGetVersion(&v)
	return int(v), err
}

// DeviceGetCount returns the number of devices visible to this process.
func DeviceGetCount() (int, error) {
	var n int32
	err := callDeviceGetCount(&n)
	return int(n), err
}

// DeviceGet returns the device with the given ordinal.
func DeviceGet(ordinal int) (Device, error) {
	var d Device
	err := callDeviceGet(&d, int32(ordinal))
	return d, err
}

// DeviceGetName returns the device's marketing name.
func DeviceGetName(d Device) (string, error) {
	buf := make([]byte, 256)
	err := callDeviceGetName(&buf[0], int32(len(buf)), d)
	return cString(buf), err
}

// DeviceGetUUID returns the device's 16-byte UUID.
func DeviceGetUUID(d Device) ([16]byte, error) {
	var u [16]byte
	err := callDeviceGetUuid(&u, d)
	return u, err
}

// DeviceGetPCIBusID returns the PCI address, e.g. "0000:18:00.0".
func DeviceGetPCIBusID(d Device) (string, error) {
	buf := make([]byte, 64)
	err := callDeviceGetPCIBusId(&buf[0], int32(len(buf)), d)
	return cString(buf), err
}

// DeviceTotalMem returns the device's memory in bytes.
func DeviceTotalMem(d Device) (uint64, error) {
	var n uint64
	err := callDeviceTotalMem(&n, d)
	return n, err
}

// DeviceGetAttribute returns a device attribute's value.
func DeviceGetAttribute(attr DeviceAttribute, d Device) (int, error) {
	var v int32
	err := callDeviceGetAttribute(&v, attr, d)
	return int(v), err
}

// DeviceCanAccessPeer reports whether d can map memory of peer.
func DeviceCanAccessPeer(d, peer Device) (bool, error) {
	var v int32
	err := callDeviceCanAccessPeer(&v, d, peer)
	return v != 0, err
}

// DevicePrimaryCtxRetain retains the device's primary context.
func DevicePrimaryCtxRetain(d Device) (Context, error) {
	var c Context
	err := callDevicePrimaryCtxRetain(&c, d)
	return c, err
}

// CtxSetCurrent binds c to the calling OS thread.
func CtxSetCurrent(c Context) error { return callCtxSetCurrent(c) }

// CtxSynchronize waits for all work in the current context.
func CtxSynchronize() error { return callCtxSynchronize() }

// CtxEnablePeerAccess lets the current context access peer's memory.
func CtxEnablePeerAccess(peer Context) error { return callCtxEnablePeerAccess(peer, 0) }

// MemAlloc allocates device memory in the current context.
func MemAlloc(size uint64) (DevicePtr, error) {
	var p DevicePtr
	err := callMemAlloc(&p, size)
	return p, err
}

// MemFree frees device memory.
func MemFree(p DevicePtr) error { return callMemFree(p) }

// MemAllocHost allocates page-locked host memory and returns it as a byte
// slice backed by C memory (the Go garbage collector never moves or frees
// it). Free it with MemFreeHost.
func MemAllocHost(size uint64) ([]byte, error) {
	var p unsafe.Pointer
	if err := callMemAllocHost(&p, size); err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), size), nil
}

// MemFreeHost frees memory returned by MemAllocHost.
func MemFreeHost(b []byte) error { return callMemFreeHost(unsafe.Pointer(unsafe.SliceData(b))) }

// MemAllocHostWords is MemAllocHost of n 32-bit words, with the address
// at which kernels of the current context reach them: the device writes
// them across the bus with plain stores, and no copy engine moves them
// (cuMemHostGetDevicePointer). Free them with MemFreeHostWords.
func MemAllocHostWords(n uint64) ([]uint32, DevicePtr, error) {
	var p unsafe.Pointer
	if err := callMemAllocHost(&p, n*4); err != nil {
		return nil, 0, err
	}
	var d DevicePtr
	if err := callMemHostGetDevicePointer(&d, p, 0); err != nil {
		callMemFreeHost(p)
		return nil, 0, err
	}
	return unsafe.Slice((*uint32)(p), n), d, nil
}

// MemFreeHostWords frees words returned by MemAllocHostWords.
func MemFreeHostWords(w []uint32) error { return callMemFreeHost(unsafe.Pointer(unsafe.SliceData(w))) }

// MemHostRegisterPortable is cuMemHostRegister's CU_MEMHOSTREGISTER_PORTABLE:
// the memory is page-locked for every context, not only the current one.
const MemHostRegisterPortable = 1

// MemHostRegisterDeviceMap is cuMemHostRegister's
// CU_MEMHOSTREGISTER_DEVICEMAP: kernels reach the memory at the address
// MemHostGetDevicePointer gives.
const MemHostRegisterDeviceMap = 2

// MemHostGetDevicePointer returns the address at which kernels of the
// current context reach b, host memory registered with
// MemHostRegisterDeviceMap (cuMemHostGetDevicePointer).
func MemHostGetDevicePointer(b []byte) (DevicePtr, error) {
	var d DevicePtr
	if len(b) == 0 {
		return 0, loaded("cuMemHostGetDevicePointer")
	}
	err := callMemHostGetDevicePointer(&d, unsafe.Pointer(unsafe.SliceData(b)), 0)
	return d, err
}

// MemHostRegister page-locks b, memory the caller allocated (an anonymous
// mapping, say), and registers it with the driver, so that copies to and
// from it run as from MemAllocHost's memory. b must stay allocated until
// MemHostUnregister.
func MemHostRegister(b []byte, flags uint32) error {
	if len(b) == 0 {
		return loaded("cuMemHostRegister")
	}
	return callMemHostRegister(unsafe.Pointer(unsafe.SliceData(b)), uint64(len(b)), flags)
}

// MemHostUnregister undoes MemHostRegister of b (the same start address).
func MemHostUnregister(b []byte) error {
	if len(b) == 0 {
		return loaded("cuMemHostUnregister")
	}
	return callMemHostUnregister(unsafe.Pointer(unsafe.SliceData(b)))
}

// MemGetInfo returns free and total memory of the current context's device.
func MemGetInfo() (free, total uint64, err error) {
	err = callMemGetInfo(&free, &total)
	return free, total, err
}

// MemGetAddressRange returns the base and size of the allocation holding p.
func MemGetAddressRange(p DevicePtr) (DevicePtr, uint64, error) {
	var base DevicePtr
	var size uint64
	err := callMemGetAddressRange(&base, &size, p)
	return base, size, err
}

// PointerGetAttributeUint64 reads a pointer attribute whose value is 64 bits
// wide (buffer id, range start, range size, device pointer).
func PointerGetAttributeUint64(attr PointerAttribute, p DevicePtr) (uint64, error) {
	var v uint64
	err := callPointerGetAttribute(unsafe.Pointer(&v), attr, p)
	return v, err
}

// PointerGetAttributeInt32 reads a pointer attribute whose value is a C int
// or unsigned int (memory type, device ordinal, is-managed, IPC capable).
func PointerGetAttributeInt32(attr PointerAttribute, p DevicePtr) (int32, error) {
	var v int32
	err := callPointerGetAttribute(unsafe.Pointer(&v), attr, p)
	return v, err
}

// Memcpy copies n bytes between two device (or unified) addresses.
func Memcpy(dst, src DevicePtr, n uint64) error { return callMemcpy(dst, src, n) }

// MemcpyHtoD copies len(src) bytes from host to device.
func MemcpyHtoD(dst DevicePtr, src []byte) error {
	if len(src) == 0 {
		return loaded("cuMemcpyHtoD")
	}
	return callMemcpyHtoD(dst, unsafe.Pointer(&src[0]), uint64(len(src)))
}

// MemcpyDtoH copies len(dst) bytes from device to host.
func MemcpyDtoH(dst []byte, src DevicePtr) error {
	if len(dst) == 0 {
		return loaded("cuMemcpyDtoH")
	}
	return callMemcpyDtoH(unsafe.Pointer(&dst[0]), src, uint64(len(dst)))
}

// MemcpyDtoHWords copies len(dst) 32-bit words from device to host.
func MemcpyDtoHWords(dst []uint32, src DevicePtr) error {
	if len(dst) == 0 {
		return loaded("cuMemcpyDtoH")
	}
	return callMemcpyDtoH(unsafe.Pointer(&dst[0]), src, uint64(len(dst))*4)
}

// MemcpyAsync queues a copy of n bytes between device addresses on s.
func MemcpyAsync(dst, src DevicePtr, n uint64, s Stream) error {
	return callMemcpyAsync(dst, src, n, s)
}

// MemcpyHtoDAsync queues a host-to-device copy on s. With pageable src the
// driver stages it before returning; with page-locked src the copy reads
// src later, so src must stay allocated until s is synchronized.
func MemcpyHtoDAsync(dst DevicePtr, src []byte, s Stream) error {
	if len(src) == 0 {
		return loaded("cuMemcpyHtoDAsync")
	}
	return callMemcpyHtoDAsync(dst, unsafe.Pointer(&src[0]), uint64(len(src)), s)
}

// MemcpyDtoHAsync queues a device-to-host copy on s (synchronous for
// pageable dst).
func MemcpyDtoHAsync(dst []byte, src DevicePtr, s Stream) error {
	if len(dst) == 0 {
		return loaded("cuMemcpyDtoHAsync")
	}
	return callMemcpyDtoHAsync(unsafe.Pointer(&dst[0]), src, uint64(len(dst)), s)
}

// MemsetD8 sets n bytes at p to v.
func MemsetD8(p DevicePtr, v uint8, n uint64) error { return callMemsetD8(p, v, n) }

// MemsetD8Async queues a memset on s.
func MemsetD8Async(p DevicePtr, v uint8, n uint64, s Stream) error {
	return callMemsetD8Async(p, v, n, s)
}

// StreamCreate creates a stream in the current context.
func StreamCreate(flags StreamFlags) (Stream, error) {
	var s Stream
	err := callStreamCreate(&s, uint32(flags))
	return s, err
}

// StreamDestroy destroys s.
func StreamDestroy(s Stream) error { return callStreamDestroy(s) }

// StreamSynchronize waits for s.
func StreamSynchronize(s Stream) error { return callStreamSynchronize(s) }

// StreamQuery returns nil when s is idle, ErrorNotReady while it has work.
func StreamQuery(s Stream) error { return callStreamQuery(s) }

// StreamWaitEvent makes future work on s wait for e.
func StreamWaitEvent(s Stream, e Event) error { return callStreamWaitEvent(s, e, 0) }

// EventCreate creates an event in the current context.
func EventCreate(flags EventFlags) (Event, error) {
	var e Event
	err := callEventCreate(&e, uint32(flags))
	return e, err
}

// EventDestroy destroys e.
func EventDestroy(e Event) error { return callEventDestroy(e) }

// EventRecord records e on s.
func EventRecord(e Event, s Stream) error { return callEventRecord(e, s) }

// EventSynchronize waits until e has completed.
func EventSynchronize(e Event) error { return callEventSynchronize(e) }

// EventQuery returns nil when e has completed, ErrorNotReady otherwise.
func EventQuery(e Event) error { return callEventQuery(e) }

// EventElapsedTime returns the milliseconds between two completed events
// created without EventDisableTiming (resolution about 0.5 µs).
func EventElapsedTime(start, end Event) (float32, error) {
	var ms float32
	err := callEventElapsedTime(&ms, start, end)
	return ms, err
}

// IpcGetMemHandle exports the allocation containing p.
func IpcGetMemHandle(p DevicePtr) (IpcMemHandle, error) {
	var h IpcMemHandle
	err := callIpcGetMemHandle(&h, p)
	return h, err
}

// IpcOpenMemHandle maps an exported allocation into the current context.
func IpcOpenMemHandle(h IpcMemHandle, flags IpcMemFlags) (DevicePtr, error) {
	var p DevicePtr
	err := callIpcOpenMemHandle(&p, h, uint32(flags))
	return p, err
}

// IpcCloseMemHandle unmaps memory returned by IpcOpenMemHandle.
func IpcCloseMemHandle(p DevicePtr) error { return callIpcCloseMemHandle(p) }

// IpcGetEventHandle exports an interprocess event.
func IpcGetEventHandle(e Event) (IpcEventHandle, error) {
	var h IpcEventHandle
	err := callIpcGetEventHandle(&h, e)
	return h, err
}

// IpcOpenEventHandle opens an event exported by another process.
func IpcOpenEventHandle(h IpcEventHandle) (Event, error) {
	var e Event
	err := callIpcOpenEventHandle(&e, h)
	return e, err
}

func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

// ModuleLoadData loads a module from image, PTX text or a cubin, into the
// current context (the driver compiles PTX for the device). PTX must end
// with a NUL byte; ModuleLoadData adds one to a copy when it does not.
func ModuleLoadData(image []byte) (Module, error) {
	if len(image) == 0 || image[len(image)-1] != 0 {
		image = append(slices.Clip(image), 0)
	}
	var m Module
	err := callModuleLoadData(&m, unsafe.Pointer(unsafe.SliceData(image)))
	return m, err
}

// ModuleUnload unloads m.
func ModuleUnload(m Module) error { return callModuleUnload(m) }

// ModuleGetFunction returns the kernel of m named name.
func ModuleGetFunction(m Module, name string) (Function, error) {
	var f Function
	cname := append([]byte(name), 0)
	err := callModuleGetFunction(&f, m, unsafe.SliceData(cname))
	return f, err
}

// LaunchKernel queues f on s over a grid of grid blocks of block threads
// with sharedMem bytes of dynamic shared memory. args are the kernel's
// parameters in order, each passed in an 8-byte slot: a .u64 or pointer
// parameter reads all of it, a .u32 one its low half (little-endian).
func LaunchKernel(f Function, grid, block [3]uint32, sharedMem uint32, s Stream, args ...uint64) error {
	vals := slices.Clone(args)
	ptrs := make([]unsafe.Pointer, len(vals)+1)
	for i := range vals {
		ptrs[i] = unsafe.Pointer(&vals[i])
	}
	err := callLaunchKernel(f, grid[0], grid[1], grid[2], block[0], block[1], block[2], sharedMem, s,
		unsafe.SliceData(ptrs), nil)
	runtime.KeepAlive(vals)
	runtime.KeepAlive(ptrs)
	return err
}
