package node_test

import (
	"bytes"
	"context"
	"log/slog"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// TestGPUVersionTimes publishes two versions of a GPU object on daemon
// A and gets each on daemon B right after its seal, and logs where the
// time went: A's seal (staging: the device→host copy and the checksums,
// of which a pinned buffer's allocation; the record's publish), B's get
// (the pull, of which B's pinned allocation and its store's making of the
// replica's GPU memory), A's UCX registration of the
// buffer it exposes. The first version allocates every pinned buffer;
// the second reuses them. It runs with the pool's pinned buffers from
// staging.AllocPinned and from cuMemAllocHost, and checks the bytes B
// gets (the first, a middle and the last 64 MiB; the pull checked every
// chunk's CRC); staging.AllocPinned's debug lines (populate and register
// times) go to stderr. CUDAIPC_SEAL_GIB sets the size (1 GiB by default),
// CUDAIPC_SEAL_ALLOC=AllocPinned or cuMemAllocHost runs only that one:
//
//	CUDAIPC_SEAL_GIB=8 ./cluster_node.test -test.run GPUVersionTimes -test.v
func TestGPUVersionTimes(t *testing.T) {
	dev := testutil.RequireGPU(t)
	gib := testutil.PositiveEnv(t, "CUDAIPC_SEAL_GIB", 1)
	size := gib<<30 + 4097
	// staging.AllocPinned's populate and register times, at debug level.
	defer slog.SetDefault(slog.Default())
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})))
	for _, alloc := range []string{"AllocPinned", "cuMemAllocHost"} {
		if only := os.Getenv("CUDAIPC_SEAL_ALLOC"); only != "" && only != alloc {
			continue
		}
		t.Run(alloc, func(t *testing.T) {
			srv := etcdtest.Start(t)
			capacity := 3*size + 64<<20
			a, b := startDaemonOn(t, srv, "a", capacity, "cuda"), startDaemonOn(t, srv, "b", capacity, "cuda")
			if alloc == "cuMemAllocHost" {
				node.UseAllocHost(a.node)
				node.UseAllocHost(b.node)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			for v := range 2 {
				o, err := a.c.Publish(ctx, "w", size, client.CreateOptions{Cluster: true, Device: dev.UUID().String(), Versioned: true, KeepLast: 1})
				if err != nil {
					t.Fatal(err)
				}
				want := fillObject(t, o.CUDADevice(), o.Ptr(), size, byte(v))
				aAllocs, aAlloc := node.PinnedAllocs(a.node)
				bAllocs, bAlloc := node.PinnedAllocs(b.node)
				reg, replica := node.RegisterTime(a.node), node.ReplicaCreateTime(b.node)
				t0 := time.Now()
				if err := o.Seal(ctx); err != nil {
					t.Fatal(err)
				}
				tSeal := time.Since(t0)
				// By version: B may not have seen the commit retire its
				// replica of the version before yet.
				l, err := b.c.GetWith(ctx, "w", client.GetOptions{Version: o.Version()})
				if err != nil {
					t.Fatalf("version %d on B: %v", v+1, err)
				}
				tAll := time.Since(t0)
				for _, off := range []int64{0, size/2 - 32<<20, size - 64<<20} {
					got := make([]byte, 64<<20)
					if _, err := l.ReadAt(got, off); err != nil {
						t.Fatal(err)
					}
					if !bytes.Equal(got, want(off, len(got))) {
						t.Fatalf("version %d on B: bytes at %d differ from A's", v+1, off)
					}
				}
				l.Release()
				stage, sealAlloc, publish, _ := node.LastGPUSeal(a.node)
				aAllocs2, aAlloc2 := node.PinnedAllocs(a.node)
				bAllocs2, bAlloc2 := node.PinnedAllocs(b.node)
				t.Logf("%s, version %d (%d bytes): publish→loaded %.3f s = seal %.3f s (staging %.3f s of which pinned alloc %.3f s; publish %.3f s) + get %.3f s; "+
					"pinned allocations A %d (%.3f s), B %d (%.3f s); B's GPU replica %.3f s; A's UCX registration %.3f s",
					alloc, v+1, size, tAll.Seconds(), tSeal.Seconds(), stage.Seconds(), sealAlloc.Seconds(), publish.Seconds(), (tAll - tSeal).Seconds(),
					aAllocs2-aAllocs, (aAlloc2 - aAlloc).Seconds(), bAllocs2-bAllocs, (bAlloc2 - bAlloc).Seconds(),
					(node.ReplicaCreateTime(b.node) - replica).Seconds(), (node.RegisterTime(a.node) - reg).Seconds())
			}
		})
	}
}

// fillObject fills size bytes at p with a random 64 MiB block repeated
// (on the device), and returns the bytes expected at any range.
func fillObject(t *testing.T, dev *cudaipc.Device, p cudaipc.DevicePtr, size int64, seed byte) func(off int64, n int) []byte {
	t.Helper()
	block := make([]byte, 64<<20)
	rand.NewChaCha8([32]byte{seed, 5}).Read(block)
	if err := dev.CopyToDevice(p, block[:min(size, int64(len(block)))]); err != nil {
		t.Fatal(err)
	}
	for off := int64(len(block)); off < size; off += int64(len(block)) {
		if err := dev.Copy(p+cudaipc.DevicePtr(off), p, min(int64(len(block)), size-off)); err != nil {
			t.Fatal(err)
		}
	}
	return func(off int64, n int) []byte {
		out := make([]byte, n)
		for i := range out {
			out[i] = block[(off+int64(i))%int64(len(block))]
		}
		return out
	}
}
