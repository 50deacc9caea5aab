package client

import (
	"errors"
	"fmt"
	"strings"
)

// Sentinel errors. Every error a Client returns for a failed request wraps
// one of them (errors.Is), or a context error.
var (
	ErrNotFound   = errors.New("object not found")
	ErrExists     = errors.New("object already exists")
	ErrTimeout    = errors.New("timed out")
	ErrStoreFull  = errors.New("store full")
	ErrPermission = errors.New("permission denied")
	ErrLimit      = errors.New("per-client limit reached")
	ErrInvalid    = errors.New("invalid argument")
	ErrNotSealed  = errors.New("object not sealed")
	ErrSealed     = errors.New("object already sealed")
	// ErrStoreGone means the connection to the daemon is lost (the daemon
	// stopped, restarted or closed the connection) or there is no daemon.
	// The Client is unusable afterwards; Dial again.
	ErrStoreGone = errors.New("store daemon gone")
	// ErrVersion means the daemon does not speak this client's protocol
	// version.
	ErrVersion = errors.New("protocol version not supported by the daemon")
	// ErrInternal is a failure inside the daemon, or a daemon reply that
	// breaks the protocol.
	ErrInternal = errors.New("internal store error")
)

// Error is the error a request fails with: the operation, the object it was
// about, and the store's reason. It unwraps to one of the sentinels.
type Error struct {
	Op      string // "create", "get", ...
	Name    string // object name, if any
	Message string // the daemon's message, if any
	Err     error  // a sentinel, e.g. ErrNotFound

	cause error // a second error matched by errors.Is, e.g. context.DeadlineExceeded
}

func (e *Error) Error() string {
	s := "store " + e.Op
	if e.Name != "" {
		s += fmt.Sprintf(" %q", e.Name)
	}
	s += ": " + e.Err.Error()
	// The daemon's message often ends with the code's text; say it once.
	msg := strings.TrimSuffix(e.Message, ": "+e.Err.Error())
	msg = strings.TrimPrefix(msg, e.Err.Error()+": ")
	if msg != "" && msg != e.Err.Error() {
		s += ": " + msg
	}
	return s
}

// Unwrap returns the sentinel and, for a Get whose context deadline
// passed, context.DeadlineExceeded.
func (e *Error) Unwrap() []error {
	if e.cause != nil {
		return []error{e.Err, e.cause}
	}
	return []error{e.Err}
}
