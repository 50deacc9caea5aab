package cu

import (
	"bytes"
	"unsafe"
)

// Device attributes (CUdevice_attribute) used by this module.
const (
	AttrPCIBusID                     = 33
	AttrPCIDeviceID                  = 34
	AttrUnifiedAddressing            = 41
	AttrPCIDomainID                  = 50
	AttrComputeCapabilityMajor       = 75
	AttrComputeCapabilityMinor       = 76
	AttrVirtualMemoryManagement      = 102
	AttrHandleTypePosixFDSupported   = 103
	AttrMemoryPoolsSupported         = 115
	AttrIPCEventSupported            = 125
	AttrMultiprocessorCount          = 16
	AttrIntegrated                   = 18
	AttrCanUseHostPointerForRegister = 91
)

// Pointer attributes (CUpointer_attribute) used by this module.
const (
	PointerAttrContext        = 1
	PointerAttrMemoryType     = 2
	PointerAttrBufferID       = 7
	PointerAttrIsManaged      = 8
	PointerAttrDeviceOrdinal  = 9
	PointerAttrLegacyIPC      = 10
	PointerAttrRangeStartAddr = 11
	PointerAttrRangeSize      = 12
)

// Memory types (CUmemorytype).
const (
	MemoryTypeHost    = 1
	MemoryTypeDevice  = 2
	MemoryTypeArray   = 3
	MemoryTypeUnified = 4
)

// Flags.
const (
	IpcMemLazyEnablePeerAccess = 0x1 // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
	EventDefault               = 0x0
	EventBlockingSync          = 0x1
	EventDisableTiming         = 0x2
	EventInterprocess          = 0x4
	StreamDefault              = 0x0
	StreamNonBlocking          = 0x1
)

// Init calls cuInit(0) (done by Load).
func Init() error { return loaded("cuInit") }

// DriverGetVersion returns the CUDA version the driver supports, e.g. 13000.
func DriverGetVersion() (int, error) {
	if err := loaded("cuDriverGetVersion"); err != nil {
		return 0, err
	}
	var v int32
	err := check("cuDriverGetVersion", cuDriverGetVersion(&v))
	return int(v), err
}

// DeviceGetCount returns the number of devices visible to this process.
func DeviceGetCount() (int, error) {
	if err := loaded("cuDeviceGetCount"); err != nil {
		return 0, err
	}
	var n int32
	err := check("cuDeviceGetCount", cuDeviceGetCount(&n))
	return int(n), err
}

// DeviceGet returns the device with the given ordinal.
func DeviceGet(ordinal int) (Device, error) {
	if err := loaded("cuDeviceGet"); err != nil {
		return 0, err
	}
	var d Device
	err := check("cuDeviceGet", cuDeviceGet(&d, int32(ordinal)))
	return d, err
}

// DeviceGetName returns the device's marketing name.
func DeviceGetName(d Device) (string, error) {
	if err := loaded("cuDeviceGetName"); err != nil {
		return "", err
	}
	buf := make([]byte, 256)
	if err := check("cuDeviceGetName", cuDeviceGetName(&buf[0], int32(len(buf)), d)); err != nil {
		return "", err
	}
	return cString(buf), nil
}

// DeviceGetUUID returns the device's 16-byte UUID.
func DeviceGetUUID(d Device) ([16]byte, error) {
	var u [16]byte
	if err := loaded("cuDeviceGetUuid"); err != nil {
		return u, err
	}
	err := check("cuDeviceGetUuid", cuDeviceGetUuid(&u, d))
	return u, err
}

// DeviceGetPCIBusID returns the PCI address, e.g. "0000:18:00.0".
func DeviceGetPCIBusID(d Device) (string, error) {
	if err := loaded("cuDeviceGetPCIBusId"); err != nil {
		return "", err
	}
	buf := make([]byte, 64)
	if err := check("cuDeviceGetPCIBusId", cuDeviceGetPCIBusId(&buf[0], int32(len(buf)), d)); err != nil {
		return "", err
	}
	return cString(buf), nil
}

// DeviceTotalMem returns the device's memory in bytes.
func DeviceTotalMem(d Device) (uint64, error) {
	if err := loaded("cuDeviceTotalMem"); err != nil {
		return 0, err
	}
	var n uint64
	err := check("cuDeviceTotalMem", cuDeviceTotalMem(&n, d))
	return n, err
}

// DeviceGetAttribute returns a CUdevice_attribute value.
func DeviceGetAttribute(attr int32, d Device) (int, error) {
	if err := loaded("cuDeviceGetAttribute"); err != nil {
		return 0, err
	}
	var v int32
	err := check("cuDeviceGetAttribute", cuDeviceGetAttribute(&v, attr, d))
	return int(v), err
}

// DeviceCanAccessPeer reports whether d can map memory of peer.
func DeviceCanAccessPeer(d, peer Device) (bool, error) {
	if err := loaded("cuDeviceCanAccessPeer"); err != nil {
		return false, err
	}
	var v int32
	err := check("cuDeviceCanAccessPeer", cuDeviceCanAccessPeer(&v, d, peer))
	return v != 0, err
}

// DevicePrimaryCtxRetain retains the device's primary context.
func DevicePrimaryCtxRetain(d Device) (Context, error) {
	if err := loaded("cuDevicePrimaryCtxRetain"); err != nil {
		return 0, err
	}
	var c Context
	err := check("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&c, d))
	return c, err
}

// DevicePrimaryCtxRelease releases one reference to the primary context.
func DevicePrimaryCtxRelease(d Device) error {
	if err := loaded("cuDevicePrimaryCtxRelease"); err != nil {
		return err
	}
	return check("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease(d))
}

// CtxSetCurrent binds c to the calling OS thread.
func CtxSetCurrent(c Context) error {
	if err := loaded("cuCtxSetCurrent"); err != nil {
		return err
	}
	return check("cuCtxSetCurrent", cuCtxSetCurrent(c))
}

// CtxGetCurrent returns the context bound to the calling OS thread.
func CtxGetCurrent() (Context, error) {
	if err := loaded("cuCtxGetCurrent"); err != nil {
		return 0, err
	}
	var c Context
	err := check("cuCtxGetCurrent", cuCtxGetCurrent(&c))
	return c, err
}

// CtxSynchronize waits for all work in the current context.
func CtxSynchronize() error {
	if err := loaded("cuCtxSynchronize"); err != nil {
		return err
	}
	return check("cuCtxSynchronize", cuCtxSynchronize())
}

// CtxEnablePeerAccess lets the current context access peer's memory.
func CtxEnablePeerAccess(peer Context) error {
	if err := loaded("cuCtxEnablePeerAccess"); err != nil {
		return err
	}
	return check("cuCtxEnablePeerAccess", cuCtxEnablePeerAccess(peer, 0))
}

// CtxDisablePeerAccess revokes access to peer's memory.
func CtxDisablePeerAccess(peer Context) error {
	if err := loaded("cuCtxDisablePeerAccess"); err != nil {
		return err
	}
	return check("cuCtxDisablePeerAccess", cuCtxDisablePeerAccess(peer))
}

// MemAlloc allocates device memory in the current context.
func MemAlloc(size uint64) (DevicePtr, error) {
	if err := loaded("cuMemAlloc"); err != nil {
		return 0, err
	}
	var p DevicePtr
	err := check("cuMemAlloc", cuMemAlloc(&p, size))
	return p, err
}

// MemFree frees device memory.
func MemFree(p DevicePtr) error {
	if err := loaded("cuMemFree"); err != nil {
		return err
	}
	return check("cuMemFree", cuMemFree(p))
}

// MemAllocHost allocates page-locked host memory and returns it as a byte
// slice backed by C memory (the Go garbage collector never moves or frees
// it). Free it with MemFreeHost.
func MemAllocHost(size uint64) ([]byte, error) {
	if err := loaded("cuMemAllocHost"); err != nil {
		return nil, err
	}
	var p unsafe.Pointer
	if err := check("cuMemAllocHost", cuMemAllocHost(&p, size)); err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), size), nil
}

// MemFreeHost frees memory returned by MemAllocHost.
func MemFreeHost(b []byte) error {
	if err := loaded("cuMemFreeHost"); err != nil {
		return err
	}
	return check("cuMemFreeHost", cuMemFreeHost(unsafe.Pointer(unsafe.SliceData(b))))
}

// MemGetInfo returns free and total memory of the current context's device.
func MemGetInfo() (free, total uint64, err error) {
	if err := loaded("cuMemGetInfo"); err != nil {
		return 0, 0, err
	}
	err = check("cuMemGetInfo", cuMemGetInfo(&free, &total))
	return free, total, err
}

// MemGetAddressRange returns the base and size of the allocation holding p.
func MemGetAddressRange(p DevicePtr) (DevicePtr, uint64, error) {
	if err := loaded("cuMemGetAddressRange"); err != nil {
		return 0, 0, err
	}
	var base DevicePtr
	var size uint64
	err := check("cuMemGetAddressRange", cuMemGetAddressRange(&base, &size, p))
	return base, size, err
}

// PointerGetAttributeUint64 reads a pointer attribute whose value is 64 bits
// wide (buffer id, range start, range size, device pointer).
func PointerGetAttributeUint64(attr int32, p DevicePtr) (uint64, error) {
	if err := loaded("cuPointerGetAttribute"); err != nil {
		return 0, err
	}
	var v uint64
	err := check("cuPointerGetAttribute", cuPointerGetAttribute(unsafe.Pointer(&v), attr, p))
	return v, err
}

// PointerGetAttributeInt32 reads a pointer attribute whose value is a C int
// or unsigned int (memory type, device ordinal, is-managed, IPC capable).
func PointerGetAttributeInt32(attr int32, p DevicePtr) (int32, error) {
	if err := loaded("cuPointerGetAttribute"); err != nil {
		return 0, err
	}
	var v int32
	err := check("cuPointerGetAttribute", cuPointerGetAttribute(unsafe.Pointer(&v), attr, p))
	return v, err
}

// Memcpy copies n bytes between two device (or unified) addresses.
func Memcpy(dst, src DevicePtr, n uint64) error {
	if err := loaded("cuMemcpy"); err != nil {
		return err
	}
	return check("cuMemcpy", cuMemcpy(dst, src, n))
}

// MemcpyHtoD copies len(src) bytes from host to device.
func MemcpyHtoD(dst DevicePtr, src []byte) error {
	if err := loaded("cuMemcpyHtoD"); err != nil {
		return err
	}
	if len(src) == 0 {
		return nil
	}
	return check("cuMemcpyHtoD", cuMemcpyHtoD(dst, unsafe.Pointer(&src[0]), uint64(len(src))))
}

// MemcpyDtoH copies len(dst) bytes from device to host.
func MemcpyDtoH(dst []byte, src DevicePtr) error {
	if err := loaded("cuMemcpyDtoH"); err != nil {
		return err
	}
	if len(dst) == 0 {
		return nil
	}
	return check("cuMemcpyDtoH", cuMemcpyDtoH(unsafe.Pointer(&dst[0]), src, uint64(len(dst))))
}

// MemcpyPeer copies n bytes between memory of two contexts.
func MemcpyPeer(dst DevicePtr, dctx Context, src DevicePtr, sctx Context, n uint64) error {
	if err := loaded("cuMemcpyPeer"); err != nil {
		return err
	}
	return check("cuMemcpyPeer", cuMemcpyPeer(dst, dctx, src, sctx, n))
}

// MemcpyAsync queues a copy of n bytes between device addresses on s.
func MemcpyAsync(dst, src DevicePtr, n uint64, s Stream) error {
	if err := loaded("cuMemcpyAsync"); err != nil {
		return err
	}
	return check("cuMemcpyAsync", cuMemcpyAsync(dst, src, n, s))
}

// MemcpyHtoDAsync queues a host-to-device copy on s. With pageable src the
// driver stages it before returning; with page-locked src the copy reads
// src later, so src must stay allocated until s is synchronized.
func MemcpyHtoDAsync(dst DevicePtr, src []byte, s Stream) error {
	if err := loaded("cuMemcpyHtoDAsync"); err != nil {
		return err
	}
	if len(src) == 0 {
		return nil
	}
	return check("cuMemcpyHtoDAsync", cuMemcpyHtoDAsync(dst, unsafe.Pointer(&src[0]), uint64(len(src)), s))
}

// MemcpyDtoHAsync queues a device-to-host copy on s (synchronous for
// pageable dst).
func MemcpyDtoHAsync(dst []byte, src DevicePtr, s Stream) error {
	if err := loaded("cuMemcpyDtoHAsync"); err != nil {
		return err
	}
	if len(dst) == 0 {
		return nil
	}
	return check("cuMemcpyDtoHAsync", cuMemcpyDtoHAsync(unsafe.Pointer(&dst[0]), src, uint64(len(dst)), s))
}

// MemsetD8 sets n bytes at p to v.
func MemsetD8(p DevicePtr, v uint8, n uint64) error {
	if err := loaded("cuMemsetD8"); err != nil {
		return err
	}
	return check("cuMemsetD8", cuMemsetD8(p, v, n))
}

// MemsetD8Async queues a memset on s.
func MemsetD8Async(p DevicePtr, v uint8, n uint64, s Stream) error {
	if err := loaded("cuMemsetD8Async"); err != nil {
		return err
	}
	return check("cuMemsetD8Async", cuMemsetD8Async(p, v, n, s))
}

// StreamCreate creates a stream in the current context.
func StreamCreate(flags uint32) (Stream, error) {
	if err := loaded("cuStreamCreate"); err != nil {
		return 0, err
	}
	var s Stream
	err := check("cuStreamCreate", cuStreamCreate(&s, flags))
	return s, err
}

// StreamDestroy destroys s.
func StreamDestroy(s Stream) error {
	if err := loaded("cuStreamDestroy"); err != nil {
		return err
	}
	return check("cuStreamDestroy", cuStreamDestroy(s))
}

// StreamSynchronize waits for s.
func StreamSynchronize(s Stream) error {
	if err := loaded("cuStreamSynchronize"); err != nil {
		return err
	}
	return check("cuStreamSynchronize", cuStreamSynchronize(s))
}

// StreamQuery returns nil when s is idle, ErrorNotReady while it has work.
func StreamQuery(s Stream) error {
	if err := loaded("cuStreamQuery"); err != nil {
		return err
	}
	return check("cuStreamQuery", cuStreamQuery(s))
}

// StreamWaitEvent makes future work on s wait for e.
func StreamWaitEvent(s Stream, e Event) error {
	if err := loaded("cuStreamWaitEvent"); err != nil {
		return err
	}
	return check("cuStreamWaitEvent", cuStreamWaitEvent(s, e, 0))
}

// EventCreate creates an event in the current context.
func EventCreate(flags uint32) (Event, error) {
	if err := loaded("cuEventCreate"); err != nil {
		return 0, err
	}
	var e Event
	err := check("cuEventCreate", cuEventCreate(&e, flags))
	return e, err
}

// EventDestroy destroys e.
func EventDestroy(e Event) error {
	if err := loaded("cuEventDestroy"); err != nil {
		return err
	}
	return check("cuEventDestroy", cuEventDestroy(e))
}

// EventRecord records e on s.
func EventRecord(e Event, s Stream) error {
	if err := loaded("cuEventRecord"); err != nil {
		return err
	}
	return check("cuEventRecord", cuEventRecord(e, s))
}

// EventSynchronize waits until e has completed.
func EventSynchronize(e Event) error {
	if err := loaded("cuEventSynchronize"); err != nil {
		return err
	}
	return check("cuEventSynchronize", cuEventSynchronize(e))
}

// EventQuery returns nil when e has completed, ErrorNotReady otherwise.
func EventQuery(e Event) error {
	if err := loaded("cuEventQuery"); err != nil {
		return err
	}
	return check("cuEventQuery", cuEventQuery(e))
}

// EventElapsedTime returns the milliseconds between two completed events
// created without EventDisableTiming (resolution about 0.5 µs).
func EventElapsedTime(start, end Event) (float32, error) {
	if err := loaded("cuEventElapsedTime"); err != nil {
		return 0, err
	}
	var ms float32
	err := check("cuEventElapsedTime", cuEventElapsedTime(&ms, start, end))
	return ms, err
}

// IpcGetMemHandle exports the allocation containing p.
func IpcGetMemHandle(p DevicePtr) (IpcMemHandle, error) {
	var h IpcMemHandle
	if err := loaded("cuIpcGetMemHandle"); err != nil {
		return h, err
	}
	err := check("cuIpcGetMemHandle", cuIpcGetMemHandle(&h, p))
	return h, err
}

// IpcOpenMemHandle maps an exported allocation into the current context.
func IpcOpenMemHandle(h IpcMemHandle, flags uint32) (DevicePtr, error) {
	if err := loaded("cuIpcOpenMemHandle"); err != nil {
		return 0, err
	}
	var p DevicePtr
	err := check("cuIpcOpenMemHandle", cuIpcOpenMemHandle(&p, h, flags))
	return p, err
}

// IpcCloseMemHandle unmaps memory returned by IpcOpenMemHandle.
func IpcCloseMemHandle(p DevicePtr) error {
	if err := loaded("cuIpcCloseMemHandle"); err != nil {
		return err
	}
	return check("cuIpcCloseMemHandle", cuIpcCloseMemHandle(p))
}

// IpcGetEventHandle exports an interprocess event.
func IpcGetEventHandle(e Event) (IpcEventHandle, error) {
	var h IpcEventHandle
	if err := loaded("cuIpcGetEventHandle"); err != nil {
		return h, err
	}
	err := check("cuIpcGetEventHandle", cuIpcGetEventHandle(&h, e))
	return h, err
}

// IpcOpenEventHandle opens an event exported by another process.
func IpcOpenEventHandle(h IpcEventHandle) (Event, error) {
	if err := loaded("cuIpcOpenEventHandle"); err != nil {
		return 0, err
	}
	var e Event
	err := check("cuIpcOpenEventHandle", cuIpcOpenEventHandle(&e, h))
	return e, err
}

func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}
