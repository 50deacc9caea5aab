package kv_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/kv"
	"github.com/cudaipc/cudaipc/protocol"
)

// poolSpace registers, through c, a host space of the given layout whose
// regions hold random bytes (seed), and returns it (closed when the test
// ends): a pool's source or destination, or a read's.
func poolSpace(t testing.TB, c *client.Client, name, layout string, layers, blocks int, bytes int64, seed uint64) *kv.Space {
	t.Helper()
	l, sizes := testLayout(layout, layers, blocks, bytes)
	local := &kv.Local{Layout: l}
	for i, n := range sizes {
		h, err := kv.AllocHost(n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close() })
		copy(h.Bytes(), testutil.RandomBytes(seed+uint64(i), int(n)))
		local.Memory = append(local.Memory, h.Memory())
	}
	sp, err := kv.Register(context.Background(), c, name, local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sp.Close(context.Background()) })
	return sp
}

// localSpace returns a local (unregistered) host space of the given
// layout filled with random bytes (seed).
func localSpace(layout string, layers, blocks int, bytes int64, seed uint64) *kv.Local {
	l, sizes := testLayout(layout, layers, blocks, bytes)
	local := &kv.Local{Layout: l}
	for i, n := range sizes {
		local.Memory = append(local.Memory, kv.Memory{Host: testutil.RandomBytes(seed+uint64(i), int(n))})
	}
	return local
}

// poolKeys returns n random keys of size bytes (seed).
func poolKeys(seed uint64, n, size int) [][]byte {
	raw := testutil.RandomBytes(seed, n*size)
	keys := make([][]byte, n)
	for i := range keys {
		keys[i] = raw[i*size : (i+1)*size]
	}
	return keys
}

func hostMem(l *kv.Local) func(int) []byte { return func(i int) []byte { return l.Memory[i].Host } }

// checkBlocks checks that block dst[i] of the local space d holds, for
// layers [first, first+count), block src[i] of s.
func checkBlocks(t testing.TB, s *kv.Space, src []int, d *kv.Local, dst []int, first, count int) {
	t.Helper()
	for i := range dst {
		for l := first; l < first+count; l++ {
			for p := range d.Layers[l] {
				got := block(d.Layout, l, p, dst[i], hostMem(d))
				want := block(s.Desc().Layout, l, p, src[i], hostMem(s.Local()))
				if !bytes.Equal(got, want) {
					t.Fatalf("layer %d part %d: destination block %d is not source block %d", l, p, dst[i], src[i])
				}
			}
		}
	}
}

// snapshot copies a local space's memory.
func snapshot(l *kv.Local) [][]byte {
	var out [][]byte
	for _, m := range l.Memory {
		out = append(out, bytes.Clone(m.Host))
	}
	return out
}

// checkUntouched checks that every block of d but those in written holds
// what it held in before, for every layer.
func checkUntouched(t testing.TB, d *kv.Local, before [][]byte, written []int) {
	t.Helper()
	for b := range d.Blocks {
		if slices.Contains(written, b) {
			continue
		}
		for l := range d.Layers {
			for p := range d.Layers[l] {
				if !bytes.Equal(block(d.Layout, l, p, b, hostMem(d)), block(d.Layout, l, p, b, func(i int) []byte { return before[i] })) {
					t.Fatalf("block %d layer %d part %d changed, but no key was got into it", b, l, p)
				}
			}
		}
	}
}

func waitGet(t testing.TB, tr *kv.Transfer, first, count int) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for l := first; l < first+count; l++ {
		if err := tr.WaitLayer(ctx, l); err != nil {
			return err
		}
	}
	return tr.Wait(ctx)
}

// TestPoolPutLookupGet puts blocks of a registered space into a pool and
// gets them into a local space of another layout: every byte of every
// block arrives, no other block changes; lookups count the present prefix
// (the first absent key ends it); a put of keys present stores nothing
// for them; a get of absent keys copies the rest and names their
// destination blocks (ErrMissing).
func TestPoolPutLookupGet(t *testing.T) {
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	const layers, blocks, bsize = 4, 64, 272
	r := rand.New(rand.NewPCG(3, 4))
	for i, srcKind := range []string{"vllm", "sglang", "host"} {
		dstKind := []string{"sglang", "host", "vllm-blocks-first"}[i]
		t.Run(srcKind+"-to-"+dstKind, func(t *testing.T) {
			sp := poolSpace(t, c, fmt.Sprintf("pool-test/%d/kv", i), srcKind, layers, blocks, bsize, uint64(50*i))
			bb, err := sp.Desc().BlockBytes(0, 0)
			if err != nil || bb != layers*2*bsize {
				t.Fatalf("block bytes %d, %v", bb, err)
			}
			pool, err := kv.CreatePool(ctx, c, fmt.Sprintf("pool-%d", i), client.PoolConfig{BlockBytes: bb, KeyBytes: 32, Capacity: 48 * 2304})
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			if info := pool.Info(); info.CapacityBlocks != 48 || info.SlotBytes != 2304 || info.KeyBytes != 32 {
				t.Fatalf("pool info %+v", info)
			}
			keys := poolKeys(uint64(900+i), 40, 32)
			srcIDs := scattered(r, 40, blocks)
			res, err := pool.Put(ctx, kv.PutRequest{Keys: keys[:30], Src: sp.Desc(), SrcBlocks: srcIDs[:30]})
			if err != nil {
				t.Fatal(err)
			}
			if res.Stored != 30 || res.Existed != 0 || res.Full != 0 || !bytes.Equal(res.Status, make([]byte, 30)) {
				t.Fatalf("put: %+v", res)
			}
			// Keys present already are left as they are, even with other
			// bytes behind them.
			res, err = pool.Put(ctx, kv.PutRequest{Keys: keys[20:40], Src: sp.Desc(), SrcBlocks: srcIDs[:20]})
			if err != nil {
				t.Fatal(err)
			}
			wantStatus := append(bytes.Repeat([]byte{protocol.BlockExisted}, 10), make([]byte, 10)...)
			if res.Stored != 10 || res.Existed != 10 || !bytes.Equal(res.Status, wantStatus) {
				t.Fatalf("second put: %+v", res)
			}
			// That put stored keys[30:40] from srcIDs[10:20].
			want := append(slices.Clone(srcIDs[:30]), srcIDs[10:20]...)

			for _, c2 := range []struct {
				keys [][]byte
				want int
			}{
				{keys, 40},
				{append(slices.Clone(keys[:7]), append(poolKeys(1, 1, 32), keys[8:]...)...), 7},
				{append(poolKeys(2, 1, 32), keys...), 0},
				{keys[39:], 1},
			} {
				n, pin, err := pool.Lookup(ctx, c2.keys, client.LookupOptions{})
				if err != nil || n != c2.want || pin != 0 {
					t.Fatalf("lookup of %d keys: %d, pin %d, %v; want %d", len(c2.keys), n, pin, err, c2.want)
				}
			}

			dst := localSpace(dstKind, layers, blocks+3, bsize, uint64(70+i))
			before := snapshot(dst)
			dstIDs := scattered(r, 40, blocks+3)
			tr, err := pool.Get(ctx, kv.GetRequest{Keys: keys, Dst: dst, DstBlocks: dstIDs})
			if err != nil {
				t.Fatal(err)
			}
			if err := waitGet(t, tr, 0, layers); err != nil {
				t.Fatal(err)
			}
			checkBlocks(t, sp, want, dst, dstIDs, 0, layers)
			checkUntouched(t, dst, before, dstIDs)

			// Two keys absent: the others arrive, the error names the two.
			before = snapshot(dst)
			mixed := slices.Clone(keys[:6])
			mixed[1], mixed[4] = poolKeys(3, 1, 32)[0], poolKeys(4, 1, 32)[0]
			ids := []int{1, 2, 3, 4, 5, 6}
			tr, err = pool.Get(ctx, kv.GetRequest{Keys: mixed, Dst: dst, DstBlocks: ids})
			if err != nil {
				t.Fatal(err)
			}
			err = waitGet(t, tr, 0, layers)
			var be *kv.BlockError
			if !errors.Is(err, kv.ErrMissing) || !errors.As(err, &be) || !slices.Equal(be.Blocks, []int{2, 5}) {
				t.Fatalf("get with keys absent: %v, want ErrMissing naming blocks 2 and 5", err)
			}
			checkBlocks(t, sp, []int{want[0], want[2], want[3], want[5]}, dst, []int{1, 3, 4, 6}, 0, layers)
			checkUntouched(t, dst, before, ids)

			testutil.Eventually(t, testutil.Wait, func() error {
				info, err := pool.Stat(ctx)
				if err != nil {
					return err
				}
				if info.Blocks != 40 || info.Pinned != 0 || info.Writing != 0 || info.Stored != 40 {
					return fmt.Errorf("stat %+v: want 40 blocks stored, none pinned", info)
				}
				return nil
			})
		})
	}
}

// TestPoolLayerRange keeps blocks of two of four layers: put and get name
// the range, and a space whose range is of another size is refused.
func TestPoolLayerRange(t *testing.T) {
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	sp := poolSpace(t, c, "range/kv", "vllm", 4, 16, 128, 5)
	pool, err := kv.CreatePool(ctx, c, "range", client.PoolConfig{BlockBytes: 2 * 2 * 128, KeyBytes: 16, Capacity: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	keys := poolKeys(8, 5, 16)
	if _, err := pool.Put(ctx, kv.PutRequest{Keys: keys, Src: sp.Desc(), SrcBlocks: []int{0, 1, 2, 3, 4}}); !errors.Is(err, kv.ErrMismatch) {
		t.Fatalf("a put of all four layers into a pool of two: %v, want ErrMismatch", err)
	}
	if _, err := pool.Put(ctx, kv.PutRequest{Keys: keys, Src: sp.Desc(), SrcBlocks: []int{9, 3, 4, 15, 0}, First: 1, Count: 2}); err != nil {
		t.Fatal(err)
	}
	dst := localSpace("sglang", 4, 8, 128, 6)
	before := snapshot(dst)
	tr, err := pool.Get(ctx, kv.GetRequest{Keys: keys, Dst: dst, DstBlocks: []int{7, 6, 5, 4, 3}, First: 1, Count: 2})
	if err != nil {
		t.Fatal(err)
	}
	if err := waitGet(t, tr, 1, 2); err != nil {
		t.Fatal(err)
	}
	checkBlocks(t, sp, []int{9, 3, 4, 15, 0}, dst, []int{7, 6, 5, 4, 3}, 1, 2)
	// Layers 0 and 3 of every block are as they were.
	for b := range 8 {
		for _, l := range []int{0, 3} {
			for p := range 2 {
				if !bytes.Equal(block(dst.Layout, l, p, b, hostMem(dst)), block(dst.Layout, l, p, b, func(i int) []byte { return before[i] })) {
					t.Fatalf("layer %d of block %d changed", l, b)
				}
			}
		}
	}
	if err := tr.WaitLayer(ctx, 0); !errors.Is(err, kv.ErrMismatch) {
		t.Fatalf("WaitLayer of a layer outside the get: %v", err)
	}
}

// TestPoolBulk looks up, puts and gets ten thousand keys in one call each
// (their arrays travel in a bulk file): present, absent and half present.
func TestPoolBulk(t *testing.T) {
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	const n = 10000
	sp := poolSpace(t, c, "bulk/kv", "host", 1, n, 48, 9)
	pool, err := kv.CreatePool(ctx, c, "bulk", client.PoolConfig{BlockBytes: 96, KeyBytes: 32, Capacity: 12000 * 256})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	keys := poolKeys(10, 2*n, 32)
	ids := make([]int, n)
	for i := range ids {
		ids[i] = n - 1 - i
	}
	res, err := pool.Put(ctx, kv.PutRequest{Keys: keys[:n], Src: sp.Desc(), SrcBlocks: ids})
	if err != nil || res.Stored != n || len(res.Status) != n {
		t.Fatalf("put of %d keys: stored %d, %d statuses, %v", n, res.Stored, len(res.Status), err)
	}
	for _, c2 := range []struct {
		keys [][]byte
		want int
	}{{keys[:n], n}, {keys[n:], 0}, {keys[n/2 : n/2+n], n / 2}} {
		got, _, err := pool.Lookup(ctx, c2.keys, client.LookupOptions{})
		if err != nil || got != c2.want {
			t.Fatalf("lookup: %d, %v; want %d", got, err, c2.want)
		}
	}
	dst := localSpace("host", 1, n, 48, 11)
	half := keys[n/2 : n/2+n]
	dstIDs := make([]int, n)
	for i := range dstIDs {
		dstIDs[i] = i
	}
	tr, err := pool.Get(ctx, kv.GetRequest{Keys: half, Dst: dst, DstBlocks: dstIDs})
	if err != nil {
		t.Fatal(err)
	}
	var be *kv.BlockError
	if err := waitGet(t, tr, 0, 1); !errors.As(err, &be) || len(be.Blocks) != n/2 || be.Blocks[0] != n/2 {
		t.Fatalf("get of half present keys: %v", err)
	}
	checkBlocks(t, sp, ids[n/2:], dst, dstIDs[:n/2], 0, 1)
}

// TestPoolEviction fills a pool and checks the least recently used order
// of eviction (a get makes a block the most recent), that pinned blocks
// (a lookup's pin, until it times out or is unpinned) are never evicted, a
// put that finds every block pinned stores nothing, and delete and evict.
func TestPoolEviction(t *testing.T) {
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	sp := poolSpace(t, c, "evict/kv", "vllm", 2, 32, 64, 12)
	pool, err := kv.CreatePool(ctx, c, "evict", client.PoolConfig{BlockBytes: 256, KeyBytes: 20, Capacity: 8 * 256})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	keys := poolKeys(13, 20, 20)
	put := func(ks [][]byte, ids []int) client.PutResult {
		t.Helper()
		res, err := pool.Put(ctx, kv.PutRequest{Keys: ks, Src: sp.Desc(), SrcBlocks: ids})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	present := func() []int {
		t.Helper()
		var out []int
		for i, k := range keys {
			n, _, err := pool.Lookup(ctx, [][]byte{k}, client.LookupOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if n == 1 {
				out = append(out, i)
			}
		}
		return out
	}
	noPins := func() {
		t.Helper()
		testutil.Eventually(t, testutil.Wait, func() error {
			info, err := pool.Stat(ctx)
			if err != nil {
				return err
			}
			if info.Pinned != 0 {
				return fmt.Errorf("%d blocks pinned", info.Pinned)
			}
			return nil
		})
	}
	put(keys[:8], []int{0, 1, 2, 3, 4, 5, 6, 7})
	// A get of key 0 makes it the most recently used, once unpinned.
	tr, err := pool.Get(ctx, kv.GetRequest{Keys: keys[:1], Dst: localSpace("vllm", 2, 4, 64, 1), DstBlocks: []int{0}})
	if err != nil {
		t.Fatal(err)
	}
	if err := waitGet(t, tr, 0, 2); err != nil {
		t.Fatal(err)
	}
	noPins()
	// A lookup pins key 1.
	n, pin, err := pool.Lookup(ctx, keys[1:2], client.LookupOptions{Pin: true})
	if err != nil || n != 1 || pin == 0 {
		t.Fatalf("lookup with pin: %d, pin %d, %v", n, pin, err)
	}
	res := put(keys[8:11], []int{8, 9, 10})
	if res.Stored != 3 {
		t.Fatalf("put into a full pool: %+v", res)
	}
	// 2, 3 and 4 went, least recently used first; 1 is pinned, 0 was used.
	if got, want := present(), []int{0, 1, 5, 6, 7, 8, 9, 10}; !slices.Equal(got, want) {
		t.Fatalf("present after eviction: %v, want %v", got, want)
	}
	// Pin everything: a put finds no room and says so.
	_, all, err := pool.Lookup(ctx, [][]byte{keys[0], keys[1], keys[5], keys[6], keys[7], keys[8], keys[9], keys[10]}, client.LookupOptions{Pin: true, PinTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	res = put(keys[11:13], []int{11, 12})
	if res.Full != 2 || res.Stored != 0 || !bytes.Equal(res.Status, []byte{protocol.BlockFull, protocol.BlockFull}) {
		t.Fatalf("put with every block pinned: %+v", res)
	}
	if got, _ := pool.Evict(ctx, 8); got != 0 {
		t.Fatalf("evict with every block pinned: %d evicted", got)
	}
	// The first pin is unpinned, the second times out: its blocks come
	// back in its key order, 0 least recently used.
	if err := pool.Unpin(ctx, pin); err != nil {
		t.Fatal(err)
	}
	if err := pool.Unpin(ctx, pin); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("a second unpin: %v, want ErrNotFound", err)
	}
	noPins()
	if err := pool.Unpin(ctx, all); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("unpin of a pin that timed out: %v, want ErrNotFound", err)
	}
	if got, err := pool.Evict(ctx, 2); got != 2 || err != nil {
		t.Fatalf("evict 2: %d, %v", got, err)
	}
	if got, want := present(), []int{5, 6, 7, 8, 9, 10}; !slices.Equal(got, want) {
		t.Fatalf("present after evicting 2: %v, want %v", got, want)
	}
	// Delete: a deleted key is absent, a second delete finds nothing.
	if got, err := pool.Delete(ctx, keys[5:7]); got != 2 || err != nil {
		t.Fatalf("delete: %d, %v", got, err)
	}
	if got, err := pool.Delete(ctx, keys[5:7]); got != 0 || err != nil {
		t.Fatalf("delete again: %d, %v", got, err)
	}
	if n, _, _ := pool.Lookup(ctx, keys[5:6], client.LookupOptions{}); n != 0 {
		t.Fatal("a deleted key is present")
	}
	info, err := pool.Stat(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.Evictions != 5 || info.Pinned != 0 {
		t.Fatalf("stat: %+v, want 5 evictions", info)
	}
}

// TestPoolPresent checks per-key lookups against the keys put, inline and
// through a bulk file: every key's bit, the prefix and the count; that
// they change nothing without a pin; and that with one every key present
// is pinned until a get takes the pin over.
func TestPoolPresent(t *testing.T) {
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	const n = 10000
	sp := poolSpace(t, c, "present/kv", "host", 1, n, 48, 21)
	pool, err := kv.CreatePool(ctx, c, "present", client.PoolConfig{BlockBytes: 96, KeyBytes: 24, Capacity: n * 256})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	keys := poolKeys(22, 2*n, 24)
	r := rand.New(rand.NewPCG(23, 24))
	held := map[int]bool{}
	var put [][]byte
	var ids []int
	for i := range 2 * n {
		if r.IntN(3) > 0 && len(put) < n {
			held[i] = true
			put = append(put, keys[i])
			ids = append(ids, len(ids))
		}
	}
	if res, err := pool.Put(ctx, kv.PutRequest{Keys: put, Src: sp.Desc(), SrcBlocks: ids}); err != nil || res.Stored != len(put) {
		t.Fatalf("put: %+v, %v", res, err)
	}
	check := func(idx []int, opts client.LookupOptions) client.Presence {
		t.Helper()
		ks := make([][]byte, len(idx))
		for i, k := range idx {
			ks[i] = keys[k]
		}
		got, err := pool.Present(ctx, ks, opts)
		if err != nil {
			t.Fatal(err)
		}
		prefix, count := len(idx), 0
		for i, k := range idx {
			if got.Has(i) != held[k] {
				t.Fatalf("key %d of %d (#%d): present %v, put %v", i, len(idx), k, got.Has(i), held[k])
			}
			if held[k] {
				count++
			} else {
				prefix = min(prefix, i)
			}
		}
		if got.Found != prefix || got.Count != count || len(got.Bits) != (len(idx)+7)/8 {
			t.Fatalf("%d keys: found %d, count %d, %d bytes of bits; want %d, %d", len(idx), got.Found, got.Count, len(got.Bits), prefix, count)
		}
		if (got.Pin != 0) != (opts.Pin && count > 0) {
			t.Fatalf("pin %d with opts %+v and %d keys present", got.Pin, opts, count)
		}
		return got
	}
	all := make([]int, 2*n)
	for i := range all {
		all[i] = i
	}
	r.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	check(all[:20], client.LookupOptions{})       // inline
	check(all[:n], client.LookupOptions{})        // a bulk file
	check([]int{0, 1, 2}, client.LookupOptions{}) // fewer than 8 keys
	var heldIdx []int
	for i := range 2 * n {
		if held[i] {
			heldIdx = append(heldIdx, i)
		}
	}
	check(heldIdx, client.LookupOptions{}) // every key present: the prefix is all
	if info, err := pool.Stat(ctx); err != nil || info.Pinned != 0 {
		t.Fatalf("after lookups without a pin: %+v, %v", info, err)
	}
	// A pin holds every key present; a get of some of them takes it over
	// and its unpin leaves nothing pinned.
	idx := all[n : n+500]
	p := check(idx, client.LookupOptions{Pin: true})
	if info, err := pool.Stat(ctx); err != nil || info.Pinned != p.Count {
		t.Fatalf("pinned %d, want %d (%v)", info.Pinned, p.Count, err)
	}
	var gk [][]byte
	var dst []int
	for i, k := range idx {
		if p.Has(i) && len(gk) < 40 {
			gk = append(gk, keys[k])
			dst = append(dst, len(dst))
		}
	}
	tr, err := pool.Get(ctx, kv.GetRequest{Keys: gk, Dst: localSpace("host", 1, 40, 48, 25), DstBlocks: dst, Pin: p.Pin})
	if err != nil {
		t.Fatal(err)
	}
	if err := waitGet(t, tr, 0, 1); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		info, err := pool.Stat(ctx)
		if err != nil || info.Pinned != 0 {
			return fmt.Errorf("%d blocks pinned after the get took the pin over (%v)", info.Pinned, err)
		}
		return nil
	})
	if err := pool.Unpin(ctx, p.Pin); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("unpin of a pin a get took over: %v", err)
	}
}
