// Package store is the cudaipc object store daemon. It owns the memory of
// every object and hands clients zero-copy mappings of it over a Unix
// SOCK_SEQPACKET socket, speaking package protocol.
//
// # Objects and their lifetime
//
// A client creates an object (a name, a size, a device) and gets a writable
// placement: an offset in an arena it maps once and then reuses. The object
// is visible to its creating connection only until that connection seals
// it; from then on it is immutable by contract and visible to every peer
// allowed to read it. Gets wait until the name exists and is sealed and
// grant a read-only lease. Deleting removes the name at once; the memory
// is freed when the last lease ends. A connection that goes away, however
// it dies, has its unsealed objects aborted and its leases released.
//
// # Names and their lifecycle
//
// One name table (names.go) maps each qualified name to one entry, whose
// kind is data: an object (a draft until sealed), a registration of
// external memory, or a versioned name whose versions' shards are objects.
// A name is taken only by claimLocked, so a create, register or
// seal-rename of any kind over a name of any kind is EXISTS, and freed
// only by the entry that holds it (delete, abort, eviction, a
// registration's end). Every kind goes through the same path
// (lifecycle.go): create makes a draft that only its connection sees;
// seal makes it readable (for a shard, once the version's last shard is
// sealed) and wakes the gets waiting on the name; abort, or the creator's
// connection ending, discards it; get resolves the name to one object or
// registration and leases it, or waits on the name; release and delete
// end leases and names. Per-connection limits count every entry and every
// lease the same way, whatever its kind. Subscribers are told only of
// names their list would show them.
//
// # States
//
// Each entry's state is one value with its transitions in one file
// (state.go), which refuses any transition not listed here. An object (a
// plain object, a version's shard, a no-copy shard or a partial replica
// alike):
//
//	from             to        when
//	-                draft     create (a replica or slice the cluster makes too)
//	draft            sealed    its creator seals it
//	draft            detached  a replica's pull gave up while peers read it: its name goes, its memory stays
//	draft, detached  aborted   abort, delete of a draft, its creator's end, its version aborted
//	sealed           deleted   delete, eviction, a slice dropped, its version freed
//
// Drafts and sealed objects hold their name; a deleted object's memory
// goes with its last lease, an aborted one's at once. A version of a
// versioned name:
//
//	from                       to         when
//	-                          pending    the create of its first shard
//	pending                    visible    its last shard sealed (and, if cluster-visible, published)
//	pending                    freed      aborted: a shard aborted or its creator gone, a failed cluster publish, its name deleted
//	visible                    retired    beyond keep_last (the name's, or the cluster's), or its name deleted
//	visible, retired           withdrawn  its no-copy publisher withdrew it, or went
//	retired, withdrawn         freed      its last lease ended (at once when unleased)
//
// A registration of external memory is registered, then orphaned when its
// registering connection ends (readable while leased), and dropped when
// deleted, when a legacy one's exporter ends, or with an orphan's last
// lease; its descriptors close with its last lease.
//
// # Memory
//
// Objects live in arenas, sub-allocated with 256-byte alignment by
// store/internal/alloc. An arena holds the objects of one owner uid with one
// sharing mode only, so a mapping never exposes bytes its holder may not
// read. Arenas are added up to Config.Capacity per device and given back
// when empty. When a create does not fit, sealed objects without leases are
// evicted, least recently used first, unless Config.NoEvict; on a daemon in
// a cluster, a cluster-visible one only where the cluster hook vouches that
// another live node holds it too (ClusterHook.MayEvict, room.go).
//
// The host backend keeps arenas in memfds. Creators receive a read-write
// descriptor; readers a read-only one, which cannot be mapped writable,
// written, resized, or reopened for writing through /proc (the memfd's
// mode is 0). The CUDA backend keeps GPU objects in device allocations of
// the daemon (named by GPU UUID), one per arena, and describes each to
// clients by the cudaipc.Region of the whole allocation, sent in every
// placement with its kind: a cuda-ipc region (cuMemAlloc, legacy IPC), or
// with Config.GPUShare "fd" a vmm-fd region (cuMemCreate) with the
// allocation's descriptor beside it. ObjectInfo carries the region of
// exactly the object. CUDA cannot map device memory read-only, so GPU
// readers are trusted not to write. A GPU
// arena is freed only when no object (sealed, unsealed, or deleted but
// leased) is left in it; clients close their mapping before sealing,
// aborting or releasing, so none maps freed memory.
//
// # Security
//
// Peers are identified by SO_PEERCRED when they connect. Only the daemon's
// uid, root and Config.AllowUIDs/AllowGIDs may talk to the store; others
// are refused as soon as they connect, and admitted connections are bounded
// in all and per uid (Config.MaxConns, MaxConnsPerUID). Objects are private
// to their owner's uid (and root) unless created shared. Each uid has its
// own namespace: clients name their own objects bare and other users'
// "UID:NAME", so no user can take or shadow another's name. Private objects
// share arenas of their owner's only, and a shared object has an arena of
// its own (GPU arenas are zeroed when allocated), so another uid's mapping
// reaches no draft or private object. Each uid's arenas on a device are
// bounded by Config.Quota, and a create evicts only its own uid's objects.
// Only the owner (or root) may delete a sealed object. Logs carry names,
// sizes and ids, never descriptors' contents or object bytes, and the
// lines a client can cause are rate-limited per uid. Each connection is
// bounded in objects and leases (waiting gets count as leases), each uid
// in objects (Config.MaxObjectsPerUID) and in the descriptors the daemon
// keeps for it (Config.MaxFDsPerUID, and MaxFDs for all), and a
// subscriber that stops reading its events misses them rather than making
// the daemon buffer them without bound. A sealed shared host object is
// sealed against writes (F_SEAL_WRITE) once its creator holds no writable
// mapping; until then, and for private host and GPU objects always, the
// creator can still write it, which ObjectInfo's CreatorCanWrite says
// (docs/hardening.md, "Sealed objects").
package store
