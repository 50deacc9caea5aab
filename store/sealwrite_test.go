package store

import (
	"bytes"
	"errors"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// A sealed shared host object is sealed against writes (F_SEAL_WRITE) as
// soon as its creator holds no writable mapping: before that the
// creator's mapping still writes, stat says so (creator_can_write), and
// no new writable mapping or write(2) is allowed; after, stat says the
// bytes are immutable and the creator's descriptor cannot write them.
func TestSealedSharedHostObjectWriteSeal(t *testing.T) {
	_, path, _ := serve(t, Config{})
	w := dialRaw(t, path)
	resp, files := w.do(req(&storev1.CreateRequest{Name: "pub", Size: 8192, Shared: true}))
	wantCode(t, resp, storev1.Error_OK)
	p := resp.GetCreate().GetPlacement()
	if len(files) != 1 {
		t.Fatalf("%d files with the create", len(files))
	}
	rw := files[0]
	defer rw.Close()
	m, err := unix.Mmap(int(rw.Fd()), 0, int(p.GetArenaSize()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	data := randomBytes(8192)
	copy(m[p.GetOffset():], data)
	resp, _ = w.do(req(&storev1.SealRequest{Name: "pub"}))
	wantCode(t, resp, storev1.Error_OK)

	in, _ := w.stat("pub")
	if !in.GetCreatorCanWrite() {
		t.Fatal("stat says immutable while the creator still maps the object writable")
	}
	// What stat says is true: the old mapping writes...
	m[p.GetOffset()] ^= 0xff
	// ...but nothing new may.
	if _, err := unix.Mmap(int(rw.Fd()), 0, int(p.GetArenaSize()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); !errors.Is(err, unix.EPERM) {
		t.Errorf("a new writable mapping after the seal: %v, want EPERM", err)
	}
	if _, err := rw.WriteAt([]byte{1}, int64(p.GetOffset())); !errors.Is(err, unix.EPERM) {
		t.Errorf("a write(2) after the seal: %v, want EPERM", err)
	}
	m[p.GetOffset()] ^= 0xff
	if err := unix.Munmap(m); err != nil {
		t.Fatal(err)
	}
	in, _ = w.stat("pub")
	if in.GetCreatorCanWrite() {
		t.Fatal("stat says the creator can write after it unmapped")
	}
	if _, err := unix.Mmap(int(rw.Fd()), 0, int(p.GetArenaSize()), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); !errors.Is(err, unix.EPERM) {
		t.Errorf("a writable mapping after the write seal: %v, want EPERM", err)
	}
	r := dialRaw(t, path)
	g, got := r.do(req(&storev1.GetRequest{Name: "pub"}))
	wantCode(t, g, storev1.Error_OK)
	if b := r.mapping(g.GetGet().GetPlacement(), got); !bytes.Equal(b, data) {
		t.Fatal("the reader's bytes differ")
	}
	if g.GetGet().GetInfo().GetCreatorCanWrite() {
		t.Error("the lease's info says the creator can write")
	}
}

// Private host objects share their owner's arena with its drafts: stat
// says the creator can write, always.
func TestSealedPrivateHostObjectCreatorCanWrite(t *testing.T) {
	_, path, _ := serve(t, Config{})
	w := dialRaw(t, path)
	w.put("priv", 4096, false)
	if in, _ := w.stat("priv"); !in.GetCreatorCanWrite() {
		t.Fatal("a private object's stat says immutable")
	}
}

// A shared host version's arena is sealed against writes with it, so its
// memory is never kept for the next version (double buffering): every
// version's creator can map its draft writable.
func TestSharedVersionsWritableAfterWriteSeal(t *testing.T) {
	s := newTestStore(t, Config{})
	for i := range 3 {
		c := connect(t, s, 1000) // a new connection is sent the arena's descriptor
		p, n, err := c.ss.create(createReq{name: "w", size: 1 << 20, shared: true, versioned: true})
		if err != nil {
			t.Fatal(err)
		}
		if p.share == nil || p.share.file == nil {
			t.Fatalf("version %d: no descriptor with the placement", i+1)
		}
		m, err := unix.Mmap(int(p.share.file.Fd()), 0, int(p.arenaSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		p.closeShare()
		if err != nil {
			t.Fatalf("version %d: mapping its draft writable: %v", i+1, err)
		}
		copy(m[p.offset:], randomBytes(1<<20))
		unix.Munmap(m)
		if err := c.ss.seal(sealReq{name: "w", version: n}); err != nil {
			t.Fatal(err)
		}
	}
}
