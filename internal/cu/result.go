package cu

import (
	"errors"
	"fmt"
	"strconv"
)

// Result is a CUresult, the status code every CUDA driver call returns.
// A Result other than Success is an error; errors.Is matches it by value,
// so errors.Is(err, ErrorInvalidValue) holds for any error that wraps
// CUDA_ERROR_INVALID_VALUE.
type Result int32

// The CUresult values of cuda.h (CUDA 13.0). Names follow the C names.
const (
	Success                          Result = 0
	ErrorInvalidValue                Result = 1
	ErrorOutOfMemory                 Result = 2
	ErrorNotInitialized              Result = 3
	ErrorDeinitialized               Result = 4
	ErrorProfilerDisabled            Result = 5
	ErrorProfilerNotInitialized      Result = 6
	ErrorProfilerAlreadyStarted      Result = 7
	ErrorProfilerAlreadyStopped      Result = 8
	ErrorStubLibrary                 Result = 34
	ErrorDeviceUnavailable           Result = 46
	ErrorNoDevice                    Result = 100
	ErrorInvalidDevice               Result = 101
	ErrorDeviceNotLicensed           Result = 102
	ErrorInvalidImage                Result = 200
	ErrorInvalidContext              Result = 201
	ErrorContextAlreadyCurrent       Result = 202
	ErrorMapFailed                   Result = 205
	ErrorUnmapFailed                 Result = 206
	ErrorArrayIsMapped               Result = 207
	ErrorAlreadyMapped               Result = 208
	ErrorNoBinaryForGPU              Result = 209
	ErrorAlreadyAcquired             Result = 210
	ErrorNotMapped                   Result = 211
	ErrorNotMappedAsArray            Result = 212
	ErrorNotMappedAsPointer          Result = 213
	ErrorECCUncorrectable            Result = 214
	ErrorUnsupportedLimit            Result = 215
	ErrorContextAlreadyInUse         Result = 216
	ErrorPeerAccessUnsupported       Result = 217
	ErrorInvalidPTX                  Result = 218
	ErrorInvalidGraphicsContext      Result = 219
	ErrorNVLinkUncorrectable         Result = 220
	ErrorJITCompilerNotFound         Result = 221
	ErrorUnsupportedPTXVersion       Result = 222
	ErrorJITCompilationDisabled      Result = 223
	ErrorUnsupportedExecAffinity     Result = 224
	ErrorUnsupportedDevsideSync      Result = 225
	ErrorContained                   Result = 226
	ErrorInvalidSource               Result = 300
	ErrorFileNotFound                Result = 301
	ErrorSharedObjectSymbolNotFound  Result = 302
	ErrorSharedObjectInitFailed      Result = 303
	ErrorOperatingSystem             Result = 304
	ErrorInvalidHandle               Result = 400
	ErrorIllegalState                Result = 401
	ErrorLossyQuery                  Result = 402
	ErrorNotFound                    Result = 500
	ErrorNotReady                    Result = 600
	ErrorIllegalAddress              Result = 700
	ErrorLaunchOutOfResources        Result = 701
	ErrorLaunchTimeout               Result = 702
	ErrorLaunchIncompatibleTexturing Result = 703
	ErrorPeerAccessAlreadyEnabled    Result = 704
	ErrorPeerAccessNotEnabled        Result = 705
	ErrorPrimaryContextActive        Result = 708
	ErrorContextIsDestroyed          Result = 709
	ErrorAssert                      Result = 710
	ErrorTooManyPeers                Result = 711
	ErrorHostMemoryAlreadyRegistered Result = 712
	ErrorHostMemoryNotRegistered     Result = 713
	ErrorHardwareStackError          Result = 714
	ErrorIllegalInstruction          Result = 715
	ErrorMisalignedAddress           Result = 716
	ErrorInvalidAddressSpace         Result = 717
	ErrorInvalidPC                   Result = 718
	ErrorLaunchFailed                Result = 719
	ErrorCooperativeLaunchTooLarge   Result = 720
	ErrorTensorMemoryLeak            Result = 721
	ErrorNotPermitted                Result = 800
	ErrorNotSupported                Result = 801
	ErrorSystemNotReady              Result = 802
	ErrorSystemDriverMismatch        Result = 803
	ErrorCompatNotSupportedOnDevice  Result = 804
	ErrorMPSConnectionFailed         Result = 805
	ErrorMPSRPCFailure               Result = 806
	ErrorMPSServerNotReady           Result = 807
	ErrorMPSMaxClientsReached        Result = 808
	ErrorMPSMaxConnectionsReached    Result = 809
	ErrorMPSClientTerminated         Result = 810
	ErrorCDPNotSupported             Result = 811
	ErrorCDPVersionMismatch          Result = 812
	ErrorStreamCaptureUnsupported    Result = 900
	ErrorStreamCaptureInvalidated    Result = 901
	ErrorStreamCaptureMerge          Result = 902
	ErrorStreamCaptureUnmatched      Result = 903
	ErrorStreamCaptureUnjoined       Result = 904
	ErrorStreamCaptureIsolation      Result = 905
	ErrorStreamCaptureImplicit       Result = 906
	ErrorCapturedEvent               Result = 907
	ErrorStreamCaptureWrongThread    Result = 908
	ErrorTimeout                     Result = 909
	ErrorGraphExecUpdateFailure      Result = 910
	ErrorExternalDevice              Result = 911
	ErrorInvalidClusterSize          Result = 912
	ErrorFunctionNotLoaded           Result = 913
	ErrorInvalidResourceType         Result = 914
	ErrorInvalidResourceConfig       Result = 915
	ErrorKeyRotation                 Result = 916
	ErrorUnknown                     Result = 999
)

var resultNames = map[Result]string{
	0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
	3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED", 5: "CUDA_ERROR_PROFILER_DISABLED",
	6: "CUDA_ERROR_PROFILER_NOT_INITIALIZED", 7: "CUDA_ERROR_PROFILER_ALREADY_STARTED",
	8: "CUDA_ERROR_PROFILER_ALREADY_STOPPED", 34: "CUDA_ERROR_STUB_LIBRARY", 46: "CUDA_ERROR_DEVICE_UNAVAILABLE",
	100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE", 102: "CUDA_ERROR_DEVICE_NOT_LICENSED",
	200: "CUDA_ERROR_INVALID_IMAGE", 201: "CUDA_ERROR_INVALID_CONTEXT", 202: "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
	205: "CUDA_ERROR_MAP_FAILED", 206: "CUDA_ERROR_UNMAP_FAILED", 207: "CUDA_ERROR_ARRAY_IS_MAPPED",
	208: "CUDA_ERROR_ALREADY_MAPPED", 209: "CUDA_ERROR_NO_BINARY_FOR_GPU", 210: "CUDA_ERROR_ALREADY_ACQUIRED",
	211: "CUDA_ERROR_NOT_MAPPED", 212: "CUDA_ERROR_NOT_MAPPED_AS_ARRAY", 213: "CUDA_ERROR_NOT_MAPPED_AS_POINTER",
	214: "CUDA_ERROR_ECC_UNCORRECTABLE", 215: "CUDA_ERROR_UNSUPPORTED_LIMIT", 216: "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
	217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", 218: "CUDA_ERROR_INVALID_PTX", 219: "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT",
	220: "CUDA_ERROR_NVLINK_UNCORRECTABLE", 221: "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
	222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", 223: "CUDA_ERROR_JIT_COMPILATION_DISABLED",
	224: "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY", 225: "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC",
	226: "CUDA_ERROR_CONTAINED", 300: "CUDA_ERROR_INVALID_SOURCE", 301: "CUDA_ERROR_FILE_NOT_FOUND",
	302: "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND", 303: "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
	304: "CUDA_ERROR_OPERATING_SYSTEM", 400: "CUDA_ERROR_INVALID_HANDLE", 401: "CUDA_ERROR_ILLEGAL_STATE",
	402: "CUDA_ERROR_LOSSY_QUERY", 500: "CUDA_ERROR_NOT_FOUND", 600: "CUDA_ERROR_NOT_READY",
	700: "CUDA_ERROR_ILLEGAL_ADDRESS", 701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", 702: "CUDA_ERROR_LAUNCH_TIMEOUT",
	703: "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING", 704: "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
	705: "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", 708: "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
	709: "CUDA_ERROR_CONTEXT_IS_DESTROYED", 710: "CUDA_ERROR_ASSERT", 711: "CUDA_ERROR_TOO_MANY_PEERS",
	712: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", 713: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
	714: "CUDA_ERROR_HARDWARE_STACK_ERROR", 715: "CUDA_ERROR_ILLEGAL_INSTRUCTION", 716: "CUDA_ERROR_MISALIGNED_ADDRESS",
	717: "CUDA_ERROR_INVALID_ADDRESS_SPACE", 718: "CUDA_ERROR_INVALID_PC", 719: "CUDA_ERROR_LAUNCH_FAILED",
	720: "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", 721: "CUDA_ERROR_TENSOR_MEMORY_LEAK",
	800: "CUDA_ERROR_NOT_PERMITTED", 801: "CUDA_ERROR_NOT_SUPPORTED", 802: "CUDA_ERROR_SYSTEM_NOT_READY",
	803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", 804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
	805: "CUDA_ERROR_MPS_CONNECTION_FAILED", 806: "CUDA_ERROR_MPS_RPC_FAILURE", 807: "CUDA_ERROR_MPS_SERVER_NOT_READY",
	808: "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED", 809: "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
	810: "CUDA_ERROR_MPS_CLIENT_TERMINATED", 811: "CUDA_ERROR_CDP_NOT_SUPPORTED", 812: "CUDA_ERROR_CDP_VERSION_MISMATCH",
	900: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", 901: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
	902: "CUDA_ERROR_STREAM_CAPTURE_MERGE", 903: "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
	904: "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", 905: "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
	906: "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", 907: "CUDA_ERROR_CAPTURED_EVENT",
	908: "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", 909: "CUDA_ERROR_TIMEOUT", 910: "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
	911: "CUDA_ERROR_EXTERNAL_DEVICE", 912: "CUDA_ERROR_INVALID_CLUSTER_SIZE", 913: "CUDA_ERROR_FUNCTION_NOT_LOADED",
	914: "CUDA_ERROR_INVALID_RESOURCE_TYPE", 915: "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION",
	916: "CUDA_ERROR_KEY_ROTATION", 999: "CUDA_ERROR_UNKNOWN",
}

// Short explanations for the codes IPC users meet; the driver's own text is
// not used so that messages are the same with and without the driver.
var resultHints = map[Result]string{
	ErrorInvalidValue:             "invalid argument",
	ErrorOutOfMemory:              "out of device memory",
	ErrorNotInitialized:           "driver not initialized",
	ErrorDeinitialized:            "driver shutting down",
	ErrorStubLibrary:              "libcuda.so.1 is the CUDA toolkit's stub library, not the driver",
	ErrorNoDevice:                 "no CUDA-capable device is visible",
	ErrorInvalidDevice:            "invalid device ordinal",
	ErrorInvalidContext:           "invalid context (for cuIpcOpenMemHandle: the handle was exported by this same process)",
	ErrorMapFailed:                "mapping the memory failed",
	ErrorAlreadyMapped:            "already mapped",
	ErrorOperatingSystem:          "an operating-system call failed",
	ErrorInvalidHandle:            "invalid resource handle (for IPC: the exporter freed the memory or exited)",
	ErrorNotFound:                 "named symbol not found",
	ErrorNotReady:                 "not ready: the work is still running",
	ErrorIllegalAddress:           "illegal memory access",
	ErrorPeerAccessUnsupported:    "peer access is not supported between these devices",
	ErrorPeerAccessAlreadyEnabled: "peer access already enabled",
	ErrorPeerAccessNotEnabled:     "peer access not enabled",
	ErrorContextIsDestroyed:       "context destroyed",
	ErrorTooManyPeers:             "too many peer mappings",
	ErrorNotPermitted:             "operation not permitted",
	ErrorNotSupported:             "operation not supported on this system or device",
	ErrorSystemNotReady:           "system not ready (is the fabric manager running?)",
	ErrorSystemDriverMismatch:     "driver and kernel module versions differ",
	ErrorUnknown:                  "unknown error",
}

// Name returns the C name of r, such as "CUDA_ERROR_INVALID_VALUE", or
// "CUresult(N)" for a value this package does not know.
func (r Result) Name() string {
	if n, ok := resultNames[r]; ok {
		return n
	}
	return "CUresult(" + strconv.Itoa(int(r)) + ")"
}

// Error implements error.
func (r Result) Error() string {
	if h, ok := resultHints[r]; ok {
		return r.Name() + ": " + h
	}
	return r.Name()
}

// Names returns every CUresult value this package knows, for tests and
// documentation.
func Names() map[Result]string {
	m := make(map[Result]string, len(resultNames))
	for k, v := range resultNames {
		m[k] = v
	}
	return m
}

// Error is a failed driver call: the C function and what it returned, or why
// it could not be called at all (Err, with Code == Success).
type Error struct {
	Func string // the driver entry point, e.g. "cuIpcOpenMemHandle"
	Code Result
	Err  error // set when the call was not made, e.g. the driver is absent
}

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Func + ": " + e.Err.Error()
	}
	return fmt.Sprintf("%s: %s (%d)", e.Func, e.Code.Error(), int32(e.Code))
}

// Unwrap returns the cause: the Result, or the load error.
func (e *Error) Unwrap() error {
	if e.Err != nil {
		return e.Err
	}
	return e.Code
}

// ErrNoDriver matches every error caused by a missing or unusable CUDA driver
// library.
var ErrNoDriver = errors.New("CUDA driver not available")

// LoadError says why libcuda.so.1 could not be loaded.
type LoadError struct {
	Path   string
	Reason string
}

func (e *LoadError) Error() string {
	return fmt.Sprintf("cannot load the CUDA driver library %s: %s; install the NVIDIA driver (it provides libcuda.so.1) or point %s at it", e.Path, e.Reason, EnvLibrary)
}

// Is makes errors.Is(err, ErrNoDriver) true.
func (e *LoadError) Is(target error) bool { return target == ErrNoDriver }

func check(fn string, r Result) error {
	if r == Success {
		return nil
	}
	return &Error{Func: fn, Code: r}
}
