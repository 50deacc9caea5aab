package node_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/store"
)

// Four daemons get one object at once: their pulls fan out (each replica
// being pulled feeds the next reader), and every get sees the publisher's
// bytes. Whether a reader read from a feeder depends on how the pulls
// overlap on loopback; the bound on transfers is TestFanoutOverLimitedLinks'.
func TestDaemonsFanOut(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	var readers []*daemon
	for _, name := range []string{"b", "c", "d", "e"} {
		readers = append(readers, startDaemon(t, srv, name))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	want := a.put(t, "ns/fanned", 24<<20+5, client.CreateOptions{Cluster: true})
	errs := make([]error, len(readers))
	got := make([][]byte, len(readers))
	var wg sync.WaitGroup
	for i, d := range readers {
		wg.Go(func() { got[i], errs[i] = d.get(ctx, "ns/fanned") })
	}
	wg.Wait()
	var fed uint64
	for i, d := range readers {
		if errs[i] != nil {
			t.Fatalf("get on %s: %v", d.name, errs[i])
		}
		if !bytes.Equal(got[i], want) {
			t.Fatalf("get on %s: bytes differ", d.name)
		}
		st := d.node.Stats()
		fed += st.FedBytes
		if st.Pulls != 1 || st.Failed != 0 {
			t.Errorf("%s: %+v", d.name, st)
		}
	}
	t.Logf("bytes read from feeders: %d of %d", fed, 4*len(want))
	// A reader that fed nobody advertises its replica after its get
	// returned (Puller.advertise): every node is a holder soon after.
	eventually(t, 10*time.Second, "the object listed once with 5 holders", func() bool {
		ls, err := a.node.Directory().List(ctx)
		return err == nil && len(ls) == 1 && len(ls[0].Holders) == 5
	})
	// A later get on a reader is local; a delete goes everywhere.
	if err := readers[0].c.Delete(ctx, "ns/fanned"); err != nil {
		t.Fatal(err)
	}
	for _, d := range append(readers, a) {
		eventually(t, 10*time.Second, "replica on "+d.name+" dropped", func() bool {
			_, err := d.c.Stat(ctx, "ns/fanned")
			return err != nil
		})
	}
}

// GPU replicas feed too: three daemons get one GPU object of a fourth, each
// starting once the one before it is moving bytes, so that each pull
// overlaps the next. The first reads from the publisher, each later one
// from the reader before it while that one is still pulling (its pinned
// landing buffer): every byte the later readers got came from a feeder, and
// every replica is the publisher's bytes, in GPU memory.
func TestGPUFanOut(t *testing.T) {
	dev := testutil.RequireGPU(t)
	gpu := dev.UUID().String()
	srv := etcdtest.Start(t)
	const size = 2<<30 + 4097 // ~2 s a pull over UCX tcp on loopback
	a := startDaemonOn(t, srv, "a", 3<<30, "cuda")
	var readers []*daemon
	for _, name := range []string{"b", "c", "d"} {
		readers = append(readers, startDaemonOn(t, srv, name, 3<<30, "cuda"))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	want := randomBytes(size, 31)
	putGPU(t, ctx, a, "fanned", gpu, want, client.CreateOptions{})

	got := make([][]byte, len(readers))
	errs := make([]error, len(readers))
	var wg sync.WaitGroup
	for i, d := range readers {
		if i > 0 {
			// The reader before this one is moving bytes, and not done.
			prev := readers[i-1]
			testutil.Eventually(t, testutil.Wait, func() error {
				if prev.node.Stats().Pulls > 0 {
					t.Fatalf("%s's pull ended before %s's began: the object is too small for this link", prev.name, d.name)
				}
				if prev.node.Stats().InFlight != 1 || node.StagedBytes(prev.node) == 0 {
					return fmt.Errorf("%s's pull has not moved bytes yet", prev.name)
				}
				return nil
			})
		}
		wg.Go(func() {
			l, err := d.c.Get(ctx, "fanned")
			if err != nil {
				errs[i] = err
				return
			}
			defer l.Release()
			if l.Device() == "" || l.Device() == "host" {
				errs[i] = fmt.Errorf("lease in %q memory, want the GPU", l.Device())
				return
			}
			got[i] = make([]byte, l.Size())
			_, errs[i] = l.ReadAt(got[i], 0)
		})
	}
	wg.Wait()
	for i, d := range readers {
		if errs[i] != nil {
			t.Fatalf("get on %s: %v", d.name, errs[i])
		}
		if !bytes.Equal(got[i], want) {
			t.Fatalf("get on %s: bytes differ from the publisher's", d.name)
		}
		st := d.node.Stats()
		t.Logf("%s: %+v", d.name, st)
		if st.Pulls != 1 || st.Failed != 0 {
			t.Errorf("%s: %d pulls, %d failed: want 1, 0", d.name, st.Pulls, st.Failed)
		}
		switch fed := st.FedBytes; {
		case i == 0 && fed != 0:
			t.Errorf("%s read %d bytes from feeders: want none (it started first)", d.name, fed)
		case i > 0 && fed != size:
			t.Errorf("%s read %d of %d bytes from feeders: want all (from %s)", d.name, fed, size, readers[i-1].name)
		}
	}
	// Asked whether it still feeds, a finished reader says it holds the
	// replica without exposing it (an exposure would stage it to host
	// memory).
	haveComplete(t, ctx, readers[0], cluster.Ref{Name: "fanned"})
	// Every exposure of a landing buffer was released: nothing pinned, and
	// the readers are holders.
	testutil.Eventually(t, testutil.Wait, func() error {
		e, err := a.node.Directory().Lookup(ctx, cluster.Ref{Name: "fanned"})
		if err != nil {
			return err
		}
		if len(e.Holders) != 1+len(readers) {
			return fmt.Errorf("holders %v", e.Holders)
		}
		for _, d := range append(readers, a) {
			if n := node.PinsHeld(d.node); n != 0 {
				return fmt.Errorf("%s holds %d pins", d.name, n)
			}
		}
		return nil
	})
}

// haveComplete asks d, over its control channel, which chunks it has of
// its sealed replica of ref: complete, answered without an exposure; and
// refused for an incarnation it does not hold.
func haveComplete(t *testing.T, ctx context.Context, d *daemon, ref cluster.Ref) {
	t.Helper()
	dir := d.node.Directory()
	e, err := dir.Lookup(ctx, ref)
	if err != nil {
		t.Fatal(err)
	}
	n, err := dir.Node(ctx, d.name)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := cluster.DialControl(ctx, secret, "asker", d.name, n.Control)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	exposed, staged := node.Exposures(d.node), node.StagedBytes(d.node)
	if _, _, complete, err := cc.Have(ctx, e.Ref(), e.ID, 0); err != nil || !complete {
		t.Fatalf("have of %s's sealed replica: complete=%v, %v", d.name, complete, err)
	}
	if _, _, _, err := cc.Have(ctx, e.Ref(), cluster.NewID(), 0); !errors.Is(err, cluster.ErrFeedGone) {
		t.Fatalf("have of an incarnation %s does not hold: %v, want ErrFeedGone", d.name, err)
	}
	if x, s := node.Exposures(d.node)-exposed, node.StagedBytes(d.node)-staged; x != 0 || s != 0 {
		t.Fatalf("answering have, %s made %d exposures and staged %d bytes: want none", d.name, x, s)
	}
}

// A node asked whether it still feeds a replica it has sealed answers from
// its store, without exposing it.
func TestHaveOfSealedReplica(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a.put(t, "ns/held", 3<<20+1, client.CreateOptions{Cluster: true})
	haveComplete(t, ctx, a, cluster.Ref{Name: "ns/held"})
}

// A fanned-out replica that its pull seals and then aborts (the name was
// deleted on its origin as the replica was advertised) keeps its memory
// while a peer still reads it: the peer reads the replica's bytes, not an
// object put after the abort, and the memory goes back with the peer's
// exposure.
func TestAbortedReplicaKeepsExposedMemory(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := startDaemonCap(t, srv, "a", 16<<20), startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const size = 3 << 20
	want := make([]byte, size)
	rand.NewChaCha8([32]byte{'a', 'b', 'o', 'r', 't'}).Read(want)
	r, e, release := exposedReplica(ctx, t, a, cluster.Object{Name: "ns/aborted", Owner: uint32(os.Getuid()), Size: size,
		ChunkSize: size, ID: "aborted-incarnation", Origin: "z", Sealed: time.Now()}, want)
	if err := r.Seal(); err != nil {
		t.Fatal(err)
	}
	r.Abort()
	if _, err := a.c.Stat(ctx, "ns/aborted"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("stat of the aborted replica: %v, want not found", err)
	}
	held := bytesUsed(t, a.st)
	a.put(t, "ns/after", size, client.CreateOptions{})
	peerReadsAborted(ctx, t, a, b, e, release, want, held)
}

// exposedReplica makes a replica of o on d holding b, as a pull does, and
// exposes it to peers, as a fanned-out pull does.
func exposedReplica(ctx context.Context, t *testing.T, d *daemon, o cluster.Object, b []byte) (cluster.Replica, cluster.Exposure, func()) {
	t.Helper()
	r, err := node.CreateReplica(ctx, d.node, o)
	if err != nil {
		t.Fatal(err)
	}
	copy(r.Bytes(), b)
	e, release, err := r.Traits().Expose()
	if err != nil {
		t.Fatal(err)
	}
	return r, e, release
}

// peerReadsAborted has b read exposure e of a's aborted replica, whose
// bytes are want, releases the exposure, and waits for a's store to hold
// used bytes again (the replica's memory given back).
func peerReadsAborted(ctx context.Context, t *testing.T, a, b *daemon, e cluster.Exposure, release func(), want []byte, used int64) {
	t.Helper()
	got := make([]byte, len(want))
	if err := node.ReadExposure(ctx, b.node, e, got); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("a peer read other bytes than the aborted replica's through its exposure (first difference at %d)", firstDiff(got, want))
	}
	release()
	eventually(t, 10*time.Second, "the aborted replica's memory given back", func() bool {
		return bytesUsed(t, a.st) == used
	})
}

// bytesUsed sums st's cudaipc_store_bytes_used over its devices.
func bytesUsed(t *testing.T, st *store.Store) int64 {
	t.Helper()
	rec := httptest.NewRecorder()
	st.MetricsHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	var sum int64
	for line := range strings.SplitSeq(rec.Body.String(), "\n") {
		if !strings.HasPrefix(line, "cudaipc_store_bytes_used{") {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			t.Fatalf("metric line %q: %v", line, err)
		}
		sum += int64(v)
	}
	return sum
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// A pull that aborts its replica while a peer still reads it (fan-out)
// frees the name at once: a retry makes a new replica, seals it and gets
// it, while the peer still reads the aborted replica's bytes through its
// exposure; the aborted replica's memory goes back with the exposure. A
// plain object, and a version's only shard.
func TestRetryBesideExposedAbortedReplica(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := startDaemon(t, srv, "a"), startDaemon(t, srv, "b")
	for _, version := range []uint64{0, 7} {
		t.Run(fmt.Sprintf("version=%d", version), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			const size = 3 << 20
			name := fmt.Sprintf("ns/retried-%d", version)
			o := cluster.Object{Name: name, Owner: uint32(os.Getuid()), Size: size, ChunkSize: size, ID: "retried-incarnation",
				Origin: "z", Sealed: time.Now(), Version: version}
			if version != 0 {
				o.Shards = 1
			}
			old, fresh := make([]byte, size), make([]byte, size)
			rand.NewChaCha8([32]byte{'o', 'l', 'd', byte(version)}).Read(old)
			rand.NewChaCha8([32]byte{'n', 'e', 'w', byte(version)}).Read(fresh)
			r, e, release := exposedReplica(ctx, t, a, o, old)
			r.Abort()
			before := bytesUsed(t, a.st)
			r2, err := node.CreateReplica(ctx, a.node, o)
			if err != nil {
				t.Fatalf("a retry beside the aborted replica a peer reads: %v", err)
			}
			copy(r2.Bytes(), fresh)
			if err := r2.Seal(); err != nil {
				t.Fatal(err)
			}
			v, got, err := a.getVersion(ctx, name, client.GetOptions{Version: version})
			if err != nil || v != version || !bytes.Equal(got, fresh) {
				t.Fatalf("get of the retried replica: version %d, %v (equal %v)", v, err, bytes.Equal(got, fresh))
			}
			peerReadsAborted(ctx, t, a, b, e, release, old, before)
		})
	}
}
