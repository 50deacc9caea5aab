package cluster

import (
	"errors"

	"github.com/cudaipc/cudaipc/protocol"
)

// Sentinel errors of the cluster packages; errors returned wrap them, so
// errors.Is matches. Each but ErrSecret wraps in turn the protocol
// sentinel of the error code it reaches a client with (see class), so that
// a failure keeps its class on the way through the store: errors.Is(err,
// protocol.ErrUnavailable) holds for an error wrapping ErrUnavailable.
var (
	// ErrUnavailable: the directory (etcd) cannot be reached in time.
	// Local work is unaffected; cluster calls fail with it until etcd
	// answers again. Code UNAVAILABLE.
	ErrUnavailable = class("cluster directory unavailable", protocol.ErrUnavailable)
	// ErrNotFound: no record of that name (node, object, version). Code
	// NOT_FOUND.
	ErrNotFound = class("not in the cluster directory", protocol.ErrNotFound)
	// ErrExists: a create-only record already exists. Code EXISTS.
	ErrExists = class("already in the cluster directory", protocol.ErrExists)
	// ErrNoHolder: the object is recorded but no live node holds it. Code
	// NOT_FOUND.
	ErrNoHolder = class("no live node holds the object", protocol.ErrNotFound)
	// ErrUnreachable: live nodes hold the object, but none could be read
	// from (refused, dropped the connection, stalled, or failed the mutual
	// authentication). Code UNAVAILABLE: a retry may find one that
	// answers, or find that none holds it.
	ErrUnreachable = class("no holder of the object could be read from", protocol.ErrUnavailable)
	// ErrBadRecord: a directory record or control message is malformed or
	// its MAC does not verify (forged, or written with another secret).
	// Code DATA_LOSS.
	ErrBadRecord = class("malformed or unauthenticated cluster record", protocol.ErrDataLoss)
	// ErrAuth: a peer failed the mutual challenge over the cluster secret.
	// Code UNAVAILABLE, not PERMISSION: the reader's rights are not in
	// question; that peer cannot serve this node until one of them runs
	// with the right secret, and another holder may.
	ErrAuth = class("cluster peer authentication failed", protocol.ErrUnavailable)
	// ErrChecksum: a pulled chunk does not match the checksum recorded at
	// seal. Code DATA_LOSS.
	ErrChecksum = class("chunk checksum mismatch", protocol.ErrDataLoss)
	// ErrSecret: the cluster secret file is missing, too short or readable
	// by others. It stops a daemon from starting and reaches no client.
	ErrSecret = errors.New("bad cluster secret")
)

// classError is a sentinel with its own text that also matches the
// protocol sentinel of its class.
type classError struct {
	msg  string
	code error
}

// class returns a sentinel with text msg that wraps code, one of the
// protocol's sentinels.
func class(msg string, code error) error { return &classError{msg: msg, code: code} }

func (e *classError) Error() string { return e.msg }

// Unwrap returns the protocol sentinel of e's class.
func (e *classError) Unwrap() error { return e.code }
