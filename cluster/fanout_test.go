package cluster_test

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/clustertest"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/internal/memtransport"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// gated is a reader's transport whose reads from one peer wait until the
// gate opens, so that a test can have every reader start its pull before
// the publisher serves a byte.
type gated struct {
	*memtransport.Worker
	peer []byte
	gate chan struct{}
}

func (g gated) Connect(ctx context.Context, addr []byte) (cluster.Endpoint, error) {
	ep, err := g.Worker.Connect(ctx, addr)
	if err != nil || !bytes.Equal(addr, g.peer) {
		return ep, err
	}
	return gatedEP{ep, g.gate}, nil
}

type gatedEP struct {
	cluster.Endpoint
	gate chan struct{}
}

func (e gatedEP) Get(ctx context.Context, rkey []byte, addr uint64, dst []byte) error {
	select {
	case <-e.gate:
	case <-ctx.Done():
		return ctx.Err()
	}
	return e.Endpoint.Get(ctx, rkey, addr, dst)
}

// fanoutCluster starts a publisher and readers with fan-out, every
// reader's reads from the publisher held until open is called.
func fanoutCluster(t *testing.T, readers int) (pub *testNode, rs []*testNode, ws []*memtransport.Worker, open func()) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	pw := nw.Worker()
	pub = clustertest.StartNode(t, srv, pw, "pub", secret)
	gate := make(chan struct{})
	for i := range readers {
		w := nw.Worker()
		n := clustertest.StartNode(t, srv, gated{w, pw.WorkerAddress(), gate}, fmt.Sprintf("r%d", i), secret)
		n.EnableFanout()
		rs, ws = append(rs, n), append(ws, w)
	}
	var once sync.Once
	return pub, rs, ws, func() { once.Do(func() { close(gate) }) }
}

// pullAll starts every reader's pull of ref and returns a function that
// waits for them.
func pullAll(ctx context.Context, rs []*testNode, ref cluster.Ref) func() []error {
	errs := make([]error, len(rs))
	var wg sync.WaitGroup
	for i, r := range rs {
		wg.Go(func() { _, errs[i] = r.P.Pull(ctx, ref) })
	}
	return func() []error { wg.Wait(); return errs }
}

// feedersAre waits until the directory lists n feeders of o and returns
// them in order.
func feedersAre(t *testing.T, d *testNode, o cluster.Object, n int) []string {
	t.Helper()
	var fs []string
	testutil.Eventually(t, testutil.Wait, func() error {
		var err error
		if fs, err = d.Dir.Feeders(context.Background(), o.Ref(), o.ID); err == nil && len(fs) != n {
			err = fmt.Errorf("feeders %v, want %d", fs, n)
		}
		return err
	})
	return fs
}

func TestFanoutChain(t *testing.T) {
	pub, rs, ws, open := fanoutCluster(t, 4)
	ctx := bounded(t, 60*time.Second)
	const chunk = 256 << 10
	o, want := pub.Put(t, "ns/weights", 24*chunk+777, chunk)
	n := len(o.Sums)
	wait := pullAll(ctx, rs, o.Ref())
	order := feedersAre(t, pub, o, 4)
	byName := map[string]int{}
	for i, r := range rs {
		byName[r.Name] = i
	}
	// Every link of the chain is open before a byte moves: the publisher
	// exposes the object to the first reader, each reader but the last its
	// replica being pulled to the next. A reader that asked its upstream
	// only after the upstream had finished would read a sealed replica
	// from a holder (no fed bytes), which is right but not this test.
	testutil.Eventually(t, testutil.Wait, func() error {
		if ex := pub.Store.Exposed(); ex != 1 {
			return fmt.Errorf("the publisher exposes %d objects, want 1", ex)
		}
		for _, name := range order[:len(order)-1] {
			if ex := rs[byName[name]].Store.Exposed(); ex != 1 {
				return fmt.Errorf("feeder %s exposes %d replicas, want 1", name, ex)
			}
		}
		return nil
	})
	open()
	for i, err := range wait() {
		if err != nil {
			t.Fatalf("reader r%d: %v", i, err)
		}
	}
	// The publisher served every chunk once (N readers cost it one
	// transfer); each feeder served every chunk once to the next in the
	// chain, the last none.
	pw := pub.Store.T.(*memtransport.Worker)
	if g := pw.Gets(); g != n {
		t.Errorf("the publisher served %d GETs for %d chunks", g, n)
	}
	for _, r := range rs {
		if !bytes.Equal(r.Store.Get(o.Ref()), want) {
			t.Errorf("reader %s's replica differs", r.Name)
		}
	}
	t.Logf("chain: pub → %v", order)
	for k, name := range order {
		i := byName[name]
		wantServed, wantFed := n, uint64(o.Size)
		if k == len(order)-1 {
			wantServed = 0
		}
		if k == 0 {
			wantFed = 0
		}
		if g := ws[i].Gets(); g != wantServed {
			t.Errorf("feeder %s (#%d of the chain) served %d GETs, want %d", name, k, g, wantServed)
		}
		if st := rs[i].P.Stats(); st.FedBytes != wantFed || st.Bytes != uint64(o.Size) {
			t.Errorf("reader %s: %+v, want %d bytes fed", name, st, wantFed)
		}
	}
	// Feeds, feeder records, exposures and pins are gone with the pulls.
	feedersAre(t, pub, o, 0)
	for _, nd := range append([]*testNode{pub}, rs...) {
		testutil.Eventually(t, testutil.Wait, func() error {
			if ex := nd.Store.Exposed(); ex != 0 {
				return fmt.Errorf("node %s still exposes %d objects", nd.Name, ex)
			}
			if k, err := nd.Dir.Pinned(ctx, o.Ref()); k != 0 || err != nil {
				return fmt.Errorf("node %s pinned by %d (%v)", nd.Name, k, err)
			}
			return nil
		})
	}
	// The holders are all five, once each has advertised its replica.
	testutil.Eventually(t, testutil.Wait, func() error {
		if e, err := pub.Dir.Lookup(ctx, o.Ref()); err != nil || len(e.Holders) != 5 {
			return fmt.Errorf("holders %v (%v)", e.Holders, err)
		}
		return nil
	})
}

// A feeder that dies mid-pull: the readers behind it move to the holders
// and the feeders before it, and every replica is right.
func TestFanoutFeederDies(t *testing.T) {
	pub, rs, ws, open := fanoutCluster(t, 4)
	ctx := bounded(t, 60*time.Second)
	const chunk = 128 << 10
	o, want := pub.Put(t, "ns/kv", 40*chunk, chunk)
	for _, r := range rs {
		r.P.ChunkTimeout = 2 * time.Second
	}
	wait := pullAll(ctx, rs, o.Ref())
	order := feedersAre(t, pub, o, 4)
	// Slow the publisher, so that the chain is mid-object when the second
	// feeder's data plane dies.
	pub.Store.T.(*memtransport.Worker).SetDelay(5 * time.Millisecond)
	idx := slices.IndexFunc(rs, func(r *testNode) bool { return r.Name == order[1] })
	open()
	testutil.Eventually(t, testutil.Wait, func() error {
		if ws[idx].Gets() < 3 {
			return fmt.Errorf("feeder %s served %d chunks", order[1], ws[idx].Gets())
		}
		return nil
	})
	ws[idx].Kill()
	errs := wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("reader %s: %v", rs[i].Name, err)
		}
		if !bytes.Equal(rs[i].Store.Get(o.Ref()), want) {
			t.Fatalf("reader %s's replica differs", rs[i].Name)
		}
	}
	next := rs[slices.IndexFunc(rs, func(r *testNode) bool { return r.Name == order[2] })]
	if st := next.P.Stats(); st.Failovers == 0 {
		t.Errorf("reader %s behind the dead feeder: %+v, want a failover", next.Name, st)
	}
}

// noAdvertise is a directory whose AddHolder fails as one whose lease is
// lost does (ErrUnavailable).
type noAdvertise struct{ cluster.Directory }

func (noAdvertise) AddHolder(context.Context, cluster.Entry) error {
	return fmt.Errorf("%w: the lease is lost", cluster.ErrUnavailable)
}

// Fanned-out readers that cannot advertise their replicas (the directory
// away at the end of the pull, as when etcd drops the node's lease) keep
// them, local and unadvertised: every pull succeeds with the publisher's
// bytes, and the directory lists the publisher alone. Dropping a sealed
// replica then failed the get, and freed memory a peer still read.
func TestFanoutWithoutAdvertising(t *testing.T) {
	pub, rs, _, open := fanoutCluster(t, 3)
	ctx := bounded(t, 60*time.Second)
	for _, r := range rs {
		r.P.Dir = noAdvertise{r.P.Dir}
	}
	const chunk = 128 << 10
	o, want := pub.Put(t, "ns/unadvertised", 16*chunk+3, chunk)
	wait := pullAll(ctx, rs, o.Ref())
	feedersAre(t, pub, o, 3)
	open()
	for i, err := range wait() {
		if err != nil {
			t.Fatalf("reader %s: %v", rs[i].Name, err)
		}
		if !bytes.Equal(rs[i].Store.Get(o.Ref()), want) {
			t.Fatalf("reader %s's replica differs", rs[i].Name)
		}
		if st := rs[i].P.Stats(); st.Pulls != 1 || st.Failed != 0 {
			t.Errorf("reader %s: %+v, want 1 pull and no failure", rs[i].Name, st)
		}
	}
	e, err := pub.Dir.Lookup(ctx, o.Ref())
	if err != nil || len(e.Holders) != 1 || e.Holders[0] != pub.Name {
		t.Fatalf("holders %v (%v), want the publisher alone", e.Holders, err)
	}
}

// A "have" for an object a node neither feeds nor holds is refused; one
// for a sealed replica says it is complete.
func TestFeedRequests(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a := clustertest.StartNode(t, srv, nw.Worker(), "a", secret)
	ctx := bounded(t, 30*time.Second)
	o, _ := a.Put(t, "ns/x", 1<<20, 256<<10)
	an, err := a.Dir.Node(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	cc, err := cluster.DialControl(ctx, secret, "b", "a", an.Control)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	if _, _, complete, err := cc.Have(ctx, o.Ref(), o.ID, 0); err != nil || !complete {
		t.Fatalf("have of a sealed replica: complete=%v, %v", complete, err)
	}
	if _, _, _, err := cc.Have(ctx, o.Ref(), cluster.NewID(), 0); err == nil {
		t.Fatal("have of another incarnation answered")
	}
	exp, _, have, complete, err := cc.Feed(ctx, o.Ref(), o.ID)
	if err != nil || !complete || have != nil || exp.Size != o.Size {
		t.Fatalf("feed of a sealed replica: %+v complete=%v have=%v, %v", exp, complete, have, err)
	}
	if _, _, _, _, err := cc.Feed(ctx, cluster.Ref{Owner: 1000, Name: "nope"}, o.ID); err == nil {
		t.Fatal("feed of an unknown object answered")
	}
}

// endsGetFirst is a directory whose AddHolder first ends the get the pull
// serves (cancel), as a waiting get ends once its replica is sealed, then
// advertises.
type endsGetFirst struct {
	cluster.Directory
	cancel context.CancelFunc
}

func (d endsGetFirst) AddHolder(ctx context.Context, e cluster.Entry) error {
	d.cancel()
	return d.Directory.AddHolder(ctx, e)
}

// A fanned-out reader advertises its sealed replica even when the get it
// pulled for ends before the write goes out: the write has a context of
// its own. Under the get's context the replica stayed local and
// unadvertised for good.
func TestFanoutAdvertisesAfterTheGetEnds(t *testing.T) {
	pub, rs, _, open := fanoutCluster(t, 1)
	ctx := bounded(t, 60*time.Second)
	get, cancel := context.WithCancel(ctx)
	defer cancel()
	r := rs[0]
	r.P.Dir = endsGetFirst{r.P.Dir, cancel}
	const chunk = 128 << 10
	o, want := pub.Put(t, "ns/waited", 8*chunk+5, chunk)
	open()
	if _, err := r.P.Pull(get, o.Ref()); err != nil {
		t.Fatalf("pull: %v", err)
	}
	if !bytes.Equal(r.Store.Get(o.Ref()), want) {
		t.Fatal("the replica differs from the publisher's object")
	}
	e, err := pub.Dir.Lookup(ctx, o.Ref())
	if err != nil || len(e.Holders) != 2 {
		t.Fatalf("holders %v (%v), want the publisher and %s", e.Holders, err, r.Name)
	}
}
