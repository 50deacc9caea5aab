package store

import (
	"errors"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/bundle"
)

// A superseded version's memory is reused by the next version of the same
// size (double buffering): the placement repeats, and readers map nothing
// new. Spare memory gives way when a create needs room.
func TestVersionMemoryReused(t *testing.T) {
	s := newTestStore(t, Config{Capacity: 8 << 20, NoEvict: true})
	c := connect(t, s, 1000)
	publish := func() placement {
		t.Helper()
		p, n, err := c.ss.create(createReq{name: "w", size: 3 << 20, versioned: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.ss.seal(sealReq{name: "w", version: n}); err != nil {
			t.Fatal(err)
		}
		p.closeShare()
		return p
	}
	p1 := publish()
	p2 := publish() // v1 superseded: its memory becomes the spare
	p3 := publish() // takes v1's memory
	if p3.arenaID != p1.arenaID || p3.offset != p1.offset {
		t.Fatalf("v3 at arena %d offset %d, want v1's arena %d offset %d", p3.arenaID, p3.offset, p1.arenaID, p1.offset)
	}
	if p2.arenaID == p1.arenaID && p2.offset == p1.offset {
		t.Fatal("v2 shares v1's memory while v1 was visible")
	}
	// 8 MiB: v3 and the spare (v2's) take 6; a plain 4 MiB object needs
	// the spare's room.
	p, err := c.ss.createObject("plain", 4<<20, "", false)
	if err != nil {
		t.Fatalf("create with spare memory to give back: %v", err)
	}
	p.closeShare()
}

// The versions of one model carry the same manifest: the daemon parses it
// once, and still checks every version (a cached verdict is for the same
// bytes and the same object size only).
func TestManifestCheckedOncePerLayout(t *testing.T) {
	s := newTestStore(t, Config{Capacity: 8 << 20, NoEvict: true})
	c := connect(t, s, 1000)
	specs := []bundle.Spec{{Name: "a", DType: "BF16", Shape: []int64{3, 5}}, {Name: "b", DType: "F32", Shape: []int64{7}}}
	man, size, err := bundle.Layout(specs, 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	good := man.Marshal()
	other, _, _ := bundle.Layout(specs[:1], 0, nil)
	publish := func(raw []byte, objSize int64) error {
		t.Helper()
		p, n, err := c.ss.create(createReq{name: "m", size: objSize, versioned: true, manifestSize: int64(len(raw))})
		if err != nil {
			t.Fatal(err)
		}
		defer p.closeShare()
		if _, err := p.manifest.WriteAt(raw, 0); err != nil {
			t.Fatal(err)
		}
		return c.ss.seal(sealReq{name: "m", version: n})
	}
	for v := 0; v < 3; v++ {
		if err := publish(good, size); err != nil {
			t.Fatalf("version %d: %v", v+1, err)
		}
	}
	if s.manifests.parsed != 1 || s.manifests.hits != 2 {
		t.Fatalf("3 versions of one layout: parsed %d, cache hits %d; want 1 and 2", s.manifests.parsed, s.manifests.hits)
	}
	if err := publish(other.Marshal(), size); err != nil {
		t.Fatal(err)
	}
	if s.manifests.parsed != 2 {
		t.Fatalf("a new layout: parsed %d times in all, want 2", s.manifests.parsed)
	}
	// The same bytes against an object too small for them: checked, refused.
	err = publish(good, size-1)
	if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "past the object's") {
		t.Fatalf("manifest past the object's end: %v, want ErrInvalid naming it", err)
	}
	bad := append([]byte(nil), good...)
	bad[len(bad)/2] = '!'
	for i := 0; i < 2; i++ {
		if err := publish(bad, size); !errors.Is(err, ErrInvalid) {
			t.Fatalf("corrupt manifest, try %d: %v, want ErrInvalid", i+1, err)
		}
	}
}
