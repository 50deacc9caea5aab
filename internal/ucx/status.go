package ucx

import (
	"errors"
	"fmt"
	"strconv"
)

// Status is a ucs_status_t. In the C headers it is a packed enum: one
// signed byte, which is why results are read as int8. A Status other than
// OK and InProgress is an error; errors.Is matches it by value, so
// errors.Is(err, ErrUnreachable) holds for any error that wraps
// UCS_ERR_UNREACHABLE.
type Status int8

// The ucs_status_t values of ucs/type/status.h (identical in UCX 1.13 and
// 1.16). Names follow the C names.
const (
	OK                   Status = 0
	InProgress           Status = 1
	ErrNoMessage         Status = -1
	ErrNoResource        Status = -2
	ErrIOError           Status = -3
	ErrNoMemory          Status = -4
	ErrInvalidParam      Status = -5
	ErrUnreachable       Status = -6
	ErrInvalidAddr       Status = -7
	ErrNotImplemented    Status = -8
	ErrMessageTruncated  Status = -9
	ErrNoProgress        Status = -10
	ErrBufferTooSmall    Status = -11
	ErrNoElem            Status = -12
	ErrSomeConnectsFail  Status = -13
	ErrNoDevice          Status = -14
	ErrBusy              Status = -15
	ErrCanceled          Status = -16
	ErrShmemSegment      Status = -17
	ErrAlreadyExists     Status = -18
	ErrOutOfRange        Status = -19
	ErrTimedOut          Status = -20
	ErrExceedsLimit      Status = -21
	ErrUnsupported       Status = -22
	ErrRejected          Status = -23
	ErrNotConnected      Status = -24
	ErrConnectionReset   Status = -25
	ErrFirstLinkFailure  Status = -40
	ErrLastLinkFailure   Status = -59
	ErrFirstEndpointFail Status = -60
	ErrEndpointTimeout   Status = -80
	ErrLastEndpointFail  Status = -89
	ErrLast              Status = -100
)

var statusNames = map[Status]string{
	OK:                   "UCS_OK",
	InProgress:           "UCS_INPROGRESS",
	ErrNoMessage:         "UCS_ERR_NO_MESSAGE",
	ErrNoResource:        "UCS_ERR_NO_RESOURCE",
	ErrIOError:           "UCS_ERR_IO_ERROR",
	ErrNoMemory:          "UCS_ERR_NO_MEMORY",
	ErrInvalidParam:      "UCS_ERR_INVALID_PARAM",
	ErrUnreachable:       "UCS_ERR_UNREACHABLE",
	ErrInvalidAddr:       "UCS_ERR_INVALID_ADDR",
	ErrNotImplemented:    "UCS_ERR_NOT_IMPLEMENTED",
	ErrMessageTruncated:  "UCS_ERR_MESSAGE_TRUNCATED",
	ErrNoProgress:        "UCS_ERR_NO_PROGRESS",
	ErrBufferTooSmall:    "UCS_ERR_BUFFER_TOO_SMALL",
	ErrNoElem:            "UCS_ERR_NO_ELEM",
	ErrSomeConnectsFail:  "UCS_ERR_SOME_CONNECTS_FAILED",
	ErrNoDevice:          "UCS_ERR_NO_DEVICE",
	ErrBusy:              "UCS_ERR_BUSY",
	ErrCanceled:          "UCS_ERR_CANCELED",
	ErrShmemSegment:      "UCS_ERR_SHMEM_SEGMENT",
	ErrAlreadyExists:     "UCS_ERR_ALREADY_EXISTS",
	ErrOutOfRange:        "UCS_ERR_OUT_OF_RANGE",
	ErrTimedOut:          "UCS_ERR_TIMED_OUT",
	ErrExceedsLimit:      "UCS_ERR_EXCEEDS_LIMIT",
	ErrUnsupported:       "UCS_ERR_UNSUPPORTED",
	ErrRejected:          "UCS_ERR_REJECTED",
	ErrNotConnected:      "UCS_ERR_NOT_CONNECTED",
	ErrConnectionReset:   "UCS_ERR_CONNECTION_RESET",
	ErrFirstLinkFailure:  "UCS_ERR_FIRST_LINK_FAILURE",
	ErrLastLinkFailure:   "UCS_ERR_LAST_LINK_FAILURE",
	ErrFirstEndpointFail: "UCS_ERR_FIRST_ENDPOINT_FAILURE",
	ErrEndpointTimeout:   "UCS_ERR_ENDPOINT_TIMEOUT",
	ErrLastEndpointFail:  "UCS_ERR_LAST_ENDPOINT_FAILURE",
	ErrLast:              "UCS_ERR_LAST",
}

var statusHints = map[Status]string{
	ErrNoMemory:        "out of memory",
	ErrInvalidParam:    "invalid parameter",
	ErrUnreachable:     "destination is unreachable (no common transport: check UCX_TLS and UCX_NET_DEVICES on both sides)",
	ErrInvalidAddr:     "invalid address",
	ErrNoDevice:        "no such device (check UCX_NET_DEVICES)",
	ErrBusy:            "device is busy",
	ErrCanceled:        "request canceled",
	ErrTimedOut:        "operation timed out",
	ErrUnsupported:     "operation is not supported",
	ErrRejected:        "operation rejected by the peer",
	ErrNotConnected:    "endpoint is not connected",
	ErrConnectionReset: "connection reset by the peer",
	ErrEndpointTimeout: "endpoint timeout: the peer stopped answering",
}

// Name returns the C name of s, such as "UCS_ERR_UNREACHABLE". A value in
// the link-failure or endpoint-failure range that has no name of its own
// reads "UCS_ERR_LINK_FAILURE(N)" or "UCS_ERR_ENDPOINT_FAILURE(N)"; any
// other unknown value "ucs_status_t(N)".
func (s Status) Name() string {
	if n, ok := statusNames[s]; ok {
		return n
	}
	switch {
	case s.IsLinkFailure():
		return "UCS_ERR_LINK_FAILURE(" + strconv.Itoa(int(s)) + ")"
	case s.IsEndpointFailure():
		return "UCS_ERR_ENDPOINT_FAILURE(" + strconv.Itoa(int(s)) + ")"
	}
	return "ucs_status_t(" + strconv.Itoa(int(s)) + ")"
}

// IsLinkFailure reports whether s lies in UCX's link-failure range
// (UCS_IS_LINK_ERROR).
func (s Status) IsLinkFailure() bool { return s <= ErrFirstLinkFailure && s >= ErrLastLinkFailure }

// IsEndpointFailure reports whether s lies in UCX's endpoint-failure range
// (UCS_IS_ENDPOINT_ERROR).
func (s Status) IsEndpointFailure() bool {
	return s <= ErrFirstEndpointFail && s >= ErrLastEndpointFail
}

// Error implements error.
func (s Status) Error() string {
	if h, ok := statusHints[s]; ok {
		return s.Name() + ": " + h
	}
	return s.Name()
}

// Names returns every ucs_status_t value this package names, for tests and
// documentation.
func Names() map[Status]string {
	m := make(map[Status]string, len(statusNames))
	for k, v := range statusNames {
		m[k] = v
	}
	return m
}

// Error is a failed UCX call: the C function and the status it returned,
// or why it could not be called at all (Err, with Status == OK).
type Error struct {
	Func   string // the C function, e.g. "ucp_ep_create"
	Status Status
	Err    error // set when the call was not made, e.g. libucp is absent
}

func (e *Error) Error() string {
	if e.Err != nil {
		return e.Func + ": " + e.Err.Error()
	}
	return fmt.Sprintf("%s: %s (%d)", e.Func, e.Status.Error(), int8(e.Status))
}

// Unwrap returns the cause: the Status, or the load error.
func (e *Error) Unwrap() error {
	if e.Err != nil {
		return e.Err
	}
	return e.Status
}

// ErrNotFound matches every error caused by a missing or unusable libucp.
var ErrNotFound = errors.New("UCX not found")

// LoadError says why libucp could not be loaded.
type LoadError struct {
	Path   string
	Reason string
}

func (e *LoadError) Error() string {
	return fmt.Sprintf("UCX not found: cannot load %s: %s; install libucx0 (Debian/Ubuntu) or point %s at libucp.so.0", e.Path, e.Reason, EnvLibrary)
}

// Is makes errors.Is(err, ErrNotFound) true.
func (e *LoadError) Is(target error) bool { return target == ErrNotFound }

func check(fn string, s Status) error {
	if s == OK {
		return nil
	}
	return &Error{Func: fn, Status: s}
}
