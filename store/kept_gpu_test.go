package store

import (
	"bytes"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// TestGPUKeptArenaReuse: on the cuda backend, by legacy IPC and by
// descriptor, an emptied GPU arena is kept and its owner's next object of
// a fitting size lands in it (same arena, same region: clients hit their
// mapping); another uid never gets it, and once it is given back (under
// pressure, or explicitly) the memory another uid's new arena gets shows
// zeros, none of the owner's random bytes.
func TestGPUKeptArenaReuse(t *testing.T) {
	dev := testutil.RequireGPU(t)
	for _, share := range []string{GPUShareIPC, GPUShareFD} {
		t.Run(share, func(t *testing.T) {
			if share == GPUShareFD && !dev.VMMFDSupported() {
				t.Skip("the GPU cannot export memory as file descriptors")
			}
			keptArenaReuse(t, dev, share)
		})
	}
}

type gpuRW interface {
	ReadAt([]byte, int64) (int, error)
	WriteAt([]byte, int64) (int, error)
}

func keptArenaReuse(t *testing.T, dev *cudaipc.Device, share string) {
	const size = 96 << 20 // above a pool's first arena: an arena of its own size
	s := newTestStore(t, Config{Backend: "cuda", GPUShare: share, Capacity: 256 << 20})
	gpu := dev.UUID().String()
	owner, other := connect(t, s, 1000), connect(t, s, 65534)
	mem := func(id uint64) gpuRW {
		t.Helper()
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.devices[gpu].arenas[id].(*gpuArena).mem.(gpuRW)
	}
	var secrets []byte
	fill := func(p placement) {
		t.Helper()
		data := randomBytes(p.size)
		if _, err := mem(p.arenaID).WriteAt(data, p.offset); err != nil {
			t.Fatal(err)
		}
		for i := int64(0); i+64 <= p.size; i += p.size / 16 {
			secrets = append(secrets, data[i:i+64]...)
		}
	}
	// noSecrets reads a whole arena as its readers map it.
	noSecrets := func(what string, id uint64) {
		t.Helper()
		s.mu.Lock()
		n := s.devices[gpu].arenas[id].(*gpuArena).region.Size
		s.mu.Unlock()
		whole := make([]byte, n)
		if _, err := mem(id).ReadAt(whole, 0); err != nil {
			t.Fatal(err)
		}
		for i := 0; i+64 <= len(secrets); i += 64 {
			if bytes.Contains(whole, secrets[i:i+64]) {
				t.Fatalf("%s: the owner's bytes (secret %d) show in arena %d", what, i/64, id)
			}
		}
		if i := bytes.IndexFunc(whole, func(r rune) bool { return r != 0 }); i >= 0 {
			t.Fatalf("%s: arena %d is not zero at byte %d", what, id, i)
		}
	}
	p1, err := owner.ss.createObject("a", size, gpu, false)
	if err != nil {
		t.Fatal(err)
	}
	p1.closeShare()
	fill(p1)
	if err := owner.ss.sealName("a"); err != nil {
		t.Fatal(err)
	}
	if err := owner.ss.delete("a"); err != nil {
		t.Fatal(err)
	}
	p2, err := owner.ss.createObject("b", size, gpu, false)
	if err != nil {
		t.Fatal(err)
	}
	p2.closeShare()
	if p2.arenaID != p1.arenaID || !bytes.Equal(p2.region, p1.region) {
		t.Fatalf("the owner's next object is in arena %d, want the kept arena %d", p2.arenaID, p1.arenaID)
	}
	fill(p2)
	if err := owner.ss.abortName("b"); err != nil {
		t.Fatal(err)
	}
	// Another uid's object: an arena of its own, zeroed.
	po, err := other.ss.createObject("o", size, gpu, false)
	if err != nil {
		t.Fatal(err)
	}
	po.closeShare()
	if po.arenaID == p1.arenaID {
		t.Fatal("another uid's object landed in the owner's kept arena")
	}
	noSecrets("another uid's new arena beside the kept one", po.arenaID)
	// The capacity left (256 - 96 kept - 96) needs the kept arena's room;
	// the owner unmaps it (as its client does when told) so that its memory
	// goes back to the driver, which hands it out to the next allocation.
	if err := other.ss.abortName("o"); err != nil {
		t.Fatal(err)
	}
	pb, err := other.ss.createObject("big", 160<<20, gpu, false)
	if err != nil {
		t.Fatalf("a create needing the kept arenas' room: %v", err)
	}
	pb.closeShare()
	s.mu.Lock()
	freed := owner.ss.takeFreedLocked()
	s.mu.Unlock()
	if len(freed) != 1 || freed[0] != p1.arenaID {
		t.Fatalf("the owner was told of freed arenas %v, want [%d]", freed, p1.arenaID)
	}
	noSecrets("another uid's arena made under pressure", pb.arenaID)
	if err := owner.ss.forget(freed); err != nil {
		t.Fatal(err)
	}
	if err := other.ss.abortName("big"); err != nil {
		t.Fatal(err)
	}
	s.mu.Lock()
	s.devices[gpu].alloc.ReleaseKept()
	for _, id := range other.ss.takeFreedLocked() {
		other.ss.forgetLocked(id)
	}
	s.mu.Unlock()
	pn, err := other.ss.createObject("after", size, gpu, false)
	if err != nil {
		t.Fatal(err)
	}
	pn.closeShare()
	noSecrets("another uid's arena after the owner's went back to the driver", pn.arenaID)
}
