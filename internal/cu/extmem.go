package cu

// Optional entry points for memory other libraries allocated and for
// stream memory operations. They are resolved on first use, not by Load, so
// that a driver without them still loads; a missing one is an *Error
// matching ErrNotSupported. (Kept apart until the generated entry table
// takes them as optional entries.)

import (
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

// More pointer attributes (CUpointer_attribute).
const (
	PointerAttrAllowedHandleTypes = 14 // CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES
	PointerAttrAccessFlags        = 16 // CU_POINTER_ATTRIBUTE_ACCESS_FLAGS
	PointerAttrMempoolHandle      = 17 // CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE
	PointerAttrMappingSize        = 18 // CU_POINTER_ATTRIBUTE_MAPPING_SIZE
	PointerAttrMappingBaseAddr    = 19 // CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR
)

// AttrCanUse64BitStreamMemOps is CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS:
// cuStreamWriteValue64 and cuStreamWaitValue64 work on the device.
const AttrCanUse64BitStreamMemOps = 93

// Flags of the stream memory operations.
const (
	StreamWaitValueGEQ   = 0x0 // CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0
	StreamWaitValueEQ    = 0x1 // CU_STREAM_WAIT_VALUE_EQ
	StreamWriteValueDflt = 0x0 // CU_STREAM_WRITE_VALUE_DEFAULT: a memory barrier before the write
)

var opt struct {
	once                        sync.Once
	cuMemRetainAllocationHandle uintptr
	cuStreamWriteValue64        uintptr
	cuStreamWaitValue64         uintptr
}

// resolveOptional finds the optional entry points through cuGetProcAddress
// (at apiVersion, which gives the _v2 stream memory operations), falling
// back to their versioned symbols.
func resolveOptional() {
	opt.once.Do(func() {
		if Load() != nil {
			return
		}
		h, err := purego.Dlopen(loadedPath, purego.RTLD_NOW|purego.RTLD_GLOBAL)
		if err != nil {
			return
		}
		var getProc func(symbol string, pfn *uintptr, version int32, flags uint64, status *int32) Result
		if p, err := purego.Dlsym(h, "cuGetProcAddress_v2"); err == nil {
			purego.RegisterFunc(&getProc, p)
		}
		for _, e := range []struct {
			name, symbol string
			addr         *uintptr
		}{
			{"cuMemRetainAllocationHandle", "cuMemRetainAllocationHandle", &opt.cuMemRetainAllocationHandle},
			{"cuStreamWriteValue64", "cuStreamWriteValue64_v2", &opt.cuStreamWriteValue64},
			{"cuStreamWaitValue64", "cuStreamWaitValue64_v2", &opt.cuStreamWaitValue64},
		} {
			var fp uintptr
			if getProc != nil {
				var status int32
				if r := getProc(e.name, &fp, apiVersion, 0, &status); r != Success || status != 0 {
					fp = 0
				}
			}
			if fp == 0 {
				fp, _ = purego.Dlsym(h, e.symbol)
			}
			*e.addr = fp
		}
	})
}

// optional loads the library and the optional entries; it returns an error
// naming fn if the library does not load or lacks fn.
func optional(fn string, addr *uintptr) error {
	if err := loaded(fn); err != nil {
		return err
	}
	resolveOptional()
	if *addr == 0 {
		return &Error{Func: fn, Code: ErrorNotSupported}
	}
	return nil
}

// MemRetainAllocationHandle returns a new reference to the physical
// allocation mapped at p, which must lie in a VMM mapping (cuMemMap). The
// caller releases it with MemRelease. Memory from cuMemAlloc or a
// stream-ordered pool gives ErrorInvalidValue.
func MemRetainAllocationHandle(p DevicePtr) (MemGenericAllocationHandle, error) {
	if err := optional("cuMemRetainAllocationHandle", &opt.cuMemRetainAllocationHandle); err != nil {
		return 0, err
	}
	var h MemGenericAllocationHandle
	r, _, _ := purego.SyscallN(opt.cuMemRetainAllocationHandle, uintptr(unsafe.Pointer(&h)), uintptr(p))
	return h, check("cuMemRetainAllocationHandle", res(r))
}

// StreamWriteValue64 enqueues on s a 64-bit write of v to p, after the
// stream's earlier work (flags StreamWriteValueDflt).
func StreamWriteValue64(s Stream, p DevicePtr, v uint64, flags uint32) error {
	if err := optional("cuStreamWriteValue64", &opt.cuStreamWriteValue64); err != nil {
		return err
	}
	r, _, _ := purego.SyscallN(opt.cuStreamWriteValue64, uintptr(s), uintptr(p), uintptr(v), uintptr(flags))
	return check("cuStreamWriteValue64", res(r))
}

// StreamWaitValue64 makes s wait, before its later work, until the 64-bit
// value at p satisfies flags against v (StreamWaitValueGEQ: *p >= v).
func StreamWaitValue64(s Stream, p DevicePtr, v uint64, flags uint32) error {
	if err := optional("cuStreamWaitValue64", &opt.cuStreamWaitValue64); err != nil {
		return err
	}
	r, _, _ := purego.SyscallN(opt.cuStreamWaitValue64, uintptr(s), uintptr(p), uintptr(v), uintptr(flags))
	return check("cuStreamWaitValue64", res(r))
}

// MemMapOffset maps size bytes of h, from offset bytes into it, at p. The
// driver documents offset as "currently must be zero" for device memory;
// the argument exists so that a later driver may accept more.
func MemMapOffset(p DevicePtr, size, offset uint64, h MemGenericAllocationHandle) error {
	if err := loaded("cuMemMap"); err != nil {
		return err
	}
	return check("cuMemMap", cuMemMap(p, size, offset, h, 0))
}
