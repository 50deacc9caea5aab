package kv_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/kv"
)

// TestGPUReadBlocks reads scattered blocks of an engine's GPU space (VMM
// memory shared by descriptor, and cudaMalloc memory by legacy IPC) of
// each layout, from another process, into a local GPU space of another
// layout through the gather kernel: every read block arrives, every other
// destination byte stays, each layer completes; a read from GPU into host
// memory is ErrNotSupported.
func TestGPUReadBlocks(t *testing.T) {
	dev := testutil.RequireGPU(t)
	sock := startDaemon(t, "BACKEND=cuda")
	c := dial(t, sock)
	ctx := context.Background()
	const layers, blocks, bsize = 3, 40, 4096 + 48
	r := rand.New(rand.NewPCG(5, 6))
	for i, kind := range []string{"vllm", "vllm-blocks-first", "sglang", "host"} {
		alloc := []string{"vmm", "legacy"}[i%2]
		dstKind := []string{"sglang", "host", "vllm", "vllm-blocks-first"}[i]
		t.Run(kind+"-"+alloc, func(t *testing.T) {
			e := startEngine(t, sock, "gpu/"+kind, kind, layers, blocks, bsize, uint64(40+i), testutil.SpawnOptions{Env: []string{"GPU=" + alloc}})
			dl, dsizes := testLayout(dstKind, layers, blocks, bsize)
			dst := &kv.Local{Layout: dl}
			var orig [][]byte
			for j, n := range dsizes {
				m, free, err := gpuMemory("legacy", n)
				if err != nil {
					t.Fatal(err)
				}
				defer free()
				orig = append(orig, testutil.RandomBytes(uint64(900+j), int(n)))
				if err := dev.CopyToDevice(m.Ptr, orig[j]); err != nil {
					t.Fatal(err)
				}
				dst.Memory = append(dst.Memory, m)
			}
			n := 1 + r.IntN(blocks-1)
			srcIDs, dstIDs := scattered(r, n, blocks), scattered(r, n, blocks)
			tr, err := kv.ReadBlocks(ctx, c, kv.Request{Src: e.desc, SrcBlocks: srcIDs, Dst: dst, DstBlocks: dstIDs, First: 1})
			if err != nil {
				t.Fatal(err)
			}
			for l := 1; l < layers; l++ {
				if err := tr.WaitLayer(ctx, l); err != nil {
					t.Fatalf("layer %d: %v", l, err)
				}
			}
			if err := tr.Wait(ctx); err != nil {
				t.Fatal(err)
			}
			got := make([][]byte, len(dsizes))
			for j, n := range dsizes {
				got[j] = make([]byte, n)
				if err := dev.CopyFromDevice(got[j], dst.Memory[j].Ptr); err != nil {
					t.Fatal(err)
				}
			}
			want := make([][]byte, len(orig))
			for j := range orig {
				want[j] = bytes.Clone(orig[j])
			}
			for k, b := range dstIDs {
				for l := 1; l < layers; l++ {
					for p := range 2 {
						copy(block(dl, l, p, b, func(i int) []byte { return want[i] }), block(e.desc.Layout, l, p, srcIDs[k], e.region))
					}
				}
			}
			for j := range want {
				if !bytes.Equal(got[j], want[j]) {
					t.Fatalf("destination region %d is not what the read should leave", j)
				}
			}
			host := &kv.Local{Layout: dl}
			for _, n := range dsizes {
				host.Memory = append(host.Memory, kv.Memory{Host: make([]byte, n)})
			}
			if _, err := kv.ReadBlocks(ctx, c, kv.Request{Src: e.desc, SrcBlocks: srcIDs, Dst: host, DstBlocks: dstIDs}); !errors.Is(err, kv.ErrNotSupported) {
				t.Errorf("a read from GPU into host memory: %v, want ErrNotSupported", err)
			}
		})
	}
}
