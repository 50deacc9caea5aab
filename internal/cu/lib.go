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
	fn     any
	raw    *uintptr // also keep the address, for calls made with SyscallN
}

// cuCtxSetCurrentAddr is called through purego.SyscallN rather than a
// RegisterFunc binding: it runs before every context-bound call, and
// SyscallN skips the reflection of a bound function.
var cuCtxSetCurrentAddr uintptr

// The bound driver functions. Types follow cuda.h on LP64 Linux: size_t and
// CUdeviceptr are 64-bit, int is int32, pointers to C objects are uintptr.
var (
	cuInit                    func(flags uint32) Result
	cuDriverGetVersion        func(v *int32) Result
	cuDeviceGetCount          func(n *int32) Result
	cuDeviceGet               func(d *Device, ordinal int32) Result
	cuDeviceGetName           func(name *byte, n int32, d Device) Result
	cuDeviceGetUuid           func(uuid *[16]byte, d Device) Result
	cuDeviceGetPCIBusId       func(id *byte, n int32, d Device) Result
	cuDeviceTotalMem          func(bytes *uint64, d Device) Result
	cuDeviceGetAttribute      func(v *int32, attr int32, d Device) Result
	cuDeviceCanAccessPeer     func(can *int32, d, peer Device) Result
	cuDevicePrimaryCtxRetain  func(ctx *Context, d Device) Result
	cuDevicePrimaryCtxRelease func(d Device) Result
	cuCtxSetCurrent           func(ctx Context) Result
	cuCtxGetCurrent           func(ctx *Context) Result
	cuCtxSynchronize          func() Result
	cuCtxEnablePeerAccess     func(peer Context, flags uint32) Result
	cuCtxDisablePeerAccess    func(peer Context) Result
	cuMemAlloc                func(p *DevicePtr, size uint64) Result
	cuMemFree                 func(p DevicePtr) Result
	cuMemAllocHost            func(p *unsafe.Pointer, size uint64) Result
	cuMemFreeHost             func(p unsafe.Pointer) Result
	cuMemGetInfo              func(free, total *uint64) Result
	cuMemGetAddressRange      func(base *DevicePtr, size *uint64, p DevicePtr) Result
	cuPointerGetAttribute     func(data unsafe.Pointer, attr int32, p DevicePtr) Result
	cuMemcpy                  func(dst, src DevicePtr, n uint64) Result
	cuMemcpyHtoD              func(dst DevicePtr, src unsafe.Pointer, n uint64) Result
	cuMemcpyDtoH              func(dst unsafe.Pointer, src DevicePtr, n uint64) Result
	cuMemcpyPeer              func(dst DevicePtr, dctx Context, src DevicePtr, sctx Context, n uint64) Result
	cuMemcpyAsync             func(dst, src DevicePtr, n uint64, s Stream) Result
	cuMemcpyHtoDAsync         func(dst DevicePtr, src unsafe.Pointer, n uint64, s Stream) Result
	cuMemcpyDtoHAsync         func(dst unsafe.Pointer, src DevicePtr, n uint64, s Stream) Result
	cuMemsetD8                func(p DevicePtr, v uint8, n uint64) Result
	cuMemsetD8Async           func(p DevicePtr, v uint8, n uint64, s Stream) Result
	cuStreamCreate            func(s *Stream, flags uint32) Result
	cuStreamDestroy           func(s Stream) Result
	cuStreamSynchronize       func(s Stream) Result
	cuStreamQuery             func(s Stream) Result
	cuStreamWaitEvent         func(s Stream, e Event, flags uint32) Result
	cuEventCreate             func(e *Event, flags uint32) Result
	cuEventDestroy            func(e Event) Result
	cuEventRecord             func(e Event, s Stream) Result
	cuEventSynchronize        func(e Event) Result
	cuEventQuery              func(e Event) Result
	cuEventElapsedTime        func(ms *float32, start, end Event) Result
	cuIpcGetMemHandle         func(h *IpcMemHandle, p DevicePtr) Result
	cuIpcOpenMemHandle        func(p *DevicePtr, h IpcMemHandle, flags uint32) Result
	cuIpcCloseMemHandle       func(p DevicePtr) Result
	cuIpcGetEventHandle       func(h *IpcEventHandle, e Event) Result
	cuIpcOpenEventHandle      func(e *Event, h IpcEventHandle) Result

	// Virtual memory management. The struct pointers point at Go values
	// whose layout vmm_test.go checks against cuda.h.
	cuMemCreate                            func(h *MemGenericAllocationHandle, size uint64, prop *MemAllocationProp, flags uint64) Result
	cuMemRelease                           func(h MemGenericAllocationHandle) Result
	cuMemExportToShareableHandle           func(shareable *int32, h MemGenericAllocationHandle, handleType int32, flags uint64) Result
	cuMemImportFromShareableHandle         func(h *MemGenericAllocationHandle, osHandle uintptr, handleType int32) Result
	cuMemAddressReserve                    func(p *DevicePtr, size, alignment uint64, addr DevicePtr, flags uint64) Result
	cuMemAddressFree                       func(p DevicePtr, size uint64) Result
	cuMemMap                               func(p DevicePtr, size, offset uint64, h MemGenericAllocationHandle, flags uint64) Result
	cuMemUnmap                             func(p DevicePtr, size uint64) Result
	cuMemSetAccess                         func(p DevicePtr, size uint64, desc *MemAccessDesc, count uint64) Result
	cuMemGetAllocationGranularity          func(g *uint64, prop *MemAllocationProp, option int32) Result
	cuMemGetAllocationPropertiesFromHandle func(prop *MemAllocationProp, h MemGenericAllocationHandle) Result
)

var entries = []entry{
	{"cuInit", "cuInit", &cuInit, nil},
	{"cuDriverGetVersion", "cuDriverGetVersion", &cuDriverGetVersion, nil},
	{"cuDeviceGetCount", "cuDeviceGetCount", &cuDeviceGetCount, nil},
	{"cuDeviceGet", "cuDeviceGet", &cuDeviceGet, nil},
	{"cuDeviceGetName", "cuDeviceGetName", &cuDeviceGetName, nil},
	{"cuDeviceGetUuid", "cuDeviceGetUuid_v2", &cuDeviceGetUuid, nil},
	{"cuDeviceGetPCIBusId", "cuDeviceGetPCIBusId", &cuDeviceGetPCIBusId, nil},
	{"cuDeviceTotalMem", "cuDeviceTotalMem_v2", &cuDeviceTotalMem, nil},
	{"cuDeviceGetAttribute", "cuDeviceGetAttribute", &cuDeviceGetAttribute, nil},
	{"cuDeviceCanAccessPeer", "cuDeviceCanAccessPeer", &cuDeviceCanAccessPeer, nil},
	{"cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRetain", &cuDevicePrimaryCtxRetain, nil},
	{"cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", &cuDevicePrimaryCtxRelease, nil},
	{"cuCtxSetCurrent", "cuCtxSetCurrent", &cuCtxSetCurrent, &cuCtxSetCurrentAddr},
	{"cuCtxGetCurrent", "cuCtxGetCurrent", &cuCtxGetCurrent, nil},
	{"cuCtxSynchronize", "cuCtxSynchronize", &cuCtxSynchronize, nil},
	{"cuCtxEnablePeerAccess", "cuCtxEnablePeerAccess", &cuCtxEnablePeerAccess, nil},
	{"cuCtxDisablePeerAccess", "cuCtxDisablePeerAccess", &cuCtxDisablePeerAccess, nil},
	{"cuMemAlloc", "cuMemAlloc_v2", &cuMemAlloc, nil},
	{"cuMemFree", "cuMemFree_v2", &cuMemFree, nil},
	{"cuMemAllocHost", "cuMemAllocHost_v2", &cuMemAllocHost, nil},
	{"cuMemFreeHost", "cuMemFreeHost", &cuMemFreeHost, nil},
	{"cuMemGetInfo", "cuMemGetInfo_v2", &cuMemGetInfo, nil},
	{"cuMemGetAddressRange", "cuMemGetAddressRange_v2", &cuMemGetAddressRange, nil},
	{"cuPointerGetAttribute", "cuPointerGetAttribute", &cuPointerGetAttribute, nil},
	{"cuMemcpy", "cuMemcpy", &cuMemcpy, nil},
	{"cuMemcpyHtoD", "cuMemcpyHtoD_v2", &cuMemcpyHtoD, nil},
	{"cuMemcpyDtoH", "cuMemcpyDtoH_v2", &cuMemcpyDtoH, nil},
	{"cuMemcpyPeer", "cuMemcpyPeer", &cuMemcpyPeer, nil},
	{"cuMemcpyAsync", "cuMemcpyAsync", &cuMemcpyAsync, nil},
	{"cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2", &cuMemcpyHtoDAsync, nil},
	{"cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2", &cuMemcpyDtoHAsync, nil},
	{"cuMemsetD8", "cuMemsetD8_v2", &cuMemsetD8, nil},
	{"cuMemsetD8Async", "cuMemsetD8Async", &cuMemsetD8Async, nil},
	{"cuStreamCreate", "cuStreamCreate", &cuStreamCreate, nil},
	{"cuStreamDestroy", "cuStreamDestroy_v2", &cuStreamDestroy, nil},
	{"cuStreamSynchronize", "cuStreamSynchronize", &cuStreamSynchronize, nil},
	{"cuStreamQuery", "cuStreamQuery", &cuStreamQuery, nil},
	{"cuStreamWaitEvent", "cuStreamWaitEvent", &cuStreamWaitEvent, nil},
	{"cuEventCreate", "cuEventCreate", &cuEventCreate, nil},
	{"cuEventDestroy", "cuEventDestroy_v2", &cuEventDestroy, nil},
	{"cuEventRecord", "cuEventRecord", &cuEventRecord, nil},
	{"cuEventSynchronize", "cuEventSynchronize", &cuEventSynchronize, nil},
	{"cuEventQuery", "cuEventQuery", &cuEventQuery, nil},
	{"cuEventElapsedTime", "cuEventElapsedTime", &cuEventElapsedTime, nil},
	{"cuIpcGetMemHandle", "cuIpcGetMemHandle", &cuIpcGetMemHandle, nil},
	{"cuIpcOpenMemHandle", "cuIpcOpenMemHandle_v2", &cuIpcOpenMemHandle, nil},
	{"cuIpcCloseMemHandle", "cuIpcCloseMemHandle", &cuIpcCloseMemHandle, nil},
	{"cuIpcGetEventHandle", "cuIpcGetEventHandle", &cuIpcGetEventHandle, nil},
	{"cuIpcOpenEventHandle", "cuIpcOpenEventHandle", &cuIpcOpenEventHandle, nil},
	{"cuMemCreate", "cuMemCreate", &cuMemCreate, nil},
	{"cuMemRelease", "cuMemRelease", &cuMemRelease, nil},
	{"cuMemExportToShareableHandle", "cuMemExportToShareableHandle", &cuMemExportToShareableHandle, nil},
	{"cuMemImportFromShareableHandle", "cuMemImportFromShareableHandle", &cuMemImportFromShareableHandle, nil},
	{"cuMemAddressReserve", "cuMemAddressReserve", &cuMemAddressReserve, nil},
	{"cuMemAddressFree", "cuMemAddressFree", &cuMemAddressFree, nil},
	{"cuMemMap", "cuMemMap", &cuMemMap, nil},
	{"cuMemUnmap", "cuMemUnmap", &cuMemUnmap, nil},
	{"cuMemSetAccess", "cuMemSetAccess", &cuMemSetAccess, nil},
	{"cuMemGetAllocationGranularity", "cuMemGetAllocationGranularity", &cuMemGetAllocationGranularity, nil},
	{"cuMemGetAllocationPropertiesFromHandle", "cuMemGetAllocationPropertiesFromHandle", &cuMemGetAllocationPropertiesFromHandle, nil},
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
		purego.RegisterFunc(e.fn, fp)
		if e.raw != nil {
			*e.raw = fp
		}
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
