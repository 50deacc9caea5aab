package node_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/bundle"
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
			r.st.Replicas().Drop(0, name, "")
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

// BenchmarkPartialRead measures, alternating in one run, a get of a whole
// 256 MiB host bundle another daemon holds and a get of 1/8 of its
// tensors (every eighth of 32, as a tensor-parallel rank's slice of a
// pre-sharded bundle), each from nothing held locally:
//
//	go test -run '^$' -bench PartialRead -benchtime 5x ./cluster/node/
func BenchmarkPartialRead(b *testing.B) {
	srv := etcdtest.Start(b)
	a := startDaemonCap(b, srv, "a", 600<<20)
	r := startDaemonCap(b, srv, "b", 600<<20)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var tensors []client.TensorData
	var names []string
	for i := range 32 {
		td := client.TensorData{Spec: bundle.Spec{Name: fmt.Sprintf("layer.%d.w", i), DType: bundle.F32, Shape: []int64{2048, 1024 + int64(i)}}}
		n, _ := bundle.ByteSize(td.DType, td.Shape)
		td.Data = make([]byte, n)
		rand.NewChaCha8([32]byte{byte(i)}).Read(td.Data)
		tensors = append(tensors, td)
		if i%8 == 3 {
			names = append(names, td.Name)
		}
	}
	m, err := a.c.PutBundle(ctx, "model", tensors, nil, client.CreateOptions{Cluster: true})
	if err != nil {
		b.Fatal(err)
	}
	get := func(opts client.GetOptions) (time.Duration, uint64) {
		st := r.node.Stats()
		t0 := time.Now()
		l, _, err := r.c.GetBundle(ctx, "model", opts)
		if err != nil {
			b.Fatal(err)
		}
		d := time.Since(t0)
		l.Release()
		r.st.Replicas().Drop(0, "model", "")
		st2 := r.node.Stats()
		return d, st2.Bytes - st.Bytes + st2.PartialBytes - st.PartialBytes
	}
	var whole, part []time.Duration
	var wholeRead, partRead uint64
	b.ResetTimer()
	for range b.N {
		d, n := get(client.GetOptions{})
		whole, wholeRead = append(whole, d), n
		d, n = get(client.GetOptions{Tensors: names})
		part, partRead = append(part, d), n
	}
	b.StopTimer()
	slices.Sort(whole)
	slices.Sort(part)
	b.ReportMetric(float64(m.Tensors[len(m.Tensors)-1].End)/(1<<20), "bundle_MiB")
	b.ReportMetric(float64(wholeRead)/(1<<20), "whole_read_MiB")
	b.ReportMetric(float64(partRead)/(1<<20), "partial_read_MiB")
	b.ReportMetric(float64(whole[len(whole)/2].Microseconds())/1e3, "whole_p50_ms")
	b.ReportMetric(float64(part[len(part)/2].Microseconds())/1e3, "partial_p50_ms")
	b.ReportMetric(float64(part[len(part)/2])/float64(whole[len(whole)/2]), "partial/whole")
}
