package store

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol/storev1"
	"golang.org/x/sys/unix"
)

// fakeFDGPUs stands in for the driver behind the cuda backend with
// GPUShareFD: an allocation is a memfd, exported as duplicates of it.
type fakeFDGPUs struct {
	mu     sync.Mutex
	live   int
	allocs []int64
}

type fakeFDMem struct {
	g     *fakeFDGPUs
	f     *os.File
	id    cudaipc.AllocationID
	size  int64
	freed bool
}

func (m *fakeFDMem) Export(off, size int64) (cudaipc.Region, error) {
	u, err := cudaipc.ParseUUID(fakeGPU)
	if err != nil {
		return cudaipc.Region{}, err
	}
	r := cudaipc.Region{
		Version: cudaipc.RegionVersion, Kind: cudaipc.KindVMMFD, AllocationID: m.id,
		Offset: off, Size: size, AllocSize: m.size, Device: u,
		ExporterPID: 4242, PIDNamespace: 4026531836, BootID: cudaipc.BootID{1},
		ExporterBase: 1 << 40,
	}
	return r, r.Validate()
}

func (m *fakeFDMem) ExportFD() (*os.File, error) {
	fd, err := unix.FcntlInt(m.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "fake-vmm"), nil
}

func (m *fakeFDMem) Free() error {
	m.g.mu.Lock()
	defer m.g.mu.Unlock()
	if m.freed {
		return errors.New("double free")
	}
	m.freed = true
	m.g.live--
	return m.f.Close()
}

func (g *fakeFDGPUs) liveCount() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.live
}

// newFakeFDStore returns a store whose backend is the cuda backend, sharing
// by descriptor, over one fake GPU.
func newFakeFDStore(t *testing.T) (*Store, *fakeFDGPUs) {
	t.Helper()
	s := newTestStore(t, Config{Capacity: 4 << 30, GPUShare: GPUShareFD})
	g := &fakeFDGPUs{}
	s.backend = &cudaBackend{uuids: []string{fakeGPU}, alloc: func(uuid string, size int64) (gpuMemory, error) {
		if uuid != fakeGPU {
			t.Errorf("alloc on %q", uuid)
		}
		fd, err := unix.MemfdCreate("fake-vmm", unix.MFD_CLOEXEC)
		if err != nil {
			return nil, err
		}
		g.mu.Lock()
		defer g.mu.Unlock()
		g.live++
		g.allocs = append(g.allocs, size)
		return &fakeFDMem{g: g, f: os.NewFile(uintptr(fd), "fake-vmm"), id: cudaipc.NewAllocationID(), size: size}, nil
	}}
	return s, g
}

// inode identifies the open file behind a descriptor.
func inode(t *testing.T, f *os.File) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// Every placement of a descriptor-shared GPU arena, writable or not,
// carries the same arena's descriptor and its vmm-fd region; ObjectInfo has
// the object's region.
func TestCUDAFDPlacements(t *testing.T) {
	s, g := newFakeFDStore(t)
	c := connect(t, s, 1000)
	var arenaIno uint64
	for i, size := range []int64{1, 4096, 3<<20 + 5} {
		name := fmt.Sprintf("fd-%d", i)
		p, err := c.ss.createObject(name, size, fakeGPU, false)
		if err != nil {
			t.Fatal(err)
		}
		if p.share == nil || p.share.file == nil || p.device != fakeGPU || !p.proto().GetFdAttached() || p.proto().GetKind() != storev1.Placement_VMM_FD {
			t.Fatalf("create placement %+v: want a descriptor and kind VMM_FD", p)
		}
		if r := decodeRegion(t, p.region); r.Kind != cudaipc.KindVMMFD || r.Offset != 0 || r.Size != gpuFirstArena || r.AllocSize != gpuFirstArena {
			t.Fatalf("create placement's region %+v: want the whole arena's, of kind vmm-fd", r)
		}
		ino := inode(t, p.share.file)
		if i == 0 {
			arenaIno = ino
		}
		if ino != arenaIno || p.arenaSize != gpuFirstArena {
			t.Fatalf("object %d: arena inode %d (want %d), arena size %d", i, ino, arenaIno, p.arenaSize)
		}
		p.closeShare()
		if err := c.ss.sealName(name); err != nil {
			t.Fatal(err)
		}
		in, err := c.ss.stat(name)
		if err != nil || in.Device != fakeGPU {
			t.Fatalf("stat %+v, %v", in, err)
		}
		if r := decodeRegion(t, in.Region); r.Kind != cudaipc.KindVMMFD || r.Offset != int64(p.offset) || r.Size != size {
			t.Fatalf("stat's region %+v: want exactly the object's", r)
		}
		// A read-only lease on the same connection: the same descriptor
		// again, read-only being advisory for GPU memory.
		lp, err := c.ss.getName(t.Context(), name, false)
		if err != nil {
			t.Fatal(err)
		}
		if lp.share == nil || lp.share.file == nil || inode(t, lp.share.file) != arenaIno || !bytes.Equal(lp.region, p.region) || lp.writable || len(lp.info.Region) == 0 {
			t.Fatalf("get placement %+v", lp)
		}
		lp.closeShare()
		if err := c.ss.release(lp.leaseID); err != nil {
			t.Fatal(err)
		}
	}
	if len(g.allocs) != 1 {
		t.Fatalf("arenas allocated: %v, want one", g.allocs)
	}
	// Its last object gone, the arena is kept (Config.KeepArenas); given
	// back, it goes, descriptor and allocation, once the client forgets it.
	for i := range 3 {
		if err := c.ss.delete(fmt.Sprintf("fd-%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	s.mu.Lock()
	if kept := c.ss.takeFreedLocked(); len(kept) != 0 {
		t.Errorf("told of freed arenas %v while the arena is kept", kept)
	}
	s.devices[fakeGPU].alloc.ReleaseKept()
	s.mu.Unlock()
	if g.liveCount() != 1 {
		t.Fatal("arena freed while the client may still map it")
	}
	s.mu.Lock()
	freed := c.ss.takeFreedLocked()
	s.mu.Unlock()
	if err := c.ss.forget(freed); err != nil {
		t.Fatal(err)
	}
	if g.liveCount() != 0 {
		t.Fatal("arena kept after its last object went and the client forgot it")
	}
	// Host objects still live in memfds sent once per connection.
	if hp := c.put("host-obj", 100, false); len(hp) != 100 {
		t.Fatal("host object")
	}
}

func TestGPUShareConfig(t *testing.T) {
	_, err := New(Config{Backend: "host", GPUShare: "bogus"})
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), `"bogus"`) || !strings.Contains(err.Error(), "want ipc or fd") {
		t.Fatalf("GPUShare bogus: %v", err)
	}
	for _, share := range []string{"", GPUShareIPC, GPUShareFD} {
		s, err := New(Config{Backend: "host", GPUShare: share})
		if err != nil {
			t.Fatalf("GPUShare %q: %v", share, err)
		}
		s.Close()
	}
}
