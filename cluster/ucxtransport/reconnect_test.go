package ucxtransport_test

import (
	"bytes"
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/clustertest"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// closeCounting is a node whose endpoints count their closes.
type closeCounting struct {
	node
	closed *atomic.Int64
}

func (n closeCounting) Connect(ctx context.Context, addr []byte) (cluster.Endpoint, error) {
	ep, err := n.node.Connect(ctx, addr)
	if err != nil {
		return nil, err
	}
	return countedEndpoint{ep, n.closed}, nil
}

type countedEndpoint struct {
	cluster.Endpoint
	closed *atomic.Int64
}

func (e countedEndpoint) Close() error {
	e.closed.Add(1)
	return e.Endpoint.Close()
}

// TestPullAfterPeerEvicted: B, keeping a connection to one holder at a
// time (MaxPeers 1), pulls a large object from A, then one from C, which
// evicts and closes its connection to A, then another large object from A
// again over a new connection from the same pulling workers: every
// replica is right (rendezvous-size fetch replies, two lanes).
func TestPullAfterPeerEvicted(t *testing.T) {
	requireUCX(t)
	srv := etcdtest.Start(t)
	two := ucxtransport.Options{Lanes: 2}
	var closed atomic.Int64
	bt := closeCounting{newNodeWith(t, "b", two), &closed}
	a := clustertest.StartNode(t, srv, newNodeWith(t, "a", two), "a", secret)
	b := clustertest.StartNode(t, srv, bt, "b", secret)
	c := clustertest.StartNode(t, srv, newNodeWith(t, "c", two), "c", secret)
	b.P.MaxPeers = 1
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	pull := func(from *clustertest.Node, name string, size int64) {
		t.Helper()
		o, want := from.Put(t, name, size, 2<<20)
		if _, err := b.P.Pull(ctx, o.Ref()); err != nil {
			t.Fatalf("pull of %s from %s: %v", name, from.Name, err)
		}
		if !bytes.Equal(b.Store.Get(o.Ref()), want) {
			t.Fatalf("B's replica of %s from %s differs", name, from.Name)
		}
	}
	pull(a, "ns/first", 12<<20+77)
	pull(c, "ns/evicts", 3<<20+5)
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := closed.Load(); n != 1 {
			return fmt.Errorf("B closed %d endpoints, want 1 (to A, evicted)", n)
		}
		return nil
	})
	pull(a, "ns/second", 12<<20+99)
	if d := b.P.Dials(); d != 3 {
		t.Errorf("B dialled %d times, want 3 (A, C, A again)", d)
	}
}
