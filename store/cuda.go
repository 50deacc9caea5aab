package store

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/cudaipc/cudaipc"
	"golang.org/x/sys/unix"
)

// Arena sizes of GPU devices. Each arena costs every client that reads from
// it one cuIpcOpenMemHandle (40–80 µs, more across GPUs) or, shared by
// descriptor, one import and map (67–134 µs on an H200), so GPU arenas
// start larger than host ones and grow to 1 GiB; an object larger than
// that gets an arena of its own size.
const (
	gpuFirstArena  = 64 << 20
	gpuMostArena   = 1 << 30
	gpuGranularity = 2 << 20 // cuMemAlloc's own granularity on current GPUs
)

// gpuMemory is one device allocation as the CUDA backend uses it: the seam
// in front of the driver, so that the backend's logic runs in CPU tests
// with a fake. *cudaipc.Buffer implements it.
type gpuMemory interface {
	// Export describes [off, off+size) of the allocation for another
	// process.
	Export(off, size int64) (cudaipc.Region, error)
	// Free gives the allocation back to the driver.
	Free() error
}

// gpuFDMemory is one shareable (VMM) device allocation, the seam of the
// descriptor path as gpuMemory is of the legacy one.
// *cudaipc.ShareableBuffer implements it.
type gpuFDMemory interface {
	// ExportFD returns a new descriptor of the allocation.
	ExportFD() (*os.File, error)
	// Free drops the daemon's reference; descriptors and importers' mappings
	// keep the memory alive.
	Free() error
}

// cudaBackend keeps objects of GPU devices in device allocations (one per
// arena, made by the daemon) and objects of the "host" device in memfd
// arenas, like hostBackend. GPUs are named by UUID ("GPU-…"), which,
// unlike ordinals, mean the same in every process. Exactly one of alloc
// (GPUShareIPC: cuMemAlloc, shared as legacy IPC regions) and allocFD
// (GPUShareFD: cuMemCreate, shared as descriptors) is set.
type cudaBackend struct {
	host    hostBackend
	uuids   []string // canonical UUIDs of the GPUs, in the daemon's ordinal order
	alloc   func(uuid string, size int64) (gpuMemory, error)
	allocFD func(uuid string, size int64) (gpuFDMemory, error)
}

func newCUDABackend(devs []*cudaipc.Device, share string) (*cudaBackend, error) {
	byUUID := make(map[string]*cudaipc.Device, len(devs))
	b := &cudaBackend{}
	for _, d := range devs {
		u := d.UUID().String()
		switch {
		case share == GPUShareFD && !d.VMMFDSupported():
			return nil, fmt.Errorf("store: backend cuda: %s (%s) cannot export memory as file descriptors (use --gpu-share ipc)", u, d.Name())
		case share != GPUShareFD && !d.LegacyIPCSupported():
			return nil, fmt.Errorf("store: backend cuda: %s (%s) does not support CUDA IPC (try --gpu-share fd)", u, d.Name())
		}
		if share == GPUShareFD {
			// Arena sizes are multiples of gpuGranularity; cuMemCreate
			// needs multiples of the VMM granularity.
			g, err := d.VMMGranularity()
			if err != nil {
				return nil, fmt.Errorf("store: backend cuda: %s: %w", u, err)
			}
			if g <= 0 || gpuGranularity%g != 0 {
				return nil, fmt.Errorf("store: backend cuda: %s: VMM granularity %d does not divide the store's %d-byte arena unit (use --gpu-share ipc)", u, g, gpuGranularity)
			}
		}
		byUUID[u] = d
		b.uuids = append(b.uuids, u)
	}
	// Every new arena is zeroed: CUDA hands out memory the daemon freed
	// before, and what another uid's objects (or drafts) left there must
	// not show in an arena that this arena's readers map whole.
	if share == GPUShareFD {
		b.allocFD = func(uuid string, size int64) (gpuFDMemory, error) {
			d := byUUID[uuid]
			m, err := d.AllocShareable(size)
			if err != nil {
				return nil, err
			}
			if err := d.Memset(m.Ptr(), 0, m.Size()); err != nil {
				return nil, errors.Join(fmt.Errorf("zeroing a new arena: %w", err), m.Free())
			}
			return m, nil
		}
	} else {
		b.alloc = func(uuid string, size int64) (gpuMemory, error) {
			m, err := byUUID[uuid].Alloc(size)
			if err != nil {
				return nil, err
			}
			if err := m.Memset(0); err != nil {
				return nil, errors.Join(fmt.Errorf("zeroing a new arena: %w", err), m.Free())
			}
			return m, nil
		}
	}
	return b, nil
}

func (*cudaBackend) name() string { return "cuda" }

func (b *cudaBackend) isGPU(device string) bool { return device != hostDevice }

func (b *cudaBackend) device(requested string) (string, error) {
	if requested == "" || requested == hostDevice {
		return hostDevice, nil
	}
	u, err := cudaipc.ParseUUID(requested)
	if err != nil {
		if _, nerr := strconv.Atoi(requested); nerr == nil {
			return "", invalidf("device %q: the daemon names GPUs by UUID, not ordinal (clients resolve ordinals in their own process); its GPUs are %s", requested, strings.Join(b.uuids, ", "))
		}
		return "", invalidf("device %q: want %q or a GPU UUID (%s)", requested, hostDevice, strings.Join(b.uuids, ", "))
	}
	s := u.String()
	for _, have := range b.uuids {
		if have == s {
			return s, nil
		}
	}
	return "", invalidf("device %q: the daemon has no such GPU; its GPUs are %s", requested, strings.Join(b.uuids, ", "))
}

func (b *cudaBackend) granularity(device string) int64 {
	if b.isGPU(device) {
		return gpuGranularity
	}
	return b.host.granularity(device)
}

func (b *cudaBackend) arenaSizes(device string) (first, most int64) {
	if b.isGPU(device) {
		return gpuFirstArena, gpuMostArena
	}
	return b.host.arenaSizes(device)
}

func (b *cudaBackend) newArena(device string, id uint64, size int64) (arena, error) {
	if !b.isGPU(device) {
		return b.host.newArena(device, id, size)
	}
	if b.allocFD != nil {
		return b.newFDArena(device, id, size)
	}
	mem, err := b.alloc(device, size)
	if err != nil {
		return nil, allocError(device, id, size, err)
	}
	r, err := mem.Export(0, size)
	if err == nil {
		var blob []byte
		if blob, err = r.MarshalBinary(); err == nil {
			return &cudaArena{mem: mem, region: r, blob: blob}, nil
		}
	}
	return nil, errors.Join(fmt.Errorf("arena %d on %s: exporting: %w", id, device, err), mem.Free())
}

func allocError(device string, id uint64, size int64, err error) error {
	if errors.Is(err, cudaipc.ErrOutOfMemory) {
		return fmt.Errorf("%w: %s: allocating a %d-byte arena: %v", ErrStoreFull, device, size, err)
	}
	return fmt.Errorf("arena %d on %s: %w", id, device, err)
}

func (b *cudaBackend) newFDArena(device string, id uint64, size int64) (arena, error) {
	mem, err := b.allocFD(device, size)
	if err != nil {
		return nil, allocError(device, id, size, err)
	}
	f, err := mem.ExportFD()
	if err != nil {
		return nil, errors.Join(fmt.Errorf("arena %d on %s: exporting: %w", id, device, err), mem.Free())
	}
	return &cudaFDArena{mem: mem, file: f}, nil
}

// cudaArena is one device allocation, exported once.
type cudaArena struct {
	mem    gpuMemory
	region cudaipc.Region // of the whole allocation
	blob   []byte         // region's binary encoding
}

// share returns the whole arena's region. It cannot be made read-only:
// CUDA IPC maps device memory read-write, so readers are trusted not to
// write (arenas per owner and sharing keep other users' objects out of
// their reach).
func (a *cudaArena) share(bool) (arenaShare, error) { return arenaShare{region: a.blob}, nil }

func (a *cudaArena) objectRegion(off, n int64) []byte {
	r, err := a.region.Sub(off, n)
	if err != nil {
		return nil
	}
	b, err := r.MarshalBinary()
	if err != nil {
		return nil
	}
	return b
}

// discard does nothing: device memory cannot be partly given back, and the
// arena is freed as a whole once empty.
func (*cudaArena) discard(_, _ int64) {}

func (a *cudaArena) close() error { return a.mem.Free() }

func (*cudaArena) sharePerPlacement() bool { return true }

// cudaFDArena is one shareable device allocation, exported once as a
// descriptor that every share duplicates.
type cudaFDArena struct {
	mem  gpuFDMemory
	file *os.File
}

// share returns a duplicate of the arena's descriptor, for readers and
// writers alike: a descriptor of device memory maps read-write whoever
// holds it, so read-only is advisory, as with legacy IPC.
func (a *cudaFDArena) share(bool) (arenaShare, error) {
	fd, err := unix.FcntlInt(a.file.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return arenaShare{}, fmt.Errorf("dup arena fd: %w", err)
	}
	return arenaShare{file: os.NewFile(uintptr(fd), a.file.Name())}, nil
}

func (*cudaFDArena) sharePerPlacement() bool { return true }

// objectRegion is nil: a descriptor-shared object has no region a process
// outside the store could open.
func (*cudaFDArena) objectRegion(_, _ int64) []byte { return nil }

func (*cudaFDArena) discard(_, _ int64) {}

// close drops the daemon's references. Clients' mappings and descriptors in
// flight keep the memory until they go.
func (a *cudaFDArena) close() error { return errors.Join(a.file.Close(), a.mem.Free()) }
