package cluster_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/clustertest"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/internal/memtransport"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
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
	if _, err := c.P.Pull(ctx, cluster.Ref{Owner: 1000, Name: "nope"}); !errors.Is(err, cluster.ErrNotFound) || protocol.CodeOf(err) != storev1.Error_NOT_FOUND {
		t.Fatalf("pull of an unknown name: %v (code %v)", err, protocol.CodeOf(err))
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
	// A dies with reads in flight (both holders' reads are held until
	// each has some and A is dead): C finishes from B, A's chunks
	// included.
	release := make(chan struct{})
	worker(a).Hold(release)
	worker(b).Hold(release)
	pulled := make(chan error, 1)
	go func() { _, err := c.P.Pull(ctx, o.Ref()); pulled <- err }()
	testutil.Eventually(t, 10*time.Second, func() error {
		if worker(a).Waiting() == 0 || worker(b).Waiting() == 0 {
			return fmt.Errorf("reads waiting: %d from A, %d from B", worker(a).Waiting(), worker(b).Waiting())
		}
		return nil
	})
	worker(a).Kill()
	close(release)
	if err := <-pulled; err != nil {
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
	// A dies with reads in flight (held until it is dead).
	release := make(chan struct{})
	worker(a).Hold(release)
	go func() {
		for worker(a).Waiting() == 0 {
			time.Sleep(time.Millisecond)
		}
		worker(a).Kill()
		close(release)
	}()
	start := time.Now()
	_, err := b.P.Pull(ctx, o.Ref())
	took := time.Since(start)
	if err == nil || !strings.Contains(err.Error(), "node a") || strings.Contains(err.Error(), "\n") {
		t.Fatalf("pull from a dead only holder: %v; want one line naming node a", err)
	}
	// A's record is live still: unreachable, not gone.
	if !errors.Is(err, cluster.ErrUnreachable) || protocol.CodeOf(err) != storev1.Error_UNAVAILABLE {
		t.Fatalf("pull from a dead only holder: %v (code %v), want UNAVAILABLE", err, protocol.CodeOf(err))
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
	if err == nil || !strings.Contains(err.Error(), "node h: no chunk within 500ms") || protocol.CodeOf(err) != storev1.Error_UNAVAILABLE {
		t.Fatalf("pull from a hung holder: %v (code %v)", err, protocol.CodeOf(err))
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
	if !errors.Is(err, cluster.ErrChecksum) || !strings.Contains(err.Error(), "chunk 1") || !strings.Contains(err.Error(), "node a") ||
		protocol.CodeOf(err) != storev1.Error_DATA_LOSS {
		t.Fatalf("pull of a corrupt chunk: %v (code %v)", err, protocol.CodeOf(err))
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
	if _, err := evil.P.Pull(ctx, o.Ref()); !errors.Is(err, cluster.ErrBadRecord) || protocol.CodeOf(err) != storev1.Error_DATA_LOSS {
		t.Fatalf("pull with the wrong secret: %v (code %v)", err, protocol.CodeOf(err))
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

// repairOnBadChunk is a log handler that calls repair at the first
// "chunk failed its checksum" record, which the puller logs before the
// chunk can be read again.
type repairOnBadChunk struct {
	mu     sync.Mutex
	bad    []string
	repair func()
}

func (h *repairOnBadChunk) Enabled(context.Context, slog.Level) bool { return true }
func (h *repairOnBadChunk) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *repairOnBadChunk) WithGroup(string) slog.Handler            { return h }
func (h *repairOnBadChunk) Handle(_ context.Context, r slog.Record) error {
	if !strings.Contains(r.Message, "failed its checksum") {
		return nil
	}
	var chunk string
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "chunk" {
			chunk = a.Value.String()
		}
		return true
	})
	h.mu.Lock()
	defer h.mu.Unlock()
	h.bad = append(h.bad, chunk)
	if h.repair != nil {
		h.repair()
		h.repair = nil
	}
	return nil
}

// TestPullRetriesBadChunk: a chunk that arrives corrupt (the holder's
// bytes changed after the seal, and back once the reader saw it) is not
// counted, and is read again: the replica is right. With reads of
// several chunks each (ReadBytes), the bad chunk's neighbours in the same
// read count, and it alone is read again.
func TestPullRetriesBadChunk(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a := startNode(t, srv, nw, "a", secret)
	ctx := bounded(t, 60*time.Second)
	for _, readBytes := range []int64{0, 4 << 20} {
		r := startNode(t, srv, nw, fmt.Sprintf("r%d", readBytes), secret) // the directory's prefix is the test's
		t.Run(fmt.Sprintf("read=%d", readBytes), func(t *testing.T) {
			o, data := a.Put(t, fmt.Sprintf("bad-chunk-%d", readBytes), 13<<20+99, 1<<20)
			want := bytes.Clone(data)
			data[5<<20+12345] ^= 0x01 // chunk 5
			h := &repairOnBadChunk{repair: func() { data[5<<20+12345] ^= 0x01 }}
			r.P.Logger = slog.New(h)
			r.P.ReadBytes = readBytes
			ga := worker(a).Gets()
			if _, err := r.P.Pull(ctx, o.Ref()); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(r.Store.Get(o.Ref()), want) {
				t.Fatal("the replica differs")
			}
			h.mu.Lock()
			defer h.mu.Unlock()
			if len(h.bad) != 1 || h.bad[0] != "5" {
				t.Fatalf("chunks that failed their check: %v, want [5]", h.bad)
			}
			// 14 chunks: one read each, or reads of up to 4 (at least 4
			// reads, as the stream takes them), and chunk 5 again.
			reads := worker(a).Gets() - ga
			if readBytes == 0 && reads != 15 || readBytes > 0 && (reads < 5 || reads > 14) {
				t.Fatalf("%d reads from the holder", reads)
			}
			t.Logf("%d reads from the holder", reads)
		})
	}
}

// A pull makes its replica (and so room for it, which may evict) only once
// a holder has answered for the object: a pull whose only holder is
// recorded but does not serve it makes none, and fails naming it.
func TestPullMakesNoRoomWithoutHolder(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret)
	ctx := bounded(t, 30*time.Second)
	o, _ := a.Put(t, "unreachable", 4<<20, 1<<20)
	a.Store.Forget(o.Ref()) // A's records and lease live on
	_, err := b.P.Pull(ctx, o.Ref())
	if !errors.Is(err, cluster.ErrNoHolder) || !strings.Contains(err.Error(), "node a") {
		t.Fatalf("pull from a holder that cannot be read: %v; want ErrNoHolder naming node a", err)
	}
	if n := b.Store.Creates(); n != 0 {
		t.Fatalf("the failed pull made %d replicas: room was made before a holder answered", n)
	}
}
