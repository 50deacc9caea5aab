package store

import (
	"errors"
	"fmt"

	"github.com/cudaipc/cudaipc/protocol"
)

// Errors the store reports. Except ErrDaemonRunning, they are the
// protocol's sentinels, so that errors.Is matches them and
// protocol.CodeOf maps them to the code a client receives.
var (
	// ErrNotFound: no object of that name, or lease of that id, visible to
	// the caller.
	ErrNotFound = protocol.ErrNotFound
	// ErrExists: an object of that name exists already.
	ErrExists = protocol.ErrExists
	// ErrStoreFull: not enough memory on the device, even after eviction.
	ErrStoreFull = protocol.ErrStoreFull
	// ErrPermission: the caller may not do this.
	ErrPermission = protocol.ErrPermission
	// ErrLimit: a per-client limit (objects, leases) was reached.
	ErrLimit = protocol.ErrLimit
	// ErrInvalid: a malformed or out-of-range argument.
	ErrInvalid = protocol.ErrInvalid
	// ErrNotSealed: the operation needs a sealed object. The store does
	// not report it today (a get of an unsealed object waits, then times
	// out); it completes the protocol's set.
	ErrNotSealed = protocol.ErrNotSealed
	// ErrSealed: the operation needs an unsealed object.
	ErrSealed = protocol.ErrSealed
	// ErrTimeout: a get's object was not sealed in time.
	ErrTimeout = protocol.ErrTimeout
	// ErrDaemonRunning: ListenAndServe found another daemon serving the
	// socket.
	ErrDaemonRunning = errors.New("a store daemon is already running")
)

func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}
