// Package cluster is what cudaipc daemons share to form a cluster: the
// records of the directory (nodes, objects with their chunk checksums,
// holders, versions, pins), sealed with the cluster secret; the mutual
// authentication of daemons; and the puller, which makes a local replica of
// an object another node holds.
//
// The packages below it plug in the engines: cluster/etcddir is the
// directory on etcd v3, and the data plane is UCX (internal/ucx and the
// typed package above it) behind the Transport seam. This package never
// touches purego or unsafe.
//
// # Records
//
// Every directory value is a record sealed by Seal: an HMAC-SHA256 over its
// key and JSON body with a key derived from the cluster secret, then the
// body. Open rejects, with an error wrapping ErrBadRecord, a value that is
// malformed, too large, fails validation, or whose MAC does not verify, so
// a process that can write to etcd but lacks the secret cannot forge a node,
// an object, a holder or a pin. Records carry no secrets: rkeys and memory
// addresses only cross the authenticated control channel.
//
// # Checksums
//
// An object is pulled and checked in chunks (ChunkSizeFor: 4 MiB, up to
// 16 MiB for objects beyond 4 GiB, more beyond 1 TiB); each chunk's
// CRC-32C is recorded at seal and checked after the pull, on the CPU's CRC
// instructions (SSE 4.2, ARMv8) through hash/crc32, or on the GPU for GPU
// objects; it detects corruption, and the records' MACs and the
// authenticated channel guard against forgery.
//
// # Users
//
// Objects are named in their owner's namespace, as in one store: a record
// carries the owner's uid and whether the object is shared, and a replica
// is made with the same owner and sharing, so each node applies its own
// per-uid rules to it. Uids are matched across nodes by number: the nodes
// of a cluster must share one uid space (one directory service, or the
// same images), as NFS requires.
package cluster
