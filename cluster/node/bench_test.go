package node_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/transport/ucx/ucxperf"
)

// BenchmarkClusterPull measures gets of objects another daemon holds,
// through the whole path (directory lookup, pin, authenticated control
// channel, UCX GETs into the new object, checksums, seal, advertise), next
// to ucx_perftest on the same link (UCX tcp on lo) in the same run:
//
//	go test -run '^$' -bench ClusterPull -benchtime 3x ./cluster/node/
func BenchmarkClusterPull(b *testing.B) {
	b.Run("1GiB", func(b *testing.B) { benchPull(b, 1<<30, 1) })
	b.Run("4KiB", func(b *testing.B) { benchPull(b, 4096, 1000) })
}

func benchPull(b *testing.B, size, objects int) {
	srv := etcdtest.Start(b)
	a := startDaemonCap(b, srv, "a", 2*int64(size)*int64(objects)+64<<20)
	r := startDaemonCap(b, srv, "b", 2*int64(size)*int64(objects)+64<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	names := make([]string, objects)
	for i := range names {
		names[i] = fmt.Sprintf("bench/%d", i)
		o, err := a.c.Create(ctx, names[i], int64(size), client.CreateOptions{Cluster: true})
		if err != nil {
			b.Fatal(err)
		}
		for j := range o.Bytes() {
			o.Bytes()[j] = byte(i + j)
		}
		if err := o.Seal(ctx); err != nil {
			b.Fatal(err)
		}
	}
	var lat []time.Duration
	b.SetBytes(int64(size) * int64(objects))
	b.ResetTimer()
	for range b.N {
		for _, name := range names {
			t0 := time.Now()
			l, err := r.c.Get(ctx, name)
			if err != nil {
				b.Fatal(err)
			}
			lat = append(lat, time.Since(t0))
			l.Release()
		}
		b.StopTimer()
		for _, name := range names {
			r.st.DropCluster(0, name, "")
		}
		b.StartTimer()
	}
	b.StopTimer()
	slices.Sort(lat)
	b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50_µs")
	b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99_µs")
	env := []string{"UCX_TLS=tcp", "UCX_NET_DEVICES=lo"}
	if size >= 1<<20 {
		pt, err := ucxperf.Perftest(ctx, ucxperf.PerftestOptions{Test: "ucp_get", Size: 1 << 20, Iters: 2048, Warmup: 64, Outstanding: 8, Env: env})
		if err != nil {
			b.Logf("ucx_perftest: %v", err)
			return
		}
		b.ReportMetric(pt.BytesPerSec/1e9, "perftest_ucp_get_GB/s")
		return
	}
	pt, err := ucxperf.Perftest(ctx, ucxperf.PerftestOptions{Test: "ucp_am_lat", Size: size, Iters: 2000, Warmup: 100, Env: env})
	if err != nil {
		b.Logf("ucx_perftest: %v", err)
		return
	}
	b.ReportMetric(float64(2*pt.P50.Microseconds()), "perftest_am_round_trip_µs")
}
