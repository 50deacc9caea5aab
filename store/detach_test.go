package store

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"testing"

	"golang.org/x/sys/unix"
)

// usedBytes is how many bytes the store's objects hold, drafts included.
func usedBytes(s *Store) int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var n int64
	for _, d := range s.devices {
		n += d.alloc.Stats().Used
	}
	return n
}

// A replica detached from its name keeps its bytes and memory until
// released, while a new replica of the name is made, sealed and read; a
// versioned shard's replica does not detach.
func TestClusterReplicaDetach(t *testing.T) {
	s := newTestStore(t, Config{Capacity: 64 << 20, Cluster: nopCluster{}})
	const size = 1 << 20
	old := make([]byte, size)
	rand.NewChaCha8([32]byte{1}).Read(old)
	f, err := s.Replicas().Create(ClusterObject{Owner: 1000, Name: "w", Size: size, ID: "id-old"})
	if err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(int(f.File.Fd()), 0, int(f.ArenaSize), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	copy(mem[f.Offset:], old)
	before := usedBytes(s)
	if !f.Detach() {
		t.Fatal("a plain replica did not detach")
	}
	if err := f.Seal(); err == nil {
		t.Fatal("a detached replica sealed")
	}
	// The name is free: a new replica takes it, seals, and is what a
	// cluster read finds.
	g, err := s.Replicas().Create(ClusterObject{Owner: 1000, Name: "w", Size: size, ID: "id-new"})
	if err != nil {
		t.Fatalf("a replica beside a detached one: %v", err)
	}
	fresh := make([]byte, size)
	rand.NewChaCha8([32]byte{2}).Read(fresh)
	if _, err := g.File.WriteAt(fresh, g.Offset); err != nil {
		t.Fatal(err)
	}
	g.File.Close()
	if err := g.Seal(); err != nil {
		t.Fatal(err)
	}
	g.Release()
	r, err := s.Replicas().Lease(1000, "w", 0, 0, "id-new")
	if err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if _, err := r.File.ReadAt(got, r.Offset); err != nil || !bytes.Equal(got, fresh) {
		t.Fatalf("the new replica's bytes: %v, equal %v", err, bytes.Equal(got, fresh))
	}
	r.File.Close()
	r.Release()
	if _, err := s.Replicas().Lease(1000, "w", 0, 0, "id-old"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("lease of the detached incarnation: %v, want not found", err)
	}
	// The detached one's bytes and memory are still its own.
	if !bytes.Equal(mem[f.Offset:f.Offset+size], old) {
		t.Fatal("the detached replica's bytes changed before its release")
	}
	if used := usedBytes(s); used < before+size {
		t.Fatalf("used %d bytes with both replicas, want at least %d", used, before+size)
	}
	f.File.Close()
	f.Release()
	if used := usedBytes(s); used != before {
		t.Fatalf("used %d bytes after the detached replica's release, want %d", used, before)
	}
	// Nothing to detach: a released replica, a cluster read.
	if f.Detach() {
		t.Fatal("a released replica detached")
	}
	r, err = s.Replicas().Lease(1000, "w", 0, 0, "id-new")
	if err != nil {
		t.Fatal(err)
	}
	r.File.Close()
	if r.Detach() {
		t.Fatal("a cluster read detached")
	}
	r.Release()
	if !s.Replicas().Has(1000, "w", 0, 0) {
		t.Fatal("the sealed replica went with a refused detach")
	}

	// A version's only shard detaches with its version: the retry makes
	// the version again, seals and publishes it.
	v, err := s.Replicas().Create(ClusterObject{Owner: 1000, Name: "series", Size: 4096, ID: "id-v", Version: 3, Shards: 1})
	if err != nil {
		t.Fatal(err)
	}
	v.File.Close()
	if !v.Detach() {
		t.Fatal("a version's only shard did not detach")
	}
	w, err := s.Replicas().Create(ClusterObject{Owner: 1000, Name: "series", Size: 4096, ID: "id-v2", Version: 3, Shards: 1})
	if err != nil {
		t.Fatalf("the version again beside its detached shard: %v", err)
	}
	w.File.Close()
	if err := w.Seal(); err != nil {
		t.Fatal(err)
	}
	w.Release()
	if !s.Replicas().Has(1000, "series", 3, 0) {
		t.Fatal("the version made again is not there")
	}
	both := usedBytes(s)
	v.Release()
	if used := usedBytes(s); used >= both {
		t.Fatalf("used %d bytes after the detached shard's release, %d before", used, both)
	}
	if !s.Replicas().Has(1000, "series", 3, 0) {
		t.Fatal("the detached shard's release took the version made again")
	}

	// Beside another shard of its version, a shard does not detach: its
	// abort must free the version.
	a, err := s.Replicas().Create(ClusterObject{Owner: 1000, Name: "sharded", Size: 4096, ID: "id-a", Version: 1, Shard: 0, Shards: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Release()
	a.File.Close()
	b, err := s.Replicas().Create(ClusterObject{Owner: 1000, Name: "sharded", Size: 4096, ID: "id-a", Version: 1, Shard: 1, Shards: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Release()
	b.File.Close()
	if a.Detach() {
		t.Fatal("a shard beside another of its version detached")
	}
}
