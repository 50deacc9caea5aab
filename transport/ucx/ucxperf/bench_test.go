package ucxperf_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"os"
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
var linkEnv = []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=lo", "UCX_LOG_FILE=/dev/stderr", "UCX_WARN_UNUSED_ENV_VARS=n"}

func TestMain(m *testing.M) {
	for _, kv := range linkEnv {
		for i := range kv {
			if kv[i] == '=' {
				if _, set := os.LookupEnv(kv[:i]); !set {
					os.Setenv(kv[:i], kv[i+1:])
				}
				break
			}
		}
	}
	testutil.RunRole(testutil.Roles{"arena": arenaRole})
	os.Exit(m.Run())
}

type arenaInfo struct {
	Addr, Key string
}

// arenaRole maps a memfd arena of $SIZE bytes (as the daemon's arenas
// are), registers it once, and serves it until stdin closes.
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
	w, err := c.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		return err
	}
	r, err := c.Register(mem)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Serve(ctx)
	a, _ := w.Address().MarshalBinary()
	k, _ := r.Key().MarshalBinary()
	if err := p.Send(arenaInfo{Addr: base64.StdEncoding.EncodeToString(a), Key: base64.StdEncoding.EncodeToString(k)}); err != nil {
		return err
	}
	var v any
	for p.Recv(&v) == nil {
	}
	cancel()
	return c.Close()
}

// connect starts an arena process of size bytes and connects to it.
func connect(b testing.TB, size int) (*ucx.Endpoint, *ucx.RemoteKey) {
	b.Helper()
	if err := ucx.Available(); err != nil {
		b.Skip(err)
	}
	child := testutil.Spawn(b, "arena", "SIZE="+strconv.Itoa(size))
	var info arenaInfo
	if err := child.Recv(&info); err != nil {
		b.Fatalf("arena: %v\n%s", err, child.Stderr())
	}
	c, err := ucx.NewContext(ucx.ContextOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close() })
	w, err := c.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		b.Fatal(err)
	}
	var addr ucx.WorkerAddress
	var rk ucx.RegionKey
	ab, _ := base64.StdEncoding.DecodeString(info.Addr)
	kb, _ := base64.StdEncoding.DecodeString(info.Key)
	if err := addr.UnmarshalBinary(ab); err != nil {
		b.Fatal(err)
	}
	if err := rk.UnmarshalBinary(kb); err != nil {
		b.Fatal(err)
	}
	ep, err := w.Connect(addr)
	if err != nil {
		b.Fatal(err)
	}
	key, err := ep.Unpack(rk)
	if err != nil {
		b.Fatal(err)
	}
	return ep, key
}

// BenchmarkGet1GiB pulls a 1 GiB arena from another process in chunks and
// runs ucx_perftest's ucp_get with the chunk size on the same link
// afterwards: perftest-MB/s is the floor, ratio our rate over it.
func BenchmarkGet1GiB(b *testing.B) {
	const size = 1 << 30
	ep, key := connect(b, size)
	dst := make([]byte, size)
	o := ucx.GetOptions{}
	ctx := context.Background()
	if err := ucx.GetWith(ctx, ep, key, key.Key().Addr, dst, o); err != nil { // connect, fault dst in
		b.Fatal(err)
	}
	b.SetBytes(size)
	b.ResetTimer()
	start := time.Now()
	for b.Loop() {
		if err := ucx.GetWith(ctx, ep, key, key.Key().Addr, dst, o); err != nil {
			b.Fatal(err)
		}
	}
	ours := float64(size) * float64(b.N) / time.Since(start).Seconds()
	b.StopTimer()
	floor := perftest(b, ucxperf.PerftestOptions{Size: ucx.DefaultChunk, Iters: size / ucx.DefaultChunk, Warmup: 64})
	b.ReportMetric(floor.BytesPerSec/1e6, "perftest-MB/s")
	b.ReportMetric(ours/floor.BytesPerSec, "ratio")
}

// BenchmarkGetRoundTrip times single GETs of 8 bytes and 4 KiB (one request
// in flight) and ucx_perftest's ucp_get latency of the same size.
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
			floor := perftest(b, ucxperf.PerftestOptions{Size: size, Iters: max(b.N, 1000), Warmup: 100})
			b.ReportMetric(float64(lat.P50.Nanoseconds())/1e3, "p50-µs")
			b.ReportMetric(float64(lat.P99.Nanoseconds())/1e3, "p99-µs")
			b.ReportMetric(float64(floor.P50.Nanoseconds())/1e3, "perftest-p50-µs")
			b.ReportMetric(float64(lat.P50)/float64(floor.P50), "p50-ratio")
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
