// Package clustertest runs cluster nodes inside one test process: each node
// a real directory on a real etcd, a control server on loopback, a puller,
// and a small in-memory store, over any Transport that can register memory.
package clustertest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/etcddir"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
)

// Transport is a cluster.Transport that can also expose memory.
type Transport interface {
	cluster.Transport
	// Register exposes b: the rkey and remote address of its first byte
	// that peers Get with, and release to withdraw it.
	Register(b []byte) (rkey []byte, addr uint64, release func(), err error)
}

// Store is a node's local objects as the puller (Sink) and the control
// server (Source) see them.
type Store struct {
	T       Transport
	mu      sync.Mutex
	objects map[cluster.Ref]*obj
	exposed int
	creates int
}

type obj struct {
	id     string
	b      []byte
	sealed bool
}

// Create implements cluster.Sink.
func (s *Store) Create(ctx context.Context, o cluster.Object) (cluster.Replica, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.objects[o.Ref()]; ok {
		return nil, fmt.Errorf("%s exists locally", o.Ref())
	}
	ob := &obj{id: o.ID, b: make([]byte, o.Size)}
	s.objects[o.Ref()] = ob
	s.creates++
	return &replica{s: s, ref: o.Ref(), o: ob}, nil
}

type replica struct {
	s   *Store
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

// Creates counts the replicas Create made: the room a store would have
// made for them.
func (s *Store) Creates() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.creates
}

// Forget drops the local object ref, leaving its records as they are: the
// directory still names this node a holder, which refuses to expose it.
func (s *Store) Forget(ref cluster.Ref) {
	s.mu.Lock()
	delete(s.objects, ref)
	s.mu.Unlock()
}

// Expose implements cluster.Source.
func (s *Store) Expose(ref cluster.Ref, id string) (cluster.Exposure, func(), error) {
	s.mu.Lock()
	o, ok := s.objects[ref]
	s.mu.Unlock()
	if !ok || !o.sealed || o.id != id {
		return cluster.Exposure{}, nil, fmt.Errorf("%s: %w", ref, cluster.ErrNotFound)
	}
	rkey, addr, release, err := s.T.Register(o.b)
	if err != nil {
		return cluster.Exposure{}, nil, err
	}
	s.mu.Lock()
	s.exposed++
	s.mu.Unlock()
	return cluster.Exposure{Worker: s.T.WorkerAddress(), RKey: rkey, Addr: addr, Size: int64(len(o.b))}, func() {
		release()
		s.mu.Lock()
		s.exposed--
		s.mu.Unlock()
	}, nil
}

// Get returns the bytes of a sealed local object, nil when there is none.
func (s *Store) Get(ref cluster.Ref) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	if o, ok := s.objects[ref]; ok && o.sealed {
		return o.b
	}
	return nil
}

// Len counts local objects, sealed or not.
func (s *Store) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.objects)
}

// Exposed counts the exposures not yet released.
func (s *Store) Exposed() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.exposed
}

// Node is one cluster node of a test.
type Node struct {
	Name  string
	Dir   *etcddir.Directory
	Store *Store
	P     *cluster.Puller
	// Feeding is served by the node's control server; EnableFanout lets
	// the puller use it.
	Feeding *cluster.Feeding
}

// StartNode starts a node named name on etcd srv with transport tr.
func StartNode(t *testing.T, srv *etcdtest.Server, tr Transport, name string, sec cluster.Secret) *Node {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, closeNode, err := OpenNode(ctx, NodeOptions{Endpoints: []string{srv.Endpoint()}, Prefix: "/t/" + t.Name() + "/",
		Listen: "127.0.0.1:0", Name: name, Secret: sec, T: tr})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(closeNode)
	return n
}

// NodeOptions say where a node of OpenNode runs.
type NodeOptions struct {
	// Endpoints and Prefix locate the directory in etcd.
	Endpoints []string
	Prefix    string
	// Listen is the control channel's address (host:port; port 0 for any),
	// which the node advertises as it is bound.
	Listen string
	Name   string
	Secret cluster.Secret
	T      Transport
}

// OpenNode starts a node, as StartNode does, outside a test (in a helper
// process): closeNode stops it.
func OpenNode(ctx context.Context, o NodeOptions) (n *Node, closeNode func(), err error) {
	dir, err := etcddir.Open(ctx, etcddir.Config{Endpoints: o.Endpoints, Node: o.Name, Secret: o.Secret,
		TTL: 2 * time.Second, CallTimeout: 5 * time.Second, Prefix: o.Prefix})
	if err != nil {
		return nil, nil, err
	}
	st := &Store{T: o.T, objects: map[cluster.Ref]*obj{}}
	ln, err := net.Listen("tcp", o.Listen)
	if err != nil {
		dir.Close()
		return nil, nil, err
	}
	feeding := &cluster.Feeding{}
	cs := &cluster.ControlServer{Node: o.Name, Secret: o.Secret, Source: st, Feeding: feeding}
	served := make(chan struct{})
	go func() { cs.Serve(ln); close(served) }()
	closeNode = func() {
		if n != nil {
			n.P.Close()
		}
		ln.Close()
		<-served
		dir.Close()
	}
	if err := dir.Join(ctx, cluster.Node{Name: o.Name, Worker: o.T.WorkerAddress(), Control: ln.Addr().String()}); err != nil {
		closeNode()
		return nil, nil, err
	}
	n = &Node{Name: o.Name, Dir: dir, Store: st, Feeding: feeding,
		P: &cluster.Puller{Dir: dir, Transport: o.T, Secret: o.Secret, Sink: st, ChunkTimeout: 3 * time.Second}}
	return n, closeNode, nil
}

// Put makes a sealed local object of random bytes on n and publishes it.
func (n *Node) Put(t *testing.T, name string, size int64, chunk int64) (cluster.Object, []byte) {
	t.Helper()
	o, b, err := n.Publish(context.Background(), name, size, chunk)
	if err != nil {
		t.Fatal(err)
	}
	return o, b
}

// Publish is Put outside a test.
func (n *Node) Publish(ctx context.Context, name string, size int64, chunk int64) (cluster.Object, []byte, error) {
	b := make([]byte, size)
	rand.NewChaCha8([32]byte{byte(size), byte(len(name)), byte(size >> 16)}).Read(b)
	if chunk == 0 {
		chunk = cluster.ChunkSizeFor(size)
	}
	o := cluster.Object{Name: name, Owner: 1000, Size: size, ChunkSize: chunk, Sums: cluster.Checksums(b, chunk), ID: cluster.NewID()}
	return n.PublishAs(ctx, o, b)
}

// PublishAs makes b a sealed local object of record o (whose checksums and
// id it fills in when missing) and publishes it: for versions, shards.
func (n *Node) PublishAs(ctx context.Context, o cluster.Object, b []byte) (cluster.Object, []byte, error) {
	if o.ChunkSize == 0 {
		o.ChunkSize = cluster.ChunkSizeFor(int64(len(b)))
	}
	if o.Sums == nil {
		o.Sums = cluster.Checksums(b, o.ChunkSize)
	}
	if o.ID == "" {
		o.ID = cluster.NewID()
	}
	o.Size = int64(len(b))
	n.Store.mu.Lock()
	n.Store.objects[o.Ref()] = &obj{id: o.ID, b: b, sealed: true}
	n.Store.mu.Unlock()
	if _, err := n.Dir.Publish(ctx, o); err != nil {
		return o, nil, err
	}
	return o, b, nil
}
