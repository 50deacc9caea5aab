package staging_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/staging"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

func TestMain(m *testing.M) {
	// UCX over tcp on loopback (two "nodes" in one process, as the GPU
	// machine's daemons share its loopback), its logs on stderr.
	testutil.SetUCXLoopbackEnv()
	os.Exit(m.Run())
}

func requireUCX(tb testing.TB) {
	tb.Helper()
	if err := ucx.Available(); err != nil {
		if os.Getenv("CUDAIPC_REQUIRE_UCX") == "1" || testutil.GPURequired() {
			tb.Fatal(err)
		}
		tb.Skip(err)
	}
}

// rig is the staging path between two "nodes" in this process: a device
// buffer on the holder's GPU, staged device→host into the holder's pinned
// ring (registered with UCX once), read by a UCX GET into the reader's
// pinned ring, copied host→device into the reader's GPU buffer.
type rig struct {
	l            staging.Layout
	src, dst     *cudaipc.Buffer
	ringA, ringB *cudaipc.HostBuffer
	regA         *ucxtransport.Region
	keyA         []byte // a window on ringA, for fetches
	ep           cluster.Endpoint
	sA, sB       *cudaipc.Stream
	want         [32]byte
}

func newRig(tb testing.TB, devA, devB *cudaipc.Device, l staging.Layout) *rig {
	tb.Helper()
	requireUCX(tb)
	r := &rig{l: l}
	must := func(err error) {
		tb.Helper()
		if err != nil {
			tb.Fatal(err)
		}
	}
	var err error
	r.src, err = devA.Alloc(l.Size)
	must(err)
	tb.Cleanup(func() { r.src.Free() })
	r.dst, err = devB.Alloc(l.Size)
	must(err)
	tb.Cleanup(func() { r.dst.Free() })
	host := make([]byte, l.Size)
	rand.NewChaCha8([32]byte{byte(l.Size), byte(l.Chunk >> 10)}).Read(host)
	r.want = sha256.Sum256(host)
	must(devA.CopyToDevice(r.src.Ptr(), host))
	must(r.dst.Memset(0))
	ring := int64(l.Depth) * l.Chunk
	r.ringA, err = devA.AllocHost(ring)
	must(err)
	tb.Cleanup(func() { r.ringA.Free() })
	r.ringB, err = devB.AllocHost(ring)
	must(err)
	tb.Cleanup(func() { r.ringB.Free() })
	r.sA, err = devA.NewStream()
	must(err)
	tb.Cleanup(func() { r.sA.Close() })
	r.sB, err = devB.NewStream()
	must(err)
	tb.Cleanup(func() { r.sB.Close() })

	ta, err := ucxtransport.New("holder")
	must(err)
	tb.Cleanup(func() { ta.Close() })
	tbr, err := ucxtransport.New("reader")
	must(err)
	tb.Cleanup(func() { tbr.Close() })
	r.regA, err = ta.Register(r.ringA.Bytes())
	must(err)
	tb.Cleanup(func() { r.regA.Close() })
	var closeWindow func()
	r.keyA, closeWindow, err = r.regA.Window(0, int64(len(r.ringA.Bytes())))
	must(err)
	tb.Cleanup(closeWindow)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r.ep, err = tbr.Connect(ctx, ta.WorkerAddress())
	must(err)
	tb.Cleanup(func() { r.ep.Close() })
	return r
}

func (r *rig) ends() staging.Ends {
	a, b := r.ringA.Bytes(), r.ringB.Bytes()
	return staging.Ends{
		Out: func(ctx context.Context, off, n, slot int64) error {
			if err := r.sA.CopyFromDeviceAsync(a[slot:slot+n], r.src.Ptr()+cudaipc.DevicePtr(off)); err != nil {
				return err
			}
			return r.sA.Synchronize()
		},
		Wire: func(ctx context.Context, off, n, slot int64) error {
			return r.ep.Get(ctx, r.keyA, r.regA.Addr(slot), b[slot:slot+n])
		},
		In: func(ctx context.Context, off, n, slot int64) error {
			if err := r.sB.CopyToDeviceAsync(r.dst.Ptr()+cudaipc.DevicePtr(off), b[slot:slot+n]); err != nil {
				return err
			}
			return r.sB.Synchronize()
		},
	}
}

// check compares the reader's buffer with the holder's bytes.
func (r *rig) check(tb testing.TB, dev *cudaipc.Device) {
	tb.Helper()
	got := make([]byte, r.l.Size)
	if err := dev.CopyFromDevice(got, r.dst.Ptr()); err != nil {
		tb.Fatal(err)
	}
	if sha256.Sum256(got) != r.want {
		i := 0
		src := make([]byte, r.l.Size)
		_ = dev.CopyFromDevice(src, r.src.Ptr())
		for i < len(got) && got[i] == src[i] {
			i++
		}
		tb.Fatalf("staged copy of %d bytes differs from the source, first at byte %d", r.l.Size, i)
	}
}

func (r *rig) run(tb testing.TB) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if err := staging.Copy(ctx, r.l, r.ends()); err != nil {
		tb.Fatal(err)
	}
}

// TestStagedCopyGPU: random bytes from one GPU buffer to another through
// the staging path, checked by sha256; across two GPUs where there are two.
func TestStagedCopyGPU(t *testing.T) {
	dev := testutil.RequireGPU(t)
	for _, l := range []staging.Layout{
		{Size: 256<<20 + 4097, Chunk: 4 << 20, Depth: 4},
		{Size: 3<<20 + 1, Chunk: 1 << 20, Depth: 1},
		{Size: 1000, Chunk: 256, Depth: 3},
	} {
		r := newRig(t, dev, dev, l)
		r.run(t)
		r.check(t, dev)
	}
	if devs, err := cudaipc.Devices(); err == nil && len(devs) >= 2 {
		r := newRig(t, devs[0], devs[1], staging.Layout{Size: 64<<20 + 3, Chunk: 2 << 20, Depth: 4})
		r.run(t)
		r.check(t, devs[1])
	}
}

// BenchmarkStagedCopy sweeps the staging path's chunk size and depth for a
// 1 GiB GPU object (CUDAIPC_STAGING_MIB changes it), next to its floors in
// the same run: pinned device→host and host→device copies, and UCX GETs
// between the pinned rings alone. Bytes are checked after each sweep
// point. Its 15 points move 15 × N GiB over UCX tcp (~1 GB/s on the H200
// machine's loopback), so it runs only when asked, with a small N:
//
//	CUDAIPC_STAGING_BENCH=1 ./cluster_staging.test -test.run '^$' \
//	    -test.bench StagedCopy -test.benchtime 3x
func BenchmarkStagedCopy(b *testing.B) {
	if os.Getenv("CUDAIPC_STAGING_BENCH") != "1" {
		b.Skip("the staging sweep moves 15 GiB an iteration: set CUDAIPC_STAGING_BENCH=1 and -benchtime 3x")
	}
	dev := testutil.RequireGPU(b)
	size := int64(1 << 30)
	if s := os.Getenv("CUDAIPC_STAGING_MIB"); s != "" {
		var mib int64
		if _, err := fmt.Sscan(s, &mib); err != nil || mib <= 0 {
			b.Fatalf("CUDAIPC_STAGING_MIB=%q", s)
		}
		size = mib << 20
	}
	for _, chunk := range []int64{256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20} {
		for _, depth := range []int{2, 4, 8} {
			l := staging.Layout{Size: size, Chunk: chunk, Depth: depth}
			b.Run(fmt.Sprintf("chunk=%dKiB/depth=%d", chunk>>10, depth), func(b *testing.B) {
				r := newRig(b, dev, dev, l)
				e := r.ends()
				b.SetBytes(size)
				b.ResetTimer()
				for range b.N {
					r.run(b)
				}
				b.StopTimer()
				r.check(b, dev)
				// The floors, one stage alone at this chunk size.
				for _, f := range []struct {
					name  string
					stage func(ctx context.Context, off, n, slot int64) error
				}{{"d2h", e.Out}, {"wire", e.Wire}, {"h2d", e.In}} {
					start := time.Now()
					if err := staging.Copy(context.Background(), l, staging.Ends{Out: nop, Wire: f.stage, In: nop}); err != nil {
						b.Fatal(err)
					}
					b.ReportMetric(float64(size)/time.Since(start).Seconds()/1e9, f.name+"_GB/s")
				}
			})
		}
	}
}

func nop(context.Context, int64, int64, int64) error { return nil }

// The check above must fail on a wrong byte: the staging of one chunk to
// the wrong offset is caught.
func TestStagedCopyCheckFailsGPU(t *testing.T) {
	dev := testutil.RequireGPU(t)
	l := staging.Layout{Size: 8 << 20, Chunk: 1 << 20, Depth: 2}
	r := newRig(t, dev, dev, l)
	e := r.ends()
	in := e.In
	e.In = func(ctx context.Context, off, n, slot int64) error {
		if off == 3<<20 {
			off = 4 << 20 // chunk 3 lands on chunk 4
		}
		return in(ctx, off, n, slot)
	}
	if err := staging.Copy(context.Background(), l, e); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, l.Size)
	if err := dev.CopyFromDevice(got, r.dst.Ptr()); err != nil {
		t.Fatal(err)
	}
	if sha256.Sum256(got) == r.want || !bytes.Equal(got[3<<20:3<<20+16], make([]byte, 16)) {
		t.Fatal("a misplaced chunk went unnoticed")
	}
}
