package kv_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/kv"
	"github.com/cudaipc/cudaipc/store"
)

func TestMain(m *testing.M) {
	testutil.RunRole(testutil.Roles{"daemon": roleDaemon, "engine": roleEngine, "reader": roleReader,
		"pooluser": rolePoolUser, "stormer": roleStormer})
	os.Exit(m.Run())
}

// roleDaemon serves a host-backend store on SOCK (admitting ALLOW_UIDS
// beside its own; of CAPACITY bytes when set) until killed.
func roleDaemon(*testutil.Peer) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	cfg := store.Config{Backend: "host"}
	if b := os.Getenv("BACKEND"); b != "" {
		cfg.Backend = b
	}
	cfg.Capacity, _ = strconv.ParseInt(os.Getenv("CAPACITY"), 10, 64)
	for _, f := range strings.Fields(os.Getenv("ALLOW_UIDS")) {
		u, _ := strconv.ParseUint(f, 10, 32)
		cfg.AllowUIDs = append(cfg.AllowUIDs, uint32(u))
	}
	st, err := store.New(cfg)
	if err != nil {
		return err
	}
	defer st.Close()
	return st.ListenAndServe(ctx, os.Getenv("SOCK"))
}

// engineMsg is what the engine role says: its space's description, or
// that a command is done.
type engineMsg struct {
	Desc string `json:"desc,omitempty"`
	Done string `json:"done,omitempty"`
}

// roleEngine registers the space NAME of layout LAYOUT (testLayout),
// region i filled with random bytes of SEED+i, in host memory or, with
// GPU=vmm or GPU=legacy, in GPU 0's memory (VMM memory shared by
// descriptor, or cudaMalloc memory); it says its description, then obeys
// "close" (closes the space) until its input ends.
func roleEngine(p *testutil.Peer) error {
	ctx := context.Background()
	c, err := client.Dial(ctx, os.Getenv("SOCK"))
	if err != nil {
		return err
	}
	defer c.Close()
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	layers, _ := strconv.Atoi(os.Getenv("LAYERS"))
	blocks, _ := strconv.Atoi(os.Getenv("BLOCKS"))
	bytes, _ := strconv.ParseInt(os.Getenv("BYTES"), 10, 64)
	layout, sizes := testLayout(os.Getenv("LAYOUT"), layers, blocks, bytes)
	local := &kv.Local{Layout: layout}
	for i, n := range sizes {
		data := testutil.RandomBytes(seed+uint64(i), int(n))
		if os.Getenv("GPU") != "" {
			m, free, err := gpuMemory(os.Getenv("GPU"), n)
			if err != nil {
				return err
			}
			defer free()
			if err := m.Device.CopyToDevice(m.Ptr, data); err != nil {
				return err
			}
			local.Memory = append(local.Memory, m)
			continue
		}
		h, err := kv.AllocHost(n)
		if err != nil {
			return err
		}
		defer h.Close()
		copy(h.Bytes(), data)
		local.Memory = append(local.Memory, h.Memory())
	}
	sp, err := kv.Register(ctx, c, os.Getenv("NAME"), local, client.RegisterOptions{Shared: os.Getenv("SHARED") == "1"})
	if err != nil {
		return err
	}
	t, err := sp.Desc().MarshalText()
	if err != nil {
		return err
	}
	if err := p.Send(engineMsg{Desc: string(t)}); err != nil {
		return err
	}
	for {
		var cmd string
		if err := p.Recv(&cmd); err != nil {
			return nil
		}
		switch cmd {
		case "close":
			if err := sp.Close(ctx); err != nil {
				return err
			}
		default:
			return fmt.Errorf("unknown command %q", cmd)
		}
		if err := p.Send(engineMsg{Done: cmd}); err != nil {
			return err
		}
	}
}

// testLayout returns a layout of the given kind and its regions' sizes:
//   - vllm: a region a layer, [2, blocks, ...]: K blocks, then V blocks;
//   - vllm-blocks-first: a region a layer, [blocks, 2, ...]: K and V of a
//     block side by side;
//   - sglang: a region for K and one for V of each layer;
//   - host: one region, block-major (an offload buffer): block b holds K
//     and V of every layer.
func testLayout(kind string, layers, blocks int, bytes int64) (kv.Layout, []int64) {
	l := kv.Layout{Blocks: blocks, Layers: make([][]kv.Part, layers)}
	b := int64(blocks)
	var sizes []int64
	for i := range l.Layers {
		switch kind {
		case "vllm":
			l.Layers[i] = []kv.Part{{Region: i, Stride: bytes, Bytes: bytes}, {Region: i, Base: b * bytes, Stride: bytes, Bytes: bytes}}
			sizes = append(sizes, 2*b*bytes)
		case "vllm-blocks-first":
			l.Layers[i] = []kv.Part{{Region: i, Stride: 2 * bytes, Bytes: bytes}, {Region: i, Base: bytes, Stride: 2 * bytes, Bytes: bytes}}
			sizes = append(sizes, 2*b*bytes)
		case "sglang":
			l.Layers[i] = []kv.Part{{Region: 2 * i, Stride: bytes, Bytes: bytes}, {Region: 2*i + 1, Stride: bytes, Bytes: bytes}}
			sizes = append(sizes, b*bytes, b*bytes)
		case "host":
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

// startDaemon runs a daemon child on a socket in a world-traversable
// directory and waits until it answers; it returns the socket.
func startDaemon(t testing.TB, env ...string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "cudaipc-kv-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "store.sock")
	testutil.Spawn(t, "daemon", append(env, "SOCK="+sock)...)
	testutil.Eventually(t, testutil.Wait, func() error {
		c, err := client.Dial(context.Background(), sock)
		if err != nil {
			return err
		}
		return c.Close()
	})
	return sock
}

func dial(t testing.TB, sock string) *client.Client {
	t.Helper()
	c, err := client.Dial(context.Background(), sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// engine is an engine child and its space's description.
type engine struct {
	*testutil.Child
	desc  *kv.Desc
	seed  uint64
	sizes []int64
}

// startEngine starts an engine child registering the space name of the
// given layout; env adds to its environment.
func startEngine(t testing.TB, sock, name, layout string, layers, blocks int, bytes int64, seed uint64, o testutil.SpawnOptions) *engine {
	t.Helper()
	o.Env = append(o.Env, "SOCK="+sock, "NAME="+name, "LAYOUT="+layout, "LAYERS="+strconv.Itoa(layers),
		"BLOCKS="+strconv.Itoa(blocks), "BYTES="+strconv.FormatInt(bytes, 10), "SEED="+strconv.FormatUint(seed, 10))
	e := &engine{Child: testutil.SpawnWith(t, "engine", o), seed: seed}
	var m engineMsg
	if err := e.Recv(&m); err != nil {
		t.Fatalf("engine: %v: %s", err, e.Stderr())
	}
	e.desc = new(kv.Desc)
	if err := e.desc.UnmarshalText([]byte(m.Desc)); err != nil {
		t.Fatal(err)
	}
	_, e.sizes = testLayout(layout, layers, blocks, bytes)
	return e
}

// region returns the bytes the engine filled its region i with.
func (e *engine) region(i int) []byte { return testutil.RandomBytes(e.seed+uint64(i), int(e.sizes[i])) }

// readerMsg is what the reader role says: the class of its read's error,
// or the checksum of its destination's regions, one after another.
type readerMsg struct {
	Err string `json:"err,omitempty"`
	Sum string `json:"sum,omitempty"`
}

// roleReader reads blocks 0..3 of the space DESC into blocks 4..7 of a
// zeroed local space of the same layout (telling the source NOTIFY when
// set), and says how it went.
func roleReader(p *testutil.Peer) error {
	ctx := context.Background()
	c, err := client.Dial(ctx, os.Getenv("SOCK"))
	if err != nil {
		return err
	}
	defer c.Close()
	var d kv.Desc
	if err := d.UnmarshalText([]byte(os.Getenv("DESC"))); err != nil {
		return err
	}
	dst := &kv.Local{Layout: d.Layout}
	for _, r := range d.Regions {
		dst.Memory = append(dst.Memory, kv.Memory{Host: make([]byte, r.Size)})
	}
	req := kv.Request{Src: &d, SrcBlocks: []int{0, 1, 2, 3}, Dst: dst, DstBlocks: []int{4, 5, 6, 7}}
	if n, ok := os.LookupEnv("NOTIFY"); ok {
		req.Notify = []byte(n)
	}
	tr, err := kv.ReadBlocks(ctx, c, req)
	if err == nil {
		err = tr.Wait(ctx)
	}
	switch {
	case errors.Is(err, client.ErrNotFound):
		return p.Send(readerMsg{Err: "notfound"})
	case errors.Is(err, client.ErrPermission):
		return p.Send(readerMsg{Err: "permission"})
	case err != nil:
		return p.Send(readerMsg{Err: err.Error()})
	}
	var all []byte
	for _, m := range dst.Memory {
		all = append(all, m.Host...)
	}
	return p.Send(readerMsg{Sum: testutil.Sum(all)})
}

// gpuMemory allocates n bytes of GPU 0's memory: VMM memory shared by
// descriptor (kind "vmm") or cudaMalloc memory ("legacy").
func gpuMemory(kind string, n int64) (kv.Memory, func(), error) {
	dev, err := cudaipc.DeviceByOrdinal(0)
	if err != nil {
		return kv.Memory{}, nil, err
	}
	if kind == "vmm" {
		b, err := dev.AllocShareable(n)
		if err != nil {
			return kv.Memory{}, nil, err
		}
		return kv.Memory{Device: dev, Ptr: b.Ptr(), Size: n}, func() { b.Free() }, nil
	}
	b, err := dev.Alloc(n)
	if err != nil {
		return kv.Memory{}, nil, err
	}
	return kv.Memory{Device: dev, Ptr: b.Ptr(), Size: n}, func() { b.Free() }, nil
}
