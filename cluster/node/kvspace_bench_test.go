package node_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
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

// smallSpaces is a host space of 4,096 blocks of 4 KiB registered with
// daemon a (random bytes) and one of the same layout registered with
// daemon r, the reader's.
type smallSpaces struct {
	a, r     *daemon
	src, dst *hostSpace
	sp       *kv.Space
	desc     []byte // the source's description
	dstDesc  []byte
}

const smallBlocks, smallBlock = 4096, 4096

func newSmallSpaces(b *testing.B, ctx context.Context) *smallSpaces {
	srv := etcdtest.Start(b)
	s := &smallSpaces{a: startDaemon(b, srv, "a"), r: startDaemon(b, srv, "b")}
	layout := kv.Layout{Blocks: smallBlocks, Layers: [][]kv.Part{{{Region: 0, Stride: smallBlock, Bytes: smallBlock}}}}
	s.src = newHostSpace(b, layout, []int64{smallBlocks * smallBlock}, 3)
	var err error
	if s.sp, err = kv.Register(ctx, s.a.c, "small/src", s.src.local, client.RegisterOptions{}); err != nil {
		b.Fatal(err)
	}
	s.dst = newHostSpace(b, layout, []int64{smallBlocks * smallBlock}, 0)
	dsp, err := kv.Register(ctx, s.r.c, "small/dst", s.dst.local, client.RegisterOptions{})
	if err != nil {
		b.Fatal(err)
	}
	if s.desc, err = s.sp.Desc().MarshalBinary(); err != nil {
		b.Fatal(err)
	}
	if s.dstDesc, err = dsp.Desc().MarshalBinary(); err != nil {
		b.Fatal(err)
	}
	return s
}

// read reads block i (mod the space's blocks) into the same block of the
// reader's space.
func (s *smallSpaces) read(ctx context.Context, i int) error {
	tr, err := kv.ReadBlocks(ctx, s.r.c, kv.Request{Src: s.sp.Desc(), SrcBlocks: []int{i % smallBlocks}, Dst: s.dst.local, DstBlocks: []int{i % smallBlocks}})
	if err != nil {
		return err
	}
	return tr.Wait(ctx)
}

// BenchmarkKVSmallRead reads one 4 KiB block of a space of another daemon
// (one kv_read, one kvread between the daemons), one at a time (p50 and
// p99 beside ucx_perftest's active-message round trip at 4 KiB), then
// KV_BENCH_CONCURRENT (1,000) at once from one client, KV_BENCH_ROUNDS (3)
// times (reads a second and their p99, beside ucx_perftest's message rate
// of 4 KiB active messages; KV_BENCH_CPUPROFILE=FILE profiles them).
//
//	go test -run '^$' -bench KVSmallRead -benchtime 2000x ./cluster/node/
func BenchmarkKVSmallRead(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	s := newSmallSpaces(b, ctx)
	if err := s.read(ctx, 0); err != nil {
		b.Fatal(err)
	}
	lat := make([]time.Duration, 0, b.N)
	b.SetBytes(smallBlock)
	b.ResetTimer()
	for i := range b.N {
		start := time.Now()
		if err := s.read(ctx, i); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50_µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99_µs")
	conc := 1000
	if v := os.Getenv("KV_BENCH_CONCURRENT"); v != "" {
		var err error
		if conc, err = strconv.Atoi(v); err != nil {
			b.Fatal(err)
		}
	}
	rounds := 3
	if v := os.Getenv("KV_BENCH_ROUNDS"); v != "" {
		var err error
		if rounds, err = strconv.Atoi(v); err != nil {
			b.Fatal(err)
		}
	}
	clat := make([]time.Duration, 0, rounds*conc)
	var took time.Duration
	stopProfile := func() {}
	if f := os.Getenv("KV_BENCH_CPUPROFILE"); f != "" { // the concurrent reads alone
		out, err := os.Create(f)
		if err != nil {
			b.Fatal(err)
		}
		if err := pprof.StartCPUProfile(out); err != nil {
			b.Fatal(err)
		}
		stopProfile = func() { pprof.StopCPUProfile(); out.Close() }
	}
	cpu0 := processCPU(b)
	for range rounds {
		lat := make([]time.Duration, conc)
		errs := make([]error, conc)
		var wg sync.WaitGroup
		start := time.Now()
		for i := range conc {
			wg.Go(func() {
				t0 := time.Now()
				errs[i] = s.read(ctx, i)
				lat[i] = time.Since(t0)
			})
		}
		wg.Wait()
		took += time.Since(start)
		for _, err := range errs {
			if err != nil {
				b.Fatal(err)
			}
		}
		clat = append(clat, lat...)
	}
	stopProfile()
	b.ReportMetric(float64((processCPU(b)-cpu0).Nanoseconds())/1e3/float64(len(clat)), "concurrent_cpu_µs/read")
	written := seq(min(max(conc, b.N), smallBlocks)) // blocks 0, 1, ... read into the same ids
	checkRead(b, s.src, s.dst, make2(s.dst), written, written, 0, 1)
	slices.Sort(clat)
	rate := float64(len(clat)) / took.Seconds()
	b.ReportMetric(rate, "concurrent_reads/s")
	b.ReportMetric(float64(clat[len(clat)*99/100].Microseconds()), "concurrent_p99_µs")
	env := []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=lo"}
	pt, err := ucxperf.Perftest(ctx, ucxperf.PerftestOptions{Test: "ucp_am_lat", Size: smallBlock, Iters: 2000, Warmup: 100, Env: env})
	if err != nil {
		b.Logf("ucx_perftest: %v", err)
		return
	}
	rt := 2 * pt.P50
	b.ReportMetric(float64(rt.Microseconds()), "perftest_am_round_trip_µs")
	b.ReportMetric(float64(lat[len(lat)/2])/float64(rt), "p50_x_round_trip")
	if pt, err = ucxperf.Perftest(ctx, ucxperf.PerftestOptions{Test: "ucp_am_bw", Size: smallBlock, Iters: 20000, Warmup: 1000, Env: env}); err == nil {
		b.ReportMetric(pt.MsgRate, "perftest_am_msg/s")
		b.ReportMetric(rate/pt.MsgRate, "concurrent_x_msg_rate")
	}
}

// BenchmarkKVSmallReadParts times the parts of one 4 KiB read across
// nodes, one at a time: the whole read (client, both daemons), the same
// kv_read sent with package client alone, the client's round trip to its
// daemon (a stat), the daemons' "kvread" (the
// reader's daemon to the source's and back, no client), and what the
// source's daemon does for one (no control channel).
//
//	go test -run '^$' -bench KVSmallReadParts -benchtime 5000x ./cluster/node/
func BenchmarkKVSmallReadParts(b *testing.B) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	s := newSmallSpaces(b, ctx)
	if err := s.read(ctx, 0); err != nil {
		b.Fatal(err)
	}
	parts := []struct {
		name string
		op   func(i int) error
	}{
		{"read", func(i int) error { return s.read(ctx, i) }},
		{"client_kv_read", func(i int) error { // the same, without package kv
			b := uint32(i % smallBlocks)
			return s.r.c.ReadSpace(ctx, client.SpaceRead{Src: s.desc, Dst: s.dstDesc, SrcBlocks: []uint32{b}, DstBlocks: []uint32{b}}, nil)
		}},
		{"client_round_trip", func(i int) error {
			if _, err := s.r.c.Stat(ctx, "no/such"); err != nil && !errors.Is(err, client.ErrNotFound) {
				return err
			}
			return nil
		}},
		{"daemons_kvread", func(i int) error {
			_, err := node.GatherSpaceOnce(ctx, s.r.node, 0, s.desc, "a", i%smallBlocks, smallBlock)
			return err
		}},
		{"source_gather", func(i int) error {
			_, err := node.SourceGather(s.a.node, 0, s.desc, i%smallBlocks, cluster.MaxInline)
			return err
		}},
	}
	for _, p := range parts {
		b.Run(p.name, func(b *testing.B) {
			if err := p.op(0); err != nil {
				b.Fatal(err)
			}
			lat := make([]time.Duration, 0, b.N)
			cpu0 := processCPU(b)
			b.ResetTimer()
			for i := range b.N {
				t0 := time.Now()
				if err := p.op(i); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			b.ReportMetric(float64((processCPU(b)-cpu0).Nanoseconds())/1e3/float64(b.N), "cpu_µs/op")
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds())/1e3, "p50_µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99_µs")
		})
	}
}

// processCPU is the CPU time this process has used (both daemons, their
// clients and the benchmark: all run in it).
func processCPU(b *testing.B) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		b.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
