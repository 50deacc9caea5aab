package cluster_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/etcddir"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/internal/memtransport"
)

var secret = mustSecret("the-cluster-secret-for-tests")

func mustSecret(s string) cluster.Secret {
	sec, err := cluster.NewSecret([]byte(s))
	if err != nil {
		panic(err)
	}
	return sec
}

// store is a node's local objects, as the puller and the control server see
// them: replicas made by pulls, originals put by tests.
type store struct {
	w       *memtransport.Worker
	mu      sync.Mutex
	objects map[cluster.Ref]*obj
	exposed int
}

type obj struct {
	id     string
	b      []byte
	sealed bool
}

func (s *store) Create(ctx context.Context, o cluster.Object) (cluster.Replica, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.objects[o.Ref()]; ok {
		return nil, fmt.Errorf("%s exists locally", o.Ref())
	}
	ob := &obj{id: o.ID, b: make([]byte, o.Size)}
	s.objects[o.Ref()] = ob
	return &replica{s: s, ref: o.Ref(), o: ob}, nil
}

type replica struct {
	s   *store
	ref cluster.Ref
	o   *obj
}

func (r *replica) Bytes() []byte { return r.o.b }
func (r *replica) Seal() error {
	r.s.mu.Lock()
	r.o.sealed = true
	r.s.mu.Unlock()
	return nil
}
func (r *replica) Abort() {
	r.s.mu.Lock()
	delete(r.s.objects, r.ref)
	r.s.mu.Unlock()
}

func (s *store) Expose(ref cluster.Ref, id string) (cluster.Exposure, func(), error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	o, ok := s.objects[ref]
	if !ok || !o.sealed || o.id != id {
		return cluster.Exposure{}, nil, fmt.Errorf("%s: %w", ref, cluster.ErrNotFound)
	}
	rkey, addr := s.w.Register(o.b)
	s.exposed++
	return cluster.Exposure{Worker: s.w.WorkerAddress(), RKey: rkey, Addr: addr, Size: int64(len(o.b))}, func() {
		s.w.Unregister(rkey)
		s.mu.Lock()
		s.exposed--
		s.mu.Unlock()
	}, nil
}

func (s *store) get(ref cluster.Ref) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	if o, ok := s.objects[ref]; ok && o.sealed {
		return o.b
	}
	return nil
}

type testNode struct {
	name  string
	dir   *etcddir.Directory
	store *store
	p     *cluster.Puller
	ln    net.Listener
}

func startNode(t *testing.T, srv *etcdtest.Server, net0 *memtransport.Network, name string, sec cluster.Secret) *testNode {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	dir, err := etcddir.Open(ctx, etcddir.Config{Endpoints: []string{srv.Endpoint()}, Node: name, Secret: sec,
		TTL: 2 * time.Second, CallTimeout: 5 * time.Second, Prefix: "/t/" + t.Name() + "/"})
	if err != nil {
		t.Fatal(err)
	}
	w := net0.Worker()
	st := &store{w: w, objects: map[cluster.Ref]*obj{}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cs := &cluster.ControlServer{Node: name, Secret: sec, Source: st}
	served := make(chan struct{})
	go func() { cs.Serve(ln); close(served) }()
	if err := dir.Join(ctx, cluster.Node{Name: name, Worker: w.WorkerAddress(), Control: ln.Addr().String()}); err != nil {
		t.Fatal(err)
	}
	n := &testNode{name: name, dir: dir, store: st, ln: ln,
		p: &cluster.Puller{Dir: dir, Transport: w, Secret: sec, Sink: st, ChunkTimeout: 3 * time.Second}}
	t.Cleanup(func() {
		ln.Close()
		<-served
		dir.Close()
	})
	return n
}

// put makes a sealed local object on n and publishes it.
func (n *testNode) put(t *testing.T, name string, size int64, chunk int64) (cluster.Object, []byte) {
	t.Helper()
	b := make([]byte, size)
	rand.NewChaCha8([32]byte{byte(size), byte(len(name))}).Read(b)
	if chunk == 0 {
		chunk = cluster.ChunkSizeFor(size)
	}
	o := cluster.Object{Name: name, Owner: 1000, Size: size, ChunkSize: chunk, Sums: cluster.Checksums(b, chunk), ID: cluster.NewID()}
	n.store.mu.Lock()
	n.store.objects[o.Ref()] = &obj{id: o.ID, b: b, sealed: true}
	n.store.mu.Unlock()
	if _, err := n.dir.Publish(context.Background(), o); err != nil {
		t.Fatal(err)
	}
	return o, b
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
	o, want := a.put(t, "ns/weights", 10<<20+12345, 1<<20)
	// Put on A, get on B: all chunks from A.
	e, err := b.p.Pull(ctx, o.Ref())
	if err != nil {
		t.Fatal(err)
	}
	if got := b.store.get(o.Ref()); !bytes.Equal(got, want) || e.ID != o.ID {
		t.Fatal("B's replica differs from A's object")
	}
	if e, _ := c.dir.Lookup(ctx, o.Ref()); strings.Join(e.Holders, ",") != "a,b" {
		t.Fatalf("holders after B's pull: %v", e.Holders)
	}
	// Get on C: striped over A and B.
	ga, gb := a.store.w.Gets(), b.store.w.Gets()
	if _, err := c.p.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	if got := c.store.get(o.Ref()); !bytes.Equal(got, want) {
		t.Fatal("C's replica differs")
	}
	da, db := a.store.w.Gets()-ga, b.store.w.Gets()-gb
	t.Logf("C's 11 chunks: %d from A, %d from B", da, db)
	if da+db != 11 || da == 0 || db == 0 {
		t.Fatalf("C's chunks: %d from A, %d from B; want both, 11 in all", da, db)
	}
	// Exposures end with the pulls; pins too.
	for _, n := range []*testNode{a, b} {
		n.store.mu.Lock()
		ex := n.store.exposed
		n.store.mu.Unlock()
		if ex != 0 {
			t.Errorf("node %s still exposes %d objects", n.name, ex)
		}
		if k, err := n.dir.Pinned(ctx, o.Ref()); k != 0 || err != nil {
			t.Errorf("node %s pinned by %d (%v)", n.name, k, err)
		}
	}
	if st := c.p.Stats(); st.Pulls != 1 || st.Bytes != uint64(o.Size) || st.InFlight != 0 {
		t.Errorf("stats %+v", st)
	}
	// Unknown names and deleted names.
	if _, err := c.p.Pull(ctx, cluster.Ref{Owner: 1000, Name: "nope"}); !errors.Is(err, cluster.ErrNotFound) {
		t.Fatalf("pull of an unknown name: %v", err)
	}
}

func TestPullFailover(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b, c := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret), startNode(t, srv, nw, "c", secret)
	ctx := bounded(t, 60*time.Second)
	o, want := a.put(t, "big", 24<<20, 1<<20)
	if _, err := b.p.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	// A is slow and dies mid-pull: C finishes from B.
	a.store.w.SetDelay(20 * time.Millisecond)
	go func() {
		for a.store.w.Gets() < 2 {
			time.Sleep(time.Millisecond)
		}
		a.store.w.Kill()
	}()
	if _, err := c.p.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(c.store.get(o.Ref()), want) {
		t.Fatal("C's replica differs")
	}
	if st := c.p.Stats(); st.Failovers != 1 {
		t.Fatalf("stats %+v, want one failover", st)
	}
}

func TestPullOnlyHolderDies(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a, b := startNode(t, srv, nw, "a", secret), startNode(t, srv, nw, "b", secret)
	ctx := bounded(t, 30*time.Second)
	o, _ := a.put(t, "lonely", 8<<20, 1<<20)
	a.store.w.SetDelay(20 * time.Millisecond)
	go func() {
		for a.store.w.Gets() < 2 {
			time.Sleep(time.Millisecond)
		}
		a.store.w.Kill()
	}()
	start := time.Now()
	_, err := b.p.Pull(ctx, o.Ref())
	took := time.Since(start)
	if err == nil || !strings.Contains(err.Error(), "node a") || strings.Contains(err.Error(), "\n") {
		t.Fatalf("pull from a dead only holder: %v; want one line naming node a", err)
	}
	t.Logf("failed after %v: %v", took.Round(time.Millisecond), err)
	if b.store.get(o.Ref()) != nil {
		t.Fatal("a half replica is visible")
	}
	b.store.mu.Lock()
	left := len(b.store.objects)
	b.store.mu.Unlock()
	if left != 0 {
		t.Fatal("the aborted replica is left")
	}
	// A hung holder (no answer at all) is dropped after the chunk timeout.
	h := startNode(t, srv, nw, "h", secret)
	o2, _ := h.put(t, "hung", 2<<20, 1<<20)
	b.p.ChunkTimeout = 500 * time.Millisecond
	h.store.w.SetDelay(time.Hour)
	start = time.Now()
	_, err = b.p.Pull(ctx, o2.Ref())
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
	o, data := a.put(t, "flaky", 3<<20, 1<<20)
	data[(1<<20)+7] ^= 0x40 // corrupt A's copy after its checksums were recorded
	_, err := b.p.Pull(ctx, o.Ref())
	if !errors.Is(err, cluster.ErrChecksum) || !strings.Contains(err.Error(), "chunk 1") || !strings.Contains(err.Error(), "node a") {
		t.Fatalf("pull of a corrupt chunk: %v", err)
	}
	if b.store.get(o.Ref()) != nil {
		t.Fatal("a corrupt replica is visible")
	}
}

func TestPullRefusedWithoutSecret(t *testing.T) {
	srv := etcdtest.Start(t)
	nw := memtransport.NewNetwork()
	a := startNode(t, srv, nw, "a", secret)
	ctx := bounded(t, 30*time.Second)
	o, _ := a.put(t, "private", 1<<20, 0)
	// A node with another secret: its directory cannot read the
	// records (forged to it), and A refuses its control channel.
	evil := startNode(t, srv, nw, "evil", mustSecret("not-the-cluster-secret!!"))
	if _, err := evil.p.Pull(ctx, o.Ref()); !errors.Is(err, cluster.ErrBadRecord) {
		t.Fatalf("pull with the wrong secret: %v", err)
	}
	an, err := a.dir.Node(ctx, "a")
	if err != nil {
		t.Fatal(err)
	}
	_, err = cluster.DialControl(ctx, mustSecret("not-the-cluster-secret!!"), "evil", "a", an.Control)
	if !errors.Is(err, cluster.ErrAuth) {
		t.Fatalf("control channel with the wrong secret: %v", err)
	}
	a.store.mu.Lock()
	ex := a.store.exposed
	a.store.mu.Unlock()
	if ex != 0 || a.store.w.Gets() != 0 {
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
