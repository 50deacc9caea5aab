// Package cu is the raw layer over the CUDA driver API (libcuda.so.1),
// loaded at run time with purego so that the module builds and tests with
// CGO_ENABLED=0 and without CUDA installed. Functions are named after the C
// entry points without the "cu" prefix and return Go errors (*Error) instead
// of CUresult. This is the only package of the module that uses unsafe or
// purego; callers above it are responsible for making the right context
// current on a locked OS thread before calls that need one.
package cu

import (
	"github.com/ebitengine/purego"

	"github.com/cudaipc/cudaipc/internal/dl"
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
	// Module is a CUmodule: code loaded into a context.
	Module uintptr
	// Function is a CUfunction: a kernel of a Module.
	Function uintptr
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

var lib = dl.Library{Pkg: "cu", Name: "the driver library", Default: DefaultLibrary, Env: EnvLibrary}

// SetLibrary sets the path of the driver library to load. It must be called
// before the first driver call; afterwards it returns an error.
func SetLibrary(path string) error { return lib.Set(path) }

// Library returns the path that is (or will be) loaded.
func Library() string { return lib.Path() }

// Load loads the driver library, resolves every entry point and calls
// cuInit(0). It runs once; later calls return the first result.
func Load() error { return lib.Load(load) }

//go:generate go run ./gen -in entrypoints.txt -out zentrypoints.go

// entry is one driver function of entrypoints.txt: the name given to
// cuGetProcAddress, the versioned symbol used when cuGetProcAddress does
// not give it, whether the library must have it, and where its address
// goes. The functions themselves, cuX (the trampoline) and callX (the
// typed wrapper), are generated into zentrypoints.go.
//
// Types follow cuda.h on LP64 Linux: size_t and CUdeviceptr are 64-bit,
// int is int32, pointers to C objects are uintptr. Calls go through
// purego.SyscallN, which costs about a fifth of a purego.RegisterFunc
// binding (no reflection); the two functions that take a 64-byte handle by
// value go through RegisterFunc bindings, which lay such structs out per
// the platform ABI.
type entry struct {
	name     string
	symbol   string
	required bool
	fn       any      // a RegisterFunc binding, for calls that pass structs by value
	addr     *uintptr // the address, for calls made with SyscallN
}

func load(path string) error {
	h, err := purego.Dlopen(path, purego.RTLD_NOW|purego.RTLD_GLOBAL)
	if err != nil {
		return &LoadError{Path: path, Reason: dl.OpenReason(err)}
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
			switch {
			case err == nil:
				fp = p
			case e.required:
				return &LoadError{Path: path, Reason: "it lacks " + e.symbol + ": not the NVIDIA driver library, or a driver older than CUDA 12.0"}
			default:
				continue // optional: callX reports it missing
			}
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

// Has reports whether the loaded library provides the entry point name
// (e.g. "cuStreamWriteValue64"): the feature probe for optional entry
// points. It is false without a driver.
func Has(name string) bool {
	if Load() != nil {
		return false
	}
	for _, e := range entries {
		if e.name == name {
			return *e.addr != 0
		}
	}
	return false
}

// MissingError says that the loaded driver library lacks an optional entry
// point: the feature that needs it is unavailable, the rest works. It
// matches ErrorNotSupported.
type MissingError struct {
	Path   string // the library
	Symbol string // the versioned symbol it lacks
}

func (e *MissingError) Error() string {
	return "the driver library " + e.Path + " lacks " + e.Symbol + ": this feature needs a newer NVIDIA driver"
}

// Is makes errors.Is(err, ErrorNotSupported) true.
func (e *MissingError) Is(target error) bool { return target == ErrorNotSupported }

func missing(fn, symbol string) error {
	return &Error{Func: fn, Err: &MissingError{Path: Library(), Symbol: symbol}}
}

// loaded makes sure the library is loaded; if it is not, it returns the
// load error attributed to fn.
func loaded(fn string) error {
	if err := Load(); err != nil {
		return &Error{Func: fn, Err: err}
	}
	return nil
}
