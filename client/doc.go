// Package client talks to the cudaipc object store daemon (cudaipc serve).
//
// A Client holds one connection to the daemon. Calls on it are safe for
// concurrent use: a get that waits for an object to be sealed
// (GetOptions.Wait) does not hold up other calls, and subscription events arrive while calls are in flight.
//
// Lifetimes:
//
//   - Create returns an Object: a writable buffer visible only to this
//     client until Seal. Seal makes it immutable and visible to readers;
//     Abort (or closing the client, or the process dying) discards it. After
//     Seal or Abort the Object's Bytes must not be used.
//   - Get returns a Lease: a read-only view of a sealed object. The memory
//     stays valid until Release, even if the object is deleted or the
//     store wants the space. A lease the client forgets is released when the
//     connection closes (including when the process is killed). When
//     Release (or Close) returns, the daemon has ended the lease: every
//     connection sees it gone and a deleted object's memory reusable.
//   - The lease fast path: the client shares a lease table with the daemon
//     (docs/protocol.md 6.7). A lease of a plain object is released by one
//     compare-and-swap in it, with no system call, and a later Get of the
//     same name takes the lease back the same way unless the daemon has
//     reclaimed it (it needed the memory) or the object was deleted; then
//     the Get goes through the socket. Options.NoFastPath turns it off.
//   - A call that reads its own reply polls the socket for up to
//     Options.Spin (50 µs by default; CUDAIPC_SPIN) before it sleeps, so a
//     reply that comes within it costs no wake-up; it spends that CPU.
//   - Memory is mapped once per daemon arena and cached, so a Get costs one
//     socket round trip. Mappings are unmapped when the client is closed and
//     no Object or Lease uses them any more; Bytes of a released lease must
//     not be used.
//   - GPU objects (CreateOptions.Device a GPU ordinal or UUID, on a daemon
//     with the cuda backend) are mapped with cudaipc.Import through its
//     process-wide cache: one driver open per daemon arena per process.
//     An arena stays mapped after its last Object or Lease ends (up to
//     Options.MaxIdleArenas idle arenas, least recently used dropped
//     first), until the daemon says it freed the arena or the client
//     closes: getting and releasing one object at a time costs one open.
//     Use ReadAt/WriteAt, or Ptr and Mapping on the device; Bytes is nil.
//     Every GPU placement carries a region and says its kind: a cuda-ipc
//     region (legacy IPC), or, from a daemon started with --gpu-share fd,
//     a vmm-fd region with its arena's descriptor beside it, which the
//     client imports with cudaipc.Import(r, cudaipc.WithFile(f)) through
//     the same cache and closes at once. Mapping().Region().Kind says
//     which. The vmm-fd path works from another PID namespace (a
//     container), which legacy IPC does not.
//     The mapping is closed before Seal, Abort or Release reaches the
//     daemon, which may then free the memory: finish device work first.
//     Client.Close closes the GPU mappings of the Objects and Leases still
//     open (the daemon may free that memory once the connection is gone).
//
// Timeouts: no call hangs on a daemon that stopped answering. Dial is
// bounded by Options.DialTimeout (10 s by default) or its context's
// deadline; a get with GetOptions.Wait waits as long as its context allows
// (it may wait for a seal); every other call is bounded by its context's deadline or, without
// one, by Options.CallTimeout (30 s by default), as are Release and Close.
// A call that runs out of time fails with ErrTimeout.
//
// Errors match the package's sentinels with errors.Is: ErrNotFound,
// ErrExists, ErrTimeout, ErrStoreFull, ErrPermission, ErrLimit, ErrInvalid,
// ErrNotSealed, ErrSealed, ErrVersion, ErrInternal, and from a daemon in a
// cluster ErrUnavailable (retry later) and ErrDataLoss (a record or the
// bytes do not verify: retrying does not help), are protocol's (one
// table maps the daemon's codes to them); ErrStoreGone (the daemon went
// away: Dial again once a new daemon runs) and ErrClosed are the client's
// own. When this process cannot map GPU memory the daemon sent, the error
// wraps the cudaipc error that says why (cudaipc.ErrOtherPIDNamespace: the
// daemon shares by legacy IPC and this process is in another container).
package client
