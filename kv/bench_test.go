package kv_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/kv"
)

// BenchmarkReadBlocks reads a request's KV blocks of Llama-3-8B's shapes
// (32 layers, K and V of 8 heads × 128 dims × 16 tokens in bf16: 32 KiB a
// block a part; vLLM's layout) from an engine process into this one, for
// requests of 128, 1k and 8k tokens (KV_BENCH_TOKENS lists others, e.g.
// 32768), scattered over a space twice the request. Host memory, or GPU 0's
// with KV_BENCH_GPU=1. Beside each read's time it reports, over the same
// copies in this process, x_floor (the read over the floor: the coalesced
// copies, on the GPU one gather launch a layer) and loop_over_read (a copy
// per block, on the GPU cuMemcpyAsync each, over the read): medians, the
// read's over its b.N reads, the floor's over 9 runs. Every read's blocks
// are checked after the timing.
func BenchmarkReadBlocks(b *testing.B) {
	tokens := []int{128, 1 << 10, 8 << 10}
	if v := os.Getenv("KV_BENCH_TOKENS"); v != "" {
		tokens = nil
		for f := range strings.FieldsFuncSeq(v, func(r rune) bool { return r == ',' || r == ' ' }) {
			n, err := strconv.Atoi(f)
			if err != nil {
				b.Fatal(err)
			}
			tokens = append(tokens, n)
		}
	}
	gpu := os.Getenv("KV_BENCH_GPU") == "1"
	var dev *cudaipc.Device
	env := []string{}
	backend := "BACKEND=host"
	if gpu {
		dev = testutil.RequireGPU(b)
		env, backend = []string{"GPU=vmm"}, "BACKEND=cuda"
	}
	sock := startDaemon(b, backend)
	c := dial(b, sock)
	ctx := context.Background()
	const layers, bsize = 32, 32 << 10
	for _, tok := range tokens {
		n := (tok + 15) / 16
		blocks := 2 * n
		b.Run(fmt.Sprintf("tokens=%d", tok), func(b *testing.B) {
			e := startEngine(b, sock, fmt.Sprintf("bench/%d", tok), "vllm", layers, blocks, bsize, 77, testutil.SpawnOptions{Env: env})
			r := rand.New(rand.NewPCG(uint64(tok), 1))
			srcIDs, dstIDs := r.Perm(blocks)[:n], r.Perm(blocks)[:n]
			src := &kv.Local{Layout: e.desc.Layout}
			dst := &kv.Local{Layout: e.desc.Layout}
			for i, size := range e.sizes {
				if !gpu {
					src.Memory = append(src.Memory, kv.Memory{Host: e.region(i)})
					dst.Memory = append(dst.Memory, kv.Memory{Host: make([]byte, size)})
					continue
				}
				for _, l := range []*kv.Local{src, dst} {
					m, free, err := gpuMemory("legacy", size)
					if err != nil {
						b.Fatal(err)
					}
					b.Cleanup(free)
					l.Memory = append(l.Memory, m)
				}
				if err := dev.CopyToDevice(src.Memory[i].Ptr, e.region(i)); err != nil {
					b.Fatal(err)
				}
			}
			floor := timeIt(b, 9, func() error { return copyLocal(dev, src, dst, srcIDs, dstIDs, true) })
			loop := timeIt(b, 3, func() error { return copyLocal(dev, src, dst, srcIDs, dstIDs, false) })
			req := kv.Request{Src: e.desc, SrcBlocks: srcIDs, Dst: dst, DstBlocks: dstIDs}
			read := func() error {
				tr, err := kv.ReadBlocks(ctx, c, req)
				if err != nil {
					return err
				}
				return tr.Wait(ctx)
			}
			if err := read(); err != nil { // the mappings' first use is not timed
				b.Fatal(err)
			}
			bytesPerRead := int64(n) * layers * 2 * bsize
			b.SetBytes(bytesPerRead)
			b.ResetTimer()
			var reads []time.Duration
			for b.Loop() {
				start := time.Now()
				if err := read(); err != nil {
					b.Fatal(err)
				}
				reads = append(reads, time.Since(start))
			}
			b.StopTimer()
			per := median(reads)
			b.ReportMetric(float64(per)/float64(floor), "x_floor")
			b.ReportMetric(float64(loop)/float64(per), "loop_over_read")
			b.ReportMetric(float64(floor.Microseconds()), "floor_us")
			checkRead(b, dev, e, dst, srcIDs, dstIDs)
		})
	}
}

// timeIt returns the median of reps runs of f, after one more that warms
// it up (the kernel's first load, the scratch's growth).
func timeIt(b *testing.B, reps int, f func() error) time.Duration {
	var ds []time.Duration
	for i := range reps + 1 {
		start := time.Now()
		if err := f(); err != nil {
			b.Fatal(err)
		}
		if i > 0 {
			ds = append(ds, time.Since(start))
		}
	}
	return median(ds)
}

// median returns the median of ds (which it sorts).
func median(ds []time.Duration) time.Duration {
	slices.Sort(ds)
	return ds[len(ds)/2]
}

// copyLocal copies the blocks within this process: coalesced (the
// floor: on the GPU one gather launch a layer) or a copy per block (on the
// GPU a cuMemcpyAsync each, then one synchronize).
func copyLocal(dev *cudaipc.Device, src, dst *kv.Local, srcIDs, dstIDs []int, coalesced bool) error {
	var stream *cudaipc.Stream
	var groups [][]cudaipc.Copy
	if dev != nil && !coalesced {
		s, err := dev.NewStream()
		if err != nil {
			return err
		}
		defer s.Close()
		stream = s
	}
	for l := range src.Layers {
		var g []cudaipc.Copy
		for p, sp := range src.Layers[l] {
			dp := dst.Layers[l][p]
			for k := 0; k < len(srcIDs); {
				run := 1
				for coalesced && k+run < len(srcIDs) && srcIDs[k+run] == srcIDs[k]+run && dstIDs[k+run] == dstIDs[k]+run {
					run++
				}
				so, do, n := sp.Base+int64(srcIDs[k])*sp.Stride, dp.Base+int64(dstIDs[k])*dp.Stride, int64(run)*sp.Bytes
				switch {
				case dev == nil:
					copy(dst.Memory[dp.Region].Host[do:do+n], src.Memory[sp.Region].Host[so:so+n])
				case coalesced:
					g = append(g, cudaipc.Copy{Dst: dst.Memory[dp.Region].Ptr + cudaipc.DevicePtr(do), Src: src.Memory[sp.Region].Ptr + cudaipc.DevicePtr(so), Bytes: n})
				default:
					if err := stream.CopyAsync(dst.Memory[dp.Region].Ptr+cudaipc.DevicePtr(do), src.Memory[sp.Region].Ptr+cudaipc.DevicePtr(so), n); err != nil {
						return err
					}
				}
				k += run
			}
		}
		groups = append(groups, g)
	}
	switch {
	case dev == nil:
		return nil
	case coalesced:
		return dev.Gather(groups, nil)
	default:
		return stream.Synchronize()
	}
}

// checkRead checks that dst's blocks dstIDs hold the engine's srcIDs.
func checkRead(b *testing.B, dev *cudaipc.Device, e *engine, dst *kv.Local, srcIDs, dstIDs []int) {
	mem := func(i int) []byte { return dst.Memory[i].Host }
	if dev != nil {
		host := make([][]byte, len(dst.Memory))
		for i, m := range dst.Memory {
			host[i] = make([]byte, m.Size)
			if err := dev.CopyFromDevice(host[i], m.Ptr); err != nil {
				b.Fatal(err)
			}
		}
		mem = func(i int) []byte { return host[i] }
	}
	regions := make(map[int][]byte)
	src := func(i int) []byte {
		if regions[i] == nil {
			regions[i] = e.region(i)
		}
		return regions[i]
	}
	for l := range dst.Layers {
		for p := range 2 {
			for k := range srcIDs {
				if !bytes.Equal(block(dst.Layout, l, p, dstIDs[k], mem), block(e.desc.Layout, l, p, srcIDs[k], src)) {
					b.Fatalf("layer %d part %d: destination block %d is not source block %d", l, p, dstIDs[k], srcIDs[k])
				}
			}
		}
	}
}
