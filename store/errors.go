package store

import (
	"errors"
	"fmt"
)

// Errors the store reports. Each matches, with errors.Is, the protocol
// error code a client receives for it.
var (
	// ErrNotFound: no object of that name, or lease of that id, visible to
	// the caller.
	ErrNotFound = errors.New("not found")
	// ErrExists: an object of that name exists already.
	ErrExists = errors.New("already exists")
	// ErrStoreFull: not enough memory on the device, even after eviction.
	ErrStoreFull = errors.New("store full")
	// ErrPermission: the caller may not do this.
	ErrPermission = errors.New("permission denied")
	// ErrLimit: a per-client limit (objects, leases) was reached.
	ErrLimit = errors.New("limit reached")
	// ErrInvalid: a malformed or out-of-range argument.
	ErrInvalid = errors.New("invalid argument")
	// ErrNotSealed: the operation needs a sealed object.
	ErrNotSealed = errors.New("object not sealed")
	// ErrSealed: the operation needs an unsealed object.
	ErrSealed = errors.New("object already sealed")
	// ErrTimeout: a get's object was not sealed in time.
	ErrTimeout = errors.New("timed out")
	// ErrDaemonRunning: ListenAndServe found another daemon answering on
	// the socket.
	ErrDaemonRunning = errors.New("a store daemon is already running")
)

func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}
