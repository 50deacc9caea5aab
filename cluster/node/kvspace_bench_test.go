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
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/kv"
	"github.com/cudaipc/cudaipc/transport/ucx/ucxperf"
)

// BenchmarkKVReadAcrossNodes reads Llama-3-8B-shaped KV blocks (32 layers,
// K and V, 32 KiB a block a part, vLLM's layout: 16-token blocks) of
// requests of 1k and 8k tokens (KV_BENCH_TOKENS for others) at scattered
// ids, from a host space registered with daemon a into one registered with
// daemon b (UCX tcp on lo), as the daemons choose to (KV_BENCH_MODE
// "direct" or "staged" forces one), and reports beside the read's time
// two floors measured in the same run: the same bytes read with the data
// plane's raw Endpoint.Get in 4 MiB pieces, as many in flight, between two
// transports of this process (x_floor: read / floor), and, where
// ucx_perftest is installed, its ucp_get bandwidth at 1 MiB messages
// (of_perftest: the read's bandwidth / perftest's) and at the block size.
// Every read's bytes are checked after the timing.
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
	if m := os.Getenv("KV_BENCH_MODE"); m != "" {
		node.SetSpaceMode(r.node, m)
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
	floor, err := rawGetFloor(ctx, bytes, cluster.DefaultSpaceDepth, 3)
	if err != nil {
		b.Fatal(err)
	}
	slices.Sort(times)
	p50 := times[len(times)/2]
	b.ReportMetric(float64(p50.Microseconds())/1e3, "read_p50_ms")
	b.ReportMetric(float64(floor.Microseconds())/1e3, "floor_ms")
	b.ReportMetric(float64(p50)/float64(floor), "x_floor")
	b.ReportMetric(float64(bytes)/p50.Seconds()/1e9, "read_GB/s")
	env := []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=lo"}
	pt, err := ucxperf.Perftest(ctx, ucxperf.PerftestOptions{Test: "ucp_get", Size: 1 << 20, Iters: 1024, Warmup: 64, Outstanding: 8, Env: env})
	if err != nil {
		b.Logf("ucx_perftest: %v", err)
		return
	}
	b.ReportMetric(pt.BytesPerSec/1e9, "perftest_GB/s")
	b.ReportMetric(float64(bytes)/p50.Seconds()/pt.BytesPerSec, "of_perftest")
	if pt, err = ucxperf.Perftest(ctx, ucxperf.PerftestOptions{Test: "ucp_get", Size: bsize, Iters: 4096, Warmup: 256,
		Outstanding: cluster.DefaultSpaceDepth, Env: env}); err == nil {
		b.ReportMetric(pt.BytesPerSec/1e9, "perftest_block_GB/s")
	}
}

// rawGetFloor reads n bytes with the data plane's raw Endpoint.Get, in
// pieces of 4 MiB, depth in flight, between two UCX transports of this
// process, and returns the best of rounds.
func rawGetFloor(ctx context.Context, n int64, depth, rounds int) (time.Duration, error) {
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
	src, dst := make([]byte, n), make([]byte, n)
	reg, err := ta.Register(src)
	if err != nil {
		return 0, err
	}
	defer reg.Close()
	key, closeWindow, err := reg.Window(0, n)
	if err != nil {
		return 0, err
	}
	defer closeWindow()
	ep, err := tb.Connect(ctx, ta.WorkerAddress())
	if err != nil {
		return 0, err
	}
	defer ep.Close()
	const piece = 4 << 20
	best := time.Duration(1<<63 - 1)
	for range rounds {
		var (
			mu    sync.Mutex
			next  int64
			first error
			wg    sync.WaitGroup
		)
		start := time.Now()
		for range depth {
			wg.Go(func() {
				for {
					mu.Lock()
					off := next
					next += piece
					mu.Unlock()
					if off >= n {
						return
					}
					end := min(off+piece, n)
					if err := ep.Get(ctx, key, reg.Addr(off), dst[off:end]); err != nil {
						mu.Lock()
						first, next = err, n
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

// BenchmarkKVSmallRead reads one 4 KiB block of a space of another daemon
// (one kv_read, one kvopen, one fetch), one at a time (p50 and p99
// beside ucx_perftest's active-message round trip at 4 KiB), then
// KV_BENCH_CONCURRENT (1,000) at once from one client (reads a second and
// their p99).
//
//	go test -run '^$' -bench KVSmallRead -benchtime 2000x ./cluster/node/
func BenchmarkKVSmallRead(b *testing.B) {
	const blocks, bsize = 4096, 4096
	srv := etcdtest.Start(b)
	a := startDaemon(b, srv, "a")
	r := startDaemon(b, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	layout := kv.Layout{Blocks: blocks, Layers: [][]kv.Part{{{Region: 0, Stride: bsize, Bytes: bsize}}}}
	src := newHostSpace(b, layout, []int64{blocks * bsize}, 3)
	sp, err := kv.Register(ctx, a.c, "small/src", src.local, client.RegisterOptions{})
	if err != nil {
		b.Fatal(err)
	}
	dst := newHostSpace(b, layout, []int64{blocks * bsize}, 0)
	if _, err := kv.Register(ctx, r.c, "small/dst", dst.local, client.RegisterOptions{}); err != nil {
		b.Fatal(err)
	}
	read := func(i int) error {
		tr, err := kv.ReadBlocks(ctx, r.c, kv.Request{Src: sp.Desc(), SrcBlocks: []int{i % blocks}, Dst: dst.local, DstBlocks: []int{i % blocks}})
		if err != nil {
			return err
		}
		return tr.Wait(ctx)
	}
	if err := read(0); err != nil {
		b.Fatal(err)
	}
	lat := make([]time.Duration, 0, b.N)
	b.SetBytes(bsize)
	b.ResetTimer()
	for i := range b.N {
		start := time.Now()
		if err := read(i); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50_µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99_µs")
	conc := 1000
	if s := os.Getenv("KV_BENCH_CONCURRENT"); s != "" {
		if conc, err = strconv.Atoi(s); err != nil {
			b.Fatal(err)
		}
	}
	clat := make([]time.Duration, conc)
	errs := make([]error, conc)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range conc {
		wg.Go(func() {
			t0 := time.Now()
			errs[i] = read(i)
			clat[i] = time.Since(t0)
		})
	}
	wg.Wait()
	took := time.Since(start)
	for _, err := range errs {
		if err != nil {
			b.Fatal(err)
		}
	}
	written := seq(min(max(conc, b.N), blocks)) // blocks 0, 1, ... read into the same ids
	checkRead(b, src, dst, make2(dst), written, written, 0, 1)
	slices.Sort(clat)
	b.ReportMetric(float64(conc)/took.Seconds(), "concurrent_reads/s")
	b.ReportMetric(float64(clat[conc*99/100].Microseconds()), "concurrent_p99_µs")
	pt, err := ucxperf.Perftest(ctx, ucxperf.PerftestOptions{Test: "ucp_am_lat", Size: bsize, Iters: 2000, Warmup: 100,
		Env: []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=lo"}})
	if err != nil {
		b.Logf("ucx_perftest: %v", err)
		return
	}
	rt := 2 * pt.P50
	b.ReportMetric(float64(rt.Microseconds()), "perftest_am_round_trip_µs")
	b.ReportMetric(float64(lat[len(lat)/2])/float64(rt), "p50_x_round_trip")
}
