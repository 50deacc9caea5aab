package client

import (
	"errors"
	"fmt"
	"strings"

	"github.com/cudaipc/cudaipc/protocol"
)

// Sentinel errors. Every error a Client returns for a failed request wraps
// one of them (errors.Is), a context error, or, when this process cannot
// map the memory the daemon sent, the cudaipc error that says why (for
// example cudaipc.ErrOtherPIDNamespace). The daemon's error codes map to
// these through protocol's table: they are protocol's sentinels.
var (
	ErrNotFound   = protocol.ErrNotFound
	ErrExists     = protocol.ErrExists
	ErrTimeout    = protocol.ErrTimeout
	ErrStoreFull  = protocol.ErrStoreFull
	ErrPermission = protocol.ErrPermission
	ErrLimit      = protocol.ErrLimit
	ErrInvalid    = protocol.ErrInvalid
	ErrNotSealed  = protocol.ErrNotSealed
	ErrSealed     = protocol.ErrSealed
	// ErrVersion means the daemon does not speak this client's protocol
	// version.
	ErrVersion = protocol.ErrVersion
	// ErrInternal is a failure inside the daemon, or a daemon reply that
	// breaks the protocol.
	ErrInternal = protocol.ErrInternal
	// ErrUnavailable means a daemon in a cluster could not reach what the
	// answer needs: the cluster directory, or every live node holding the
	// object. Nothing was lost; retry later.
	ErrUnavailable = protocol.ErrUnavailable
	// ErrDataLoss means a record or the bytes of the object, as another
	// node holds them, do not verify (forged, written with another cluster
	// secret, or corrupt). Retrying does not help.
	ErrDataLoss = protocol.ErrDataLoss
	// ErrStoreGone means the connection to the daemon is lost (the daemon
	// stopped, restarted or closed the connection) or there is no daemon.
	// The Client is unusable afterwards; Dial again. It has no protocol
	// code: no daemon sends it.
	ErrStoreGone = errors.New("store daemon gone")
)

// Error is the error a request fails with: the operation, the object it was
// about, and the store's reason. It unwraps to one of the sentinels.
type Error struct {
	Op      string // "create", "get", ...
	Name    string // object name, if any
	Message string // the daemon's message, if any
	Err     error  // a sentinel, e.g. ErrNotFound, or a cudaipc error of mapping
	// Limit says, for ErrLimit, which limit the daemon says was hit: the
	// name of a protocol Error.Limit ("CONNECTIONS_PER_UID",
	// "OBJECTS_PER_UID", "DESCRIPTORS_PER_UID", ...); "" when it does not
	// say. Message says what to do about it.
	Limit string

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
