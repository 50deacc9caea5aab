package node_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/kv"
	"github.com/cudaipc/cudaipc/protocol"
)

// Cluster-wide KV block pools (docs/kv.md, "Across the cluster"): keys
// placed on the live nodes by rendezvous hashing, each node's share in its
// own pool, reached through any node's daemon.

// waitLive waits until each daemon's mirror of the directory has the live
// nodes names, sorted.
func waitLive(t *testing.T, names []string, ds ...*daemon) {
	t.Helper()
	testutil.Eventually(t, testutil.Wait, func() error {
		for _, d := range ds {
			if got, _, _ := d.node.Mirror().LiveNodes(); !slices.Equal(got, names) {
				return fmt.Errorf("daemon %s's live nodes are %v, want %v", d.name, got, names)
			}
		}
		return nil
	})
}

// chainKeys returns n keys of 32 random bytes (an engine's chained block
// hashes, as far as the pool can tell).
func chainKeys(seed uint64, n int) [][]byte {
	r := rand.New(rand.NewPCG(seed, 99))
	out := make([][]byte, n)
	for i := range out {
		out[i] = make([]byte, 32)
		for j := range out[i] {
			out[i][j] = byte(r.Uint32())
		}
	}
	return out
}

// owners returns the node each key belongs to among nodes.
func owners(keys [][]byte, nodes ...string) []string {
	p := cluster.NewPlacement(nodes)
	out := make([]string, len(keys))
	for i, k := range keys {
		out[i] = nodes[p.Owner(k)]
	}
	return out
}

func countOf(s []string, v string) int {
	n := 0
	for _, x := range s {
		if x == v {
			n++
		}
	}
	return n
}

// poolEngine is a host KV space registered on a daemon, random bytes in
// every block, and its pool.
type poolEngine struct {
	src  *hostSpace
	sp   *kv.Space
	pool *kv.Pool
	cfg  client.PoolConfig
}

// newPoolEngine registers a space of layers and blocks (vLLM's layout,
// bsize bytes a part) with random bytes of seed on d, and makes (or
// opens) the cluster-wide pool "prefix" of its blocks there.
func newPoolEngine(ctx context.Context, t *testing.T, d *daemon, layers, blocks int, bsize int64, seed uint64) *poolEngine {
	t.Helper()
	l, sizes := kvLayout("vllm", layers, blocks, bsize)
	e := &poolEngine{src: newHostSpace(t, l, sizes, seed)}
	var err error
	if e.sp, err = kv.Register(ctx, d.c, fmt.Sprintf("engine/%s/%d", d.name, seed), e.src.local, client.RegisterOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.sp.Close(context.Background()) })
	bb, err := e.sp.Desc().BlockBytes(0, 0)
	if err != nil {
		t.Fatal(err)
	}
	e.cfg = client.PoolConfig{BlockBytes: bb, KeyBytes: 32, Capacity: int64(max(1024, blocks)) * bb, Cluster: true}
	if e.pool, err = kv.CreatePool(ctx, d.c, "prefix", e.cfg); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.pool.Close() })
	return e
}

// checkBlocks checks that block dstIDs[i] of dst holds block srcIDs[i] of
// src for each i in which, every byte of every layer.
func checkBlocks(t *testing.T, src, dst *hostSpace, srcIDs, dstIDs []int, which []int) {
	t.Helper()
	for _, i := range which {
		for l := range src.local.Layers {
			for p := range src.local.Layers[l] {
				want := kvBlock(src.local.Layout, l, p, srcIDs[i], src.region)
				if got := kvBlock(dst.local.Layout, l, p, dstIDs[i], dst.region); !bytes.Equal(got, want) {
					t.Fatalf("key %d: destination block %d, layer %d part %d differs from source block %d", i, dstIDs[i], l, p, srcIDs[i])
				}
			}
		}
	}
}

func seqFrom(n int) []int { return seq(n) }

// TestPoolAcrossNodes: a cluster-wide pool over three daemons. A put on
// one places each key on its node (a node without the pool makes it);
// lookups, gets, pinned lookups and deletes through any daemon reach them
// all, blocks inline or staged, every byte checked.
func TestPoolAcrossNodes(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b, c := startDaemon(t, srv, "a"), startDaemon(t, srv, "b"), startDaemon(t, srv, "c")
	all := []string{"a", "b", "c"}
	waitLive(t, all, a, b, c)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const layers, blocks, bsize = 4, 96, 512 // blocks of 4 KiB
	ea := newPoolEngine(ctx, t, a, layers, blocks, bsize, 7)
	// c makes the pool too; b has none until a put needs it.
	pc, err := kv.CreatePool(ctx, c.c, "prefix", ea.cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	if again, err := kv.CreatePool(ctx, a.c, "prefix", ea.cfg); err != nil || again.Info().ID != ea.pool.Info().ID || !again.Info().Cluster {
		t.Fatalf("a second cluster-wide create of the same pool: %+v, %v; want the pool", again.Info(), err)
	}
	other := ea.cfg
	other.BlockBytes *= 2
	if _, err := kv.CreatePool(ctx, a.c, "prefix", other); !errors.Is(err, client.ErrExists) {
		t.Fatalf("a cluster-wide create of another shape: %v, want EXISTS", err)
	}
	r := rand.New(rand.NewPCG(5, 6))
	const n = 90
	keys := chainKeys(1, n)
	own := owners(keys, all...)
	srcIDs := scattered(r, n, blocks)
	res, err := ea.pool.Put(ctx, kv.PutRequest{Keys: keys, Src: ea.sp.Desc(), SrcBlocks: srcIDs})
	if err != nil || res.Stored != n {
		t.Fatalf("put: %+v, %v; want %d stored", res, err, n)
	}
	for _, d := range []*daemon{a, b, c} {
		info, err := d.c.StatPool(ctx, "prefix")
		if err != nil || info.Blocks != countOf(own, d.name) || !info.Cluster {
			t.Fatalf("daemon %s's pool: %+v, %v; want its %d keys of %d", d.name, info, err, countOf(own, d.name), n)
		}
	}
	t.Logf("keys on a, b, c: %d, %d, %d", countOf(own, "a"), countOf(own, "b"), countOf(own, "c"))
	if res, err := ea.pool.Put(ctx, kv.PutRequest{Keys: keys, Src: ea.sp.Desc(), SrcBlocks: srcIDs}); err != nil || res.Existed != n {
		t.Fatalf("the same put again: %+v, %v; want every key present", res, err)
	}
	pb, err := kv.OpenPool(ctx, b.c, "prefix")
	if err != nil {
		t.Fatal(err)
	}
	defer pb.Close()
	for _, d := range []*kv.Pool{ea.pool, pb, pc} {
		if got, _, err := d.Lookup(ctx, keys, client.LookupOptions{}); got != n || err != nil {
			t.Fatalf("lookup through %s: %d, %v; want %d", d.Name(), got, err, n)
		}
	}
	gap := slices.Clone(keys)
	gap[50] = chainKeys(2, 1)[0]
	if got, _, err := pb.Lookup(ctx, gap, client.LookupOptions{}); got != 50 || err != nil {
		t.Fatalf("lookup of a chain whose key 50 is absent: %d, %v", got, err)
	}
	// Per key (keys that are not a chain): every key but the one replaced.
	pr, err := pb.Present(ctx, gap, client.LookupOptions{})
	if err != nil || pr.Found != 50 || pr.Count != n-1 || pr.Has(50) || !pr.Has(49) || !pr.Has(51) {
		t.Fatalf("per-key lookup of the chain with a gap: %+v, %v", pr, err)
	}
	// A get through b: the blocks of a's and c's keys staged there (more
	// than fits an answer), every byte.
	staged := node.KVStagedBytes(a.node) + node.KVStagedBytes(c.node)
	l, sizes := kvLayout("vllm", layers, blocks, bsize)
	dst := newHostSpace(t, l, sizes, 0)
	dstIDs := scattered(r, n, blocks)
	tr, err := pb.Get(ctx, kv.GetRequest{Keys: keys, Dst: dst.local, DstBlocks: dstIDs})
	if err != nil {
		t.Fatal(err)
	}
	if err := tr.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	checkBlocks(t, ea.src, dst, srcIDs, dstIDs, seqFrom(n))
	if node.KVStagedBytes(a.node)+node.KVStagedBytes(c.node) == staged {
		t.Error("no block of the get was staged")
	}
	// The get left copies in b's pool: a lookup of them asks nobody.
	if info, err := b.c.StatPool(ctx, "prefix"); err != nil || info.Blocks != n {
		t.Fatalf("b's pool after the get: %+v, %v; want all %d blocks", info, err, n)
	}
	// A small get through a of two of c's keys: inline in c's answer.
	var cs []int
	for i, o := range own {
		if o == "c" && len(cs) < 2 {
			cs = append(cs, i)
		}
	}
	dst2 := newHostSpace(t, l, sizes, 0)
	small := [][]byte{keys[cs[0]], keys[cs[1]]}
	tr, err = ea.pool.Get(ctx, kv.GetRequest{Keys: small, Dst: dst2.local, DstBlocks: []int{3, 1}})
	if err != nil || tr.Wait(ctx) != nil {
		t.Fatalf("small get: %v %v", err, tr.Err())
	}
	checkBlocks(t, ea.src, dst2, []int{srcIDs[cs[0]], srcIDs[cs[1]]}, []int{3, 1}, []int{0, 1})
	// A pinned lookup through c brings the prefix's blocks there and pins
	// them; the get takes the pin over.
	found, pin, err := pc.Lookup(ctx, keys[:40], client.LookupOptions{Pin: true})
	if err != nil || found != 40 || pin == 0 {
		t.Fatalf("pinned lookup through c: %d, pin %d, %v", found, pin, err)
	}
	if info, _ := c.c.StatPool(ctx, "prefix"); info.Pinned != 40 {
		t.Fatalf("c pins %d blocks after a pinned lookup of 40", info.Pinned)
	}
	dst3 := newHostSpace(t, l, sizes, 0)
	tr, err = pc.Get(ctx, kv.GetRequest{Keys: keys[:40], Dst: dst3.local, DstBlocks: dstIDs[:40], Pin: pin})
	if err != nil || tr.Wait(ctx) != nil {
		t.Fatalf("get with the lookup's pin: %v %v", err, tr.Err())
	}
	checkBlocks(t, ea.src, dst3, srcIDs, dstIDs, seqFrom(40))
	// A pinned per-key lookup through a pins every key present, there.
	pr, err = ea.pool.Present(ctx, gap[40:60], client.LookupOptions{Pin: true})
	if err != nil || pr.Count != 19 || pr.Found != 10 || pr.Pin == 0 {
		t.Fatalf("pinned per-key lookup through a: %+v, %v", pr, err)
	}
	if info, _ := a.c.StatPool(ctx, "prefix"); info.Pinned != 19 {
		t.Fatalf("a pins %d blocks after a pinned per-key lookup of 19 present", info.Pinned)
	}
	if err := ea.pool.Unpin(ctx, pr.Pin); err != nil {
		t.Fatal(err)
	}
	// A delete through c removes the keys everywhere, copies included.
	if k, err := pc.Delete(ctx, keys[:10]); err != nil || k < 10 {
		t.Fatalf("delete: %d, %v", k, err)
	}
	for _, d := range []*kv.Pool{ea.pool, pb, pc} {
		if got, _, err := d.Lookup(ctx, keys, client.LookupOptions{}); got != 0 || err != nil {
			t.Fatalf("lookup through %s after the delete: %d, %v", d.Name(), got, err)
		}
	}
	if got, _, err := pb.Lookup(ctx, keys[10:], client.LookupOptions{}); got != n-10 || err != nil {
		t.Fatalf("lookup of the keys not deleted: %d, %v", got, err)
	}
}

// TestPoolMembershipChanges: a node that joins takes only its share of
// the keys (absent there until put again), and one that leaves gives up
// only its own: the keys it held go back to the nodes that held them
// before, which still do.
func TestPoolMembershipChanges(t *testing.T) {
	srv := etcdtest.Start(t)
	a, b := startDaemon(t, srv, "a"), startDaemon(t, srv, "b")
	waitLive(t, []string{"a", "b"}, a, b)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	e := newPoolEngine(ctx, t, a, 2, 64, 256, 11)
	const n = 240
	keys := chainKeys(3, n)
	ids := make([]int, n)
	for i := range ids {
		ids[i] = i % 64
	}
	put := func() client.PutResult {
		t.Helper()
		res, err := e.pool.Put(ctx, kv.PutRequest{Keys: keys, Src: e.sp.Desc(), SrcBlocks: ids})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	if res := put(); res.Stored != n {
		t.Fatalf("put: %+v", res)
	}
	pb, err := kv.OpenPool(ctx, b.c, "prefix")
	if err != nil {
		t.Fatal(err)
	}
	defer pb.Close()
	present := func(p *kv.Pool, i int) bool {
		got, _, err := p.Lookup(ctx, keys[i:i+1], client.LookupOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return got == 1
	}
	two := owners(keys, "a", "b")
	// c joins (a daemon of its own process, which makes the pool with the
	// first put that reaches it).
	h := startHelperDaemon(t, srv, "c", "host", 256<<20, 0)
	waitLive(t, []string{"a", "b", "c"}, a, b)
	three := owners(keys, "a", "b", "c")
	moved := 0
	for i := range keys {
		if three[i] != two[i] {
			if three[i] != "c" {
				t.Fatalf("key %d moved from %s to %s when c joined", i, two[i], three[i])
			}
			moved++
		}
		// Through b: c's keys are absent (c has no pool yet), but for
		// those b held before (b finds its own copy).
		if want := three[i] != "c" || two[i] == "b"; present(pb, i) != want {
			t.Fatalf("key %d (of %s, was %s's) present through b: %v, want %v", i, three[i], two[i], !want, want)
		}
	}
	t.Logf("c joined and took %d of %d keys", moved, n)
	if res := put(); res.Stored != moved || res.Existed != n-moved {
		t.Fatalf("the put again after c joined: %+v, want %d stored (c's share), the rest present", res, moved)
	}
	if got, _, err := pb.Lookup(ctx, keys, client.LookupOptions{}); got != n || err != nil {
		t.Fatalf("lookup after c's share was put: %d, %v", got, err)
	}
	// c leaves: its keys go back to a and b, which still hold them.
	if err := h.c.CloseStdin(); err != nil {
		t.Fatal(err)
	}
	if err := h.c.Wait(30 * time.Second); err != nil {
		t.Fatalf("c leaving: %v\n%s", err, h.c.Stderr())
	}
	waitLive(t, []string{"a", "b"}, a, b)
	if got, _, err := pb.Lookup(ctx, keys, client.LookupOptions{}); got != n || err != nil {
		t.Fatalf("lookup after c left: %d, %v; want every key", got, err)
	}
}

// TestPoolOwnerKilled: the daemon of a node owning keys killed (SIGKILL)
// in the middle of a get ends it at once with a BlockError naming that
// node's blocks (ErrMissing, UNAVAILABLE), the others' blocks right; a
// silent node (SIGSTOP) costs a lookup no more than its timeout, which
// answers the prefix up to the node's first key; the other daemons serve
// on, and once the dead node's record expires its share is placed on
// them.
func TestPoolOwnerKilled(t *testing.T) {
	srv := etcdtest.Start(t)
	h := startHelperDaemon(t, srv, "a", "host", 1<<30, 0)
	b, c := startDaemon(t, srv, "b"), startDaemon(t, srv, "c")
	all := []string{"a", "b", "c"}
	waitLive(t, all, b, c)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const layers, blocks, bsize = 4, 256, 8 << 10 // blocks of 64 KiB
	e := newPoolEngine(ctx, t, b, layers, blocks, bsize, 21)
	pc, err := kv.CreatePool(ctx, c.c, "prefix", e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	r := rand.New(rand.NewPCG(8, 9))
	const n = 200
	keys := chainKeys(4, n)
	own := owners(keys, all...)
	srcIDs := scattered(r, n, blocks)
	if res, err := e.pool.Put(ctx, kv.PutRequest{Keys: keys, Src: e.sp.Desc(), SrcBlocks: srcIDs}); err != nil || res.Stored != n {
		t.Fatalf("put: %+v, %v", res, err)
	}
	firstOf := func(node string) int { return slices.Index(own, node) }

	// Silent: a lookup through c waits its timeout for a, no more, and
	// answers the prefix up to a's first key (c holds its own; b answers
	// for b's).
	if err := syscall.Kill(h.c.Pid(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitStopped(t, h.c.Pid())
	start := time.Now()
	got, _, err := pc.Lookup(ctx, keys, client.LookupOptions{Timeout: 300 * time.Millisecond})
	took := time.Since(start)
	t.Logf("lookup with a stopped: %d keys in %v", got, took)
	if err != nil || got != firstOf("a") {
		t.Fatalf("lookup with a stopped: %d, %v; want %d (a's first key)", got, err, firstOf("a"))
	}
	if took > 2*time.Second {
		t.Errorf("a lookup of timeout 300ms took %v with a stopped", took)
	}
	if err := syscall.Kill(h.c.Pid(), syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// Within its TTL a answers again; a lookup finds every key.
	testutil.Eventually(t, testutil.Wait, func() error {
		if got, _, err := pc.Lookup(ctx, keys, client.LookupOptions{}); got != n || err != nil {
			return fmt.Errorf("lookup after a woke: %d, %v", got, err)
		}
		return nil
	})
	waitLive(t, all, b, c)

	// Killed in the middle of a get through c: a answered, then died
	// before its blocks were fetched.
	var once sync.Once
	node.OnPoolGet(c.node, func(owner string) {
		if owner == "a" {
			once.Do(func() { h.kill(t) })
		}
	})
	l, sizes := kvLayout("vllm", layers, blocks, bsize)
	dst := newHostSpace(t, l, sizes, 0)
	dstIDs := scattered(r, n, blocks)
	start = time.Now()
	tr, err := pc.Get(ctx, kv.GetRequest{Keys: keys, Dst: dst.local, DstBlocks: dstIDs})
	if err != nil {
		t.Fatal(err)
	}
	err = tr.Wait(ctx)
	took = time.Since(start)
	node.OnPoolGet(c.node, nil)
	t.Logf("a killed mid-get: the get ended %v later: %v", took, err)
	var be *kv.BlockError
	var aIDs, others []int
	for i, o := range own {
		if o == "a" {
			aIDs = append(aIDs, dstIDs[i])
		} else {
			others = append(others, i)
		}
	}
	slices.Sort(aIDs)
	gotIDs := slices.Clone(be2(err, &be))
	slices.Sort(gotIDs)
	if !errors.As(err, &be) || !slices.Equal(gotIDs, aIDs) || !errors.Is(err, kv.ErrMissing) || !errors.Is(err, client.ErrUnavailable) {
		t.Fatalf("get with a killed: %v; want a BlockError naming a's %d blocks, missing and UNAVAILABLE", err, len(aIDs))
	}
	if took > 15*time.Second {
		t.Errorf("the get took %v to fail", took)
	}
	checkBlocks(t, e.src, dst, srcIDs, dstIDs, others)

	// b and c serve on. Until a's record expires, a's keys are absent and
	// not stored; then a's share is placed on b and c.
	if got, _, err := e.pool.Lookup(ctx, keys, client.LookupOptions{Timeout: 300 * time.Millisecond}); err != nil || got > firstOf("a") {
		t.Fatalf("lookup through b after the kill: %d, %v; want at most %d", got, err, firstOf("a"))
	}
	waitLive(t, []string{"b", "c"}, b, c)
	two := owners(keys, "b", "c")
	for i := range keys {
		if own[i] != "a" && two[i] != own[i] {
			t.Fatalf("key %d of %s moved to %s when a died", i, own[i], two[i])
		}
	}
	res, err := e.pool.Put(ctx, kv.PutRequest{Keys: keys, Src: e.sp.Desc(), SrcBlocks: srcIDs})
	if err != nil || res.Stored+res.Existed != n || res.Stored > len(aIDs) {
		t.Fatalf("the put again after a died: %+v, %v; want a's share (%d keys, less those c kept from the get) stored", res, err, len(aIDs))
	}
	dst2 := newHostSpace(t, l, sizes, 0)
	tr, err = pc.Get(ctx, kv.GetRequest{Keys: keys, Dst: dst2.local, DstBlocks: dstIDs})
	if err != nil || tr.Wait(ctx) != nil {
		t.Fatalf("get after a died: %v %v", err, tr.Err())
	}
	checkBlocks(t, e.src, dst2, srcIDs, dstIDs, seqFrom(n))
	if info, err := c.c.StatPool(ctx, "prefix"); err != nil || info.Pinned != 0 {
		t.Fatalf("c's pool after the gets: %+v, %v; want no pin left", info, err)
	}
	if st := protocol.BlockUnavailable; st != 3 {
		t.Fatal("BlockUnavailable changed number")
	}
}

// waitStopped waits until every thread of process pid is stopped (SIGSTOP
// reaches a thread running on another CPU a moment after kill returns).
func waitStopped(t *testing.T, pid int) {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, func() error {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			return err
		}
		for _, task := range tasks {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
			if err != nil {
				return err
			}
			// The state follows the command's closing parenthesis.
			if i := bytes.LastIndexByte(b, ')'); i < 0 || i+2 >= len(b) || b[i+2] != 'T' && b[i+2] != 't' {
				return fmt.Errorf("thread %s of process %d is not stopped yet", task.Name(), pid)
			}
		}
		return nil
	})
}

// be2 returns the blocks a BlockError names, nil for another error.
func be2(err error, be **kv.BlockError) []int {
	if errors.As(err, be) {
		return (*be).Blocks
	}
	return nil
}

// TestPoolManyKeys: requests of more keys than one call to a node carries
// (cluster.MaxPoolCallKeys) and of more bytes (lowered here) are cut into
// several calls, gets two at a time: 40,000 keys through two daemons, put,
// looked up (prefix and per key), got with every byte checked, deleted.
func TestPoolManyKeys(t *testing.T) {
	node.SetMaxPoolCallBytes(t, 1<<20)
	srv := etcdtest.Start(t)
	a, b := startDaemon(t, srv, "a"), startDaemon(t, srv, "b")
	waitLive(t, []string{"a", "b"}, a, b)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	const n, blocks = 40_000, 50_000
	e := newPoolEngine(ctx, t, a, 1, blocks, 128, 31) // blocks of 256 bytes
	keys := chainKeys(6, n)
	own := owners(keys, "a", "b")
	if countOf(own, "b") <= cluster.MaxPoolCallKeys {
		t.Fatalf("b owns %d keys: the test wants more than one call's %d", countOf(own, "b"), cluster.MaxPoolCallKeys)
	}
	r := rand.New(rand.NewPCG(11, 12))
	srcIDs := r.Perm(blocks)[:n]
	if res, err := e.pool.Put(ctx, kv.PutRequest{Keys: keys, Src: e.sp.Desc(), SrcBlocks: srcIDs}); err != nil || res.Stored != n {
		t.Fatalf("put: %d stored, %d present, %d full, %d unavailable, %v", res.Stored, res.Existed, res.Full, res.Unavailable, err)
	}
	if info, err := b.c.StatPool(ctx, "prefix"); err != nil || info.Blocks != countOf(own, "b") {
		t.Fatalf("b's share: %+v, %v; want %d", info, err, countOf(own, "b"))
	}
	if got, _, err := e.pool.Lookup(ctx, keys, client.LookupOptions{}); got != n || err != nil {
		t.Fatalf("lookup: %d, %v", got, err)
	}
	gap := slices.Clone(keys)
	gap[n-7] = chainKeys(7, 1)[0]
	if pr, err := e.pool.Present(ctx, gap, client.LookupOptions{}); err != nil || pr.Count != n-1 || pr.Found != n-7 || pr.Has(n-7) {
		t.Fatalf("per-key lookup: %d present, prefix %d, %v", pr.Count, pr.Found, err)
	}
	l, sizes := kvLayout("vllm", 1, blocks, 128)
	dst := newHostSpace(t, l, sizes, 0)
	dstIDs := r.Perm(blocks)[:n]
	tr, err := e.pool.Get(ctx, kv.GetRequest{Keys: keys, Dst: dst.local, DstBlocks: dstIDs})
	if err != nil {
		t.Fatal(err)
	}
	if err := tr.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	checkBlocks(t, e.src, dst, srcIDs, dstIDs, seqFrom(n))
	if k, err := e.pool.Delete(ctx, keys); err != nil || k < n {
		t.Fatalf("delete: %d, %v", k, err)
	}
	if got, _, err := e.pool.Lookup(ctx, keys[n/2:], client.LookupOptions{}); got != 0 || err != nil {
		t.Fatalf("lookup after the delete: %d, %v", got, err)
	}
}
