package cluster_test

import (
	"bytes"
	"context"
	"errors"
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

// A LandingReplica gets every chunk once, checked, at its offset; a chunk
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
