package ucx

import (
	"errors"
	"strconv"
	"sync"
	"unsafe"

	"github.com/ebitengine/purego"
)

type (
	// Context is a ucp_context_h.
	Context uintptr
	// Worker is a ucp_worker_h.
	Worker uintptr
	// Ep is a ucp_ep_h.
	Ep uintptr
	// Mem is a ucp_mem_h: a registered memory region.
	Mem uintptr
	// Rkey is a ucp_rkey_h: a remote key unpacked on an endpoint.
	Rkey uintptr
	// Request is the request pointer of a ucs_status_ptr_t that is neither
	// NULL nor an error: an operation still in progress, to be polled with
	// RequestCheckStatus and released with RequestFree.
	Request uintptr
)

// Feature bits of Params.Features (ucp_feature).
const (
	FeatureTag    uint64 = 1 << 0
	FeatureRMA    uint64 = 1 << 1
	FeatureWakeup uint64 = 1 << 4
	FeatureAM     uint64 = 1 << 6
)

// Field bits of Params.FieldMask (ucp_params_field).
const (
	ParamFieldFeatures        uint64 = 1 << 0
	ParamFieldMtWorkersShared uint64 = 1 << 5
	ParamFieldName            uint64 = 1 << 8
)

// Field bits of ContextAttr.FieldMask (ucp_context_attr_field).
const (
	AttrFieldRequestSize uint64 = 1 << 0
	AttrFieldThreadMode  uint64 = 1 << 1
	AttrFieldMemoryTypes uint64 = 1 << 2
	AttrFieldName        uint64 = 1 << 3
)

// ThreadMode is a ucs_thread_mode_t.
type ThreadMode int32

// Thread modes.
const (
	ThreadModeSingle     ThreadMode = 0
	ThreadModeSerialized ThreadMode = 1
	ThreadModeMulti      ThreadMode = 2
)

// MemoryType is a ucs_memory_type_t. UCS_MEMORY_TYPE_LAST (and UNKNOWN,
// equal to it) is 5 in UCX 1.13 and 6 in 1.16, where RDMA was inserted
// before it: never pass or compare those two as numbers.
type MemoryType int32

// Memory types, equal in UCX 1.13 and 1.16.
const (
	MemoryTypeHost        MemoryType = 0
	MemoryTypeCUDA        MemoryType = 1
	MemoryTypeCUDAManaged MemoryType = 2
	MemoryTypeROCm        MemoryType = 3
	MemoryTypeROCmManaged MemoryType = 4
	MemoryTypeRDMA        MemoryType = 5 // UCX 1.16 and later
)

// String returns the name UCX gives the memory type.
func (m MemoryType) String() string {
	switch m {
	case MemoryTypeHost:
		return "host"
	case MemoryTypeCUDA:
		return "cuda"
	case MemoryTypeCUDAManaged:
		return "cuda-managed"
	case MemoryTypeROCm:
		return "rocm"
	case MemoryTypeROCmManaged:
		return "rocm-managed"
	case MemoryTypeRDMA:
		return "rdma"
	}
	return "ucs_memory_type_t(" + strconv.Itoa(int(m)) + ")"
}

// Field bits of WorkerParams.FieldMask (ucp_worker_params_field).
const (
	WorkerParamFieldThreadMode uint64 = 1 << 0
	WorkerParamFieldEvents     uint64 = 1 << 2
	WorkerParamFieldName       uint64 = 1 << 6
)

// Wakeup event bits of WorkerParams.Events (ucp_wakeup_event_types).
const (
	WakeupRMA uint32 = 1 << 0
	WakeupAMO uint32 = 1 << 1
	WakeupTX  uint32 = 1 << 10
	WakeupRX  uint32 = 1 << 11
)

// Field bits of WorkerAttr.FieldMask (ucp_worker_attr_field).
const (
	WorkerAttrFieldThreadMode   uint64 = 1 << 0
	WorkerAttrFieldAddress      uint64 = 1 << 1
	WorkerAttrFieldAddressFlags uint64 = 1 << 2
	WorkerAttrFieldMaxAmHeader  uint64 = 1 << 3
	WorkerAttrFieldName         uint64 = 1 << 4
)

// Field bits of EpParams.FieldMask (ucp_ep_params_field).
const (
	EpParamFieldRemoteAddress   uint64 = 1 << 0
	EpParamFieldErrHandlingMode uint64 = 1 << 1
	EpParamFieldErrHandler      uint64 = 1 << 2
	EpParamFieldName            uint64 = 1 << 7
)

// ErrHandlingMode is a ucp_err_handling_mode_t.
type ErrHandlingMode int32

// Error handling modes. With ErrHandlingPeer every request completes (with
// an error) when the peer fails, and a forced close is allowed.
const (
	ErrHandlingNone ErrHandlingMode = 0
	ErrHandlingPeer ErrHandlingMode = 1
)

// Field bits of MemMapParams.FieldMask (ucp_mem_map_params_field).
const (
	MemMapParamFieldAddress    uint64 = 1 << 0
	MemMapParamFieldLength     uint64 = 1 << 1
	MemMapParamFieldFlags      uint64 = 1 << 2
	MemMapParamFieldProt       uint64 = 1 << 3
	MemMapParamFieldMemoryType uint64 = 1 << 4
)

// Protection bits of MemMapParams.Prot (ucp_mem_map_prot).
const (
	MemMapProtLocalRead   uint32 = 1 << 0
	MemMapProtLocalWrite  uint32 = 1 << 1
	MemMapProtRemoteRead  uint32 = 1 << 8
	MemMapProtRemoteWrite uint32 = 1 << 9
)

// Bits of RequestParam.OpAttrMask (ucp_op_attr_t).
const (
	OpAttrFieldRequest    uint32 = 1 << 0
	OpAttrFieldCallback   uint32 = 1 << 1
	OpAttrFieldUserData   uint32 = 1 << 2
	OpAttrFieldDatatype   uint32 = 1 << 3
	OpAttrFieldFlags      uint32 = 1 << 4
	OpAttrFieldMemoryType uint32 = 1 << 6
	OpAttrFieldRecvInfo   uint32 = 1 << 7
	OpAttrFieldMemh       uint32 = 1 << 8
	OpAttrFlagNoImmCmpl   uint32 = 1 << 16
	OpAttrFlagFastCmpl    uint32 = 1 << 17
)

// EpCloseFlagForce is UCP_EP_CLOSE_FLAG_FORCE, a RequestParam.Flags bit of
// EpCloseNbx: release the endpoint at once, completing its outstanding
// requests with UCS_ERR_CANCELED. Both sides' endpoints must use
// ErrHandlingPeer.
const EpCloseFlagForce uint32 = 1 << 0

// slack follows every parameter struct: a later UCX that reads a longer
// struct (ucp_mem_map_params_t grew from 40 to 48 bytes in 1.16) reads
// zeros, which its field_mask ignores.
type slack [64]byte

// Params is ucp_params_t (80 bytes in UCX 1.13 and 1.16).
type Params struct {
	FieldMask       uint64
	Features        uint64
	RequestSize     uint64
	RequestInit     uintptr
	RequestCleanup  uintptr
	TagSenderMask   uint64
	MtWorkersShared int32
	_               int32
	EstimatedNumEps uint64
	EstimatedNumPpn uint64
	Name            *byte
	_               slack
}

// ContextAttr is ucp_context_attr_t (64 bytes).
type ContextAttr struct {
	FieldMask   uint64
	RequestSize uint64
	ThreadMode  ThreadMode
	_           int32
	MemoryTypes uint64 // bit i set: MemoryType(i) is supported
	Name        [32]byte
	_           slack
}

// WorkerParams is ucp_worker_params_t (200 bytes).
type WorkerParams struct {
	FieldMask   uint64
	ThreadMode  ThreadMode
	_           int32
	CPUMask     [16]uint64 // ucs_cpu_set_t: 1024 bits
	Events      uint32
	_           int32
	UserData    uintptr
	EventFd     int32
	_           int32
	Flags       uint64
	Name        *byte
	AmAlignment uint64
	ClientID    uint64
	_           slack
}

// WorkerAttr is ucp_worker_attr_t (80 bytes).
type WorkerAttr struct {
	FieldMask      uint64
	ThreadMode     ThreadMode
	AddressFlags   uint32
	Address        uintptr
	AddressLength  uint64
	MaxAmHeader    uint64
	Name           [32]byte
	MaxDebugString uint64
	_              slack
}

// EpParams is ucp_ep_params_t (104 bytes).
type EpParams struct {
	FieldMask         uint64
	Address           *byte // const ucp_address_t *
	ErrMode           ErrHandlingMode
	_                 int32
	ErrHandlerCb      uintptr
	ErrHandlerArg     uintptr
	UserData          uintptr
	Flags             uint32
	_                 int32
	SockaddrAddr      uintptr
	SockaddrLen       uint32
	_                 int32
	ConnRequest       uintptr
	Name              *byte
	LocalSockaddrAddr uintptr
	LocalSockaddrLen  uint32
	_                 int32
	_                 slack
}

// MemMapParams is ucp_mem_map_params_t (40 bytes in UCX 1.13, 48 in 1.16).
type MemMapParams struct {
	FieldMask          uint64
	Address            uintptr
	Length             uint64
	Flags              uint32
	Prot               uint32
	MemoryType         MemoryType
	_                  int32
	ExportedMemhBuffer uintptr // UCX 1.16 and later
	_                  slack
}

// RequestParam is ucp_request_param_t (72 bytes).
type RequestParam struct {
	OpAttrMask  uint32
	Flags       uint32
	Request     uintptr
	Cb          uintptr
	Datatype    uint64
	UserData    uintptr
	ReplyBuffer uintptr
	MemoryType  MemoryType
	_           int32
	RecvInfo    uintptr
	Memh        Mem
	_           slack
}

// TagRecvInfo is ucp_tag_recv_info_t (16 bytes): what a completed tag
// receive matched.
type TagRecvInfo struct {
	SenderTag uint64
	Length    uint64
}

func status(r uintptr) Status { return Status(int8(r)) }

// statusPtr decodes a ucs_status_ptr_t: NULL is done, a value in the
// last 100 of the address space an error (UCS_PTR_IS_ERR), anything else a
// request in progress.
func statusPtr(fn string, r uintptr) (Request, error) {
	switch {
	case r == 0:
		return 0, nil
	case r >= ^uintptr(0)-99: // (uintptr)UCS_ERR_LAST and above
		return 0, &Error{Func: fn, Status: Status(int8(int64(r)))}
	}
	return Request(r), nil
}

// GetVersion calls ucp_get_version.
func GetVersion() (major, minor, release uint32, err error) {
	if err := loaded("ucp_get_version"); err != nil {
		return 0, 0, 0, err
	}
	major, minor, release = getVersion()
	return major, minor, release, nil
}

func getVersion() (major, minor, release uint32) {
	purego.SyscallN(procs.getVersion, uintptr(unsafe.Pointer(&major)), uintptr(unsafe.Pointer(&minor)), uintptr(unsafe.Pointer(&release)))
	return major, minor, release
}

func versionString(major, minor uint32) string {
	return strconv.FormatUint(uint64(major), 10) + "." + strconv.FormatUint(uint64(minor), 10)
}

// InitVersion calls ucp_init_version with the library's own API version
// (so that it never warns of a mismatch) and no ucp_config_t: UCX reads
// its settings from the UCX_* environment variables.
func InitVersion(params *Params) (Context, error) {
	if err := loaded("ucp_init_version"); err != nil {
		return 0, err
	}
	major, minor, _ := getVersion()
	var c Context
	r, _, _ := purego.SyscallN(procs.initVersion, uintptr(major), uintptr(minor), uintptr(unsafe.Pointer(params)), 0, uintptr(unsafe.Pointer(&c)))
	return c, check("ucp_init_version", status(r))
}

// Cleanup calls ucp_cleanup.
func Cleanup(c Context) {
	if loaded("ucp_cleanup") == nil {
		purego.SyscallN(procs.cleanup, uintptr(c))
	}
}

// ContextQuery calls ucp_context_query.
func ContextQuery(c Context, attr *ContextAttr) error {
	if err := loaded("ucp_context_query"); err != nil {
		return err
	}
	r, _, _ := purego.SyscallN(procs.contextQuery, uintptr(c), uintptr(unsafe.Pointer(attr)))
	return check("ucp_context_query", status(r))
}

// WorkerCreate calls ucp_worker_create.
func WorkerCreate(c Context, params *WorkerParams) (Worker, error) {
	if err := loaded("ucp_worker_create"); err != nil {
		return 0, err
	}
	var w Worker
	r, _, _ := purego.SyscallN(procs.workerCreate, uintptr(c), uintptr(unsafe.Pointer(params)), uintptr(unsafe.Pointer(&w)))
	return w, check("ucp_worker_create", status(r))
}

// WorkerDestroy calls ucp_worker_destroy.
func WorkerDestroy(w Worker) {
	if loaded("ucp_worker_destroy") == nil {
		purego.SyscallN(procs.workerDestroy, uintptr(w))
	}
}

// WorkerQuery calls ucp_worker_query. With WorkerAttrFieldAddress, the
// address it returns must be released with WorkerReleaseAddress.
func WorkerQuery(w Worker, attr *WorkerAttr) error {
	if err := loaded("ucp_worker_query"); err != nil {
		return err
	}
	r, _, _ := purego.SyscallN(procs.workerQuery, uintptr(w), uintptr(unsafe.Pointer(attr)))
	return check("ucp_worker_query", status(r))
}

// WorkerProgress calls ucp_worker_progress and returns how many events it
// handled (0 when idle).
func WorkerProgress(w Worker) uint32 {
	r, _, _ := purego.SyscallN(procs.workerProgress, uintptr(w))
	return uint32(r)
}

// WorkerGetAddress calls ucp_worker_get_address: a pointer to the packed
// worker address and its length, to be released with WorkerReleaseAddress.
func WorkerGetAddress(w Worker) (addr uintptr, length uint64, err error) {
	if err := loaded("ucp_worker_get_address"); err != nil {
		return 0, 0, err
	}
	r, _, _ := purego.SyscallN(procs.workerGetAddress, uintptr(w), uintptr(unsafe.Pointer(&addr)), uintptr(unsafe.Pointer(&length)))
	return addr, length, check("ucp_worker_get_address", status(r))
}

// WorkerReleaseAddress calls ucp_worker_release_address.
func WorkerReleaseAddress(w Worker, addr uintptr) {
	purego.SyscallN(procs.workerReleaseAddress, uintptr(w), addr)
}

// WorkerGetEfd calls ucp_worker_get_efd: a descriptor, owned by the worker,
// that becomes readable when the armed worker has events (the context needs
// FeatureWakeup).
func WorkerGetEfd(w Worker) (int, error) {
	if err := loaded("ucp_worker_get_efd"); err != nil {
		return -1, err
	}
	var fd int32
	r, _, _ := purego.SyscallN(procs.workerGetEfd, uintptr(w), uintptr(unsafe.Pointer(&fd)))
	return int(fd), check("ucp_worker_get_efd", status(r))
}

// WorkerArm calls ucp_worker_arm. ErrBusy means events are pending: progress
// the worker and arm again.
func WorkerArm(w Worker) error {
	r, _, _ := purego.SyscallN(procs.workerArm, uintptr(w))
	return check("ucp_worker_arm", status(r))
}

// WorkerSignal calls ucp_worker_signal, which UCX allows from any thread:
// it makes the worker's event descriptor readable.
func WorkerSignal(w Worker) error {
	r, _, _ := purego.SyscallN(procs.workerSignal, uintptr(w))
	return check("ucp_worker_signal", status(r))
}

// MemMap calls ucp_mem_map.
func MemMap(c Context, params *MemMapParams) (Mem, error) {
	if err := loaded("ucp_mem_map"); err != nil {
		return 0, err
	}
	var m Mem
	r, _, _ := purego.SyscallN(procs.memMap, uintptr(c), uintptr(unsafe.Pointer(params)), uintptr(unsafe.Pointer(&m)))
	return m, check("ucp_mem_map", status(r))
}

// MemUnmap calls ucp_mem_unmap.
func MemUnmap(c Context, m Mem) error {
	if err := loaded("ucp_mem_unmap"); err != nil {
		return err
	}
	r, _, _ := purego.SyscallN(procs.memUnmap, uintptr(c), uintptr(m))
	return check("ucp_mem_unmap", status(r))
}

// RkeyPack calls ucp_rkey_pack and copies the packed key into Go memory,
// releasing UCX's buffer (ucp_rkey_buffer_release).
func RkeyPack(c Context, m Mem) ([]byte, error) {
	if err := loaded("ucp_rkey_pack"); err != nil {
		return nil, err
	}
	var buf uintptr
	var size uint64
	r, _, _ := purego.SyscallN(procs.rkeyPack, uintptr(c), uintptr(m), uintptr(unsafe.Pointer(&buf)), uintptr(unsafe.Pointer(&size)))
	if err := check("ucp_rkey_pack", status(r)); err != nil {
		return nil, err
	}
	out := copyC(buf, size)
	purego.SyscallN(procs.rkeyBufferRelease, buf)
	return out, nil
}

// CopyAddress copies length bytes at the C address addr (a worker address
// from WorkerGetAddress or WorkerQuery) into Go memory.
func CopyAddress(addr uintptr, length uint64) []byte { return copyC(addr, length) }

func copyC(p uintptr, n uint64) []byte {
	if p == 0 || n == 0 {
		return nil
	}
	src := unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&p))), n)
	return append([]byte(nil), src...)
}

// EpCreate calls ucp_ep_create.
func EpCreate(w Worker, params *EpParams) (Ep, error) {
	if err := loaded("ucp_ep_create"); err != nil {
		return 0, err
	}
	var e Ep
	r, _, _ := purego.SyscallN(procs.epCreate, uintptr(w), uintptr(unsafe.Pointer(params)), uintptr(unsafe.Pointer(&e)))
	return e, check("ucp_ep_create", status(r))
}

// EpCloseNbx calls ucp_ep_close_nbx: a Request to poll, or 0 when closed.
func EpCloseNbx(e Ep, param *RequestParam) (Request, error) {
	r, _, _ := purego.SyscallN(procs.epCloseNbx, uintptr(e), uintptr(unsafe.Pointer(param)))
	return statusPtr("ucp_ep_close_nbx", r)
}

// EpFlushNbx calls ucp_ep_flush_nbx.
func EpFlushNbx(e Ep, param *RequestParam) (Request, error) {
	r, _, _ := purego.SyscallN(procs.epFlush, uintptr(e), uintptr(unsafe.Pointer(param)))
	return statusPtr("ucp_ep_flush_nbx", r)
}

// EpRkeyUnpack calls ucp_ep_rkey_unpack on the packed key buf. UCX does not
// know buf's length and trusts its contents: check them first.
func EpRkeyUnpack(e Ep, buf []byte) (Rkey, error) {
	if err := loaded("ucp_ep_rkey_unpack"); err != nil {
		return 0, err
	}
	if len(buf) == 0 {
		return 0, &Error{Func: "ucp_ep_rkey_unpack", Status: ErrInvalidParam}
	}
	var k Rkey
	r, _, _ := purego.SyscallN(procs.epRkeyUnpack, uintptr(e), uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&k)))
	return k, check("ucp_ep_rkey_unpack", status(r))
}

// RkeyDestroy calls ucp_rkey_destroy.
func RkeyDestroy(k Rkey) {
	if loaded("ucp_rkey_destroy") == nil {
		purego.SyscallN(procs.rkeyDestroy, uintptr(k))
	}
}

// GetNbx calls ucp_get_nbx to read len(dst) bytes at remoteAddr into dst:
// 0 when it completed at once, or a Request. Until that request completes
// UCX writes into dst: the caller keeps dst alive and in place (not on a
// goroutine stack) until then.
func GetNbx(e Ep, dst []byte, remoteAddr uint64, k Rkey, param *RequestParam) (Request, error) {
	if len(dst) == 0 {
		return 0, nil
	}
	r, _, _ := purego.SyscallN(procs.getNbx, uintptr(e), uintptr(unsafe.Pointer(&dst[0])), uintptr(len(dst)), uintptr(remoteAddr), uintptr(k), uintptr(unsafe.Pointer(param)))
	return statusPtr("ucp_get_nbx", r)
}

// GetNbxAt is GetNbx into n bytes at the address dst of memory that is not
// Go's (an mmap'd or device arena, registered with MemMap), which the
// caller keeps mapped until the request completes.
func GetNbxAt(e Ep, dst uint64, n uint64, remoteAddr uint64, k Rkey, param *RequestParam) (Request, error) {
	if n == 0 {
		return 0, nil
	}
	r, _, _ := purego.SyscallN(procs.getNbx, uintptr(e), uintptr(dst), uintptr(n), uintptr(remoteAddr), uintptr(k), uintptr(unsafe.Pointer(param)))
	return statusPtr("ucp_get_nbx", r)
}

// TagSendNbx calls ucp_tag_send_nbx to send n bytes at addr with tag: 0
// when it completed at once (the bytes may be reused), or a Request. Until
// that request completes UCX reads the n bytes at addr: the caller keeps
// them mapped and unchanged until then.
func TagSendNbx(e Ep, addr uint64, n uint64, tag uint64, param *RequestParam) (Request, error) {
	r, _, _ := purego.SyscallN(procs.tagSendNbx, uintptr(e), uintptr(addr), uintptr(n), uintptr(tag), uintptr(unsafe.Pointer(param)))
	return statusPtr("ucp_tag_send_nbx", r)
}

// TagRecvNbx calls ucp_tag_recv_nbx to receive, into the n bytes at addr,
// a message whose tag equals tag in the bits of mask. With
// OpAttrFlagNoImmCmpl in param it always returns a Request, to be polled
// and then read with TagRecvRequestTest. Until it completes (or is
// canceled) UCX may write the n bytes at addr.
func TagRecvNbx(w Worker, addr uint64, n uint64, tag, mask uint64, param *RequestParam) (Request, error) {
	r, _, _ := purego.SyscallN(procs.tagRecvNbx, uintptr(w), uintptr(addr), uintptr(n), uintptr(tag), uintptr(mask), uintptr(unsafe.Pointer(param)))
	return statusPtr("ucp_tag_recv_nbx", r)
}

// TagRecvRequestTest calls ucp_tag_recv_request_test: InProgress, or the
// status the receive completed with and, in info, the tag it matched and
// the length it received.
func TagRecvRequestTest(req Request, info *TagRecvInfo) Status {
	r, _, _ := purego.SyscallN(procs.tagRecvRequestTest, uintptr(req), uintptr(unsafe.Pointer(info)))
	return status(r)
}

// RequestCheckStatus calls ucp_request_check_status: InProgress, OK or the
// error the request completed with.
func RequestCheckStatus(req Request) Status {
	r, _, _ := purego.SyscallN(procs.requestCheckStatus, uintptr(req))
	return status(r)
}

// RequestFree calls ucp_request_free.
func RequestFree(req Request) {
	purego.SyscallN(procs.requestFree, uintptr(req))
}

// RequestCancel calls ucp_request_cancel. UCX cancels receives; an RMA
// request it leaves to complete (or to fail when its endpoint is closed
// with EpCloseFlagForce).
func RequestCancel(w Worker, req Request) {
	purego.SyscallN(procs.requestCancel, uintptr(w), uintptr(req))
}

// Addr returns the address of b's first byte, the number a peer passes to
// ucp_get_nbx as remote_addr, or 0 for an empty slice.
func Addr(b []byte) uint64 {
	if len(b) == 0 {
		return 0
	}
	return uint64(uintptr(unsafe.Pointer(&b[0])))
}

// NewErrHandler makes a C function pointer for ucp_ep_params_t's
// err_handler.cb (ucp_err_handler_cb_t: void (void *arg, ucp_ep_h ep,
// ucs_status_t status)) that calls fn. UCX calls it from
// ucp_worker_progress on the thread that progresses the worker. purego
// allows a bounded number of callbacks per process: make one and share it.
func NewErrHandler(fn func(arg uintptr, ep Ep, s Status)) uintptr {
	return purego.NewCallback(func(arg, ep uintptr, s uintptr) {
		fn(arg, Ep(ep), Status(int8(s)))
	})
}

// libc is the C library, for the FILE* that ucp_context_print_info writes
// to (open_memstream).
var libc struct {
	once                        sync.Once
	err                         error
	openMemstream, fclose, free uintptr
}

func loadLibc() error {
	libc.once.Do(func() {
		h, err := purego.Dlopen("libc.so.6", purego.RTLD_NOW|purego.RTLD_GLOBAL)
		if err != nil {
			libc.err = errors.New("ucx: cannot load libc.so.6: " + err.Error())
			return
		}
		for _, s := range []struct {
			name string
			addr *uintptr
		}{{"open_memstream", &libc.openMemstream}, {"fclose", &libc.fclose}, {"free", &libc.free}} {
			if *s.addr, err = purego.Dlsym(h, s.name); err != nil {
				libc.err = errors.New("ucx: libc.so.6 lacks " + s.name)
				return
			}
		}
	})
	return libc.err
}

// ContextPrintInfo calls ucp_context_print_info into a memory stream and
// returns the text: the context's components, memory domains and transport
// resources ("resource N : md M dev D flags -- tcp/lo").
func ContextPrintInfo(c Context) (string, error) {
	if err := loaded("ucp_context_print_info"); err != nil {
		return "", err
	}
	if procs.contextPrintInfo == 0 {
		return "", &Error{Func: "ucp_context_print_info", Err: errors.New("not in this libucp")}
	}
	if err := loadLibc(); err != nil {
		return "", err
	}
	var buf uintptr
	var size uint64
	f, _, _ := purego.SyscallN(libc.openMemstream, uintptr(unsafe.Pointer(&buf)), uintptr(unsafe.Pointer(&size)))
	if f == 0 {
		return "", errors.New("ucx: open_memstream failed")
	}
	purego.SyscallN(procs.contextPrintInfo, uintptr(c), f)
	purego.SyscallN(libc.fclose, f) // sets buf and size
	out := string(copyC(buf, size))
	purego.SyscallN(libc.free, buf)
	return out, nil
}
