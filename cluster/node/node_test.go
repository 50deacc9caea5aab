package node_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/etcddir"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/store"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

func TestMain(m *testing.M) {
	testutil.SetUCXLoopbackEnv()
	testutil.RunRole(roles)
	os.Exit(m.Run())
}

var secret, _ = cluster.NewSecret([]byte("node-test-cluster-secret"))

type daemon struct {
	logMu  sync.Mutex
	logBuf bytes.Buffer
	name   string
	node   *node.Node
	st     *store.Store
	sock   string
	c      *client.Client
}

// startDaemon runs a store daemon in this process, joined to the cluster
// on srv, and a client of it.
func startDaemon(t testing.TB, srv *etcdtest.Server, name string) *daemon {
	t.Helper()
	return startDaemonCap(t, srv, name, 256<<20)
}

// startDaemonCap is startDaemon with a capacity.
func startDaemonCap(t testing.TB, srv *etcdtest.Server, name string, capacity int64) *daemon {
	t.Helper()
	return startDaemonOn(t, srv, name, capacity, "host")
}

// startDaemonOn is startDaemonCap with a store backend ("host", "cuda").
// twoDaemons starts etcd and two host daemons, a and b, and returns them
// with a context that ends after timeout or with the test.
func twoDaemons(t *testing.T, timeout time.Duration) (srv *etcdtest.Server, a, b *daemon, ctx context.Context) {
	t.Helper()
	srv = etcdtest.Start(t)
	a, b = startDaemon(t, srv, "a"), startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	t.Cleanup(cancel)
	return srv, a, b, ctx
}

func startDaemonOn(t testing.TB, srv *etcdtest.Server, name string, capacity int64, backend string) *daemon {
	t.Helper()
	return startDaemonKeep(t, srv, name, capacity, backend, 2)
}

// startDaemonKeep is startDaemonOn with the directory's KeepRecords.
func startDaemonKeep(t testing.TB, srv *etcdtest.Server, name string, capacity int64, backend string, keepRecords int) *daemon {
	t.Helper()
	return startDaemonWith(t, srv, name, capacity, backend, func(c *node.Config) { c.Directory.KeepRecords = keepRecords })
}

// startDaemonWith is startDaemonOn with the node's configuration as set
// changes it (after the test's defaults: KeepRecords 2).
func startDaemonWith(t testing.TB, srv *etcdtest.Server, name string, capacity int64, backend string, set func(*node.Config)) *daemon {
	t.Helper()
	return startDaemonOpts(t, srv, name, daemonOpts{capacity: capacity, backend: backend, node: set})
}

// daemonOpts are what startDaemonOpts starts a daemon with.
type daemonOpts struct {
	capacity int64
	backend  string
	// node and store, when set, change the node's and the store's
	// configuration after the test's defaults.
	node  func(*node.Config)
	store func(*store.Config)
	// public puts the socket in a directory every uid may enter.
	public bool
}

// startDaemonOpts is startDaemon with options.
func startDaemonOpts(t testing.TB, srv *etcdtest.Server, name string, o daemonOpts) *daemon {
	t.Helper()
	capacity, backend, set := o.capacity, o.backend, o.node
	if set == nil {
		set = func(*node.Config) {}
	}
	if err := ucx.Available(); err != nil {
		if os.Getenv("CUDAIPC_REQUIRE_UCX") == "1" || os.Getenv(etcdtest.EnvRequire) == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	d := &daemon{name: name}
	log := slog.New(slog.NewTextHandler(testWriter{t, name, &d.logMu, &d.logBuf}, &slog.HandlerOptions{Level: slog.LevelInfo}))
	cfg := node.Config{
		Directory: etcddir.Config{Endpoints: []string{srv.Endpoint()}, Node: name, Secret: secret, TTL: 2 * time.Second,
			CallTimeout: 5 * time.Second, Prefix: "/t/" + t.Name() + "/", KeepRecords: 2},
		Listen: "127.0.0.1:0", Logger: log,
	}
	set(&cfg)
	n, err := node.Start(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(n.Collectors()...)
	scfg := store.Config{Backend: backend, Capacity: capacity, Cluster: n, Logger: log, Registerer: reg}
	if o.store != nil {
		o.store(&scfg)
	}
	st, err := store.New(scfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Attach(ctx, st); err != nil {
		t.Fatal(err)
	}
	d.node, d.st, d.sock = n, st, filepath.Join(t.TempDir(), "s.sock")
	if o.public {
		dir, err := os.MkdirTemp("", "cudaipc-node-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		d.sock = filepath.Join(dir, "s.sock")
	}
	sctx, stop := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() { st.ListenAndServe(sctx, d.sock); close(served) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if d.c, err = client.Dial(ctx, d.sock); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Cleanup(func() {
		d.c.Close()
		stop()
		<-served
		st.Close()
		n.Close()
	})
	return d
}

type testWriter struct {
	t    testing.TB
	name string
	mu   *sync.Mutex
	buf  *bytes.Buffer
}

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Logf("%s: %s", w.name, strings.TrimSpace(string(b)))
	w.mu.Lock()
	w.buf.Write(b)
	w.mu.Unlock()
	return len(b), nil
}

// logged reports whether d's log has s.
func (d *daemon) logged(s string) bool {
	d.logMu.Lock()
	defer d.logMu.Unlock()
	return strings.Contains(d.logBuf.String(), s)
}

func (d *daemon) put(t *testing.T, name string, size int, opts client.CreateOptions) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	b := make([]byte, size)
	rand.NewChaCha8([32]byte{byte(size), byte(len(name))}).Read(b)
	o, err := d.c.Create(ctx, name, int64(size), opts)
	if err != nil {
		t.Fatal(err)
	}
	copy(o.Bytes(), b)
	if err := o.Seal(ctx); err != nil {
		t.Fatal(err)
	}
	return b
}

func (d *daemon) get(ctx context.Context, name string) ([]byte, error) {
	l, err := d.c.Get(ctx, name)
	if err != nil {
		return nil, err
	}
	defer l.Release()
	return bytes.Clone(l.Bytes()), nil
}

// eventually polls cond until it holds, failing after timeout.
func eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestDaemonsShareObjects(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := startDaemon(t, srv, "a"), startDaemon(t, srv, "b"), startDaemon(t, srv, "c")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	want := a.put(t, "weights", 6<<20+77, client.CreateOptions{Cluster: true})
	a.put(t, "local-only", 4096, client.CreateOptions{})
	// Put on A, get on B and C: an ordinary local lease.
	for _, d := range []*daemon{b, c} {
		got, err := d.get(ctx, "weights")
		if err != nil {
			t.Fatalf("get on %s: %v", d.name, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("get on %s: bytes differ", d.name)
		}
		info, err := d.c.Stat(ctx, "weights")
		if err != nil || !info.Cluster || !info.Sealed || info.Size != int64(len(want)) {
			t.Fatalf("stat on %s: %+v %v", d.name, info, err)
		}
	}
	if m := metric(t, b.st, "cudaipc_cluster_pulled_bytes_total"); m != fmt.Sprintf("%g", float64(len(want))) {
		t.Errorf("B's pulled bytes metric: %s, want %d", m, len(want))
	}
	if m := metric(t, a.st, "cudaipc_cluster_exposures_total"); m == "0" || m == "" {
		t.Errorf("A's exposures metric: %q", m)
	}
	if f, g := metric(t, b.st, `cudaipc_cluster_reads_total{read="fetch"}`), metric(t, b.st, `cudaipc_cluster_reads_total{read="get"}`); f == "0" || f == "" || g != "0" {
		t.Errorf("B's reads: %q fetches, %q GETs; want fetches only", f, g)
	}
	// A answered B's fetches, and perhaps C's (C reads from A and B).
	if m := metric(t, a.st, `cudaipc_cluster_fetch_answers_total{result="sent"}`); m == "0" || m == "" {
		t.Errorf("A's fetch answers sent: %q", m)
	}
	var sent float64
	if _, err := fmt.Sscan(metric(t, a.st, "cudaipc_cluster_fetch_sent_bytes_total"), &sent); err != nil || sent < float64(len(want)) {
		t.Errorf("A sent %g bytes answering fetches (%v), want at least B's %d", sent, err, len(want))
	}
	if m := metric(t, a.st, `cudaipc_cluster_fetch_answers_total{result="refused"}`); m != "0" {
		t.Errorf("A refused %q fetches", m)
	}
	// B and C advertise their replicas after answering the gets.
	testutil.Eventually(t, testutil.Wait, func() error {
		ls, err := c.node.Directory().List(ctx)
		if err != nil || len(ls) != 1 || strings.Join(ls[0].Holders, ",") != "a,b,c" {
			return fmt.Errorf("directory: %+v %v", ls, err)
		}
		return nil
	})
	// Node-local objects do not cross.
	if _, err := b.get(ctx, "local-only"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("get of A's local object on B: %v", err)
	}
	// Deleting on C removes every replica.
	if err := c.c.Delete(ctx, "weights"); err != nil {
		t.Fatal(err)
	}
	for _, d := range []*daemon{a, b} {
		eventually(t, 10*time.Second, "replica on "+d.name+" dropped", func() bool {
			_, err := d.c.Stat(ctx, "weights")
			return errors.Is(err, client.ErrNotFound)
		})
	}
	if _, err := b.get(ctx, "weights"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("get after the cluster delete: %v", err)
	}
	// The name can be put again, anywhere.
	want2 := b.put(t, "weights", 100000, client.CreateOptions{Cluster: true})
	if got, err := a.get(ctx, "weights"); err != nil || !bytes.Equal(got, want2) {
		t.Fatalf("get of the new incarnation on A: %v", err)
	}
}

func TestDaemonWithoutCluster(t *testing.T) {
	st, err := store.New(store.Config{Backend: "host", Capacity: 16 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	sock := filepath.Join(t.TempDir(), "s.sock")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sctx, stop := context.WithCancel(ctx)
	served := make(chan struct{})
	go func() { st.ListenAndServe(sctx, sock); close(served) }()
	defer func() { stop(); <-served }()
	var c *client.Client
	eventually(t, 10*time.Second, "daemon up", func() bool {
		c, err = client.Dial(ctx, sock)
		return err == nil
	})
	defer c.Close()
	if _, err := c.Create(ctx, "x", 10, client.CreateOptions{Cluster: true}); !errors.Is(err, client.ErrInvalid) || !strings.Contains(err.Error(), "not part of a cluster") {
		t.Fatalf("cluster object on a lone daemon: %v", err)
	}
	if _, err := c.Get(ctx, "x"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("get on a lone daemon: %v", err)
	}
}

func TestRestartedNodeRejoins(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	b := startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	want := a.put(t, "kept", 300000, client.CreateOptions{Cluster: true})
	if got, err := b.get(ctx, "kept"); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("get on B: %v", err)
	}
	// A second live node named b is refused (after waiting out the TTL).
	start := time.Now()
	n, err := node.Start(ctx, node.Config{
		Directory: etcddir.Config{Endpoints: []string{srv.Endpoint()}, Node: "b", Secret: secret, TTL: 2 * time.Second,
			CallTimeout: 5 * time.Second, Prefix: "/t/" + t.Name() + "/"},
		Listen: "127.0.0.1:0",
	})
	if err != nil {
		t.Fatal(err)
	}
	st, err := store.New(store.Config{Backend: "host", Capacity: 16 << 20, Cluster: n})
	if err != nil {
		t.Fatal(err)
	}
	err = n.Attach(ctx, st)
	st.Close()
	n.Close()
	if !errors.Is(err, cluster.ErrExists) || time.Since(start) > 10*time.Second {
		t.Fatalf("a second node b: %v after %v, want ErrExists within the TTL", err, time.Since(start))
	}
}

// TestChunkSizeConfig: a node configured with a chunk size publishes its
// objects in chunks of it (and a larger one only where the object would
// have too many), and another node of the default pulls them intact; a
// chunk size that is not a power of two in bounds is refused at Start.
func TestChunkSizeConfig(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemonWith(t, srv, "a", 256<<20, "host", func(c *node.Config) { c.ChunkSize = 1 << 20 })
	b := startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	want := a.put(t, "fine", 5<<20+123, client.CreateOptions{Cluster: true})
	e, err := b.node.Directory().Lookup(ctx, cluster.Ref{Name: "fine"})
	if err != nil {
		t.Fatal(err)
	}
	if e.ChunkSize != 1<<20 || len(e.Sums) != 6 {
		t.Fatalf("A's record: chunk %d, %d sums; want 1 MiB chunks, 6", e.ChunkSize, len(e.Sums))
	}
	if got, err := b.get(ctx, "fine"); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("get on B: %v (bytes equal: %v)", err, bytes.Equal(got, want))
	}
	// B's default: 4 MiB.
	want = b.put(t, "coarse", 5<<20+123, client.CreateOptions{Cluster: true})
	if e, err = a.node.Directory().Lookup(ctx, cluster.Ref{Name: "coarse"}); err != nil || e.ChunkSize != cluster.DefaultChunkSize {
		t.Fatalf("B's record: chunk %d, %v; want the default, %d", e.ChunkSize, err, cluster.DefaultChunkSize)
	}
	if got, err := a.get(ctx, "coarse"); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("get on A: %v", err)
	}
	for _, bad := range []int64{3 << 20, cluster.MinChunkSize / 2, 2 * cluster.MaxChunkSize, -1} {
		_, err := node.Start(ctx, node.Config{
			Directory: etcddir.Config{Endpoints: []string{srv.Endpoint()}, Node: "bad", Secret: secret, Prefix: "/t/" + t.Name() + "/"},
			Listen:    "127.0.0.1:0", ChunkSize: bad,
		})
		if err == nil || !strings.Contains(err.Error(), "power of two") {
			t.Fatalf("chunk size %d: %v, want a refusal naming a power of two", bad, err)
		}
	}
}

// publish writes a version of name on d: shards shards of size bytes each,
// in one version; it returns the version and the shards' bytes.
func (d *daemon) publish(t *testing.T, name string, shards, size int) (uint64, [][]byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var ver uint64
	var all [][]byte
	for i := range shards {
		o, err := d.c.Publish(ctx, name, int64(size), client.CreateOptions{Cluster: true, Shards: shards, Shard: i, Version: ver})
		if err != nil {
			t.Fatalf("publish %s shard %d on %s: %v", name, i, d.name, err)
		}
		ver = o.Version()
		b := make([]byte, size)
		rand.NewChaCha8([32]byte{byte(ver), byte(i), 3}).Read(b)
		copy(o.Bytes(), b)
		if err := o.Seal(ctx); err != nil {
			t.Fatalf("seal %s v%d shard %d on %s: %v", name, ver, i, d.name, err)
		}
		all = append(all, b)
	}
	return ver, all
}

func (d *daemon) getVersion(ctx context.Context, name string, opts client.GetOptions) (uint64, []byte, error) {
	l, err := d.c.GetWith(ctx, name, opts)
	if err != nil {
		return 0, nil, err
	}
	defer l.Release()
	return l.Info().Version, bytes.Clone(l.Bytes()), nil
}

func TestVersionsAcrossDaemons(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := startDaemon(t, srv, "a"), startDaemon(t, srv, "b"), startDaemon(t, srv, "c")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	v1, s1 := a.publish(t, "policy", 2, 200000)
	// B reads the latest version, both shards, as ordinary leases.
	ver, got, err := b.getVersion(ctx, "policy", client.GetOptions{})
	if err != nil || ver != v1 || !bytes.Equal(got, s1[0]) {
		t.Fatalf("latest on B: v%d %v (want v%d)", ver, err, v1)
	}
	if ver, got, err = b.getVersion(ctx, "policy", client.GetOptions{Version: v1, Shard: 1}); err != nil || ver != v1 || !bytes.Equal(got, s1[1]) {
		t.Fatalf("shard 1 on B: v%d %v", ver, err)
	}
	// C waits for a version newer than v1; A publishes v2.
	type result struct {
		ver uint64
		b   []byte
		err error
	}
	res := make(chan result, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		ver, got, err := c.getVersion(wctx, "policy", client.GetOptions{NewerThan: v1, Wait: true})
		res <- result{ver, got, err}
	}()
	v2, s2 := a.publish(t, "policy", 2, 200000)
	select {
	case r := <-res:
		if r.err != nil || r.ver != v2 || !bytes.Equal(r.b, s2[0]) {
			t.Fatalf("newer than v%d on C: v%d %v (want v%d)", v1, r.ver, r.err, v2)
		}
	case <-time.After(40 * time.Second):
		t.Fatal("C's get newer_than did not return")
	}
	// v3 prunes v1's records (KeepRecords 2): B keeps its replica of v1
	// (no name was deleted) and reads v3 when asked for the latest.
	v3, s3 := a.publish(t, "policy", 2, 200000)
	eventually(t, 10*time.Second, "v1's records pruned", func() bool {
		_, err := b.node.Directory().Lookup(ctx, cluster.Ref{Owner: 0, Name: "policy", Version: v1})
		return errors.Is(err, cluster.ErrNotFound)
	})
	if ver, got, err := b.getVersion(ctx, "policy", client.GetOptions{Version: v1}); err != nil || ver != v1 || !bytes.Equal(got, s1[0]) {
		t.Fatalf("B's own v%d after its records were pruned: v%d %v", v1, ver, err)
	}
	if ver, got, err := b.getVersion(ctx, "policy", client.GetOptions{NewerThan: v2, Wait: true}); err != nil || ver != v3 || !bytes.Equal(got, s3[0]) {
		t.Fatalf("newer than v%d on B: v%d %v", v2, ver, err)
	}

	// Shards published on different nodes form one version: shard 0 of
	// version 10 on A, shard 1 on B; C reads both, and A, which holds only
	// its own shard, completes the version from B.
	s10 := make([][]byte, 2)
	for i, d := range []*daemon{a, b} {
		o, err := d.c.Publish(ctx, "joint", 150000, client.CreateOptions{Cluster: true, Version: 10, Shards: 2, Shard: i})
		if err != nil {
			t.Fatal(err)
		}
		s10[i] = make([]byte, 150000)
		rand.NewChaCha8([32]byte{10, byte(i)}).Read(s10[i])
		copy(o.Bytes(), s10[i])
		if err := o.Seal(ctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []*daemon{c, a, b} {
		for shard := range 2 {
			ver, got, err := d.getVersion(ctx, "joint", client.GetOptions{Version: 10, Shard: shard})
			if err != nil || ver != 10 || !bytes.Equal(got, s10[shard]) {
				t.Fatalf("joint v10 shard %d on %s: v%d %v", shard, d.name, ver, err)
			}
		}
		if ver, _, err := d.getVersion(ctx, "joint", client.GetOptions{}); err != nil || ver != 10 {
			t.Fatalf("joint latest on %s: v%d %v", d.name, ver, err)
		}
	}

	// A get newer than the latest times out as a local one would.
	short, cancel2 := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel2()
	if _, _, err := b.getVersion(short, "policy", client.GetOptions{NewerThan: v3, Wait: true}); !errors.Is(err, client.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("newer than the latest: %v", err)
	}
	// Deleting the name on C removes it everywhere.
	if err := c.c.Delete(ctx, "policy"); err != nil {
		t.Fatal(err)
	}
	for _, d := range []*daemon{a, b} {
		eventually(t, 10*time.Second, "policy gone from "+d.name, func() bool {
			_, err := d.c.Stat(ctx, "policy")
			return errors.Is(err, client.ErrNotFound)
		})
	}
}

// metric returns the value of an unlabelled metric of st's /metrics.
func metric(t *testing.T, st *store.Store, name string) string {
	t.Helper()
	rec := httptest.NewRecorder()
	st.MetricsHandler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	for line := range strings.SplitSeq(rec.Body.String(), "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			return v
		}
	}
	return ""
}

func TestLocalWorkWithoutEtcd(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	kept := a.put(t, "kept", 5000, client.CreateOptions{})
	srv.Kill()
	// Local objects are read and written as before.
	if got, err := a.get(ctx, "kept"); err != nil || !bytes.Equal(got, kept) {
		t.Fatalf("local get with etcd down: %v", err)
	}
	// A get that waits is answered by a local seal.
	done := make(chan error, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		l, err := a.c.GetWith(wctx, "later", client.GetOptions{Wait: true})
		if err == nil {
			l.Release()
		}
		done <- err
	}()
	eventually(t, 20*time.Second, "the waiting get found the directory away", func() bool {
		return a.logged("cluster directory unavailable: the get waits")
	})
	a.put(t, "later", 100, client.CreateOptions{})
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("waiting get with etcd down: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("waiting get not answered by the local seal")
	}
	// A cluster-visible put is sealed here but says it is not published.
	o, err := a.c.Create(ctx, "pub", 100, client.CreateOptions{Cluster: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Seal(ctx); err == nil || !strings.Contains(err.Error(), "not published to the cluster") || !strings.Contains(err.Error(), "unavailable") {
		t.Fatalf("cluster seal with etcd down: %v", err)
	}
	// The failed put left nothing behind: once etcd is back it is simply
	// put again, and published.
	if _, err := a.c.Stat(ctx, "pub"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("stat of the unpublished object: %v", err)
	}
	srv.Restart()
	eventually(t, 30*time.Second, "a cluster put works again", func() bool {
		o, err := a.c.Create(ctx, "pub", 100, client.CreateOptions{Cluster: true})
		if err != nil {
			return false
		}
		return o.Seal(ctx) == nil
	})
	if _, err := a.node.Directory().Lookup(ctx, cluster.Ref{Owner: 0, Name: "pub"}); err != nil {
		t.Fatalf("the put after etcd came back is not in the directory: %v", err)
	}
}

func TestPinHoldsReplica(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 60*time.Second)
	a.put(t, "pinned", 100000, client.CreateOptions{Cluster: true})
	e, err := b.node.Directory().Lookup(ctx, cluster.Ref{Owner: 0, Name: "pinned"})
	if err != nil {
		t.Fatal(err)
	}
	leases := func() int {
		info, err := a.c.Stat(ctx, "pinned")
		if err != nil {
			t.Fatal(err)
		}
		return info.Leases
	}
	if n := leases(); n != 0 {
		t.Fatalf("leases before the pin: %d", n)
	}
	// B's pin makes A hold its replica (a lease of A's own: no eviction,
	// no reuse) until B unpins.
	unpin, err := b.node.Directory().Pin(ctx, "a", e.Ref(), e.ID)
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "A holds its pinned replica", func() bool { return leases() == 1 })
	unpin()
	eventually(t, 10*time.Second, "A lets go after the unpin", func() bool { return leases() == 0 })
}

// A version of more shards than a node pulls at once (shardPulls): one get
// on B brings every shard, each with A's bytes.
func TestManyShardsAcrossDaemons(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 60*time.Second)
	const shards = 9
	v, want := a.publish(t, "many", shards, 300001)
	if ver, got, err := b.getVersion(ctx, "many", client.GetOptions{}); err != nil || ver != v || !bytes.Equal(got, want[0]) {
		t.Fatalf("latest on B: v%d %v (want v%d, shard 0's bytes)", ver, err, v)
	}
	if p := b.node.Stats().Pulls; p != shards {
		t.Fatalf("B made %d pulls for a version of %d shards", p, shards)
	}
	for i := range shards {
		ver, got, err := b.getVersion(ctx, "many", client.GetOptions{Version: v, Shard: i})
		if err != nil || ver != v || !bytes.Equal(got, want[i]) {
			t.Fatalf("shard %d on B: v%d %v", i, ver, err)
		}
	}
	if p := b.node.Stats().Pulls; p != shards {
		t.Fatalf("B pulled %d more objects for shards the version's first get brought", p-shards)
	}
}
