package cudaipc

import (
	"errors"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// Result is a CUresult, the status a CUDA driver call returns. Every value
// implements error and has a name (Result.Name), with or without the driver.
type Result = cu.Result

// Error is a failed driver call. Its text names the C function and the CUDA
// error, e.g. "cuIpcOpenMemHandle: CUDA_ERROR_INVALID_VALUE: invalid
// argument (1)". errors.Is matches it against the Err* constants.
type Error = cu.Error

// LoadError says why the driver library could not be loaded; it matches
// ErrNoDriver.
type LoadError = cu.LoadError

// Sentinels for the driver errors that IPC users test for. Use errors.Is:
//
//	if errors.Is(err, cudaipc.ErrInvalidResourceHandle) { /* exporter is gone */ }
//
// The names ending in the CUDA runtime's spelling (ErrMapBufferObjectFailed,
// ErrInvalidResourceHandle, ErrDeviceUninitialized) are the same values as
// their driver-API twins.
const (
	ErrInvalidValue             = cu.ErrorInvalidValue
	ErrOutOfMemory              = cu.ErrorOutOfMemory
	ErrNotInitialized           = cu.ErrorNotInitialized
	ErrDeinitialized            = cu.ErrorDeinitialized
	ErrStubLibrary              = cu.ErrorStubLibrary
	ErrNoDevice                 = cu.ErrorNoDevice
	ErrInvalidDevice            = cu.ErrorInvalidDevice
	ErrInvalidContext           = cu.ErrorInvalidContext
	ErrDeviceUninitialized      = cu.ErrorInvalidContext // cudaErrorDeviceUninitialized: e.g. opening a handle in its exporting process
	ErrMapFailed                = cu.ErrorMapFailed
	ErrMapBufferObjectFailed    = cu.ErrorMapFailed // cudaErrorMapBufferObjectFailed
	ErrAlreadyMapped            = cu.ErrorAlreadyMapped
	ErrOperatingSystem          = cu.ErrorOperatingSystem
	ErrInvalidHandle            = cu.ErrorInvalidHandle
	ErrInvalidResourceHandle    = cu.ErrorInvalidHandle // cudaErrorInvalidResourceHandle: e.g. the exporter freed or exited
	ErrNotFound                 = cu.ErrorNotFound
	ErrNotReady                 = cu.ErrorNotReady
	ErrIllegalAddress           = cu.ErrorIllegalAddress
	ErrPeerAccessUnsupported    = cu.ErrorPeerAccessUnsupported
	ErrPeerAccessAlreadyEnabled = cu.ErrorPeerAccessAlreadyEnabled
	ErrPeerAccessNotEnabled     = cu.ErrorPeerAccessNotEnabled
	ErrContextIsDestroyed       = cu.ErrorContextIsDestroyed
	ErrTooManyPeers             = cu.ErrorTooManyPeers
	ErrNotPermitted             = cu.ErrorNotPermitted
	ErrNotSupported             = cu.ErrorNotSupported
	ErrSystemNotReady           = cu.ErrorSystemNotReady
	ErrSystemDriverMismatch     = cu.ErrorSystemDriverMismatch
	ErrUnknown                  = cu.ErrorUnknown
)

var (
	// ErrNoDriver matches every error caused by a missing or unusable
	// libcuda.so.1.
	ErrNoDriver = cu.ErrNoDriver
	// ErrClosed is returned by methods of a Buffer, Stream, Event or Mapping
	// that was already closed.
	ErrClosed = errors.New("cudaipc: use of closed object")
	// ErrInUse is returned by Buffer.Free while this process still holds
	// mappings of the buffer that it knows of.
	ErrInUse = errors.New("cudaipc: buffer still has open mappings in this process")
	// ErrOtherHost is returned by Import for a Region or EventDescriptor
	// exported on another machine, or before a reboot: legacy IPC handles
	// mean nothing there.
	ErrOtherHost = errors.New("cudaipc: exported on another machine or boot")
	// ErrOtherPIDNamespace is returned by Import for a Region or
	// EventDescriptor exported in another PID namespace (another
	// container): the driver finds the exporter by pid and cannot.
	ErrOtherPIDNamespace = errors.New("cudaipc: exported in another PID namespace")
	// ErrStaleMapping is returned by Import when the allocation a Region
	// names was freed and the memory at its handle or address is now
	// another allocation that this process cannot tell apart from it.
	ErrStaleMapping = errors.New("cudaipc: stale mapping")
)

// closedError is a method called on an object already closed or freed.
// It matches ErrClosed and reads in the order a person looks for: which
// call, then why.
type closedError struct {
	call   string // e.g. "Buffer.ReadAt"
	object string // what is closed, e.g. "Buffer"
}

func (e *closedError) Error() string {
	return "cudaipc: " + e.call + ": the " + e.object + " is closed"
}

// Is reports whether target is ErrClosed.
func (e *closedError) Is(target error) bool { return target == ErrClosed }

// closedErr is the error of method op of a closed object of type object.
func closedErr(object, op string) error { return &closedError{call: object + "." + op, object: object} }

// ArgError reports an argument rejected before any driver call, with the
// reason. It matches ErrInvalidValue, like the driver's own rejection would.
type ArgError struct {
	Op     string // the method, e.g. "OpenMemHandle"
	Arg    string // the argument, e.g. "flags"
	Reason string
}

func (e *ArgError) Error() string {
	return "cudaipc: " + e.Op + ": " + e.Arg + ": " + e.Reason
}

// Is reports whether target is ErrInvalidValue.
func (e *ArgError) Is(target error) bool { return target == error(ErrInvalidValue) }

// ResultNames returns the name of every CUresult this package knows.
func ResultNames() map[Result]string { return cu.Names() }
