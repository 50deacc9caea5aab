package store

import "os"

// backend is the seam between the store and the memory it hands out: the
// host backend (memfd arenas) now, a CUDA backend later. The store keeps all
// bookkeeping; a backend only creates, shares and destroys arenas.
type backend interface {
	// name is what the hello response reports: "host", later "cuda".
	name() string
	// device returns the canonical name of the device a request asks for
	// ("" picks the default), or an error wrapping ErrInvalid when the
	// backend has no such device.
	device(requested string) (string, error)
	// granularity is the unit of arena sizes on device: a power of two, at
	// least 256.
	granularity(device string) int64
	// newArena creates an arena of size bytes (a multiple of granularity)
	// on device. id is unique for the life of the store, for names in
	// /proc and logs.
	newArena(device string, id uint64, size int64) (arena, error)
}

// arena is one contiguous range of memory of a backend.
type arena interface {
	// share returns what lets a client map the arena: a new file (the
	// caller closes it, usually after sending it) and, for GPU backends, an
	// opaque region description. writable selects the mode: a read-only
	// share must not let the client write, even by reopening the file.
	share(writable bool) (arenaShare, error)
	// discard tells the backend that [off, off+n) holds no object any more,
	// so it may give the memory back to the system. It is only a hint.
	discard(off, n int64)
	// close releases the arena. Clients that mapped it keep their mappings.
	close() error
}

// arenaShare is what a client needs to map an arena. Either field may be
// empty: host arenas travel as a file, GPU arenas as a region blob (and
// maybe a file).
type arenaShare struct {
	file   *os.File
	region []byte
}

// newBackend returns the backend Config.Backend names.
func newBackend(name string) (backend, error) {
	switch name {
	case "", "auto", "host":
		// auto picks host until GPU backends exist.
		return hostBackend{}, nil
	}
	return nil, invalidf("unknown backend %q (want auto or host)", name)
}
