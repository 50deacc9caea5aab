package node_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/kv"
	"github.com/cudaipc/cudaipc/store"
)

// KV spaces read across nodes (docs/kv.md, "Across nodes"): a space
// registered with one daemon read by a client of another straight into a
// space it registered there.

// kvLayout returns a layout of the given kind over regions of the sizes it
// returns: "vllm" (a region a layer, K blocks then V blocks), "blocks-first"
// (a region a layer, K and V of a block side by side: parts not contiguous),
// "sglang" (a region for K and one for V of each layer), "offload" (one
// region, block-major).
func kvLayout(kind string, layers, blocks int, bytes int64) (kv.Layout, []int64) {
	l := kv.Layout{Blocks: blocks, Layers: make([][]kv.Part, layers)}
	b := int64(blocks)
	var sizes []int64
	for i := range l.Layers {
		switch kind {
		case "vllm":
			l.Layers[i] = []kv.Part{{Region: i, Stride: bytes, Bytes: bytes}, {Region: i, Base: b * bytes, Stride: bytes, Bytes: bytes}}
			sizes = append(sizes, 2*b*bytes)
		case "blocks-first":
			l.Layers[i] = []kv.Part{{Region: i, Stride: 2 * bytes, Bytes: bytes}, {Region: i, Base: bytes, Stride: 2 * bytes, Bytes: bytes}}
			sizes = append(sizes, 2*b*bytes)
		case "sglang":
			l.Layers[i] = []kv.Part{{Region: 2 * i, Stride: bytes, Bytes: bytes}, {Region: 2*i + 1, Stride: bytes, Bytes: bytes}}
			sizes = append(sizes, b*bytes, b*bytes)
		case "offload":
			per := int64(layers) * 2 * bytes
			l.Layers[i] = []kv.Part{{Region: 0, Base: int64(2*i) * bytes, Stride: per, Bytes: bytes}, {Region: 0, Base: int64(2*i+1) * bytes, Stride: per, Bytes: bytes}}
			if i == 0 {
				sizes = append(sizes, b*per)
			}
		default:
			panic("unknown layout " + kind)
		}
	}
	return l, sizes
}

// hostSpace is host memory for a space of a layout, each region filled
// with random bytes of seed+i (zeros with seed 0).
type hostSpace struct {
	local *kv.Local
	mem   []*kv.HostMemory
	fixed [][]byte // instead of mem: bytes known (a space of another process)
}

func newHostSpace(t testing.TB, layout kv.Layout, sizes []int64, seed uint64) *hostSpace {
	t.Helper()
	h := &hostSpace{local: &kv.Local{Layout: layout}}
	for i, n := range sizes {
		m, err := kv.AllocHost(n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		if seed != 0 {
			copy(m.Bytes(), testutil.RandomBytes(seed+uint64(i), int(n)))
		}
		h.mem = append(h.mem, m)
		h.local.Memory = append(h.local.Memory, m.Memory())
	}
	return h
}

func (h *hostSpace) region(i int) []byte {
	if h.fixed != nil {
		return h.fixed[i]
	}
	return h.mem[i].Bytes()
}

// kvBlock is block b of part p of layer l in a layout over regions.
func kvBlock(l kv.Layout, layer, part, b int, region func(int) []byte) []byte {
	pt := l.Layers[layer][part]
	off := pt.Base + int64(b)*pt.Stride
	return region(pt.Region)[off : off+pt.Bytes]
}

// checkRead checks that dst holds what a read of src's srcIDs into dstIDs
// for layers [first, first+count) wrote over before (the destination as
// it was), every byte.
func checkRead(t testing.TB, src, dst *hostSpace, before [][]byte, srcIDs, dstIDs []int, first, count int) {
	t.Helper()
	want := make([][]byte, len(before))
	for i := range before {
		want[i] = bytes.Clone(before[i])
	}
	for l := first; l < first+count; l++ {
		for p := range src.local.Layers[l] {
			for i := range srcIDs {
				copy(kvBlock(dst.local.Layout, l, p, dstIDs[i], func(r int) []byte { return want[r] }), kvBlock(src.local.Layout, l, p, srcIDs[i], src.region))
			}
		}
	}
	for i := range want {
		if got := dst.region(i); !bytes.Equal(got, want[i]) {
			k := 0
			for k < len(got) && got[k] == want[i][k] {
				k++
			}
			t.Fatalf("destination region %d differs from byte %d on (of %d)", i, k, len(got))
		}
	}
}

// snapshot copies a space's regions.
func (h *hostSpace) snapshot() [][]byte {
	out := make([][]byte, len(h.mem))
	for i := range h.mem {
		out[i] = bytes.Clone(h.region(i))
	}
	return out
}

// scattered returns n distinct block ids of blocks, in random order, with
// runs of adjacent ids here and there.
func scattered(r *rand.Rand, n, blocks int) []int {
	ids := r.Perm(blocks)[:n]
	for i := 1; i < n; i += 4 {
		// Some runs: id i follows id i-1 where that id is free.
		want := ids[i-1] + 1
		if want < blocks && !containsInt(ids, want) {
			ids[i] = want
		}
	}
	return ids
}

func containsInt(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// TestKVReadAcrossNodes reads blocks of host spaces registered on daemon a
// into host spaces registered on daemon b, for every layout pair, scattered
// ids and layer ranges, checking every byte and that each layer completes
// on its own; b makes no replica and writes nothing to the directory.
func TestKVReadAcrossNodes(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	b := startDaemon(t, srv, "b")
	if got := a.c.Server().Node; got != "a" {
		t.Fatalf("daemon a's hello names node %q", got)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r := rand.New(rand.NewPCG(1, 2))
	for i, kind := range []string{"vllm", "blocks-first", "sglang", "offload"} {
		dkind := []string{"sglang", "vllm", "offload", "blocks-first"}[i]
		for _, mode := range []string{"direct", "staged"} {
			t.Run(mode+"/"+kind+"-to-"+dkind, func(t *testing.T) {
				node.SetSpaceMode(b.node, mode)
				readLayouts(ctx, t, a, b, r, uint64(100*i+1), mode, kind, dkind)
			})
		}
	}
	node.SetSpaceMode(b.node, "auto")
	objs, err := b.c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if !o.External {
			t.Errorf("daemon b holds %s (%d bytes), not registered memory: a read made a replica", o.Name, o.Size)
		}
	}
	if st := b.node.Stats(); st.Pulls != 0 {
		t.Errorf("daemon b pulled %d objects", st.Pulls)
	}
	if node.KVStagedBytes(a.node) == 0 {
		t.Error("no read was staged")
	}
}

// readLayouts reads scattered blocks of a space of layout kind registered
// on a into one of layout dkind registered on b, for three layer ranges,
// checking every byte and each layer's completion.
func readLayouts(ctx context.Context, t *testing.T, a, b *daemon, r *rand.Rand, seed uint64, mode, kind, dkind string) {
	const layers, blocks, bsize = 6, 40, 512
	sl, ssizes := kvLayout(kind, layers, blocks, bsize)
	src := newHostSpace(t, sl, ssizes, seed)
	sp, err := kv.Register(ctx, a.c, "engine/"+mode+"/"+kind, src.local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer sp.Close(ctx)
	if sp.Desc().Node != "a" {
		t.Fatalf("the space's description names node %q, want a", sp.Desc().Node)
	}
	text, err := sp.Desc().MarshalText()
	if err != nil {
		t.Fatal(err)
	}
	var desc kv.Desc
	if err := desc.UnmarshalText(text); err != nil {
		t.Fatal(err)
	}
	dl, dsizes := kvLayout(dkind, layers, blocks, bsize)
	dst := newHostSpace(t, dl, dsizes, seed+49)
	dsp, err := kv.Register(ctx, b.c, "decode/"+mode+"/"+dkind, dst.local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer dsp.Close(ctx)
	for _, lr := range [][2]int{{0, 0}, {2, 3}, {layers - 1, 1}} {
		n := 1 + r.IntN(blocks/2)
		srcIDs, dstIDs := scattered(r, n, blocks), scattered(r, n, blocks)
		before := dst.snapshot()
		tr, err := kv.ReadBlocks(ctx, b.c, kv.Request{Src: &desc, SrcBlocks: srcIDs, Dst: dst.local, DstBlocks: dstIDs, First: lr[0], Count: lr[1]})
		if err != nil {
			t.Fatal(err)
		}
		count := lr[1]
		if count == 0 {
			count = layers - lr[0]
		}
		for l := lr[0]; l < lr[0]+count; l++ {
			if err := tr.WaitLayer(ctx, l); err != nil {
				t.Fatalf("layer %d: %v", l, err)
			}
		}
		if err := tr.Wait(ctx); err != nil {
			t.Fatal(err)
		}
		checkRead(t, src, dst, before, srcIDs, dstIDs, lr[0], count)
	}
}

func init() { roles["kvengine"] = kvEngineRole }

// kvHeld keeps the memory of the spaces a helper process registered.
var kvHeld []*kv.HostMemory

// registerKVSpace registers, through cl, the host space c.Name of layout
// c.Layout (kvLayout; c.Size bytes a block), region i holding
// testutil.RandomBytes(c.Seed*1000+i), shared with c.Shared, and
// returns its description's text.
func registerKVSpace(cl *client.Client, c daemonCmd) (string, error) {
	layout, sizes := kvLayout(c.Layout, c.Layers, c.Blocks, c.Size)
	local := &kv.Local{Layout: layout}
	for i, n := range sizes {
		data := testutil.RandomBytes(uint64(c.Seed)*1000+uint64(i), int(n))
		if c.GPU != "" {
			m, err := gpuRegion(c.GPU, n, data)
			if err != nil {
				return "", err
			}
			local.Memory = append(local.Memory, m)
			continue
		}
		m, err := kv.AllocHost(n)
		if err != nil {
			return "", err
		}
		kvHeld = append(kvHeld, m)
		copy(m.Bytes(), data)
		local.Memory = append(local.Memory, m.Memory())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sp, err := kv.Register(ctx, cl, c.Name, local, client.RegisterOptions{Shared: c.Shared})
	if err != nil {
		return "", err
	}
	t, err := sp.Desc().MarshalText()
	return string(t), err
}

// kvEngineRole is an engine: it registers the space its command says
// (registerKVSpace) with the daemon at SOCK, says its description, and
// holds it until its input ends or it is killed.
func kvEngineRole(p *testutil.Peer) error {
	var c daemonCmd
	if err := p.Recv(&c); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	cl, err := client.Dial(ctx, os.Getenv("SOCK"))
	cancel()
	if err != nil {
		return err
	}
	defer cl.Close()
	var r daemonReply
	if r.Desc, err = registerKVSpace(cl, c); err != nil {
		r.Err = err.Error()
	}
	if err := p.Send(r); err != nil {
		return err
	}
	var more daemonCmd
	p.Recv(&more) //nolint:errcheck // until the input ends
	return nil
}

// startKVEngine starts an engine process registering the space c says
// with the daemon at sock, and returns it and the space's description.
func startKVEngine(t *testing.T, sock string, c daemonCmd, o testutil.SpawnOptions) (*testutil.Child, *kv.Desc) {
	t.Helper()
	o.Env = append(o.Env, "SOCK="+sock)
	e := testutil.SpawnWith(t, "kvengine", o)
	if err := e.Send(c); err != nil {
		t.Fatal(err)
	}
	var r daemonReply
	if err := e.Recv(&r); err != nil || r.Err != "" {
		t.Fatalf("engine: %v %s: %s", err, r.Err, e.Stderr())
	}
	return e, parseDesc(t, r.Desc)
}

func parseDesc(t testing.TB, text string) *kv.Desc {
	t.Helper()
	d := new(kv.Desc)
	if err := d.UnmarshalText([]byte(text)); err != nil {
		t.Fatal(err)
	}
	return d
}

// kvRegion is what registerKVSpace filled region i of a space of c with.
func kvRegion(c daemonCmd, i int) []byte {
	_, sizes := kvLayout(c.Layout, c.Layers, c.Blocks, c.Size)
	return testutil.RandomBytes(uint64(c.Seed)*1000+uint64(i), int(sizes[i]))
}

// kvSource is a space as registerKVSpace filled it, for checkRead.
func kvSource(c daemonCmd) *hostSpace {
	layout, sizes := kvLayout(c.Layout, c.Layers, c.Blocks, c.Size)
	h := &hostSpace{local: &kv.Local{Layout: layout}, fixed: make([][]byte, len(sizes))}
	for i := range sizes {
		h.fixed[i] = kvRegion(c, i)
	}
	return h
}

// kill kills c with SIGKILL and waits for it to be gone.
func killChild(t *testing.T, c *testutil.Child) {
	t.Helper()
	if err := syscall.Kill(c.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	c.Wait(10 * time.Second) //nolint:errcheck // killed: its exit status says so
}

// readAll reads blocks ids of src into the same ids of dst, all layers,
// through c, and waits for the read's end.
func readAll(ctx context.Context, c *client.Client, src *kv.Desc, dst *hostSpace, ids []int) (*kv.Transfer, error) {
	tr, err := kv.ReadBlocks(ctx, c, kv.Request{Src: src, SrcBlocks: ids, Dst: dst.local, DstBlocks: ids})
	if err != nil {
		return nil, err
	}
	return tr, tr.Wait(ctx)
}

// registerDst registers a zeroed host space of layout kind on d.
func registerDst(t *testing.T, d *daemon, name, kind string, layers, blocks int, bsize int64) *hostSpace {
	t.Helper()
	l, sizes := kvLayout(kind, layers, blocks, bsize)
	h := newHostSpace(t, l, sizes, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sp, err := kv.Register(ctx, d.c, name, h.local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sp.Close(context.Background()) })
	return h
}

func seq(n int) []int {
	ids := make([]int, n)
	for i := range ids {
		ids[i] = i
	}
	return ids
}

// TestKVReadEngineGone: the source engine killed (SIGKILL) before a read
// fails it with a BlockError naming the blocks (NOT_FOUND); killed
// mid-read, the read ends, complete (the exposure held the memory) or with
// a BlockError; both daemons serve on: a new engine's space is read.
func TestKVReadEngineGone(t *testing.T) {
	for _, mode := range []string{"direct", "staged"} {
		t.Run(mode, func(t *testing.T) { kvReadEngineGone(t, mode) })
	}
}

func kvReadEngineGone(t *testing.T, mode string) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	b := startDaemon(t, srv, "b")
	node.SetSpaceMode(b.node, mode)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	small := daemonCmd{Name: "gone/small", Layout: "vllm", Layers: 4, Blocks: 16, Size: 4096, Seed: 1}
	e, desc := startKVEngine(t, a.sock, small, testutil.SpawnOptions{})
	dst := registerDst(t, b, "decode/small", "vllm", 4, 16, 4096)
	ids := []int{3, 1, 4, 15}
	if _, err := readAll(ctx, b.c, desc, dst, ids); err != nil {
		t.Fatal(err)
	}
	killChild(t, e)
	// The engine's connection ends: its registration goes once no lease
	// holds it (the read's exposure is released after the read).
	var be *kv.BlockError
	testutil.Eventually(t, 10*time.Second, func() error {
		_, err := readAll(ctx, b.c, desc, dst, ids)
		if err == nil {
			return errors.New("the read of a killed engine's space succeeded")
		}
		return nil
	})
	_, err := readAll(ctx, b.c, desc, dst, ids)
	if !errors.As(err, &be) || !errors.Is(err, client.ErrNotFound) || !slices.Equal(be.Blocks, ids) || be.Layer != 0 {
		t.Fatalf("read of a killed engine's space: %v, want a BlockError naming %v from layer 0 matching client.ErrNotFound", err, ids)
	}
	t.Logf("engine gone before the read: %v", err)

	big := daemonCmd{Name: "gone/big", Layout: "vllm", Layers: 16, Blocks: 128, Size: 32 << 10, Seed: 2}
	e, desc = startKVEngine(t, a.sock, big, testutil.SpawnOptions{})
	bdst := registerDst(t, b, "decode/big", "vllm", 16, 128, 32<<10)
	all := seq(128)
	tr, err := kv.ReadBlocks(ctx, b.c, kv.Request{Src: desc, SrcBlocks: all, Dst: bdst.local, DstBlocks: all})
	if err != nil {
		t.Fatal(err)
	}
	if err := tr.WaitLayer(ctx, 0); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	killChild(t, e)
	err = tr.Wait(ctx)
	t.Logf("engine killed mid-read: the read ended %v later: %v", time.Since(start), err)
	if err == nil {
		checkRead(t, kvSource(big), bdst, make2(bdst), all, all, 0, 16)
	} else if !errors.As(err, &be) || !slices.Equal(be.Blocks, all) {
		t.Fatalf("read of an engine killed mid-read: %v, want success or a BlockError naming its blocks", err)
	}
	// Both daemons serve on.
	fresh := daemonCmd{Name: "gone/fresh", Layout: "sglang", Layers: 4, Blocks: 16, Size: 4096, Seed: 3}
	_, desc = startKVEngine(t, a.sock, fresh, testutil.SpawnOptions{})
	fdst := registerDst(t, b, "decode/fresh", "sglang", 4, 16, 4096)
	if _, err := readAll(ctx, b.c, desc, fdst, ids); err != nil {
		t.Fatal(err)
	}
	checkRead(t, kvSource(fresh), fdst, make2(fdst), ids, ids, 0, 4)
	if _, err := a.c.List(ctx); err != nil {
		t.Fatal(err)
	}
}

// make2 returns zeroed regions the sizes of h's.
func make2(h *hostSpace) [][]byte {
	out := make([][]byte, len(h.mem))
	for i, m := range h.mem {
		out[i] = make([]byte, len(m.Bytes()))
	}
	return out
}

// TestKVReadSourceDaemonKilled: the source's daemon killed (SIGKILL) in
// the middle of a read ends it, within seconds, with a BlockError naming
// the blocks (UNAVAILABLE: the node stopped answering); a read after it
// fails as clearly (UNAVAILABLE while its record lives, NOT_FOUND once it
// went); the reader's daemon serves on.
func TestKVReadSourceDaemonKilled(t *testing.T) {
	for _, mode := range []string{"direct", "staged"} {
		t.Run(mode, func(t *testing.T) { kvReadSourceDaemonKilled(t, mode) })
	}
}

func kvReadSourceDaemonKilled(t *testing.T, mode string) {
	srv := etcdtest.Start(t)
	a := startHelperDaemon(t, srv, "a", "host", 1<<30, 0)
	b := startDaemon(t, srv, "b")
	node.SetSpaceMode(b.node, mode)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	big := daemonCmd{Op: "kvspace", Name: "killed/kv", Layout: "vllm", Layers: 16, Blocks: 128, Size: 32 << 10, Seed: 4}
	desc := parseDesc(t, a.ask(t, big).Desc)
	dst := registerDst(t, b, "decode/killed", "vllm", 16, 128, 32<<10)
	all := seq(128)
	if _, err := readAll(ctx, b.c, desc, dst, all); err != nil {
		t.Fatal(err)
	}
	checkRead(t, kvSource(big), dst, make2(dst), all, all, 0, 16)
	clear(dst.mem[0].Bytes())
	tr, err := kv.ReadBlocks(ctx, b.c, kv.Request{Src: desc, SrcBlocks: all, Dst: dst.local, DstBlocks: all})
	if err != nil {
		t.Fatal(err)
	}
	if err := tr.WaitLayer(ctx, 0); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	a.kill(t)
	err = tr.Wait(ctx)
	took := time.Since(start)
	t.Logf("source daemon killed mid-read: the read ended %v later: %v", took, err)
	var be *kv.BlockError
	switch {
	case err == nil:
		// The last layers were in flight already.
		checkRead(t, kvSource(big), dst, make2(dst), all, all, 0, 16)
	case !errors.As(err, &be) || !slices.Equal(be.Blocks, all) || be.Layer < 1:
		t.Fatalf("read of a killed daemon's space: %v, want a BlockError naming the blocks from layer 1 on", err)
	case !errors.Is(err, client.ErrUnavailable) && !errors.Is(err, client.ErrNotFound):
		t.Fatalf("read of a killed daemon's space: %v, want UNAVAILABLE or NOT_FOUND", err)
	}
	if took > 15*time.Second {
		t.Errorf("the read took %v to fail", took)
	}
	start = time.Now()
	_, err = readAll(ctx, b.c, desc, dst, all)
	t.Logf("read after the kill (%v): %v", time.Since(start), err)
	if !errors.As(err, &be) || !errors.Is(err, client.ErrUnavailable) && !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("read of a killed daemon's space: %v, want a BlockError matching UNAVAILABLE or NOT_FOUND", err)
	}
	if time.Since(start) > 15*time.Second {
		t.Errorf("the read took %v to fail", time.Since(start))
	}
	// b serves on: a space of another node is read.
	c := startDaemon(t, srv, "c")
	small := daemonCmd{Name: "alive/kv", Layout: "vllm", Layers: 2, Blocks: 8, Size: 4096, Seed: 5}
	layout, sizes := kvLayout(small.Layout, small.Layers, small.Blocks, small.Size)
	src := newHostSpace(t, layout, sizes, 0)
	for i := range sizes {
		copy(src.region(i), kvRegion(small, i))
	}
	sp, err := kv.Register(ctx, c.c, small.Name, src.local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sdst := registerDst(t, b, "decode/alive", "vllm", 2, 8, 4096)
	if _, err := readAll(ctx, b.c, sp.Desc(), sdst, []int{7, 0}); err != nil {
		t.Fatal(err)
	}
	checkRead(t, src, sdst, make2(sdst), []int{7, 0}, []int{7, 0}, 0, 2)
}

func init() { roles["kvreader"] = kvReaderRole }

// kvReaderRole registers, with the daemon at SOCK, a zeroed host space of
// the layout of the space DESC, reads blocks 0..3 of DESC into its blocks
// 4..7, and says how it went: the class of the error, or the checksum of
// its regions one after another.
func kvReaderRole(p *testutil.Peer) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cl, err := client.Dial(ctx, os.Getenv("SOCK"))
	if err != nil {
		return err
	}
	defer cl.Close()
	var d kv.Desc
	if err := d.UnmarshalText([]byte(os.Getenv("DESC"))); err != nil {
		return err
	}
	dst := &kv.Local{Layout: d.Layout}
	var mem []*kv.HostMemory
	for _, r := range d.Regions {
		m, err := kv.AllocHost(r.Size)
		if err != nil {
			return err
		}
		defer m.Close()
		mem = append(mem, m)
		dst.Memory = append(dst.Memory, m.Memory())
	}
	if _, err := kv.Register(ctx, cl, "reader/kv", dst, client.RegisterOptions{}); err != nil {
		return err
	}
	tr, err := kv.ReadBlocks(ctx, cl, kv.Request{Src: &d, SrcBlocks: []int{0, 1, 2, 3}, Dst: dst, DstBlocks: []int{4, 5, 6, 7}})
	if err == nil {
		err = tr.Wait(ctx)
	}
	var m daemonReply
	switch {
	case errors.Is(err, client.ErrNotFound):
		m.Err = "notfound"
	case errors.Is(err, client.ErrPermission):
		m.Err = "permission"
	case err != nil:
		m.Err = err.Error()
	default:
		var all []byte
		for _, h := range mem {
			all = append(all, h.Bytes()...)
		}
		m.Desc = testutil.Sum(all)
	}
	return p.Send(m)
}

// TestKVReadOtherUID: a reader of another uid reads a space another node
// holds as the store's rules say: a private space of root's is refused
// (NOT_FOUND), a shared one is read; and a read never writes into a space
// that is not the reader's own (PERMISSION).
func TestKVReadOtherUID(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a child as another uid (CI runs as root)")
	}
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	b := startDaemonOpts(t, srv, "b", daemonOpts{capacity: 256 << 20, backend: "host", public: true,
		store: func(c *store.Config) { c.AllowUIDs = []uint32{65533} }})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	spaces := map[bool]*kv.Space{}
	var src *hostSpace
	for _, shared := range []bool{false, true} {
		layout, sizes := kvLayout("vllm", 2, 8, 64)
		src = newHostSpace(t, layout, sizes, 7)
		sp, err := kv.Register(ctx, a.c, fmt.Sprintf("uid/shared=%v", shared), src.local, client.RegisterOptions{Shared: shared})
		if err != nil {
			t.Fatal(err)
		}
		spaces[shared] = sp
	}
	// The go tool builds the test binary where only root may enter; the
	// reader runs a copy.
	exe := filepath.Join(filepath.Dir(b.sock), "node.test")
	bin, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, shared := range []bool{false, true} {
		text, err := spaces[shared].Desc().MarshalText()
		if err != nil {
			t.Fatal(err)
		}
		rd := testutil.SpawnWith(t, "kvreader", testutil.SpawnOptions{Exe: exe, Env: []string{"SOCK=" + b.sock, "DESC=" + string(text)},
			SysProcAttr: &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65533, Gid: 65533}}})
		var m daemonReply
		if err := rd.Recv(&m); err != nil {
			t.Fatalf("reader: %v: %s", err, rd.Stderr())
		}
		if !shared {
			if m.Err != "notfound" {
				t.Errorf("uid 65533 read root's private space: %+v, want notfound", m)
			}
			continue
		}
		want := make([][]byte, len(src.mem))
		for i := range want {
			want[i] = make([]byte, len(src.region(i)))
		}
		for l := range 2 {
			for p := range 2 {
				for k := range 4 {
					copy(kvBlock(src.local.Layout, l, p, k+4, func(i int) []byte { return want[i] }), kvBlock(src.local.Layout, l, p, k, src.region))
				}
			}
		}
		if m.Err != "" || m.Desc != testutil.Sum(bytes.Join(want, nil)) {
			t.Errorf("uid 65533 read root's shared space: %+v, want the blocks", m)
		}
	}
	// A destination of another uid: the daemon writes only into the
	// reader's own spaces.
	dst := registerDst(t, b, "decode/root", "vllm", 2, 8, 64)
	_ = dst
	other, err := kv.NewPlan(spaces[true].Desc(), spaces[true].Desc(), []int{0}, []int{0}, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	d := *other.Dst
	d.Name, d.Node = "65533:reader/kv", "b"
	srcB, _ := spaces[true].Desc().MarshalBinary()
	dstB, err := d.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	err = b.c.ReadSpace(ctx, client.SpaceRead{Src: srcB, Dst: dstB, SrcBlocks: []uint32{0}, DstBlocks: []uint32{0}}, nil)
	if !errors.Is(err, client.ErrPermission) {
		t.Errorf("a read into uid 65533's space by root: %v, want PERMISSION", err)
	}
}

// TestKVReadHostile sends kv_reads a client may forge and control requests
// a peer may: each fails with its typed error, and the daemons serve on.
func TestKVReadHostile(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	b := startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	layout, sizes := kvLayout("vllm", 2, 8, 64)
	src := newHostSpace(t, layout, sizes, 9)
	sp, err := kv.Register(ctx, a.c, "hostile/src", src.local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dst := registerDst(t, b, "hostile/dst", "vllm", 2, 8, 64)
	srcB, _ := sp.Desc().MarshalBinary()
	dstSpace := dst.local
	_ = dstSpace
	var dd kv.Desc
	{
		// The destination's description as b has it registered.
		objs, err := b.c.List(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for _, o := range objs {
			if o.Name == "hostile/dst/0" {
				if err := dd.UnmarshalBinary(o.Space); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	dstB, _ := dd.MarshalBinary()
	mod := func(d *kv.Desc, f func(*kv.Desc)) []byte {
		c := *d
		c.Regions = slices.Clone(d.Regions)
		f(&c)
		b, err := c.MarshalBinary()
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	ok := client.SpaceRead{Src: srcB, Dst: dstB, SrcBlocks: []uint32{1, 2}, DstBlocks: []uint32{3, 4}}
	if err := b.c.ReadSpace(ctx, ok, nil); err != nil {
		t.Fatal(err)
	}
	with := func(f func(*client.SpaceRead)) client.SpaceRead { r := ok; f(&r); return r }
	for _, c := range []struct {
		name string
		r    client.SpaceRead
		want error
	}{
		{"garbage source", with(func(r *client.SpaceRead) { r.Src = []byte("CKVS garbage") }), client.ErrInvalid},
		{"garbage destination", with(func(r *client.SpaceRead) { r.Dst = bytes.Repeat([]byte{0xff}, 100) }), client.ErrInvalid},
		{"source on this node", with(func(r *client.SpaceRead) { r.Src = mod(sp.Desc(), func(d *kv.Desc) { d.Node = "b" }) }), client.ErrInvalid},
		{"source of no node", with(func(r *client.SpaceRead) { r.Src = mod(sp.Desc(), func(d *kv.Desc) { d.Node = "" }) }), client.ErrInvalid},
		{"source node unknown", with(func(r *client.SpaceRead) { r.Src = mod(sp.Desc(), func(d *kv.Desc) { d.Node = "nosuch" }) }), client.ErrNotFound},
		{"stale source", with(func(r *client.SpaceRead) { r.Src = mod(sp.Desc(), func(d *kv.Desc) { d.ID[0]++ }) }), client.ErrNotFound},
		{"source name of no space", with(func(r *client.SpaceRead) {
			r.Src = mod(sp.Desc(), func(d *kv.Desc) { d.Name = "0:hostile/none" })
		}), client.ErrNotFound},
		{"source bigger than registered", with(func(r *client.SpaceRead) {
			r.Src = mod(sp.Desc(), func(d *kv.Desc) { d.Regions[0].Size *= 2 })
		}), client.ErrNotFound},
		{"destination unregistered", with(func(r *client.SpaceRead) { r.Dst = mod(&dd, func(d *kv.Desc) { d.Name = "0:hostile/none" }) }), client.ErrNotFound},
		{"destination stale", with(func(r *client.SpaceRead) { r.Dst = mod(&dd, func(d *kv.Desc) { d.ID[3]++ }) }), client.ErrNotFound},
		{"destination on another node", with(func(r *client.SpaceRead) { r.Dst = mod(&dd, func(d *kv.Desc) { d.Node = "a" }) }), client.ErrInvalid},
		{"source id out of range", with(func(r *client.SpaceRead) { r.SrcBlocks = []uint32{1, 8} }), client.ErrInvalid},
		{"destination id out of range", with(func(r *client.SpaceRead) { r.DstBlocks = []uint32{1 << 31, 0} }), client.ErrInvalid},
		{"lists differ", with(func(r *client.SpaceRead) { r.DstBlocks = []uint32{1} }), client.ErrInvalid},
		{"no blocks", with(func(r *client.SpaceRead) { r.SrcBlocks, r.DstBlocks = nil, nil }), client.ErrInvalid},
		{"layers past the end", with(func(r *client.SpaceRead) { r.First, r.Count = 1, 2 }), client.ErrInvalid},
		{"layers far past the end", with(func(r *client.SpaceRead) { r.First = 5000 }), client.ErrInvalid},
		{"layouts differ", with(func(r *client.SpaceRead) {
			r.Src = mod(sp.Desc(), func(d *kv.Desc) { d.Layers = d.Layers[:1] })
		}), client.ErrInvalid},
	} {
		err := b.c.ReadSpace(ctx, c.r, nil)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		} else {
			t.Logf("%s: %v", c.name, err)
		}
	}
	// A peer with the secret asks for what it may not have.
	cc, err := cluster.DialControl(ctx, secret, "x", "a", node.ControlAddr(a.node))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	stage := func(blocks []int, first, count int) *cluster.SpaceStage {
		return &cluster.SpaceStage{Blocks: blocks, First: first, Count: count}
	}
	for _, c := range []struct {
		name    string
		desc    []byte
		regions []int
		stage   *cluster.SpaceStage
	}{
		{"garbage", []byte("junk"), []int{0}, nil},
		{"region out of range", srcB, []int{2}, nil},
		{"negative region", srcB, []int{-1}, nil},
		{"regions not ascending", srcB, []int{1, 0}, nil},
		{"no regions", srcB, nil, nil},
		{"too many regions", srcB, make([]int, 2000), nil},
		{"a staging of no blocks", srcB, []int{0, 1}, stage(nil, 0, 2)},
		{"a staging of a block out of range", srcB, []int{0, 1}, stage([]int{8}, 0, 2)},
		{"a staging of a negative block", srcB, []int{0, 1}, stage([]int{-1}, 0, 2)},
		{"a staging of layers past the end", srcB, []int{0, 1}, stage([]int{1}, 1, 2)},
		{"a staging of negative layers", srcB, []int{0, 1}, stage([]int{1}, -1, 2)},
		{"a staging of no layers", srcB, []int{0, 1}, stage([]int{1}, 0, 0)},
		{"a staging with other regions", srcB, []int{0, 1}, stage([]int{1}, 0, 1)},
	} {
		if _, _, err := cc.OpenSpace(ctx, 0, c.desc, c.regions, c.stage); err == nil {
			t.Errorf("kvopen of %s was served", c.name)
		} else {
			t.Logf("kvopen of %s: %v", c.name, err)
		}
	}
	if _, _, err := cc.OpenSpace(ctx, 65533, srcB, []int{0}, nil); !errors.Is(err, cluster.ErrNoSpace) {
		t.Errorf("kvopen of root's private space for uid 65533: %v, want ErrNoSpace", err)
	}
	e, h, err := cc.OpenSpace(ctx, 0, srcB, []int{0, 1}, nil)
	if err != nil || len(e.Regions) != 2 {
		t.Fatalf("kvopen after refusals: %+v, %v", e, err)
	}
	if err := cc.Release(ctx, h); err != nil {
		t.Fatal(err)
	}
	// Both serve on.
	if err := b.c.ReadSpace(ctx, ok, nil); err != nil {
		t.Fatal(err)
	}
	checkRead(t, src, dst, make2(dst), []int{1, 2}, []int{3, 4}, 0, 2)
}

// TestKVReadCanceled: a read whose context ends is stopped at the daemon
// (kv_cancel) and fails with the context's error; a registration's
// mapping goes from the daemons' cache once the registration ends.
func TestKVReadCanceled(t *testing.T) {
	for _, mode := range []string{"direct", "staged"} {
		t.Run(mode, func(t *testing.T) { kvReadCanceled(t, mode) })
	}
}

func kvReadCanceled(t *testing.T, mode string) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	b := startDaemon(t, srv, "b")
	node.SetSpaceMode(b.node, mode)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	layout, sizes := kvLayout("vllm", 16, 128, 32<<10)
	src := newHostSpace(t, layout, sizes, 11)
	sp, err := kv.Register(ctx, a.c, "cancel/src", src.local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dst := registerDst(t, b, "cancel/dst", "vllm", 16, 128, 32<<10)
	all := seq(128)
	rctx, rcancel := context.WithCancel(ctx)
	tr, err := kv.ReadBlocks(rctx, b.c, kv.Request{Src: sp.Desc(), SrcBlocks: all, Dst: dst.local, DstBlocks: all})
	if err != nil {
		t.Fatal(err)
	}
	if err := tr.WaitLayer(ctx, 0); err != nil {
		t.Fatal(err)
	}
	rcancel()
	err = tr.Wait(ctx)
	var be *kv.BlockError
	if err != nil && (!errors.As(err, &be) || !errors.Is(err, context.Canceled)) {
		t.Fatalf("canceled read: %v, want a BlockError matching context.Canceled (or success: it was done)", err)
	}
	t.Logf("canceled read: %v", err)
	if _, err := readAll(ctx, b.c, sp.Desc(), dst, all); err != nil {
		t.Fatal(err)
	}
	checkRead(t, src, dst, make2(dst), all, all, 0, 16)
	if n, m := node.SpacesMapped(a.node), node.SpacesMapped(b.node); n != 16 || m != 16 {
		t.Errorf("mapped registrations: %d on the source, %d on the reader, want 16 each", n, m)
	}
	if err := sp.Close(ctx); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := node.SpacesMapped(a.node); n != 0 {
			return fmt.Errorf("the source keeps %d registrations of a closed space mapped", n)
		}
		return nil
	})
}

// TestKVReadSplit reads 20,000 scattered blocks, more ids than one
// kv_read's packet holds: the read goes as several requests, and its
// layers complete once every request has them.
func TestKVReadSplit(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	b := startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const layers, blocks, bsize = 3, 20000, 64
	layout, sizes := kvLayout("vllm", layers, blocks, bsize)
	src := newHostSpace(t, layout, sizes, 21)
	sp, err := kv.Register(ctx, a.c, "split/src", src.local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dst := registerDst(t, b, "split/dst", "sglang", layers, blocks, bsize)
	r := rand.New(rand.NewPCG(3, 4))
	srcIDs, dstIDs := r.Perm(blocks), r.Perm(blocks)
	tr, err := kv.ReadBlocks(ctx, b.c, kv.Request{Src: sp.Desc(), SrcBlocks: srcIDs, Dst: dst.local, DstBlocks: dstIDs, First: 1})
	if err != nil {
		t.Fatal(err)
	}
	for l := 1; l < layers; l++ {
		if err := tr.WaitLayer(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	if err := tr.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	checkRead(t, src, dst, make2(dst), srcIDs, dstIDs, 1, layers-1)
	want := fmt.Sprintf("%g", float64((layers-1)*2*blocks*bsize))
	if m := metric(t, b.st, "cudaipc_cluster_kv_read_bytes_total"); m != want {
		t.Errorf("b's cudaipc_cluster_kv_read_bytes_total is %s, want %s", m, want)
	}
	if m := metric(t, b.st, `cudaipc_cluster_kv_reads_total{result="ok"}`); m == "0" || m == "1" || m == "" {
		t.Errorf("b counts %s kv_reads, want the read cut into several", m)
	}
	if m := metric(t, a.st, "cudaipc_cluster_kv_staged_bytes_total"); m != want {
		t.Errorf("a's cudaipc_cluster_kv_staged_bytes_total is %s, want %s (the read staged)", m, want)
	}
}

// TestKVReadStagedGroups reads a staged read in groups of layers (a
// staging of at most 3 MiB a group, layers of 1 MiB: four groups, two at
// a time), every byte checked and each layer completing in order.
func TestKVReadStagedGroups(t *testing.T) {
	node.SetMaxStaged(t, 3<<20)
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	b := startDaemon(t, srv, "b")
	node.SetSpaceMode(b.node, "staged")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const layers, blocks, bsize = 12, 96, 8 << 10
	layout, sizes := kvLayout("blocks-first", layers, blocks, bsize)
	src := newHostSpace(t, layout, sizes, 31)
	sp, err := kv.Register(ctx, a.c, "groups/src", src.local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dst := registerDst(t, b, "groups/dst", "sglang", layers, blocks, bsize)
	r := rand.New(rand.NewPCG(5, 6))
	srcIDs, dstIDs := r.Perm(blocks)[:64], r.Perm(blocks)[:64]
	tr, err := kv.ReadBlocks(ctx, b.c, kv.Request{Src: sp.Desc(), SrcBlocks: srcIDs, Dst: dst.local, DstBlocks: dstIDs})
	if err != nil {
		t.Fatal(err)
	}
	for l := range layers {
		if err := tr.WaitLayer(ctx, l); err != nil {
			t.Fatal(err)
		}
	}
	if err := tr.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	checkRead(t, src, dst, make2(dst), srcIDs, dstIDs, 0, layers)
}
