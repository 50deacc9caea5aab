package node_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/kv"
)

// KV spaces in GPU memory read across nodes (docs/kv.md, "Across
// nodes"): staged through pinned host memory, the source's blocks
// gathered by its GPU into the staging buffer, the reader's scattered
// by its GPU from the pieces it fetched.

// kvGPUHeld keeps the GPU memory a helper process registered.
var kvGPUHeld []interface{ Free() error }

// gpuRegion allocates len(data) bytes of GPU 0's memory holding data:
// VMM memory shared by descriptor (kind "vmm") or cudaMalloc memory
// ("legacy"), kept until the process ends.
func gpuRegion(kind string, n int64, data []byte) (kv.Memory, error) {
	dev, err := cudaipc.DeviceByOrdinal(0)
	if err != nil {
		return kv.Memory{}, err
	}
	var ptr cudaipc.DevicePtr
	switch kind {
	case "vmm":
		b, err := dev.AllocShareable(n)
		if err != nil {
			return kv.Memory{}, err
		}
		kvGPUHeld, ptr = append(kvGPUHeld, b), b.Ptr()
	case "legacy":
		b, err := dev.Alloc(n)
		if err != nil {
			return kv.Memory{}, err
		}
		kvGPUHeld, ptr = append(kvGPUHeld, b), b.Ptr()
	default:
		return kv.Memory{}, fmt.Errorf("GPU memory kind %q", kind)
	}
	if data != nil {
		if err := dev.CopyToDevice(ptr, data); err != nil {
			return kv.Memory{}, err
		}
	}
	return kv.Memory{Device: dev, Ptr: ptr, Size: n}, nil
}

// gpuDst registers a zeroed space of layout kind in GPU 0's memory (VMM)
// on d, and returns it and a function that reads its regions back.
func gpuDst(ctx context.Context, t *testing.T, d *daemon, name, kind string, layers, blocks int, bsize int64) (*kv.Local, func() *hostSpace) {
	t.Helper()
	l, sizes := kvLayout(kind, layers, blocks, bsize)
	local := &kv.Local{Layout: l}
	for _, n := range sizes {
		m, err := gpuRegion("vmm", n, make([]byte, n))
		if err != nil {
			t.Fatal(err)
		}
		local.Memory = append(local.Memory, m)
	}
	sp, err := kv.Register(ctx, d.c, name, local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sp.Close(context.Background()) })
	return local, func() *hostSpace {
		h := &hostSpace{local: &kv.Local{Layout: l}, fixed: make([][]byte, len(sizes))}
		for i, m := range local.Memory {
			h.fixed[i] = make([]byte, m.Size)
			if err := m.Device.CopyFromDevice(h.fixed[i], m.Ptr); err != nil {
				t.Fatal(err)
			}
		}
		return h
	}
}

// TestKVReadAcrossNodesGPU reads blocks of spaces in GPU memory (VMM and
// cudaMalloc memory of an engine process) and in host memory on daemon a
// into spaces in GPU memory and in host memory on daemon b, at scattered
// ids, a read small enough to come in the control channel's answer and a
// larger one fetched in pieces; every byte checked.
func TestKVReadAcrossNodesGPU(t *testing.T) {
	_, a, b, ctx := gpuDaemons(t, 256<<20)
	r := rand.New(rand.NewPCG(7, 8))
	for _, c := range []struct{ src, dst string }{{"vmm", "gpu"}, {"legacy", "gpu"}, {"vmm", "host"}, {"", "gpu"}} {
		t.Run(fmt.Sprintf("%s-to-%s", map[string]string{"": "host"}[c.src]+c.src, c.dst), func(t *testing.T) {
			for _, shape := range []struct {
				layers, blocks int
				bsize          int64
				n              int
			}{{2, 16, 1024, 3}, {8, 96, 32 << 10, 40}} {
				cmd := daemonCmd{Name: fmt.Sprintf("gpu/%s-%s/%d", c.src, c.dst, shape.bsize), Layout: "vllm", Layers: shape.layers,
					Blocks: shape.blocks, Size: shape.bsize, Seed: byte(shape.n), GPU: c.src}
				_, desc := startKVEngine(t, a.sock, cmd, testutil.SpawnOptions{})
				srcIDs, dstIDs := r.Perm(shape.blocks)[:shape.n], r.Perm(shape.blocks)[:shape.n]
				var local *kv.Local
				var back func() *hostSpace
				var hdst *hostSpace
				if c.dst == "gpu" {
					local, back = gpuDst(ctx, t, b, "decode/"+cmd.Name, "sglang", shape.layers, shape.blocks, shape.bsize)
				} else {
					hdst = registerDst(t, b, "decode/"+cmd.Name, "sglang", shape.layers, shape.blocks, shape.bsize)
					local, back = hdst.local, func() *hostSpace { return hdst }
				}
				tr, err := kv.ReadBlocks(ctx, b.c, kv.Request{Src: desc, SrcBlocks: srcIDs, Dst: local, DstBlocks: dstIDs})
				if err != nil {
					t.Fatal(err)
				}
				for l := range shape.layers {
					if err := tr.WaitLayer(ctx, l); err != nil {
						t.Fatalf("layer %d: %v", l, err)
					}
				}
				if err := tr.Wait(ctx); err != nil {
					t.Fatal(err)
				}
				got := back()
				checkRead(t, kvSource(cmd), got, make2zero(got), srcIDs, dstIDs, 0, shape.layers)
			}
		})
	}
}

// make2zero returns zeroed regions the sizes of h's.
func make2zero(h *hostSpace) [][]byte {
	n := len(h.fixed)
	if h.fixed == nil {
		n = len(h.mem)
	}
	out := make([][]byte, n)
	for i := range out {
		out[i] = make([]byte, len(h.region(i)))
	}
	return out
}
