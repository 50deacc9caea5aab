// Package cu is the raw layer over the CUDA driver API (libcuda.so.1),
// loaded at run time with purego so that the module builds and tests with
// CGO_ENABLED=0 and without CUDA installed. Functions are named after the C
// entry points without the "cu" prefix and return Go errors (*Error) instead
// of CUresult. This is the only package of the module that uses unsafe or
// purego; callers above it are responsible for making the right context
// current on a locked OS thread before calls that need one.
package cu

import (
	"errors"
	"os"
	"strings"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// DefaultLibrary is the versioned soname of the driver library. The
// unversioned libcuda.so is a development symlink and may be the toolkit's
// stub, so it is never loaded by default.
const DefaultLibrary = "libcuda.so.1"

// EnvLibrary names the environment variable that overrides the library path.
const EnvLibrary = "CUDAIPC_LIBCUDA"

// apiVersion is the CUDA version whose ABI the entry points are requested
// at through cuGetProcAddress: 12.0 gives the _v2 variants of the memory,
// IPC, stream and event functions that this package declares.
const apiVersion = 12000

type (
	// Device is a CUdevice: an ordinal as seen by this process.
	Device int32
	// Context is a CUcontext.
	Context uintptr
	// Stream is a CUstream; 0 is the legacy default stream.
	Stream uintptr
	// Event is a CUevent.
	Event uintptr
	// DevicePtr is a CUdeviceptr: a device address in the unified address space.
	DevicePtr uint64
	// IpcMemHandle is CUipcMemHandle, passed by value to the driver.
	IpcMemHandle struct{ Reserved [64]byte }
	// IpcEventHandle is CUipcEventHandle, passed by value to the driver.
	IpcEventHandle struct{ Reserved [64]byte }
	// MemGenericAllocationHandle is CUmemGenericAllocationHandle (unsigned
	// long long): a process-local handle to physical memory made by
	// cuMemCreate or cuMemImportFromShareableHandle.
	MemGenericAllocationHandle uint64
)

var (
	loadOnce   sync.Once
	loadErr    error
	libMu      sync.Mutex
	libPath    string
	loadedPath string
)

// SetLibrary sets the path of the driver library to load. It must be called
// before the first driver call; afterwards it returns an error.
func SetLibrary(path string) error {
	libMu.Lock()
	defer libMu.Unlock()
	if loadedPath != "" {
		return errors.New("cu: the driver library is already loaded from " + loadedPath)
	}
	libPath = path
	return nil
}

// Library returns the path that is (or will be) loaded.
func Library() string {
	libMu.Lock()
	defer libMu.Unlock()
	if loadedPath != "" {
		return loadedPath
	}
	return chosenPath()
}

func chosenPath() string {
	if libPath != "" {
		return libPath
	}
	if p := os.Getenv(EnvLibrary); p != "" {
		return p
	}
	return DefaultLibrary
}

// Load loads the driver library, resolves every entry point and calls
// cuInit(0). It runs once; later calls return the first result.
func Load() error {
	loadOnce.Do(func() {
		libMu.Lock()
		path := chosenPath()
		loadedPath = path
		libMu.Unlock()
		loadErr = load(path)
	})
	return loadErr
}

// entry is one driver function: the name given to cuGetProcAddress, the
// versioned symbol used when cuGetProcAddress is absent, and the Go
// function variable it is bound to.
type entry struct {
	name   string
	symbol string
	fn     any      // a RegisterFunc binding, for calls that pass structs by value
	addr   *uintptr // the address, for calls made with SyscallN
}

// The driver functions. Types follow cuda.h on LP64 Linux: size_t and
// CUdeviceptr are 64-bit, int is int32, pointers to C objects are uintptr.
//
// Each is a typed Go function that calls the entry point's address through
// purego.SyscallN, which costs about a fifth of a purego.RegisterFunc
// binding (no reflection). Pointer arguments are converted to uintptr inside
// the SyscallN call expression, where //go:uintptrescapes keeps what they
// point to alive and in place. The two functions that take a 64-byte handle
// by value go through RegisterFunc bindings, which lay such structs out per
// the platform ABI.
var procs struct {
	cuInit                                 uintptr
	cuDriverGetVersion                     uintptr
	cuDeviceGetCount                       uintptr
	cuDeviceGet                            uintptr
	cuDeviceGetName                        uintptr
	cuDeviceGetUuid                        uintptr
	cuDeviceGetPCIBusId                    uintptr
	cuDeviceTotalMem                       uintptr
	cuDeviceGetAttribute                   uintptr
	cuDeviceCanAccessPeer                  uintptr
	cuDevicePrimaryCtxRetain               uintptr
	cuDevicePrimaryCtxRelease              uintptr
	cuCtxSetCurrent                        uintptr
	cuCtxGetCurrent                        uintptr
	cuCtxSynchronize                       uintptr
	cuCtxEnablePeerAccess                  uintptr
	cuCtxDisablePeerAccess                 uintptr
	cuMemAlloc                             uintptr
	cuMemFree                              uintptr
	cuMemAllocHost                         uintptr
	cuMemFreeHost                          uintptr
	cuMemGetInfo                           uintptr
	cuMemGetAddressRange                   uintptr
	cuPointerGetAttribute                  uintptr
	cuMemcpy                               uintptr
	cuMemcpyHtoD                           uintptr
	cuMemcpyDtoH                           uintptr
	cuMemcpyPeer                           uintptr
	cuMemcpyAsync                          uintptr
	cuMemcpyHtoDAsync                      uintptr
	cuMemcpyDtoHAsync                      uintptr
	cuMemsetD8                             uintptr
	cuMemsetD8Async                        uintptr
	cuStreamCreate                         uintptr
	cuStreamDestroy                        uintptr
	cuStreamSynchronize                    uintptr
	cuStreamQuery                          uintptr
	cuStreamWaitEvent                      uintptr
	cuEventCreate                          uintptr
	cuEventDestroy                         uintptr
	cuEventRecord                          uintptr
	cuEventSynchronize                     uintptr
	cuEventQuery                           uintptr
	cuEventElapsedTime                     uintptr
	cuIpcGetMemHandle                      uintptr
	cuIpcOpenMemHandle                     uintptr
	cuIpcCloseMemHandle                    uintptr
	cuIpcGetEventHandle                    uintptr
	cuIpcOpenEventHandle                   uintptr
	cuMemCreate                            uintptr
	cuMemRelease                           uintptr
	cuMemExportToShareableHandle           uintptr
	cuMemImportFromShareableHandle         uintptr
	cuMemAddressReserve                    uintptr
	cuMemAddressFree                       uintptr
	cuMemMap                               uintptr
	cuMemUnmap                             uintptr
	cuMemSetAccess                         uintptr
	cuMemGetAllocationGranularity          uintptr
	cuMemGetAllocationPropertiesFromHandle uintptr
}

// Bindings for the calls that pass a struct by value.
var (
	cuIpcOpenMemHandleFn   func(p *DevicePtr, h IpcMemHandle, flags uint32) Result
	cuIpcOpenEventHandleFn func(e *Event, h IpcEventHandle) Result
)

func res(r uintptr) Result { return Result(int32(r)) }

func cuInit(flags uint32) Result {
	r, _, _ := purego.SyscallN(procs.cuInit, uintptr(flags))
	return res(r)
}

func cuDriverGetVersion(v *int32) Result {
	r, _, _ := purego.SyscallN(procs.cuDriverGetVersion, uintptr(unsafe.Pointer(v)))
	return res(r)
}

func cuDeviceGetCount(n *int32) Result {
	r, _, _ := purego.SyscallN(procs.cuDeviceGetCount, uintptr(unsafe.Pointer(n)))
	return res(r)
}

func cuDeviceGet(d *Device, ordinal int32) Result {
	r, _, _ := purego.SyscallN(procs.cuDeviceGet, uintptr(unsafe.Pointer(d)), uintptr(ordinal))
	return res(r)
}

func cuDeviceGetName(name *byte, n int32, d Device) Result {
	r, _, _ := purego.SyscallN(procs.cuDeviceGetName, uintptr(unsafe.Pointer(name)), uintptr(n), uintptr(d))
	return res(r)
}

func cuDeviceGetUuid(uuid *[16]byte, d Device) Result {
	r, _, _ := purego.SyscallN(procs.cuDeviceGetUuid, uintptr(unsafe.Pointer(uuid)), uintptr(d))
	return res(r)
}

func cuDeviceGetPCIBusId(id *byte, n int32, d Device) Result {
	r, _, _ := purego.SyscallN(procs.cuDeviceGetPCIBusId, uintptr(unsafe.Pointer(id)), uintptr(n), uintptr(d))
	return res(r)
}

func cuDeviceTotalMem(bytes *uint64, d Device) Result {
	r, _, _ := purego.SyscallN(procs.cuDeviceTotalMem, uintptr(unsafe.Pointer(bytes)), uintptr(d))
	return res(r)
}

func cuDeviceGetAttribute(v *int32, attr int32, d Device) Result {
	r, _, _ := purego.SyscallN(procs.cuDeviceGetAttribute, uintptr(unsafe.Pointer(v)), uintptr(attr), uintptr(d))
	return res(r)
}

func cuDeviceCanAccessPeer(can *int32, d Device, peer Device) Result {
	r, _, _ := purego.SyscallN(procs.cuDeviceCanAccessPeer, uintptr(unsafe.Pointer(can)), uintptr(d), uintptr(peer))
	return res(r)
}

func cuDevicePrimaryCtxRetain(ctx *Context, d Device) Result {
	r, _, _ := purego.SyscallN(procs.cuDevicePrimaryCtxRetain, uintptr(unsafe.Pointer(ctx)), uintptr(d))
	return res(r)
}

func cuDevicePrimaryCtxRelease(d Device) Result {
	r, _, _ := purego.SyscallN(procs.cuDevicePrimaryCtxRelease, uintptr(d))
	return res(r)
}

func cuCtxSetCurrent(ctx Context) Result {
	r, _, _ := purego.SyscallN(procs.cuCtxSetCurrent, uintptr(ctx))
	return res(r)
}

func cuCtxGetCurrent(ctx *Context) Result {
	r, _, _ := purego.SyscallN(procs.cuCtxGetCurrent, uintptr(unsafe.Pointer(ctx)))
	return res(r)
}

func cuCtxSynchronize() Result {
	r, _, _ := purego.SyscallN(procs.cuCtxSynchronize)
	return res(r)
}

func cuCtxEnablePeerAccess(peer Context, flags uint32) Result {
	r, _, _ := purego.SyscallN(procs.cuCtxEnablePeerAccess, uintptr(peer), uintptr(flags))
	return res(r)
}

func cuCtxDisablePeerAccess(peer Context) Result {
	r, _, _ := purego.SyscallN(procs.cuCtxDisablePeerAccess, uintptr(peer))
	return res(r)
}

func cuMemAlloc(p *DevicePtr, size uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemAlloc, uintptr(unsafe.Pointer(p)), uintptr(size))
	return res(r)
}

func cuMemFree(p DevicePtr) Result {
	r, _, _ := purego.SyscallN(procs.cuMemFree, uintptr(p))
	return res(r)
}

func cuMemAllocHost(p *unsafe.Pointer, size uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemAllocHost, uintptr(unsafe.Pointer(p)), uintptr(size))
	return res(r)
}

func cuMemFreeHost(p unsafe.Pointer) Result {
	r, _, _ := purego.SyscallN(procs.cuMemFreeHost, uintptr(p))
	return res(r)
}

func cuMemGetInfo(free *uint64, total *uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemGetInfo, uintptr(unsafe.Pointer(free)), uintptr(unsafe.Pointer(total)))
	return res(r)
}

func cuMemGetAddressRange(base *DevicePtr, size *uint64, p DevicePtr) Result {
	r, _, _ := purego.SyscallN(procs.cuMemGetAddressRange, uintptr(unsafe.Pointer(base)), uintptr(unsafe.Pointer(size)), uintptr(p))
	return res(r)
}

func cuPointerGetAttribute(data unsafe.Pointer, attr int32, p DevicePtr) Result {
	r, _, _ := purego.SyscallN(procs.cuPointerGetAttribute, uintptr(data), uintptr(attr), uintptr(p))
	return res(r)
}

func cuMemcpy(dst DevicePtr, src DevicePtr, n uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemcpy, uintptr(dst), uintptr(src), uintptr(n))
	return res(r)
}

func cuMemcpyHtoD(dst DevicePtr, src unsafe.Pointer, n uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemcpyHtoD, uintptr(dst), uintptr(src), uintptr(n))
	return res(r)
}

func cuMemcpyDtoH(dst unsafe.Pointer, src DevicePtr, n uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemcpyDtoH, uintptr(dst), uintptr(src), uintptr(n))
	return res(r)
}

func cuMemcpyPeer(dst DevicePtr, dctx Context, src DevicePtr, sctx Context, n uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemcpyPeer, uintptr(dst), uintptr(dctx), uintptr(src), uintptr(sctx), uintptr(n))
	return res(r)
}

func cuMemcpyAsync(dst DevicePtr, src DevicePtr, n uint64, s Stream) Result {
	r, _, _ := purego.SyscallN(procs.cuMemcpyAsync, uintptr(dst), uintptr(src), uintptr(n), uintptr(s))
	return res(r)
}

func cuMemcpyHtoDAsync(dst DevicePtr, src unsafe.Pointer, n uint64, s Stream) Result {
	r, _, _ := purego.SyscallN(procs.cuMemcpyHtoDAsync, uintptr(dst), uintptr(src), uintptr(n), uintptr(s))
	return res(r)
}

func cuMemcpyDtoHAsync(dst unsafe.Pointer, src DevicePtr, n uint64, s Stream) Result {
	r, _, _ := purego.SyscallN(procs.cuMemcpyDtoHAsync, uintptr(dst), uintptr(src), uintptr(n), uintptr(s))
	return res(r)
}

func cuMemsetD8(p DevicePtr, v uint8, n uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemsetD8, uintptr(p), uintptr(v), uintptr(n))
	return res(r)
}

func cuMemsetD8Async(p DevicePtr, v uint8, n uint64, s Stream) Result {
	r, _, _ := purego.SyscallN(procs.cuMemsetD8Async, uintptr(p), uintptr(v), uintptr(n), uintptr(s))
	return res(r)
}

func cuStreamCreate(s *Stream, flags uint32) Result {
	r, _, _ := purego.SyscallN(procs.cuStreamCreate, uintptr(unsafe.Pointer(s)), uintptr(flags))
	return res(r)
}

func cuStreamDestroy(s Stream) Result {
	r, _, _ := purego.SyscallN(procs.cuStreamDestroy, uintptr(s))
	return res(r)
}

func cuStreamSynchronize(s Stream) Result {
	r, _, _ := purego.SyscallN(procs.cuStreamSynchronize, uintptr(s))
	return res(r)
}

func cuStreamQuery(s Stream) Result {
	r, _, _ := purego.SyscallN(procs.cuStreamQuery, uintptr(s))
	return res(r)
}

func cuStreamWaitEvent(s Stream, e Event, flags uint32) Result {
	r, _, _ := purego.SyscallN(procs.cuStreamWaitEvent, uintptr(s), uintptr(e), uintptr(flags))
	return res(r)
}

func cuEventCreate(e *Event, flags uint32) Result {
	r, _, _ := purego.SyscallN(procs.cuEventCreate, uintptr(unsafe.Pointer(e)), uintptr(flags))
	return res(r)
}

func cuEventDestroy(e Event) Result {
	r, _, _ := purego.SyscallN(procs.cuEventDestroy, uintptr(e))
	return res(r)
}

func cuEventRecord(e Event, s Stream) Result {
	r, _, _ := purego.SyscallN(procs.cuEventRecord, uintptr(e), uintptr(s))
	return res(r)
}

func cuEventSynchronize(e Event) Result {
	r, _, _ := purego.SyscallN(procs.cuEventSynchronize, uintptr(e))
	return res(r)
}

func cuEventQuery(e Event) Result {
	r, _, _ := purego.SyscallN(procs.cuEventQuery, uintptr(e))
	return res(r)
}

func cuEventElapsedTime(ms *float32, start Event, end Event) Result {
	r, _, _ := purego.SyscallN(procs.cuEventElapsedTime, uintptr(unsafe.Pointer(ms)), uintptr(start), uintptr(end))
	return res(r)
}

func cuIpcGetMemHandle(h *IpcMemHandle, p DevicePtr) Result {
	r, _, _ := purego.SyscallN(procs.cuIpcGetMemHandle, uintptr(unsafe.Pointer(h)), uintptr(p))
	return res(r)
}

func cuIpcOpenMemHandle(p *DevicePtr, h IpcMemHandle, flags uint32) Result {
	return cuIpcOpenMemHandleFn(p, h, flags)
}

func cuIpcCloseMemHandle(p DevicePtr) Result {
	r, _, _ := purego.SyscallN(procs.cuIpcCloseMemHandle, uintptr(p))
	return res(r)
}

func cuIpcGetEventHandle(h *IpcEventHandle, e Event) Result {
	r, _, _ := purego.SyscallN(procs.cuIpcGetEventHandle, uintptr(unsafe.Pointer(h)), uintptr(e))
	return res(r)
}

func cuIpcOpenEventHandle(e *Event, h IpcEventHandle) Result { return cuIpcOpenEventHandleFn(e, h) }

func cuMemCreate(h *MemGenericAllocationHandle, size uint64, prop *MemAllocationProp, flags uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemCreate, uintptr(unsafe.Pointer(h)), uintptr(size), uintptr(unsafe.Pointer(prop)), uintptr(flags))
	return res(r)
}

func cuMemRelease(h MemGenericAllocationHandle) Result {
	r, _, _ := purego.SyscallN(procs.cuMemRelease, uintptr(h))
	return res(r)
}

func cuMemExportToShareableHandle(shareable *int32, h MemGenericAllocationHandle, handleType int32, flags uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemExportToShareableHandle, uintptr(unsafe.Pointer(shareable)), uintptr(h), uintptr(handleType), uintptr(flags))
	return res(r)
}

func cuMemImportFromShareableHandle(h *MemGenericAllocationHandle, osHandle uintptr, handleType int32) Result {
	r, _, _ := purego.SyscallN(procs.cuMemImportFromShareableHandle, uintptr(unsafe.Pointer(h)), osHandle, uintptr(handleType))
	return res(r)
}

func cuMemAddressReserve(p *DevicePtr, size uint64, alignment uint64, addr DevicePtr, flags uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemAddressReserve, uintptr(unsafe.Pointer(p)), uintptr(size), uintptr(alignment), uintptr(addr), uintptr(flags))
	return res(r)
}

func cuMemAddressFree(p DevicePtr, size uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemAddressFree, uintptr(p), uintptr(size))
	return res(r)
}

func cuMemMap(p DevicePtr, size uint64, offset uint64, h MemGenericAllocationHandle, flags uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemMap, uintptr(p), uintptr(size), uintptr(offset), uintptr(h), uintptr(flags))
	return res(r)
}

func cuMemUnmap(p DevicePtr, size uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemUnmap, uintptr(p), uintptr(size))
	return res(r)
}

func cuMemSetAccess(p DevicePtr, size uint64, desc *MemAccessDesc, count uint64) Result {
	r, _, _ := purego.SyscallN(procs.cuMemSetAccess, uintptr(p), uintptr(size), uintptr(unsafe.Pointer(desc)), uintptr(count))
	return res(r)
}

func cuMemGetAllocationGranularity(g *uint64, prop *MemAllocationProp, option int32) Result {
	r, _, _ := purego.SyscallN(procs.cuMemGetAllocationGranularity, uintptr(unsafe.Pointer(g)), uintptr(unsafe.Pointer(prop)), uintptr(option))
	return res(r)
}

func cuMemGetAllocationPropertiesFromHandle(prop *MemAllocationProp, h MemGenericAllocationHandle) Result {
	r, _, _ := purego.SyscallN(procs.cuMemGetAllocationPropertiesFromHandle, uintptr(unsafe.Pointer(prop)), uintptr(h))
	return res(r)
}

var entries = []entry{
	{"cuInit", "cuInit", nil, &procs.cuInit},
	{"cuDriverGetVersion", "cuDriverGetVersion", nil, &procs.cuDriverGetVersion},
	{"cuDeviceGetCount", "cuDeviceGetCount", nil, &procs.cuDeviceGetCount},
	{"cuDeviceGet", "cuDeviceGet", nil, &procs.cuDeviceGet},
	{"cuDeviceGetName", "cuDeviceGetName", nil, &procs.cuDeviceGetName},
	{"cuDeviceGetUuid", "cuDeviceGetUuid_v2", nil, &procs.cuDeviceGetUuid},
	{"cuDeviceGetPCIBusId", "cuDeviceGetPCIBusId", nil, &procs.cuDeviceGetPCIBusId},
	{"cuDeviceTotalMem", "cuDeviceTotalMem_v2", nil, &procs.cuDeviceTotalMem},
	{"cuDeviceGetAttribute", "cuDeviceGetAttribute", nil, &procs.cuDeviceGetAttribute},
	{"cuDeviceCanAccessPeer", "cuDeviceCanAccessPeer", nil, &procs.cuDeviceCanAccessPeer},
	{"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", nil, &procs.cuDevicePrimaryCtxRetain},
	{"cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", nil, &procs.cuDevicePrimaryCtxRelease},
	{"cuCtxSetCurrent", "cuCtxSetCurrent", nil, &procs.cuCtxSetCurrent},
	{"cuCtxGetCurrent", "cuCtxGetCurrent", nil, &procs.cuCtxGetCurrent},
	{"cuCtxSynchronize", "cuCtxSynchronize", nil, &procs.cuCtxSynchronize},
	{"cuCtxEnablePeerAccess", "cuCtxEnablePeerAccess", nil, &procs.cuCtxEnablePeerAccess},
	{"cuCtxDisablePeerAccess", "cuCtxDisablePeerAccess", nil, &procs.cuCtxDisablePeerAccess},
	{"cuMemAlloc", "cuMemAlloc_v2", nil, &procs.cuMemAlloc},
	{"cuMemFree", "cuMemFree_v2", nil, &procs.cuMemFree},
	{"cuMemAllocHost", "cuMemAllocHost_v2", nil, &procs.cuMemAllocHost},
	{"cuMemFreeHost", "cuMemFreeHost", nil, &procs.cuMemFreeHost},
	{"cuMemGetInfo", "cuMemGetInfo_v2", nil, &procs.cuMemGetInfo},
	{"cuMemGetAddressRange", "cuMemGetAddressRange_v2", nil, &procs.cuMemGetAddressRange},
	{"cuPointerGetAttribute", "cuPointerGetAttribute", nil, &procs.cuPointerGetAttribute},
	{"cuMemcpy", "cuMemcpy", nil, &procs.cuMemcpy},
	{"cuMemcpyHtoD", "cuMemcpyHtoD_v2", nil, &procs.cuMemcpyHtoD},
	{"cuMemcpyDtoH", "cuMemcpyDtoH_v2", nil, &procs.cuMemcpyDtoH},
	{"cuMemcpyPeer", "cuMemcpyPeer", nil, &procs.cuMemcpyPeer},
	{"cuMemcpyAsync", "cuMemcpyAsync", nil, &procs.cuMemcpyAsync},
	{"cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2", nil, &procs.cuMemcpyHtoDAsync},
	{"cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2", nil, &procs.cuMemcpyDtoHAsync},
	{"cuMemsetD8", "cuMemsetD8_v2", nil, &procs.cuMemsetD8},
	{"cuMemsetD8Async", "cuMemsetD8Async", nil, &procs.cuMemsetD8Async},
	{"cuStreamCreate", "cuStreamCreate", nil, &procs.cuStreamCreate},
	{"cuStreamDestroy", "cuStreamDestroy_v2", nil, &procs.cuStreamDestroy},
	{"cuStreamSynchronize", "cuStreamSynchronize", nil, &procs.cuStreamSynchronize},
	{"cuStreamQuery", "cuStreamQuery", nil, &procs.cuStreamQuery},
	{"cuStreamWaitEvent", "cuStreamWaitEvent", nil, &procs.cuStreamWaitEvent},
	{"cuEventCreate", "cuEventCreate", nil, &procs.cuEventCreate},
	{"cuEventDestroy", "cuEventDestroy_v2", nil, &procs.cuEventDestroy},
	{"cuEventRecord", "cuEventRecord", nil, &procs.cuEventRecord},
	{"cuEventSynchronize", "cuEventSynchronize", nil, &procs.cuEventSynchronize},
	{"cuEventQuery", "cuEventQuery", nil, &procs.cuEventQuery},
	{"cuEventElapsedTime", "cuEventElapsedTime", nil, &procs.cuEventElapsedTime},
	{"cuIpcGetMemHandle", "cuIpcGetMemHandle", nil, &procs.cuIpcGetMemHandle},
	{"cuIpcOpenMemHandle", "cuIpcOpenMemHandle_v2", &cuIpcOpenMemHandleFn, &procs.cuIpcOpenMemHandle},
	{"cuIpcCloseMemHandle", "cuIpcCloseMemHandle", nil, &procs.cuIpcCloseMemHandle},
	{"cuIpcGetEventHandle", "cuIpcGetEventHandle", nil, &procs.cuIpcGetEventHandle},
	{"cuIpcOpenEventHandle", "cuIpcOpenEventHandle", &cuIpcOpenEventHandleFn, &procs.cuIpcOpenEventHandle},
	{"cuMemCreate", "cuMemCreate", nil, &procs.cuMemCreate},
	{"cuMemRelease", "cuMemRelease", nil, &procs.cuMemRelease},
	{"cuMemExportToShareableHandle", "cuMemExportToShareableHandle", nil, &procs.cuMemExportToShareableHandle},
	{"cuMemImportFromShareableHandle", "cuMemImportFromShareableHandle", nil, &procs.cuMemImportFromShareableHandle},
	{"cuMemAddressReserve", "cuMemAddressReserve", nil, &procs.cuMemAddressReserve},
	{"cuMemAddressFree", "cuMemAddressFree", nil, &procs.cuMemAddressFree},
	{"cuMemMap", "cuMemMap", nil, &procs.cuMemMap},
	{"cuMemUnmap", "cuMemUnmap", nil, &procs.cuMemUnmap},
	{"cuMemSetAccess", "cuMemSetAccess", nil, &procs.cuMemSetAccess},
	{"cuMemGetAllocationGranularity", "cuMemGetAllocationGranularity", nil, &procs.cuMemGetAllocationGranularity},
	{"cuMemGetAllocationPropertiesFromHandle", "cuMemGetAllocationPropertiesFromHandle", nil, &procs.cuMemGetAllocationPropertiesFromHandle},
}

func load(path string) error {
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		reason := strings.TrimSpace(err.Error())
		if reason == "" { // purego over cgo's dlopen can lose dlerror's text
			reason = "the dynamic loader cannot open it (not installed, or not on the library path)"
		}
		return &LoadError{Path: path, Reason: reason}
	}
	var getProc func(symbol string, pfn *uintptr, version int32, flags uint64, status *int32) Result
	if p, err := purego.Dlsym(h, "cuGetProcAddress_v2"); err == nil {
		purego.RegisterFunc(&getProc, p)
	}
	for _, e := range entries {
		var fp uintptr
		if getProc != nil {
			var status int32
			if r := getProc(e.name, &fp, apiVersion, 0, &status); r != Success || status != 0 {
				fp = 0
			}
		}
		if fp == 0 {
			p, err := purego.Dlsym(h, e.symbol)
			if err != nil {
				return &LoadError{Path: path, Reason: "it lacks " + e.symbol + ": not the NVIDIA driver library, or a driver older than CUDA 12.0"}
			}
			fp = p
		}
		if e.fn != nil {
			purego.RegisterFunc(e.fn, fp)
		}
		*e.addr = fp
	}
	if r := cuInit(0); r != Success {
		return &Error{Func: "cuInit", Code: r}
	}
	return nil
}

// loaded makes sure the library is loaded; if it is not, it returns the
// load error attributed to fn.
func loaded(fn string) error {
	if err := Load(); err != nil {
		return &Error{Func: fn, Err: err}
	}
	return nil
}
