package node_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/kv"
	"github.com/cudaipc/cudaipc/transport/ucx/ucxperf"
)

// BenchmarkKVReadAcrossNodes reads Llama-3-8B-shaped KV blocks (32 layers,
// K and V, 32 KiB a block a part, vLLM's layout: 16-token blocks) of
// requests of 1k and 8k tokens (KV_BENCH_TOKENS for others) at scattered
// ids, from a host space registered with daemon a into one registered with
// daemon b (UCX tcp on lo), and reports beside the read's time the floor:
// the same copies read with the data plane's raw Endpoint.Get, as many in
// flight, between two transports of this process (x_floor: read / floor);
// and ucx_perftest's ucp_get bandwidth at the block size when it is
// installed (of_perftest: the read's bandwidth / perftest's). Every read's
// bytes are checked after the timing.
//
//	go test -run '^$' -bench KVReadAcrossNodes -benchtime 5x ./cluster/node/
func BenchmarkKVReadAcrossNodes(b *testing.B) {
	tokens := []int{1024, 8192}
	if s := os.Getenv("KV_BENCH_TOKENS"); s != "" {
		tokens = nil
		for _, f := range strings.Split(s, ",") {
			n, err := strconv.Atoi(f)
			if err != nil {
				b.Fatal(err)
			}
			tokens = append(tokens, n)
		}
	}
	for _, n := range tokens {
		b.Run(fmt.Sprintf("tokens=%d", n), func(b *testing.B) { benchKVRead(b, n) })
	}
}

func benchKVRead(b *testing.B, tokens int) {
	const layers, bsize, blockTokens = 32, 32 << 10, 16
	n := (tokens + blockTokens - 1) / blockTokens
	blocks := 2 * n // scattered ids in a space twice the request
	srv := etcdtest.Start(b)
	a := startDaemon(b, srv, "a")
	r := startDaemon(b, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	layout, sizes := kvLayout("vllm", layers, blocks, bsize)
	src := newHostSpace(b, layout, sizes, 1)
	sp, err := kv.Register(ctx, a.c, "bench/src", src.local, client.RegisterOptions{})
	if err != nil {
		b.Fatal(err)
	}
	dst := newHostSpace(b, layout, sizes, 0)
	if _, err := kv.Register(ctx, r.c, "bench/dst", dst.local, client.RegisterOptions{}); err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(uint64(tokens), 7))
	srcIDs, dstIDs := rng.Perm(blocks)[:n], rng.Perm(blocks)[:n]
	read := func() time.Duration {
		start := time.Now()
		tr, err := kv.ReadBlocks(ctx, r.c, kv.Request{Src: sp.Desc(), SrcBlocks: srcIDs, Dst: dst.local, DstBlocks: dstIDs})
		if err != nil {
			b.Fatal(err)
		}
		if err := tr.Wait(ctx); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	read() // the first read maps and registers both spaces
	bytes := int64(n) * layers * 2 * bsize
	b.SetBytes(bytes)
	var times []time.Duration
	b.ResetTimer()
	for range b.N {
		times = append(times, read())
	}
	b.StopTimer()
	checkRead(b, src, dst, make2(dst), srcIDs, dstIDs, 0, layers)
	floor, err := rawGetFloor(ctx, sp.Desc(), src, srcIDs, dstIDs, 3)
	if err != nil {
		b.Fatal(err)
	}
	slices.Sort(times)
	p50 := times[len(times)/2]
	b.ReportMetric(float64(p50.Microseconds())/1e3, "read_p50_ms")
	b.ReportMetric(float64(floor.Microseconds())/1e3, "floor_ms")
	b.ReportMetric(float64(p50)/float64(floor), "x_floor")
	b.ReportMetric(float64(bytes)/p50.Seconds()/1e9, "read_GB/s")
	pt, err := ucxperf.Perftest(ctx, ucxperf.PerftestOptions{Test: "ucp_get", Size: bsize, Iters: 4096, Warmup: 256, Outstanding: cluster.DefaultSpaceDepth,
		Env: []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=lo"}})
	if err != nil {
		b.Logf("ucx_perftest: %v", err)
		return
	}
	b.ReportMetric(pt.BytesPerSec/1e9, "perftest_GB/s")
	b.ReportMetric(float64(bytes)/p50.Seconds()/pt.BytesPerSec, "of_perftest")
}

// rawGetFloor reads the copies of a read of srcIDs of the space d (whose
// memory is src's) into a space of the same layout with the data plane's
// raw Endpoint.Get, cluster.DefaultSpaceDepth in flight, between two UCX
// transports of this process, and returns the best of rounds.
func rawGetFloor(ctx context.Context, d *kv.Desc, src *hostSpace, srcIDs, dstIDs []int, rounds int) (time.Duration, error) {
	ta, err := ucxtransport.New("bench-floor-a")
	if err != nil {
		return 0, err
	}
	defer ta.Close()
	tb, err := ucxtransport.New("bench-floor-b")
	if err != nil {
		return 0, err
	}
	defer tb.Close()
	keys := make([][]byte, len(src.mem))
	addrs := make([]uint64, len(src.mem))
	dst := make([][]byte, len(src.mem))
	for i := range src.mem {
		reg, err := ta.Register(src.region(i))
		if err != nil {
			return 0, err
		}
		defer reg.Close()
		key, closeWindow, err := reg.Window(0, int64(len(src.region(i))))
		if err != nil {
			return 0, err
		}
		defer closeWindow()
		keys[i], addrs[i], dst[i] = key, reg.Addr(0), make([]byte, len(src.region(i)))
	}
	ep, err := tb.Connect(ctx, ta.WorkerAddress())
	if err != nil {
		return 0, err
	}
	defer ep.Close()
	p, err := kv.NewPlan(d, d, srcIDs, dstIDs, 0, 0)
	if err != nil {
		return 0, err
	}
	var copies []kv.Copy
	for l := range d.Layers {
		copies = append(copies, p.Layer(l, 4<<20)...)
	}
	best := time.Duration(1<<63 - 1)
	for range rounds {
		var (
			mu    sync.Mutex
			next  int
			first error
			wg    sync.WaitGroup
		)
		start := time.Now()
		for range cluster.DefaultSpaceDepth {
			wg.Go(func() {
				for {
					mu.Lock()
					k := next
					next++
					mu.Unlock()
					if k >= len(copies) {
						return
					}
					c := copies[k]
					if err := ep.Get(ctx, keys[c.SrcRegion], addrs[c.SrcRegion]+uint64(c.Src), dst[c.DstRegion][c.Dst:c.Dst+c.Bytes]); err != nil {
						mu.Lock()
						first = err
						next = len(copies)
						mu.Unlock()
						return
					}
				}
			})
		}
		wg.Wait()
		if first != nil {
			return 0, first
		}
		best = min(best, time.Since(start))
	}
	return best, nil
}
