package store

import (
	"testing"
)

// A superseded version's memory is reused by the next version of the same
// size (double buffering): the placement repeats, and readers map nothing
// new. Spare memory gives way when a create needs room.
func TestVersionMemoryReused(t *testing.T) {
	s := newTestStore(t, Config{Capacity: 8 << 20, NoEvict: true})
	c := connect(t, s, 1000)
	publish := func() placement {
		t.Helper()
		p, n, err := c.ss.createExt("w", 3<<20, "", false, createOptions{versioned: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := c.ss.sealExt("w", n, 0); err != nil {
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
	p, err := c.ss.create("plain", 4<<20, "", false)
	if err != nil {
		t.Fatalf("create with spare memory to give back: %v", err)
	}
	p.closeShare()
}
