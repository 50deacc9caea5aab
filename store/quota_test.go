package store

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// TestQuotaKeepsUsersApart: with two uids admitted each has half the
// capacity; one filling the store evicts only its own objects, never the
// other's, and once everything it has is leased its creates fail with
// ErrLimit (BYTES_PER_UID) naming its quota and the flag that sets it.
func TestQuotaKeepsUsersApart(t *testing.T) {
	const capacity = 16 << 20
	s := newTestStore(t, Config{Capacity: capacity, AllowUIDs: []uint32{65534}})
	if q := s.quota(); q != capacity/2 {
		t.Fatalf("fair share of two uids: %d, want %d", q, capacity/2)
	}
	root, other := connect(t, s, 0), connect(t, s, 65534)
	kept := map[string][]byte{}
	for _, name := range []string{"r0", "r1", "r2"} {
		kept[name] = root.put(name, 1<<20, false)
	}
	// uid 65534 writes far more than its quota, and more than the store.
	var names []string
	for i := range 40 {
		name := "o" + string(rune('A'+i))
		other.put(name, 1<<20, false)
		names = append(names, name)
	}
	if got := s.devices[hostDevice].alloc.Owned(65534); got > capacity/2 {
		t.Errorf("uid 65534's arenas take %d bytes, over its quota of %d", got, capacity/2)
	}
	for name, want := range kept {
		_, got := root.get(name)
		if !bytes.Equal(got, want) {
			t.Fatalf("root's %s changed", name)
		}
	}
	// Lease every object of 65534 still there: nothing left to evict.
	for _, name := range names {
		if _, err := other.ss.getName(context.Background(), name, false); err != nil && !errors.Is(err, ErrTimeout) {
			t.Fatal(err)
		}
	}
	_, err := other.ss.createObject("more", 1<<20, "", false)
	if !errors.Is(err, ErrLimit) || protocol.LimitOf(err) != storev1.Error_BYTES_PER_UID ||
		!strings.Contains(err.Error(), "uid 65534's quota") || !strings.Contains(err.Error(), "quota setting") ||
		strings.Contains(err.Error(), "--capacity") {
		t.Fatalf("create over a full quota: %v (limit %v)", err, protocol.LimitOf(err))
	}
	// Root, within its quota, still creates.
	root.put("r3", 1<<20, false)
}

// TestQuotaDefault: a daemon that admits no one else gives its uid the
// whole capacity; an explicit quota is used as is.
func TestQuotaDefault(t *testing.T) {
	if q := newTestStore(t, Config{}).quota(); q != 0 {
		t.Errorf("quota of a private daemon: %d, want 0 (the capacity)", q)
	}
	if q := newTestStore(t, Config{Capacity: 1 << 30, Quota: 100 << 20, AllowUIDs: []uint32{1, 2}}).quota(); q != 100<<20 {
		t.Errorf("explicit quota: %d", q)
	}
	if q := newTestStore(t, Config{Capacity: 1 << 30, AllowUIDs: []uint32{1, 2}, AllowGIDs: []uint32{5}}).quota(); q != (1<<30)/4 {
		t.Errorf("fair share of 3 uids and a group: %d", q)
	}
}

// TestSharedDraftsUnreachable: another uid's reader maps the whole arena of
// a shared object it gets (a placement lets it). It must find the object
// and zeros: no draft of the owner (written, never sealed), no aborted
// draft, no private object.
func TestSharedDraftsUnreachable(t *testing.T) {
	s := newTestStore(t, Config{})
	owner, reader := connect(t, s, 1000), connect(t, s, 65534)
	var secrets [][]byte
	draft := func(name string, size int64) {
		p, err := owner.ss.createObject(name, size, "", true)
		if err != nil {
			t.Fatal(err)
		}
		data := randomBytes(size)
		copy(owner.mapping(p), data)
		secrets = append(secrets, data[:64])
	}
	draft("draft", 100_000)
	draft("aborted", 50_000)
	if err := owner.ss.abortName("aborted"); err != nil {
		t.Fatal(err)
	}
	secrets = append(secrets, owner.put("private", 30_000, false)[:64])
	pub := owner.put("pub", 70_000, true)
	draft("later", 20_000) // after the reader's get below, too
	p, got := reader.get("pub")
	if !bytes.Equal(got, pub) {
		t.Fatal("the shared object's bytes differ")
	}
	whole := reader.maps[sentKey{p.arenaID, false}]
	for i, sec := range secrets {
		if bytes.Contains(whole, sec) {
			t.Errorf("secret %d of uid 1000 is readable in the arena uid 65534 mapped", i)
		}
	}
	rest := append(bytes.Clone(whole[:p.offset]), whole[p.offset+p.size:]...)
	if bytes.ContainsFunc(rest, func(r rune) bool { return r != 0 }) {
		t.Error("the arena beyond the shared object is not zero")
	}
	if int64(len(whole)) >= 2*p.size+4096 {
		t.Errorf("a %d-byte shared object's arena is %d bytes: not its own", p.size, len(whole))
	}
}
