package cluster_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/clustertest"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/internal/memtransport"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

var secret = mustSecret("the-cluster-secret-for-tests")

func mustSecret(s string) cluster.Secret {
	sec, err := cluster.NewSecret([]byte(s))
	if err != nil {
		panic(err)
	}
	return sec
}

type testNode = clustertest.Node

func startNode(t *testing.T, srv *etcdtest.Server, nw *memtransport.Network, name string, sec cluster.Secret) *testNode {
	t.Helper()
	return clustertest.StartNode(t, srv, nw.Worker(), name, sec)
}

func worker(n *testNode) *memtransport.Worker { return n.Store.T.(*memtransport.Worker) }

// waitHolders waits until the directory lists holders of ref, in order
// (pulls advertise their replicas after they return).
func waitHolders(t *testing.T, ctx context.Context, n *testNode, ref cluster.Ref, holders string) {
	t.Helper()
	testutil.Eventually(t, testutil.Wait, func() error {
		if e, err := n.Dir.Lookup(ctx, ref); err != nil || strings.Join(e.Holders, ",") != holders {
			return fmt.Errorf("holders of %s: %v (%v), want %s", ref, e.Holders, err, holders)
		}
		return nil
	})
}

func bounded(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestPullAcrossNodes(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b, c := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret), startNode(t, srv, nw, "c", secret)
	ctx := bounded(t, 30*time.Second)
	o, want := a.Put(t, "ns/weights", 10<<20+12345, 1<<20)
	// Put on A, get on B: all chunks from A.
	e, err := b.P.Pull(ctx, o.Ref())
	if err != nil {
		t.Fatal(err)
	}
	if got := b.Store.Get(o.Ref()); !bytes.Equal(got, want) || e.ID != o.ID {
		t.Fatal("B's replica differs from A's object")
	}
	waitHolders(t, ctx, c, o.Ref(), "a,b")
	// Get on C: striped over A and B. Streams take chunks as they come, so
	// on a loaded machine one holder's streams could take all eleven before
	// the other's start: the holders serve C only once C has asked each of
	// them for a chunk.
	ga, gb := worker(a).Gets(), worker(b).Gets()
	release := make(chan struct{})
	free := sync.OnceFunc(func() { close(release) })
	t.Cleanup(free)
	worker(a).Hold(release)
	worker(b).Hold(release)
	pulled := make(chan error, 1)
	go func() {
		_, err := c.P.Pull(ctx, o.Ref())
		pulled <- err
	}()
	testutil.Eventually(t, testutil.Wait, func() error {
		if wa, wb := worker(a).Waiting(), worker(b).Waiting(); wa == 0 || wb == 0 {
			return fmt.Errorf("C asks A for %d chunks and B for %d; want both asked", wa, wb)
		}
		return nil
	})
	worker(a).Hold(nil)
	worker(b).Hold(nil)
	free()
	if err := <-pulled; err != nil {
		t.Fatal(err)
	}
	if got := c.Store.Get(o.Ref()); !bytes.Equal(got, want) {
		t.Fatal("C's replica differs")
	}
	da, db := worker(a).Gets()-ga, worker(b).Gets()-gb
	t.Logf("C's 11 chunks: %d from A, %d from B", da, db)
	if da+db != 11 || da == 0 || db == 0 {
		t.Fatalf("C's chunks: %d from A, %d from B; want both, 11 in all", da, db)
	}
	// Exposures end with the pulls; pins too (released just after the
	// pull returns).
	for _, n := range []*testNode{a, b} {
		testutil.Eventually(t, testutil.Wait, func() error {
			if ex := n.Store.Exposed(); ex != 0 {
				return fmt.Errorf("node %s still exposes %d objects", n.Name, ex)
			}
			if k, err := n.Dir.Pinned(ctx, o.Ref()); k != 0 || err != nil {
				return fmt.Errorf("node %s pinned by %d (%v)", n.Name, k, err)
			}
			return nil
		})
	}
	if st := c.P.Stats(); st.Pulls != 1 || st.Bytes != uint64(o.Size) || st.InFlight != 0 {
		t.Errorf("stats %+v", st)
	}
	// Unknown names and deleted names.
	if _, err := c.P.Pull(ctx, cluster.Ref{Owner: 1000, Name: "nope"}); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("pull of an unknown name: %v", err)
	}
}

func TestPullFailover(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b, c := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret), startNode(t, srv, nw, "c", secret)
	ctx := bounded(t, 60*time.Second)
	o, want := a.Put(t, "big", 24<<20, 1<<20)
	if _, err := b.P.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	waitHolders(t, ctx, c, o.Ref(), "a,b")
	// A is slow and dies mid-pull: C finishes from B.
	worker(a).SetDelay(20 * time.Millisecond)
	go func() {
		for worker(a).Gets() < 2 {
			time.Sleep(time.Millisecond)
		}
		worker(a).Kill()
	}()
	if _, err := c.P.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(c.Store.Get(o.Ref()), want) {
		t.Fatal("C's replica differs")
	}
	if st := c.P.Stats(); st.Failovers != 1 {
		t.Fatalf("stats %+v, want one failover", st)
	}
}

func TestPullOnlyHolderDies(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret)
	ctx := bounded(t, 30*time.Second)
	o, _ := a.Put(t, "lonely", 8<<20, 1<<20)
	worker(a).SetDelay(20 * time.Millisecond)
	go func() {
		for worker(a).Gets() < 2 {
			time.Sleep(time.Millisecond)
		}
		worker(a).Kill()
	}()
	start := time.Now()
	_, err := b.P.Pull(ctx, o.Ref())
	took := time.Since(start)
	if err == nil || !strings.Contains(err.Error(), "node a") || strings.Contains(err.Error(), "\n") {
		t.Fatalf("pull from a dead only holder: %v; want one line naming node a", err)
	}
	t.Logf("failed after %v: %v", took.Round(time.Millisecond), err)
	if b.Store.Get(o.Ref()) != nil {
		t.Fatal("a half replica is visible")
	}
	if b.Store.Len() != 0 {
		t.Fatal("the aborted replica is left")
	}
	// A hung holder (no answer at all) is dropped after the chunk timeout.
	h := startNode(t, srv, nw, "h", secret)
	o2, _ := h.Put(t, "hung", 2<<20, 1<<20)
	b.P.ChunkTimeout = 500 * time.Millisecond
	worker(h).SetDelay(time.Hour)
	start = time.Now()
	_, err = b.P.Pull(ctx, o2.Ref())
	if err == nil || !strings.Contains(err.Error(), "node h: no chunk within 500ms") {
		t.Fatalf("pull from a hung holder: %v", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("pull from a hung holder took %v", took)
	}
}

func TestPullChecksum(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret)
	ctx := bounded(t, 30*time.Second)
	o, data := a.Put(t, "flaky", 3<<20, 1<<20)
	data[(1<<20)+7] ^= 0x40 // corrupt A's copy after its checksums were recorded
	_, err := b.P.Pull(ctx, o.Ref())
	if !errors.Is(err, cluster.ErrChecksum) || !strings.Contains(err.Error(), "chunk 1") || !strings.Contains(err.Error(), "node a") {
		t.Fatalf("pull of a corrupt chunk: %v", err)
	}
	if b.Store.Get(o.Ref()) != nil {
		t.Fatal("a corrupt replica is visible")
	}
}

func TestPullRefusedWithoutSecret(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a := startNode(t, srv, nw, "a", secret)
	ctx := bounded(t, 30*time.Second)
	o, _ := a.Put(t, "private", 1<<20, 0)
	// A node with another secret: its directory cannot read the
	// records (forged to it), and A refuses its control channel.
	evil := startNode(t, srv, nw, "evil", mustSecret("not-the-cluster-secret!!"))
	if _, err := evil.P.Pull(ctx, o.Ref()); !errors.Is(err, cluster.ErrBadRecord) {
		t.Fatalf("pull with the wrong secret: %v", err)
	}
	an, err := a.Dir.Node(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	_, err = cluster.DialControl(ctx, mustSecret("not-the-cluster-secret!!"), "evil", "a", an.Control)
	if !errors.Is(err, cluster.ErrAuth) {
		t.Fatalf("control channel with the wrong secret: %v", err)
	}
	if a.Store.Exposed() != 0 || worker(a).Gets() != 0 {
		t.Fatal("memory was exposed to a node without the secret")
	}
	// With the secret it works, and a peer claiming another name is caught.
	cc, err := cluster.DialControl(ctx, secret, "b", "a", an.Control)
	if err != nil {
		t.Fatal(err)
	}
	cc.Close()
	if _, err := cluster.DialControl(ctx, secret, "b", "z", an.Control); !errors.Is(err, cluster.ErrAuth) {
		t.Fatalf("dialled z, a answered: %v", err)
	}
}
