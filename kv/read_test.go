package kv_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/kv"
)

// scattered returns n distinct block ids of [0, blocks) in random order,
// with some runs of adjacent ids (which a read coalesces).
func scattered(r *rand.Rand, n, blocks int) []int {
	perm := r.Perm(blocks)
	ids := make([]int, 0, n)
	seen := make(map[int]bool)
	for _, b := range perm {
		for k := 0; k < 1+r.IntN(3) && len(ids) < n && b+k < blocks && !seen[b+k]; k++ {
			ids = append(ids, b+k)
			seen[b+k] = true
		}
		if len(ids) == n {
			break
		}
	}
	return ids
}

// block returns block b of layer l, part p of a space: its bytes in region
// memory mem(region).
func block(l kv.Layout, layer, part, b int, mem func(int) []byte) []byte {
	p := l.Layers[layer][part]
	off := p.Base + int64(b)*p.Stride
	return mem(p.Region)[off : off+p.Bytes]
}

// TestReadBlocksLayouts reads scattered blocks of an engine's host space of
// each layout, from another process, into a local space of another
// layout, for all layers and for a range: every read block arrives, every
// other destination byte stays, each layer completes, and the engine's
// regions are left without leases.
func TestReadBlocksLayouts(t *testing.T) {
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	const layers, blocks, bsize = 4, 48, 272
	r := rand.New(rand.NewPCG(1, 2))
	for i, src := range []string{"vllm", "vllm-blocks-first", "sglang", "host"} {
		dstKind := []string{"host", "sglang", "vllm-blocks-first", "vllm"}[i]
		t.Run(src+"-to-"+dstKind, func(t *testing.T) {
			e := startEngine(t, sock, "ns/engine-"+src+"/kv", src, layers, blocks, bsize, uint64(100*i), testutil.SpawnOptions{})
			dl, dsizes := testLayout(dstKind, layers, blocks+5, bsize)
			dst := &kv.Local{Layout: dl}
			var orig [][]byte
			for j, n := range dsizes {
				b := testutil.RandomBytes(uint64(7000+j), int(n))
				orig = append(orig, bytes.Clone(b))
				dst.Memory = append(dst.Memory, kv.Memory{Host: b})
			}
			for _, rng := range []struct{ first, count int }{{0, 0}, {1, 2}} {
				n := 1 + r.IntN(blocks/2)
				srcIDs, dstIDs := scattered(r, n, blocks), scattered(r, n, blocks+5)
				tr, err := kv.ReadBlocks(ctx, c, kv.Request{Src: e.desc, SrcBlocks: srcIDs, Dst: dst, DstBlocks: dstIDs, First: rng.first, Count: rng.count})
				if err != nil {
					t.Fatal(err)
				}
				last := layers
				if rng.count != 0 {
					last = rng.first + rng.count
				}
				for l := rng.first; l < last; l++ {
					if err := tr.WaitLayer(ctx, l); err != nil {
						t.Fatalf("layer %d: %v", l, err)
					}
				}
				if err := tr.Wait(ctx); err != nil {
					t.Fatal(err)
				}
				<-tr.Done()
				read := make(map[int]bool)
				for k, b := range dstIDs {
					read[b] = true
					for l := rng.first; l < last; l++ {
						for p := range 2 {
							got := block(dl, l, p, b, func(i int) []byte { return dst.Memory[i].Host })
							want := block(e.desc.Layout, l, p, srcIDs[k], e.region)
							if !bytes.Equal(got, want) {
								t.Fatalf("layers [%d, %d): layer %d part %d: destination block %d is not source block %d", rng.first, last, l, p, b, srcIDs[k])
							}
						}
					}
				}
				// Every block not read, and every layer outside the range,
				// is as it was; then the read ones become the new "as it was".
				for l := range layers {
					for p := range 2 {
						for b := range blocks + 5 {
							if read[b] && l >= rng.first && l < last {
								continue
							}
							got := block(dl, l, p, b, func(i int) []byte { return dst.Memory[i].Host })
							if !bytes.Equal(got, block(dl, l, p, b, func(i int) []byte { return orig[i] })) {
								t.Fatalf("layer %d part %d block %d changed, but was not read", l, p, b)
							}
						}
					}
				}
				for j := range orig {
					copy(orig[j], dst.Memory[j].Host)
				}
			}
			for j := range e.desc.Regions {
				testutil.Eventually(t, testutil.Wait, func() error {
					info, err := c.Stat(ctx, e.desc.RegionName(j))
					if err != nil {
						return err
					}
					if info.Leases != 0 {
						return fmt.Errorf("region %d: %d leases", j, info.Leases)
					}
					return nil
				})
			}
		})
	}
}

// TestReadBlocksBadInput checks the typed errors of bad reads: block ids
// past the end (named), layouts that do not fit, an unknown space, a stale
// description, and that a failed read changes nothing.
func TestReadBlocksBadInput(t *testing.T) {
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	const layers, blocks, bsize = 2, 16, 64
	e := startEngine(t, sock, "bad/kv", "vllm", layers, blocks, bsize, 5, testutil.SpawnOptions{})
	dl, dsizes := testLayout("vllm", layers, blocks, bsize)
	dst := &kv.Local{Layout: dl}
	for j, n := range dsizes {
		dst.Memory = append(dst.Memory, kv.Memory{Host: testutil.RandomBytes(uint64(50+j), int(n))})
	}
	read := func(r kv.Request) error {
		tr, err := kv.ReadBlocks(ctx, c, r)
		if err != nil {
			return err
		}
		return tr.Wait(ctx)
	}
	var be *kv.BlockError
	err := read(kv.Request{Src: e.desc, SrcBlocks: []int{1, blocks, 3}, Dst: dst, DstBlocks: []int{0, 1, 2}})
	if !errors.Is(err, kv.ErrBlockRange) || !errors.As(err, &be) || len(be.Blocks) != 1 || be.Blocks[0] != blocks {
		t.Errorf("source block past the end: %v, want ErrBlockRange naming block %d", err, blocks)
	}
	if err := read(kv.Request{Src: e.desc, SrcBlocks: []int{1}, Dst: dst, DstBlocks: []int{-1}}); !errors.Is(err, kv.ErrBlockRange) {
		t.Errorf("negative destination block: %v, want ErrBlockRange", err)
	}
	// A destination of another block size, and of other layers.
	for _, wrong := range []struct {
		name   string
		layers int
		bytes  int64
	}{{"block bytes", layers, bsize + 16}, {"layers", layers + 1, bsize}} {
		wl, ws := testLayout("vllm", wrong.layers, blocks, wrong.bytes)
		w := &kv.Local{Layout: wl}
		for _, n := range ws {
			w.Memory = append(w.Memory, kv.Memory{Host: make([]byte, n)})
		}
		if err := read(kv.Request{Src: e.desc, SrcBlocks: []int{1}, Dst: w, DstBlocks: []int{1}}); !errors.Is(err, kv.ErrMismatch) {
			t.Errorf("wrong %s: %v, want ErrMismatch", wrong.name, err)
		}
	}
	if err := read(kv.Request{Src: e.desc, SrcBlocks: []int{1, 2}, Dst: dst, DstBlocks: []int{1}}); !errors.Is(err, kv.ErrMismatch) {
		t.Errorf("lists of two lengths: %v, want ErrMismatch", err)
	}
	if err := read(kv.Request{Src: e.desc, SrcBlocks: []int{1}, Dst: dst, DstBlocks: []int{1}, First: 1, Count: 2}); !errors.Is(err, kv.ErrMismatch) {
		t.Errorf("layers past the end: %v, want ErrMismatch", err)
	}
	// A destination whose layout passes the end of its memory.
	short := &kv.Local{Layout: dl, Memory: []kv.Memory{{Host: make([]byte, dsizes[0]-1)}, {Host: make([]byte, dsizes[1])}}}
	if err := read(kv.Request{Src: e.desc, SrcBlocks: []int{1}, Dst: short, DstBlocks: []int{1}}); !errors.Is(err, kv.ErrInvalidDesc) {
		t.Errorf("destination memory too short: %v, want ErrInvalidDesc", err)
	}
	unknown := *e.desc
	unknown.Name = e.desc.Name + "-none"
	if err := read(kv.Request{Src: &unknown, SrcBlocks: []int{1, 2}, Dst: dst, DstBlocks: []int{3, 4}}); !errors.Is(err, client.ErrNotFound) || !errors.As(err, &be) || len(be.Blocks) != 2 {
		t.Errorf("unknown space: %v, want ErrNotFound naming the 2 blocks", err)
	}
	stale := *e.desc
	stale.ID = kv.NewID()
	if err := read(kv.Request{Src: &stale, SrcBlocks: []int{1}, Dst: dst, DstBlocks: []int{3}}); !errors.Is(err, kv.ErrStale) {
		t.Errorf("description of another registration: %v, want ErrStale", err)
	}
	for j, n := range dsizes {
		if !bytes.Equal(dst.Memory[j].Host, testutil.RandomBytes(uint64(50+j), int(n))) {
			t.Errorf("region %d of the destination changed in failed reads", j)
		}
	}
}

// TestReadBlocksSpaceGone reads a space whose engine closed it, and one
// whose engine was killed (kill -9): both fail with ErrNotFound naming
// the blocks, and the message says the space's engine ended or closed it.
func TestReadBlocksSpaceGone(t *testing.T) {
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	dl, dsizes := testLayout("sglang", 2, 8, 32)
	dst := &kv.Local{Layout: dl}
	for _, n := range dsizes {
		dst.Memory = append(dst.Memory, kv.Memory{Host: make([]byte, n)})
	}
	for _, how := range []string{"close", "kill"} {
		e := startEngine(t, sock, "gone/"+how, "sglang", 2, 8, 32, 9, testutil.SpawnOptions{})
		r := kv.Request{Src: e.desc, SrcBlocks: []int{0, 5}, Dst: dst, DstBlocks: []int{1, 2}}
		tr, err := kv.ReadBlocks(ctx, c, r)
		if err != nil {
			t.Fatal(err)
		}
		if err := tr.Wait(ctx); err != nil {
			t.Fatalf("%s: read before: %v", how, err)
		}
		if how == "close" {
			if err := e.Send("close"); err != nil {
				t.Fatal(err)
			}
			var m struct{ Done string }
			if err := e.Recv(&m); err != nil || m.Done != "close" {
				t.Fatalf("engine: %v %v", m, err)
			}
		} else {
			if err := syscall.Kill(e.Pid(), syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			_ = e.Wait(testutil.Wait)
		}
		testutil.Eventually(t, testutil.Wait, func() error {
			tr, err := kv.ReadBlocks(ctx, c, r)
			if err != nil {
				t.Fatal(err)
			}
			err = tr.Wait(ctx)
			var be *kv.BlockError
			if !errors.Is(err, client.ErrNotFound) || !errors.As(err, &be) || len(be.Blocks) != 2 {
				return fmt.Errorf("%s: %v, want ErrNotFound naming 2 blocks", how, err)
			}
			if err := tr.WaitLayer(ctx, 0); !errors.Is(err, client.ErrNotFound) {
				return fmt.Errorf("%s: WaitLayer: %v", how, err)
			}
			return nil
		})
	}
}

// TestReadBlocksOtherUID reads the space of an engine of another uid: a
// private space is refused, a shared one is read.
func TestReadBlocksOtherUID(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a child as another uid (CI runs as root)")
	}
	sock := startDaemon(t, "ALLOW_UIDS=65534 65533")
	// The go tool builds the test binary where only root may enter; the
	// engine runs a copy.
	exe := filepath.Join(filepath.Dir(sock), "kv.test")
	bin, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	nobody := testutil.SpawnOptions{Exe: exe, SysProcAttr: &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}}
	private := startEngine(t, sock, "uid/private", "vllm", 2, 8, 64, 3, nobody)
	nobody.Env = []string{"SHARED=1"}
	shared := startEngine(t, sock, "uid/shared", "vllm", 2, 8, 64, 4, nobody)
	if private.desc.Name != "65534:uid/private" {
		t.Errorf("the space's name is %q, want it qualified by the engine's uid", private.desc.Name)
	}
	reader := testutil.SpawnOptions{Exe: exe, SysProcAttr: &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65533, Gid: 65533}}}
	for _, e := range []*engine{private, shared} {
		text, err := e.desc.MarshalText()
		if err != nil {
			t.Fatal(err)
		}
		reader.Env = []string{"SOCK=" + sock, "DESC=" + string(text)}
		rd := testutil.SpawnWith(t, "reader", reader)
		var m readerMsg
		if err := rd.Recv(&m); err != nil {
			t.Fatalf("reader: %v: %s", err, rd.Stderr())
		}
		if e == private {
			if m.Err != "notfound" && m.Err != "permission" {
				t.Errorf("uid 65533 read uid 65534's private space: %+v, want notfound or permission", m)
			}
			continue
		}
		// The reader copies blocks 0..3 to 4..7 of a space like the source.
		want := make([][]byte, len(e.sizes))
		for j := range want {
			want[j] = make([]byte, e.sizes[j])
		}
		for l := range e.desc.Layers {
			for p := range 2 {
				for b := range 4 {
					copy(block(e.desc.Layout, l, p, b+4, func(i int) []byte { return want[i] }), block(e.desc.Layout, l, p, b, e.region))
				}
			}
		}
		if m.Err != "" || m.Sum != testutil.Sum(bytes.Join(want, nil)) {
			t.Errorf("uid 65533 read uid 65534's shared space: %+v, want the blocks", m)
		}
	}
}

// TestRegisterHostLifetime checks registered host memory's rules: a lease
// keeps the memory readable after its engine is killed (kill -9), the
// space goes with the last lease, and the memfd cannot shrink under its
// readers; a descriptor that is no sealable memfd is refused.
func TestRegisterHostLifetime(t *testing.T) {
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	e := startEngine(t, sock, "life/kv", "host", 2, 8, 64, 11, testutil.SpawnOptions{})
	l, err := c.Get(ctx, e.desc.RegionName(0))
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(e.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = e.Wait(testutil.Wait)
	testutil.Eventually(t, testutil.Wait, func() error {
		info, err := c.Stat(ctx, e.desc.RegionName(0))
		if err != nil {
			return err
		}
		if !info.Orphaned {
			return errors.New("not orphaned yet")
		}
		return nil
	})
	if !bytes.Equal(l.Bytes(), e.region(0)) {
		t.Fatal("a lease's bytes changed after its engine was killed")
	}
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Stat(ctx, e.desc.RegionName(0)); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("after the last lease of a dead engine's space: %v, want ErrNotFound", err)
	}

	h, err := kv.AllocHost(1 << 16)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	m := h.Memory()
	if _, err := c.RegisterHost(ctx, "life/memfd", m.File, 1<<16, client.RegisterOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := m.File.Truncate(1 << 12); err == nil {
		t.Error("a registered memfd shrank")
	}
	if _, err := c.RegisterHost(ctx, "life/big", m.File, 1<<17, client.RegisterOptions{}); !errors.Is(err, client.ErrInvalid) {
		t.Errorf("registering more bytes than the memfd has: %v, want ErrInvalid", err)
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	defer pw.Close()
	if _, err := c.RegisterHost(ctx, "life/pipe", pr, 1<<12, client.RegisterOptions{}); !errors.Is(err, client.ErrInvalid) {
		t.Errorf("registering a pipe: %v, want ErrInvalid", err)
	}
}

// TestHostMappingReused: a client maps registered host memory once: two
// leases held together share the mapping, and a lease after both ended
// finds it kept; each holds the engine's bytes.
func TestHostMappingReused(t *testing.T) {
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	e := startEngine(t, sock, "reuse/kv", "host", 2, 8, 64, 12, testutil.SpawnOptions{})
	get := func() (*client.Lease, *byte) {
		l, err := c.Get(ctx, e.desc.RegionName(0))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(l.Bytes(), e.region(0)) {
			t.Fatal("a lease of registered host memory does not hold the engine's bytes")
		}
		return l, &l.Bytes()[0]
	}
	l1, a1 := get()
	l2, a2 := get()
	if a1 != a2 {
		t.Errorf("two leases of one memfd at %p and %p: want one mapping", a1, a2)
	}
	for _, l := range []*client.Lease{l1, l2} {
		if err := l.Release(); err != nil {
			t.Fatal(err)
		}
	}
	l3, a3 := get()
	defer l3.Release()
	if a3 != a1 {
		t.Errorf("a lease after the others ended mapped at %p, not the kept %p", a3, a1)
	}
}
