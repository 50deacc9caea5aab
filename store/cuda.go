package store

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol/storev1"
	"golang.org/x/sys/unix"
)

// Arena sizes of GPU devices. Each arena costs every client that reads from
// it one cuIpcOpenMemHandle or, shared by descriptor, one import and map
// (tens of µs each: docs/benchmarks.md), so GPU arenas start larger than
// host ones and grow to 1 GiB; an object larger than that gets an arena of
// its own size.
const (
	gpuFirstArena  = 64 << 20
	gpuMostArena   = 1 << 30
	gpuGranularity = 2 << 20 // cuMemAlloc's own granularity on current GPUs
)

// gpuMemory is one device allocation as the CUDA backend uses it: the seam
// in front of the driver, so that the backend's logic runs in CPU tests
// with a fake. *cudaipc.Buffer (legacy IPC) and *cudaipc.ShareableBuffer
// (VMM, shared by descriptor) implement it; the latter also implements
// fdExporter.
type gpuMemory interface {
	// Export describes [off, off+size) of the allocation for another
	// process: a cuda-ipc or vmm-fd region.
	Export(off, size int64) (cudaipc.Region, error)
	// Free drops the daemon's reference to the allocation. Importers'
	// mappings (vmm-fd: and descriptors in flight) keep VMM memory alive.
	Free() error
}

// fdExporter is a gpuMemory whose regions (vmm-fd) need a descriptor beside
// them.
type fdExporter interface {
	// ExportFD returns a new descriptor of the allocation.
	ExportFD() (*os.File, error)
}

// cudaBackend keeps objects of GPU devices in device allocations (one per
// arena, made by the daemon) and objects of the "host" device in memfd
// arenas, like hostBackend. GPUs are named by UUID ("GPU-…"), which,
// unlike ordinals, mean the same in every process. alloc makes a GPU
// arena's allocation: cuMemAlloc (GPUShareIPC, cuda-ipc regions) or
// cuMemCreate (GPUShareFD, vmm-fd regions and a descriptor).
type cudaBackend struct {
	host  hostBackend
	uuids []string // canonical UUIDs of the GPUs, in the daemon's ordinal order
	alloc func(uuid string, size int64) (gpuMemory, error)
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
	b.alloc = func(uuid string, size int64) (gpuMemory, error) {
		d := byUUID[uuid]
		if share == GPUShareFD {
			m, err := d.AllocShareable(size)
			if err != nil {
				return nil, err
			}
			if err := d.Memset(m.Ptr(), 0, m.Size()); err != nil {
				return nil, errors.Join(fmt.Errorf("zeroing a new arena: %w", err), m.Free())
			}
			return m, nil
		}
		m, err := d.Alloc(size)
		if err != nil {
			return nil, err
		}
		if err := m.Memset(0); err != nil {
			return nil, errors.Join(fmt.Errorf("zeroing a new arena: %w", err), m.Free())
		}
		return m, nil
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

func (b *cudaBackend) keepsArenas(device string) bool { return b.isGPU(device) }

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
	mem, err := b.alloc(device, size)
	if err != nil {
		if errors.Is(err, cudaipc.ErrOutOfMemory) {
			return nil, fmt.Errorf("%w: %s: allocating a %d-byte arena: %v", ErrStoreFull, device, size, err)
		}
		return nil, fmt.Errorf("arena %d on %s: %w", id, device, err)
	}
	a, err := exportArena(mem, size)
	if err != nil {
		return nil, errors.Join(fmt.Errorf("arena %d on %s: exporting: %w", id, device, err), mem.Free())
	}
	return a, nil
}

// exportArena exports a new GPU arena once: its region, and for a vmm-fd
// region the descriptor that travels beside it.
func exportArena(mem gpuMemory, size int64) (*gpuArena, error) {
	r, err := mem.Export(0, size)
	if err != nil {
		return nil, err
	}
	a := &gpuArena{mem: mem, region: r}
	if a.blob, err = r.MarshalBinary(); err != nil {
		return nil, err
	}
	switch r.Kind {
	case cudaipc.KindCUDAIPC:
		a.kind = storev1.Placement_CUDA_IPC
	case cudaipc.KindVMMFD:
		a.kind = storev1.Placement_VMM_FD
		fe, ok := mem.(fdExporter)
		if !ok {
			return nil, fmt.Errorf("a %s region without a descriptor to send beside it", r.Kind)
		}
		if a.file, err = fe.ExportFD(); err != nil {
			return nil, err
		}
	default:
		return nil, fmt.Errorf("a region of kind %s", r.Kind)
	}
	return a, nil
}

// gpuArena is one device allocation, exported once: its region in every
// placement, and for a vmm-fd region a duplicate of its descriptor too.
type gpuArena struct {
	mem    gpuMemory
	kind   storev1.Placement_Kind // CUDA_IPC or VMM_FD
	region cudaipc.Region         // of the whole allocation
	blob   []byte                 // region's binary encoding
	file   *os.File               // VMM_FD: the allocation's descriptor
}

func (a *gpuArena) placementKind() storev1.Placement_Kind { return a.kind }

// share returns the whole arena's region and, for VMM_FD, a duplicate of
// its descriptor, for readers and writers alike: CUDA maps device memory
// read-write only, by legacy IPC or by descriptor, so readers are trusted
// not to write (arenas per owner and sharing keep other users' objects out
// of their reach).
func (a *gpuArena) share(bool) (arenaShare, error) {
	sh := arenaShare{region: a.blob}
	if a.file != nil {
		fd, err := unix.FcntlInt(a.file.Fd(), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return arenaShare{}, fmt.Errorf("dup arena fd: %w", err)
		}
		sh.file = os.NewFile(uintptr(fd), a.file.Name())
	}
	return sh, nil
}

func (a *gpuArena) objectRegion(off, n int64) []byte {
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
func (*gpuArena) discard(_, _ int64) {}

// sealWrites is false: CUDA maps device memory read-write only.
func (*gpuArena) sealWrites() bool { return false }

// descriptors: a vmm-fd arena keeps its allocation's descriptor.
func (a *gpuArena) descriptors() int {
	if a.file != nil {
		return 1
	}
	return 0
}

// close drops the daemon's references. For VMM memory, clients' mappings
// and descriptors in flight keep it until they go.
func (a *gpuArena) close() error {
	var err error
	if a.file != nil {
		err = a.file.Close()
	}
	return errors.Join(err, a.mem.Free())
}
