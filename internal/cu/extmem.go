package cu

// Memory that other libraries allocated, and stream memory operations. The
// entry points are optional entries of entrypoints.txt: a driver without
// them still loads, and their calls fail with a *MissingError.

// More pointer attributes.
const (
	PointerAttrAllowedHandleTypes PointerAttribute = 14 // CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES
	PointerAttrAccessFlags        PointerAttribute = 16 // CU_POINTER_ATTRIBUTE_ACCESS_FLAGS
	PointerAttrMempoolHandle      PointerAttribute = 17 // CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE
	PointerAttrMappingSize        PointerAttribute = 18 // CU_POINTER_ATTRIBUTE_MAPPING_SIZE
	PointerAttrMappingBaseAddr    PointerAttribute = 19 // CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR
)

// AttrCanUse64BitStreamMemOps is CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
// (122, CUDA 12+): cuStreamWriteValue64_v2 and cuStreamWaitValue64_v2 work
// on the device. 93 is the deprecated _V1 attribute of the v1 API, which
// reads 0 on the H200 with driver 580.
const AttrCanUse64BitStreamMemOps DeviceAttribute = 122

// StreamValueFlags are the flags of cuStreamWriteValue64 and
// cuStreamWaitValue64 (CUstreamWriteValue_flags, CUstreamWaitValue_flags).
type StreamValueFlags uint32

// Flags of the stream memory operations.
const (
	StreamWaitValueGEQ   StreamValueFlags = 0x0 // CU_STREAM_WAIT_VALUE_GEQ: (int64)(*addr - value) >= 0
	StreamWaitValueEQ    StreamValueFlags = 0x1 // CU_STREAM_WAIT_VALUE_EQ
	StreamWriteValueDflt StreamValueFlags = 0x0 // CU_STREAM_WRITE_VALUE_DEFAULT: a memory barrier before the write
)

// MemRetainAllocationHandle returns a new reference to the physical
// allocation mapped at p, which must lie in a VMM mapping (cuMemMap), e.g.
// memory of PyTorch's expandable segments. The caller releases it with
// MemRelease. Memory from cuMemAlloc or a stream-ordered pool gives
// ErrorInvalidValue.
func MemRetainAllocationHandle(p DevicePtr) (MemGenericAllocationHandle, error) {
	var h MemGenericAllocationHandle
	err := callMemRetainAllocationHandle(&h, p)
	return h, err
}

// StreamWriteValue64 enqueues on s a 64-bit write of v to p, after the
// stream's earlier work (flags StreamWriteValueDflt).
func StreamWriteValue64(s Stream, p DevicePtr, v uint64, flags StreamValueFlags) error {
	return callStreamWriteValue64(s, p, v, uint32(flags))
}

// StreamWaitValue64 makes s wait, before its later work, until the 64-bit
// value at p satisfies flags against v (StreamWaitValueGEQ: *p >= v).
func StreamWaitValue64(s Stream, p DevicePtr, v uint64, flags StreamValueFlags) error {
	return callStreamWaitValue64(s, p, v, uint32(flags))
}

// MemMapOffset maps size bytes of h, from offset bytes into it, at p. The
// driver documents offset as "currently must be zero" for device memory;
// the argument exists so that a later driver may accept more.
func MemMapOffset(p DevicePtr, size, offset uint64, h MemGenericAllocationHandle) error {
	return callMemMap(p, size, offset, h, 0)
}
