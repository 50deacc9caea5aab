package cluster

import "errors"

// Sentinel errors of the cluster packages; errors returned wrap them, so
// errors.Is matches.
var (
	// ErrUnavailable: the directory (etcd) cannot be reached in time.
	// Local work is unaffected; cluster calls fail with it until etcd
	// answers again.
	ErrUnavailable = errors.New("cluster directory unavailable")
	// ErrNotFound: no record of that name (node, object, version).
	ErrNotFound = errors.New("not in the cluster directory")
	// ErrExists: a create-only record already exists.
	ErrExists = errors.New("already in the cluster directory")
	// ErrNoHolder: the object is recorded but no live node holds it.
	ErrNoHolder = errors.New("no live node holds the object")
	// ErrBadRecord: a directory record or control message is malformed or
	// its MAC does not verify (forged, or written with another secret).
	ErrBadRecord = errors.New("malformed or unauthenticated cluster record")
	// ErrAuth: a peer failed the mutual challenge over the cluster secret.
	ErrAuth = errors.New("cluster peer authentication failed")
	// ErrChecksum: a pulled chunk does not match the checksum recorded at
	// seal.
	ErrChecksum = errors.New("chunk checksum mismatch")
	// ErrSecret: the cluster secret file is missing, too short or readable
	// by others.
	ErrSecret = errors.New("bad cluster secret")
)
