package cluster_test

import (
	"bytes"
	"fmt"
	"testing"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/clustertest"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/internal/memtransport"
)

// A reader keeps its control channel to a holder across pulls; when the
// holder is killed and restarts (same name, same control address, a new
// worker), the pooled channel is dropped and replaced, never reused, and
// the pull after the restart reads the new process's bytes.
func TestPooledChannelReplacedAfterRestart(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	ctx := bounded(t, 60*time.Second)
	opts := clustertest.NodeOptions{Endpoints: []string{srv.Endpoint()}, Prefix: "/t/" + t.Name() + "/",
		Listen: "127.0.0.1:0", Name: "a", Secret: secret, T: nw.Worker()}
	a, closeA, err := clustertest.OpenNode(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { closeA() }()
	b := startNode(t, srv, nw, "b", secret)

	pull := func(o *testNode, name string, size int64) {
		t.Helper()
		obj, want, err := o.Publish(ctx, name, size, 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := b.P.Pull(ctx, obj.Ref()); err != nil {
			t.Fatal(err)
		}
		if got := b.Store.Get(obj.Ref()); !bytes.Equal(got, want) {
			t.Fatalf("B's replica of %s differs", name)
		}
	}
	pull(a, "ns/one", 4096)
	pull(a, "ns/two", 3<<20+17)
	if d := b.P.Dials(); d != 1 {
		t.Fatalf("two pulls from one holder dialled %d control channels, want 1 (kept)", d)
	}

	// Kill A and start it again on the same control address.
	rec, err := b.Dir.Node(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	closeA()
	opts.Listen, opts.T = rec.Control, nw.Worker()
	var a2 *testNode
	for {
		if a2, closeA, err = clustertest.OpenNode(ctx, opts); err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("restart A on %s: %v", rec.Control, err)
		}
		time.Sleep(50 * time.Millisecond) // the address or A's old record is not free yet
	}
	pull(a2, "ns/three", 4096)
	if d := b.P.Dials(); d != 2 {
		t.Fatalf("after A restarted: %d control channels dialled, want 2 (the stale one replaced)", d)
	}
	pull(a2, "ns/four", 4096)
	if d := b.P.Dials(); d != 2 {
		t.Fatalf("the replacement channel was not kept: %d dials", d)
	}

	// Forgetting the node (its record went) dials afresh.
	b.P.ForgetNode("a")
	pull(a2, "ns/five", 4096)
	if d := b.P.Dials(); d != 3 {
		t.Fatalf("after ForgetNode: %d dials, want 3", d)
	}
}

// A burst of pulls from one holder, more at once than the holder admits
// unauthenticated connections from one address, costs one handshake: the
// pulls wait for the dial under way rather than dial too, and every one
// succeeds with the right bytes.
func TestBurstOfPullsDialsOnce(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	ctx := bounded(t, 60*time.Second)
	a := startNode(t, srv, nw, "a", secret)
	b := startNode(t, srv, nw, "b", secret)
	const n = 3 * cluster.DefaultMaxPendingPerSource
	refs := make([]cluster.Ref, n)
	wants := make([][]byte, n)
	for i := range n {
		obj, want, err := a.Publish(ctx, fmt.Sprintf("ns/burst%d", i), 4096+int64(i), 1<<20)
		if err != nil {
			t.Fatal(err)
		}
		refs[i], wants[i] = obj.Ref(), want
	}
	var g errgroup.Group
	for i := range n {
		g.Go(func() error {
			if _, err := b.P.Pull(ctx, refs[i]); err != nil {
				return fmt.Errorf("pull %d of %d at once: %w", i, n, err)
			}
			if !bytes.Equal(b.Store.Get(refs[i]), wants[i]) {
				return fmt.Errorf("B's replica of %s differs", refs[i])
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	if d := b.P.Dials(); d != 1 {
		t.Fatalf("%d pulls at once from one holder dialled %d control channels, want 1", n, d)
	}
}
