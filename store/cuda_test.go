package store

import (
	"bytes"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

const fakeGPU = "GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8"

// fakeGPUs stands in for the driver behind the cuda backend: allocations
// are bookkeeping, regions are well-formed but map nothing.
type fakeGPUs struct {
	mu     sync.Mutex
	next   uint64
	live   map[uint64]int64 // buffer id -> size
	allocs []int64
}

type fakeMem struct {
	g    *fakeGPUs
	id   uint64
	size int64
	dev  cudaipc.UUID
}

func (m *fakeMem) Export(off, size int64) (cudaipc.Region, error) {
	var h cudaipc.MemHandle
	h[0], h[8] = byte(m.id), 1
	r := cudaipc.Region{
		Version: cudaipc.RegionVersion, Kind: cudaipc.KindCUDAIPC, Handle: h,
		Offset: off, Size: size, AllocSize: m.size, Device: m.dev,
		ExporterPID: 4242, PIDNamespace: 4026531836, BootID: cudaipc.BootID{1},
		BufferID: m.id, ExporterBase: cudaipc.DevicePtr(m.id << 32),
	}
	return r, r.Validate()
}

// Device and Ptr are what the cluster side copies with: no device, an
// address in a range of the buffer's own.
func (m *fakeMem) Device() *cudaipc.Device { return nil }
func (m *fakeMem) Ptr() cudaipc.DevicePtr  { return cudaipc.DevicePtr(m.id << 32) }

func (m *fakeMem) Free() error {
	m.g.mu.Lock()
	defer m.g.mu.Unlock()
	if _, ok := m.g.live[m.id]; !ok {
		return errors.New("double free")
	}
	delete(m.g.live, m.id)
	return nil
}

func (g *fakeGPUs) liveCount() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.live)
}

// newFakeCUDAStore returns a store whose backend is the cuda backend over
// one fake GPU.
func newFakeCUDAStore(t *testing.T, cfg Config) (*Store, *fakeGPUs) {
	t.Helper()
	s := newTestStore(t, cfg)
	var g *fakeGPUs
	s.backend, g = fakeCUDABackend(t)
	return s, g
}

// fakeCUDABackend is the cuda backend over one fake GPU, fakeGPU.
func fakeCUDABackend(t testing.TB) (*cudaBackend, *fakeGPUs) {
	g := &fakeGPUs{live: map[uint64]int64{}}
	u, err := cudaipc.ParseUUID(fakeGPU)
	if err != nil {
		t.Fatal(err)
	}
	return &cudaBackend{uuids: []string{fakeGPU}, alloc: func(uuid string, size int64) (gpuMemory, error) {
		if uuid != fakeGPU {
			t.Errorf("alloc on %q", uuid)
		}
		g.mu.Lock()
		defer g.mu.Unlock()
		g.next++
		g.live[g.next] = size
		g.allocs = append(g.allocs, size)
		return &fakeMem{g: g, id: g.next, size: size, dev: u}, nil
	}}, g
}

func decodeRegion(t *testing.T, b []byte) cudaipc.Region {
	t.Helper()
	r, err := cudaipc.DecodeRegion(b)
	if err != nil {
		t.Fatalf("region %x: %v", b, err)
	}
	return r
}

func TestCUDABackendPlacements(t *testing.T) {
	s, g := newFakeCUDAStore(t, Config{Capacity: 4 << 30})
	c := connect(t, s, 1000)
	var arena cudaipc.Region
	for i, size := range []int64{1, 4096, 1 << 20, 3<<20 + 5} {
		name := "gpu-" + strings.Repeat("x", i+1)
		p, err := c.ss.createObject(name, size, strings.ToLower(strings.TrimPrefix(fakeGPU, "GPU-")), false)
		if err != nil {
			t.Fatal(err)
		}
		if p.share != nil || p.device != fakeGPU || p.proto().GetKind() != storev1.Placement_CUDA_IPC {
			t.Fatalf("placement %+v: want no fd, device %s and kind CUDA_IPC", p, fakeGPU)
		}
		r := decodeRegion(t, p.region)
		if i == 0 {
			arena = r
		}
		// The whole arena, in every placement; all in the first arena.
		if !r.Equal(arena) || r.Offset != 0 || r.Size != p.arenaSize || r.AllocSize != p.arenaSize || p.offset+p.size > r.Size {
			t.Fatalf("object %d: region %v for placement [%d,+%d) of a %d-byte arena", i, r, p.offset, p.size, p.arenaSize)
		}
		if err := c.ss.sealName(name); err != nil {
			t.Fatal(err)
		}
		in, err := c.ss.stat(name)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := arena.Sub(p.offset, size)
		if got := decodeRegion(t, in.Region); !got.Equal(want) || in.Device != fakeGPU {
			t.Fatalf("stat region %v, want %v (device %q)", got, want, in.Device)
		}
		lp, err := c.ss.getName(t.Context(), name, false)
		if err != nil {
			t.Fatal(err)
		}
		if !decodeRegion(t, lp.region).Equal(arena) || !decodeRegion(t, lp.info.Region).Equal(want) || lp.writable {
			t.Fatalf("get placement %+v", lp)
		}
		if err := c.ss.release(lp.leaseID); err != nil {
			t.Fatal(err)
		}
	}
	if len(g.allocs) != 1 || g.allocs[0] != gpuFirstArena {
		t.Fatalf("arenas allocated: %v, want one of %d bytes", g.allocs, gpuFirstArena)
	}
	// Host objects still live in memfds, without a region.
	hp := c.put("host-obj", 100, false)
	if in, _ := c.ss.stat("host-obj"); in.Device != "host" || in.Region != nil || len(hp) != 100 {
		t.Fatalf("host object: %+v", in)
	}
	// An object larger than the largest arena gets its own.
	if _, err := c.ss.createObject("big", gpuMostArena+1, fakeGPU, false); err != nil {
		t.Fatal(err)
	}
	if n := len(g.allocs); n != 2 || g.allocs[1] != gpuMostArena+gpuGranularity {
		t.Fatalf("arenas allocated: %v", g.allocs)
	}
}

func TestCUDABackendDevices(t *testing.T) {
	s, _ := newFakeCUDAStore(t, Config{})
	c := connect(t, s, 1000)
	for _, tc := range []struct{ dev, want string }{
		{"0", "by UUID, not ordinal"},
		{"GPU-00000000-0000-0000-0000-000000000001", "no such GPU"},
		{"tpu", "want \"host\" or a GPU UUID"},
	} {
		_, err := c.ss.createObject("x", 10, tc.dev, false)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), fakeGPU) {
			t.Errorf("device %q: %v, want INVALID saying %q and naming the GPUs", tc.dev, err, tc.want)
		}
	}
}

// With no arenas kept (KeepArenas < 0), an arena is given back only when
// no object, sealed, unsealed or deleted but leased, is left in it; its memory is freed once every connection it
// was sent has forgotten it (ForgetArenas) or closed, since clients keep
// idle arenas mapped.
func TestCUDAArenaFreedWhenEmpty(t *testing.T) {
	s, g := newFakeCUDAStore(t, Config{KeepArenas: -1})
	w := connect(t, s, 1000)
	r := connect(t, s, 1000)
	other := connect(t, s, 1000) // never sent the arena
	for _, name := range []string{"a", "b"} {
		if _, err := w.ss.createObject(name, 1<<20, fakeGPU, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.ss.sealName("a"); err != nil {
		t.Fatal(err)
	}
	lp, err := r.ss.getName(t.Context(), "a", false)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.ss.delete("a"); err != nil {
		t.Fatal(err)
	}
	if err := w.ss.abortName("b"); err != nil {
		t.Fatal(err)
	}
	if g.liveCount() != 1 {
		t.Fatal("arena freed while a deleted object is still leased")
	}
	if err := r.ss.release(lp.leaseID); err != nil {
		t.Fatal(err)
	}
	if g.liveCount() != 1 {
		t.Fatal("arena freed while clients may still map it")
	}
	s.mu.Lock()
	wf, rf, of := w.ss.takeFreedLocked(), r.ss.takeFreedLocked(), other.ss.takeFreedLocked()
	s.mu.Unlock()
	if len(wf) != 1 || wf[0] != lp.arenaID || len(rf) != 1 || rf[0] != lp.arenaID || len(of) != 0 {
		t.Fatalf("told of freed arenas: writer %v, reader %v, other %v; want [%d] [%d] []", wf, rf, of, lp.arenaID, lp.arenaID)
	}
	// The capacity is back at once: a new arena fits.
	if _, err := other.ss.createObject("c", 1<<20, fakeGPU, false); err != nil {
		t.Fatal(err)
	}
	if err := other.ss.forget([]uint64{lp.arenaID, 12345}); err != nil { // not held: ignored
		t.Fatal(err)
	}
	if err := w.ss.forget([]uint64{lp.arenaID}); err != nil {
		t.Fatal(err)
	}
	if g.liveCount() != 2 {
		t.Fatal("arena freed while a client still maps it")
	}
	r.ss.close(errSessionClosed) // closing forgets too
	if g.liveCount() != 1 {
		t.Fatal("arena kept after every client forgot it")
	}
}

func TestBackendCUDAWithoutGPU(t *testing.T) {
	if n, err := cudaipc.DeviceCount(); err == nil && n > 0 {
		t.Skip("this machine has a GPU")
	}
	_, err := New(Config{Backend: "cuda"})
	if err == nil || !strings.Contains(err.Error(), "backend cuda needs") || !strings.Contains(err.Error(), "--backend host") {
		t.Fatalf("cuda backend without a GPU: %v", err)
	}
	s, err := New(Config{Backend: "auto"})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if s.backend.name() != "host" {
		t.Fatalf("auto without a GPU picked %s", s.backend.name())
	}
}

// TestCUDAKeptArenas: an emptied GPU arena is kept (no ArenasFreed, memory
// still allocated) for its pool's next object of a fitting size, which
// lands in it without a new allocation; another uid's objects and shared
// objects never land in it; a create that needs its room gets it, and
// its holders are then told it was freed.
func TestCUDAKeptArenas(t *testing.T) {
	s, g := newFakeCUDAStore(t, Config{Capacity: 512 << 20})
	w, other := connect(t, s, 1000), connect(t, s, 2000)
	const size = 200 << 20 // larger than a pool's first arena: one of its own size
	p1, err := w.ss.createObject("w1", size, fakeGPU, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.ss.abortName("w1"); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	told := w.ss.takeFreedLocked()
	st := s.devices[fakeGPU].alloc.Stats()
	s.mu.Unlock()
	if len(told) != 0 || g.liveCount() != 1 || st.Kept != 1 || st.KeptBytes != size || st.Reserved != size {
		t.Fatalf("after the last object went: told %v, %d live allocations, stats %+v; want the arena kept", told, g.liveCount(), st)
	}
	p2, err := w.ss.createObject("w2", size-12345, fakeGPU, false)
	if err != nil {
		t.Fatal(err)
	}
	if p2.arenaID != p1.arenaID || p2.offset != 0 || len(g.allocs) != 1 || !bytes.Equal(p2.region, p1.region) {
		t.Fatalf("next object: arena %d at %d (want the kept %d at 0), %d allocations", p2.arenaID, p2.offset, p1.arenaID, len(g.allocs))
	}
	if err := w.ss.sealName("w2"); err != nil {
		t.Fatal(err)
	}
	if err := w.ss.delete("w2"); err != nil {
		t.Fatal(err)
	}
	// Another uid, and a shared object of the same uid: arenas of their own.
	po, err := other.ss.createObject("o", 100<<20, fakeGPU, false)
	if err != nil {
		t.Fatal(err)
	}
	ps, err := w.ss.createObject("s", 100<<20, fakeGPU, true)
	if err != nil {
		t.Fatal(err)
	}
	if po.arenaID == p1.arenaID || ps.arenaID == p1.arenaID {
		t.Fatalf("arenas %d (other uid) and %d (shared) for the kept arena %d", po.arenaID, ps.arenaID, p1.arenaID)
	}
	if err := w.ss.abortName("s"); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	told = w.ss.takeFreedLocked()
	s.mu.Unlock()
	if len(told) != 1 || told[0] != ps.arenaID {
		t.Fatalf("told of freed arenas %v, want the shared object's %d (never kept)", told, ps.arenaID)
	}
	if err := w.ss.forget(told); err != nil {
		t.Fatal(err)
	}
	// 100 MiB (other) + 200 MiB (kept) of 512: another 300 MiB needs the
	// kept arena's room.
	if _, err := other.ss.createObject("o2", 300<<20, fakeGPU, false); err != nil {
		t.Fatalf("create needing the kept arena's room: %v", err)
	}
	s.mu.Lock()
	told = w.ss.takeFreedLocked()
	st = s.devices[fakeGPU].alloc.Stats()
	s.mu.Unlock()
	if len(told) != 1 || told[0] != p1.arenaID || st.Kept != 0 {
		t.Fatalf("told of freed arenas %v, stats %+v: want the kept arena %d given back", told, st, p1.arenaID)
	}
}
