package ucxperf_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
	"github.com/cudaipc/cudaipc/transport/ucx/ucxperf"
	"golang.org/x/sys/unix"
)

// linkEnv is the link every figure here is measured on: UCX tcp over
// loopback, for both our processes and ucx_perftest's.
var linkEnv = testutil.UCXLoopbackEnv

func TestMain(m *testing.M) {
	testutil.SetUCXLoopbackEnv()
	testutil.RunRole(testutil.Roles{"arena": arenaRole})
	os.Exit(m.Run())
}

type arenaInfo struct {
	Addr, Key string
	// Addrs are the addresses of every serving worker ($LANES of them,
	// default one; Addr is the first).
	Addrs []string
	// Token is of a Window on the whole arena, for Fetch.
	Token string
}

// arenaRole maps a memfd arena of $SIZE bytes (as the daemon's arenas
// are), registers it once, and serves it until stdin closes, from $LANES
// workers (default one), each progressed by its own goroutine.
func arenaRole(p *testutil.Peer) error {
	size, _ := strconv.Atoi(os.Getenv("SIZE"))
	fd, err := unix.MemfdCreate("ucxperf-arena", unix.MFD_CLOEXEC)
	if err != nil {
		return err
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		return err
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	if err != nil {
		return err
	}
	copy(mem, testutil.RandomBytes(7, min(size, 1<<20)))
	c, err := ucx.NewContext(ucx.ContextOptions{})
	if err != nil {
		return err
	}
	defer c.Close()
	r, err := c.Register(mem)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lanes, _ := strconv.Atoi(os.Getenv("LANES"))
	var info arenaInfo
	for range max(lanes, 1) {
		w, err := c.NewWorker(ucx.WorkerOptions{})
		if err != nil {
			return err
		}
		go w.Serve(ctx)
		a, _ := w.Address().MarshalBinary()
		info.Addrs = append(info.Addrs, base64.StdEncoding.EncodeToString(a))
	}
	k, _ := r.Key().MarshalBinary()
	info.Addr, info.Key = info.Addrs[0], base64.StdEncoding.EncodeToString(k)
	win, err := r.Window(0, uint64(size))
	if err != nil {
		return err
	}
	tok := win.Token()
	info.Token = base64.StdEncoding.EncodeToString(tok[:])
	if err := p.Send(info); err != nil {
		return err
	}
	var v any
	for p.Recv(&v) == nil {
	}
	cancel()
	return c.Close()
}

// connect starts an arena process of size bytes and connects to it.
func connect(b *testing.B, size int) (*ucx.Endpoint, *ucx.RemoteKey) {
	b.Helper()
	eps, keys := connectLanes(b, size, 1)
	return eps[0], keys[0]
}

// BenchmarkGet1GiB pulls a 1 GiB memfd arena from another process, in
// alternation with ucx_perftest's ucp_get on the same link: once with the
// same bytes (one 1 GiB get, cold memory like ours) and once with our chunk
// size and depth (a 1 MiB buffer, cache-hot). Each b.N iteration is one
// round of each; the metrics are best-of (MB = 10^6 bytes).
func BenchmarkGet1GiB(b *testing.B) {
	const size = 1 << 30
	ep, key := connect(b, size)
	dst := make([]byte, size)
	ctx := context.Background()
	if err := ucx.Get(ctx, ep, key, key.Key().Addr, dst); err != nil { // connect, fault dst in
		b.Fatal(err)
	}
	if _, err := ucxperf.Perftest(ctx, ucxperf.PerftestOptions{Size: 8, Iters: 10, Env: linkEnv}); err != nil {
		b.Skipf("no floor to compare with: %v", err)
	}
	same := ucxperf.PerftestOptions{Size: size, Iters: 2, Warmup: 1, Env: linkEnv}
	chunked := ucxperf.PerftestOptions{Size: ucx.DefaultChunk, Iters: 1024, Warmup: 64, Outstanding: ucx.DefaultDepth, Env: linkEnv}
	var cold, hot ucxperf.Comparison
	for b.Loop() {
		c, err := ucxperf.CompareBandwidth(ctx, ep, key, dst, ucx.GetOptions{}, same, 1)
		if err != nil {
			b.Fatal(err)
		}
		h, err := ucxperf.CompareBandwidth(ctx, ep, key, dst, ucx.GetOptions{}, chunked, 1)
		if err != nil {
			b.Fatal(err)
		}
		cold.Ours.All = append(cold.Ours.All, c.Ours.All...)
		cold.Ours.All = append(cold.Ours.All, h.Ours.All...)
		cold.Floor.All = append(cold.Floor.All, c.Floor.All...)
		hot.Floor.All = append(hot.Floor.All, h.Floor.All...)
	}
	best := func(x []float64) float64 { return slices.Max(x) }
	ours := best(cold.Ours.All)
	b.ReportMetric(ours/1e6, "MB/s")
	b.ReportMetric(best(cold.Floor.All)/1e6, "perftest-1GiB-MB/s")
	b.ReportMetric(best(hot.Floor.All)/1e6, "perftest-1MiBx8-MB/s")
	b.ReportMetric(ours/best(cold.Floor.All), "ratio-1GiB")
	b.ReportMetric(ours/best(hot.Floor.All), "ratio-1MiBx8")
	b.Logf("ours %.0f, perftest 1 GiB %.0f, perftest 1 MiB x8 %.0f MB/s (every round)", mb(cold.Ours.All), mb(cold.Floor.All), mb(hot.Floor.All))
}

func mb(x []float64) []float64 {
	out := make([]float64, len(x))
	for i, v := range x {
		out[i] = v / 1e6
	}
	return out
}

// BenchmarkGetRoundTrip times single GETs of 8 bytes and 4 KiB (one request
// in flight), then ucx_perftest's ucp_get latency and its ucp_am_lat
// ping-pong (UCX's own round trip: twice what it prints) of the same size.
func BenchmarkGetRoundTrip(b *testing.B) {
	ep, key := connect(b, 64<<20)
	for _, size := range []int{8, 4096} {
		b.Run(fmt.Sprintf("%dB", size), func(b *testing.B) {
			ctx := context.Background()
			if _, err := ucxperf.GetLatency(ctx, ep, key, size, 100); err != nil { // warm up
				b.Fatal(err)
			}
			b.ResetTimer()
			lat, err := ucxperf.GetLatency(ctx, ep, key, size, b.N)
			if err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			get := perftest(b, ucxperf.PerftestOptions{Size: size, Iters: max(b.N, 1000), Warmup: 100, Outstanding: 1})
			// UCX's own round trip: an active-message ping-pong with both
			// sides polling; ucx_perftest prints half of it.
			am := perftest(b, ucxperf.PerftestOptions{Test: "ucp_am_lat", Size: size, Iters: max(b.N, 10000), Warmup: 1000})
			rtt := 2 * am.P50
			b.ReportMetric(float64(lat.P50.Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(lat.P99.Nanoseconds())/1e3, "p99-µs")
			b.ReportMetric(float64(get.P50.Nanoseconds())/1e3, "perftest-get-p50-µs")
			b.ReportMetric(float64(rtt.Nanoseconds())/1e3, "ucx-rtt-p50-µs")
			b.ReportMetric(float64(lat.P50)/float64(rtt), "p50/ucx-rtt")
		})
	}
}

func perftest(b testing.TB, o ucxperf.PerftestOptions) ucxperf.PerftestResult {
	b.Helper()
	o.Env = linkEnv
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	r, err := ucxperf.Perftest(ctx, o)
	if err != nil {
		b.Skipf("no floor to compare with: %v", err)
	}
	return r
}
