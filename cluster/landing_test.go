package cluster_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/internal/memtransport"
)

// landingSink makes replicas whose checked chunks are handed on (as a GPU
// replica copies them host→device): the bytes landed go to out.
type landingSink struct {
	cluster.Sink
	mu     sync.Mutex
	out    []byte
	landed map[int64]int
	fail   int64 // Landed of the chunk at this offset fails; -1: none
}

type landingReplica struct {
	cluster.Replica
	s *landingSink
}

func (s *landingSink) Create(ctx context.Context, o cluster.Object) (cluster.Replica, error) {
	r, err := s.Sink.Create(ctx, o)
	if err != nil {
		return nil, err
	}
	s.out, s.landed = make([]byte, o.Size), map[int64]int{}
	return landingReplica{r, s}, nil
}

func (r landingReplica) Traits() cluster.ReplicaTraits {
	t := r.Replica.Traits()
	t.Land = r.Landed
	return t
}

func (r landingReplica) Landed(off int64, b []byte) error {
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	if off == r.s.fail {
		return errors.New("the device copy failed")
	}
	copy(r.s.out[off:], b)
	r.s.landed[off]++
	return nil
}

// A replica with ReplicaTraits.Land gets every chunk once, checked, at its offset; a chunk
// that cannot be landed fails the pull and leaves no replica.
func TestLandingReplica(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret)
	ctx := bounded(t, 30*time.Second)
	o, want := a.Put(t, "ns/gpu-like", 5<<20+777, 1<<20)
	ls := &landingSink{Sink: b.P.Sink, fail: -1}
	b.P.Sink = ls
	if _, err := b.P.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ls.out, want) {
		t.Fatal("the landed bytes differ from A's object")
	}
	if len(ls.landed) != 6 {
		t.Fatalf("%d chunks landed, want 6", len(ls.landed))
	}
	for off, n := range ls.landed {
		if n != 1 {
			t.Fatalf("chunk at %d landed %d times", off, n)
		}
	}
	o2, _ := a.Put(t, "ns/gpu-like-2", 3<<20, 1<<20)
	ls.fail = 2 << 20
	_, err := b.P.Pull(ctx, o2.Ref())
	if err == nil || !bytes.Contains([]byte(err.Error()), []byte("the device copy failed")) {
		t.Fatalf("a chunk that could not land: %v", err)
	}
	if b.Store.Get(o2.Ref()) != nil {
		t.Fatal("a failed pull left a replica")
	}
}

// summingSink makes replicas with ReplicaTraits.LandSum, as a GPU replica whose device
// checksums each chunk where it lands: flips corrupts the landing of the
// chunk at that offset, its first flips times, as a faulty host→device
// copy would (the host bytes stay right).
type summingSink struct {
	landingSink
	flip  int64
	flips int
	sumOK bool
}

type summingReplica struct {
	landingReplica
	s *summingSink
}

func (s *summingSink) Create(ctx context.Context, o cluster.Object) (cluster.Replica, error) {
	r, err := s.landingSink.Create(ctx, o)
	if err != nil {
		return nil, err
	}
	return summingReplica{r.(landingReplica), s}, nil
}

func (r summingReplica) Traits() cluster.ReplicaTraits {
	t := r.landingReplica.Traits()
	if r.s.sumOK {
		t.LandSum = r.LandedSum
	}
	return t
}

func (r summingReplica) LandedSum(off int64, b []byte) (uint32, error) {
	landed := bytes.Clone(b)
	r.s.mu.Lock()
	defer r.s.mu.Unlock()
	if off == r.s.flip && r.s.flips > 0 {
		r.s.flips--
		landed[len(landed)/2] ^= 0x10
	}
	copy(r.s.out[off:], landed)
	r.s.landed[off]++
	return cluster.Checksum(landed), nil
}

// A replica's chunks are checked as they landed (ReplicaTraits.LandSum): a landing that
// corrupts a chunk (which a check of the host bytes would pass) is caught
// and the chunk read again; one that keeps corrupting it fails the pull,
// naming the chunk, and leaves no replica. A replica that cannot sum is
// checked on the host and landed with Landed.
func TestSummingReplica(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret)
	ctx := bounded(t, 30*time.Second)

	o, want := a.Put(t, "ns/summed", 5<<20+777, 1<<20)
	ss := &summingSink{landingSink: landingSink{Sink: b.P.Sink, fail: -1}, flip: 2 << 20, flips: 1, sumOK: true}
	b.P.Sink = ss
	if _, err := b.P.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ss.out, want) {
		t.Fatal("the landed bytes differ from A's object")
	}
	for off := int64(0); off < o.Size; off += 1 << 20 {
		if want := 1 + b2i(off == 2<<20); ss.landed[off] != want {
			t.Fatalf("chunk at %d landed %d times, want %d", off, ss.landed[off], want)
		}
	}

	o2, _ := a.Put(t, "ns/summed-bad", 3<<20+5, 1<<20)
	ss.flip, ss.flips = 1<<20, 100
	_, err := b.P.Pull(ctx, o2.Ref())
	if !errors.Is(err, cluster.ErrChecksum) || !strings.Contains(err.Error(), "chunk 1 ") {
		t.Fatalf("a chunk that always lands corrupt: %v", err)
	}
	if b.Store.Get(o2.Ref()) != nil {
		t.Fatal("a failed pull left a replica")
	}

	// No LandSum: the host checks, Land lands (landingSink counts
	// those; LandedSum is never called, as the flip would show).
	o3, want3 := a.Put(t, "ns/host-summed", 2<<20+9, 1<<20)
	ss.sumOK, ss.flip, ss.flips = false, 0, 100
	if _, err := b.P.Pull(ctx, o3.Ref()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(ss.out, want3) {
		t.Fatal("the bytes landed with Landed differ from A's object")
	}
	if ss.flips != 100 {
		t.Fatal("LandedSum was called for a replica that does not sum")
	}
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
