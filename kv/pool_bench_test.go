package kv_test

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/kv"
)

// BenchmarkPoolLookup looks up 10,000 keys in one call against a pool
// that holds all of them (hit), none (miss: the first key ends the
// prefix) or the first half (half), and reports the call's p50 and p99
// in µs beside its mean (ns/op). The keys travel in a bulk file.
func BenchmarkPoolLookup(b *testing.B) {
	const n = 10000
	sock := startDaemon(b)
	c := dial(b, sock)
	ctx := context.Background()
	sp := poolSpace(b, c, "bench-lookup/kv", "host", 1, n, 64, 1)
	pool, err := kv.CreatePool(ctx, c, "bench-lookup", client.PoolConfig{BlockBytes: 128, KeyBytes: 32, Capacity: n * 256})
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	keys := poolKeys(2, 2*n, 32)
	ids := make([]int, n)
	for i := range ids {
		ids[i] = i
	}
	if res, err := pool.Put(ctx, kv.PutRequest{Keys: keys[:n], Src: sp.Desc(), SrcBlocks: ids}); err != nil || res.Stored != n {
		b.Fatalf("put: %+v, %v", res, err)
	}
	for _, c := range []struct {
		name string
		keys [][]byte
		want int
	}{{"hit", keys[:n], n}, {"miss", keys[n:], 0}, {"half", keys[n/2 : n/2+n], n / 2}} {
		b.Run(c.name, func(b *testing.B) {
			var ds []time.Duration
			for b.Loop() {
				start := time.Now()
				got, _, err := pool.Lookup(ctx, c.keys, client.LookupOptions{})
				ds = append(ds, time.Since(start))
				if err != nil || got != c.want {
					b.Fatalf("lookup: %d, %v; want %d", got, err, c.want)
				}
			}
			b.ReportMetric(float64(percentile(ds, 50).Nanoseconds())/1e3, "p50_us")
			b.ReportMetric(float64(percentile(ds, 99).Nanoseconds())/1e3, "p99_us")
		})
	}
}

// percentile returns the p-th percentile of ds (which it sorts).
func percentile(ds []time.Duration, p int) time.Duration {
	median(ds) // sorts
	return ds[min(len(ds)-1, len(ds)*p/100)]
}

// BenchmarkPoolPutGet puts and gets a prefix of Llama-3-8B's KV blocks
// (32 layers, K and V of 32 KiB a layer a block of 16 tokens: a pool
// block of all layers is 2 MiB) through a host pool: 1k and 8k tokens
// (KV_BENCH_TOKENS lists others), from a registered space in vLLM's
// layout, scattered, into a local space of the same layout, scattered.
// Beside each op's time (the median) it reports put_x_floor and
// get_x_floor: the op over the same copies done in this process (the
// parts of each block gathered into, or scattered from, contiguous
// blocks, on as many goroutines as the daemon and the client use); and
// memcpy_GBps, one plain copy of up to 256 MiB of them. Each put stores every key
// afresh (the keys are deleted between puts, untimed); every get's blocks
// are checked after the timing.
func BenchmarkPoolPutGet(b *testing.B) {
	tokens := []int{1 << 10, 8 << 10}
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
	sock := startDaemon(b)
	c := dial(b, sock)
	ctx := context.Background()
	const layers, part = 32, 32 << 10
	const blockBytes = layers * 2 * part
	for _, tok := range tokens {
		n := (tok + 15) / 16
		b.Run(fmt.Sprintf("tokens=%d", tok), func(b *testing.B) {
			sp := poolSpace(b, c, fmt.Sprintf("bench-pool/%d/kv", tok), "vllm", layers, n, part, 3)
			pool, err := kv.CreatePool(ctx, c, fmt.Sprintf("bench-pool-%d", tok), client.PoolConfig{BlockBytes: blockBytes, KeyBytes: 32, Capacity: int64(n) * blockBytes})
			if err != nil {
				b.Fatal(err)
			}
			defer func() {
				pool.Close()
				c.DeletePool(ctx, pool.Name())
			}()
			r := rand.New(rand.NewPCG(uint64(tok), 9))
			srcIDs, dstIDs := r.Perm(n), r.Perm(n)
			keys := poolKeys(uint64(tok), n, 32)
			dst := localSpace("vllm", layers, n, part, 4)
			put := func() time.Duration {
				if _, err := pool.Delete(ctx, keys); err != nil {
					b.Fatal(err)
				}
				start := time.Now()
				res, err := pool.Put(ctx, kv.PutRequest{Keys: keys, Src: sp.Desc(), SrcBlocks: srcIDs})
				d := time.Since(start)
				if err != nil || res.Stored != n {
					b.Fatalf("put: %+v, %v", res, err)
				}
				return d
			}
			get := func() time.Duration {
				start := time.Now()
				tr, err := pool.Get(ctx, kv.GetRequest{Keys: keys, Dst: dst, DstBlocks: dstIDs})
				if err == nil {
					err = tr.Wait(ctx)
				}
				d := time.Since(start)
				if err != nil {
					b.Fatal(err)
				}
				return d
			}
			put() // the pool's pages and the mappings' first use are not timed
			get()
			// The floor: the same copies in this process, between the
			// space, a buffer of contiguous blocks in a memfd (memory like
			// the pool's) and the destination.
			sh, err := kv.AllocHost(int64(n) * blockBytes)
			if err != nil {
				b.Fatal(err)
			}
			defer sh.Close()
			staged := sh.Bytes()
			src := sp.Local()
			gatherIn := func() { copyParts(src, staged, srcIDs, true) }
			scatterOut := func() { copyParts(dst, staged, dstIDs, false) }
			plain := make([]byte, min(len(staged), 256<<20))
			gatherIn() // warm
			scatterOut()
			b.SetBytes(int64(n) * blockBytes)
			// The floors are timed between the ops, so that a load on the
			// machine that comes and goes weighs on both alike.
			var puts, gets, fputs, fgets, memcpys []time.Duration
			for b.Loop() {
				puts = append(puts, put())
				fputs = append(fputs, timeOnce(gatherIn))
				gets = append(gets, get())
				fgets = append(fgets, timeOnce(scatterOut))
				memcpys = append(memcpys, timeOnce(func() { copy(plain, staged) }))
			}
			p, g := median(puts), median(gets)
			floorPut, floorGet, memcpy := median(fputs), median(fgets), median(memcpys)
			b.ReportMetric(float64(p)/float64(floorPut), "put_x_floor")
			b.ReportMetric(float64(g)/float64(floorGet), "get_x_floor")
			b.ReportMetric(float64(p.Microseconds()), "put_us")
			b.ReportMetric(float64(g.Microseconds()), "get_us")
			b.ReportMetric(float64(len(plain))/memcpy.Seconds()/1e9, "memcpy_GBps")
			b.StopTimer()
			for i := range n {
				for l := range layers {
					for pt := range 2 {
						got := block(dst.Layout, l, pt, dstIDs[i], hostMem(dst))
						want := block(sp.Desc().Layout, l, pt, srcIDs[i], hostMem(src))
						if !bytes.Equal(got, want) {
							b.Fatalf("layer %d part %d: block %d is not source block %d", l, pt, dstIDs[i], srcIDs[i])
						}
					}
				}
			}
		})
	}
}

// timeOnce returns how long f takes.
func timeOnce(f func()) time.Duration {
	start := time.Now()
	f()
	return time.Since(start)
}

// copyParts copies the parts of blocks ids[i] of the local space l into
// (in) or out of block i of staged, blocks of all layers end to end, on
// as many goroutines as a pool's put and get use.
func copyParts(l *kv.Local, staged []byte, ids []int, in bool) {
	var bb int64
	for _, parts := range l.Layers {
		for _, p := range parts {
			bb += p.Bytes
		}
	}
	one := func(i int) {
		off := int64(i) * bb
		for _, parts := range l.Layers {
			for _, p := range parts {
				so := p.Base + int64(ids[i])*p.Stride
				mem := l.Memory[p.Region].Host[so : so+p.Bytes]
				if in {
					copy(staged[off:off+p.Bytes], mem)
				} else {
					copy(mem, staged[off:off+p.Bytes])
				}
				off += p.Bytes
			}
		}
	}
	workers := max(1, min(runtime.GOMAXPROCS(0), 8, int(int64(len(ids))*bb/(8<<20))))
	var wg sync.WaitGroup
	per := (len(ids) + workers - 1) / workers
	for w := range workers {
		lo, hi := min(w*per, len(ids)), min((w+1)*per, len(ids))
		wg.Go(func() {
			for i := lo; i < hi; i++ {
				one(i)
			}
		})
	}
	wg.Wait()
}
