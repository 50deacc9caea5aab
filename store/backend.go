package store

import (
	"errors"
	"fmt"
	"log/slog"
	"os"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// backend is the seam between the store and the memory it hands out: the
// host backend (memfd arenas) and the CUDA backend (device allocations,
// plus host memory for the "host" device). The store keeps all
// bookkeeping; a backend only creates, shares and destroys arenas.
type backend interface {
	// name is what the hello response reports: "host" or "cuda".
	name() string
	// device returns the canonical name of the device a request asks for
	// ("" picks the default, host memory), or an error wrapping ErrInvalid
	// when the backend has no such device.
	device(requested string) (string, error)
	// granularity is the unit of arena sizes on device: a power of two, at
	// least 256.
	granularity(device string) int64
	// arenaSizes bounds the arenas of device: a pool's first arena is
	// first bytes, each further one twice the previous, up to most (a
	// larger object gets an arena of its own size). 0 means the
	// allocator's defaults.
	arenaSizes(device string) (first, most int64)
	// newArena creates an arena of size bytes (a multiple of granularity)
	// on device. id is unique for the life of the store, for names in
	// /proc and logs.
	newArena(device string, id uint64, size int64) (arena, error)
	// keepsArenas reports whether device's empty arenas may be kept for
	// their pool's next objects (Config.KeepArenas): GPU arenas, whose
	// allocation, zeroing and import by every client are expensive.
	keepsArenas(device string) bool
}

// arena is one contiguous range of memory of a backend.
type arena interface {
	// share returns what lets a client map the arena: a new file (the
	// caller closes it, usually after sending it) and, for GPU backends, an
	// opaque region description. writable selects the mode: a read-only
	// share must not let the client write, even by reopening the file.
	// (GPU arenas cannot honour that: CUDA maps device memory read-write
	// only.)
	share(writable bool) (arenaShare, error)
	// placementKind says how clients map the arena. The share of a GPU
	// arena (CUDA_IPC, VMM_FD) travels with every placement rather than
	// once per connection and mode: clients keep nothing of an arena they
	// no longer map (a kept descriptor of a VMM arena would keep its
	// device memory allocated after the store frees it).
	placementKind() storev1.Placement_Kind
	// objectRegion describes [off, off+n) of the arena for ObjectInfo:
	// the binary encoding of a cudaipc.Region for GPU arenas, nil for host
	// ones.
	objectRegion(off, n int64) []byte
	// discard tells the backend that [off, off+n) holds no object any more,
	// so it may give the memory back to the system. It is only a hint.
	discard(off, n int64)
	// close releases the arena. Host clients that mapped it keep their
	// mappings; a GPU arena must only be closed when no client maps it any
	// more, which the store guarantees by closing an arena only once no
	// object (sealed, unsealed, or deleted but leased) remains in it.
	close() error
	// descriptors is how many file descriptors the arena keeps open in
	// the daemon (charged to its owner: budget.go).
	descriptors() int
	// sealWrites makes the arena's memory immutable for everyone where the
	// kernel allows it, and reports whether it is: only once no writable
	// mapping of it is left (a creator that has not unmapped its draft
	// keeps writing through its mapping). Only for arenas of one sealed
	// object. GPU memory cannot be sealed: false.
	sealWrites() bool
}

// arenaShare is what a client needs to map an arena. Host arenas travel as
// a file, once per connection and mode; GPU arenas as a region blob
// (docs/region.md, binary) of the whole arena in every placement, with a
// file beside it for vmm-fd regions, the same for readers and writers.
type arenaShare struct {
	file   *os.File
	region []byte
}

// newBackend returns the backend Config.Backend names, its GPU arenas
// shared as Config.GPUShare says. auto picks cuda when the CUDA driver
// loads and sees at least one GPU, else host; cuda fails without a GPU.
func newBackend(name, gpuShare string, log *slog.Logger) (backend, error) {
	switch name {
	case "", "auto":
		devs, err := cudaipc.Devices()
		if err != nil || len(devs) == 0 {
			why := "no GPU visible"
			if err != nil {
				why = err.Error()
			}
			log.Info("backend auto: host memory only", "reason", why)
			return hostBackend{}, nil
		}
		b, err := newCUDABackend(devs, gpuShare)
		if err != nil {
			return nil, err
		}
		log.Info("backend auto: cuda and host", "gpus", b.uuids, "gpu_share", gpuShare)
		return b, nil
	case "host":
		return hostBackend{}, nil
	case "cuda":
		devs, err := cudaipc.Devices()
		if err != nil {
			return nil, fmt.Errorf("store: backend cuda needs the CUDA driver and a GPU: %w; or use --backend host (or auto) on a machine without one", err)
		}
		if len(devs) == 0 {
			return nil, errors.New("store: backend cuda needs a GPU, and the driver sees none: use --backend host or auto")
		}
		b, err := newCUDABackend(devs, gpuShare)
		if err != nil {
			return nil, err
		}
		log.Info("backend cuda", "gpus", b.uuids, "gpu_share", gpuShare)
		return b, nil
	}
	return nil, invalidf("unknown backend %q (want auto, cuda or host)", name)
}
