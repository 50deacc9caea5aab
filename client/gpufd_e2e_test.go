package client_test

// GPU objects of a daemon started with --gpu-share fd (store.GPUShareFD):
// arenas are VMM allocations whose descriptors travel with every
// placement. They skip without a GPU (and fail with CUDAIPC_REQUIRE_GPU=1).

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

const fdShare = "GPU_SHARE=fd"

func startFDDaemon(t *testing.T) (*daemon, *cudaipc.Device) {
	t.Helper()
	return startGPUDaemon(t, fdShare)
}

// A GPU object created, written and sealed by one process is read, every
// byte compared, by two others: a reader child and the test.
func TestGPUFDObjectBetweenProcesses(t *testing.T) {
	d, dev := startFDDaemon(t)
	c := dialNoIdle(t, d.socket) // every Release unmaps: counted below
	const seed = 23
	for _, size := range []int64{1, 4097, 1 << 20, 80<<20 + 3} { // the last one needs a second, larger arena
		name := fmt.Sprintf("fd-%d", size)
		env := append(gpuEnvs(d.socket, seed, name, 1, size), fdShare)
		spawn(t, "gpu-producer", nil, env...).expect("sealed 1")
		if got := spawn(t, "gpu-fd-reader", nil, env...).expect("ok"); got != "kind=vmm-fd mapped=1 after=1" {
			t.Errorf("%s: reader %s", name, got)
		}
		before := cudaipc.ImportCacheStats().Mapped
		l, err := c.Get(context.Background(), name+"-0")
		if err != nil {
			t.Fatal(err)
		}
		info := l.Info()
		if l.Mapping() == nil || l.Mapping().Region().Kind != cudaipc.KindVMMFD || info.Region == nil || !info.Region.Equal(l.Mapping().Region()) ||
			l.Device() != dev.UUID().String() || l.CUDADevice() == nil || l.Ptr() == 0 || l.Bytes() != nil {
			t.Fatalf("lease: mapping %v, info %+v, ptr %#x", l.Mapping() != nil, info, l.Ptr())
		}
		if n := cudaipc.ImportCacheStats().Mapped - before; n != 1 {
			t.Fatalf("%d allocations mapped for one lease", n)
		}
		got := make([]byte, size)
		if _, err := l.ReadAt(got, 0); err != nil {
			t.Fatal(err)
		}
		if i := firstDiff(got, stream(seed, name+"-0", int(size))); i >= 0 {
			t.Fatalf("%s: bytes differ at %d", name, i)
		}
		// Reads stop at the object's end, not the arena's.
		if n, err := l.ReadAt(make([]byte, 2), size-1); n != 1 || err == nil {
			t.Fatalf("ReadAt across the end: %d, %v", n, err)
		}
		// Ptr is the object's first byte, for device code.
		first := make([]byte, 1)
		if err := l.CUDADevice().CopyFromDevice(first, l.Ptr()); err != nil || first[0] != got[0] {
			t.Fatalf("reading at Ptr: %v, %d vs %d", err, first[0], got[0])
		}
		if err := l.Release(); err != nil {
			t.Fatal(err)
		}
		if l.Ptr() != 0 || l.CUDADevice() != nil || cudaipc.ImportCacheStats().Mapped != before {
			t.Fatalf("after Release: ptr %#x, %d allocations mapped (was %d)", l.Ptr(), cudaipc.ImportCacheStats().Mapped, before)
		}
	}
}

// Many objects in one arena cost a reader one descriptor import: while it
// holds 200 leases it maps one allocation, and keeps it (idle) after
// releasing them.
func TestGPUFDOneImportPerArena(t *testing.T) {
	d, _ := startFDDaemon(t)
	env := append(gpuEnvs(d.socket, 29, "many", 200, 64<<10), fdShare) // 12.5 MiB: one 64 MiB arena
	spawn(t, "gpu-producer", nil, env...).expect("sealed 200")
	if got, want := spawn(t, "gpu-fd-reader", nil, env...).expect("ok"), "kind=vmm-fd mapped=1 after=1"; got != want {
		t.Fatalf("reader: %s, want %s", got, want)
	}
	// The same in this process, with a writer's Object and readers' Leases
	// of one arena: two mappings, the Object's read-write and one read-only
	// shared by the three Leases (leases map read-only), gone with the last
	// of them when the client keeps no idle arenas.
	c := dialNoIdle(t, d.socket)
	ctx := context.Background()
	before := cudaipc.ImportCacheStats().Mapped
	o, err := c.Create(ctx, "mixed-w", 64<<10, client.CreateOptions{Device: "0"})
	if err != nil {
		t.Fatal(err)
	}
	var leases []*client.Lease
	for i := range 3 {
		l, err := c.Get(ctx, fmt.Sprintf("many-%d", i))
		if err != nil {
			t.Fatal(err)
		}
		leases = append(leases, l)
	}
	if n := cudaipc.ImportCacheStats().Mapped - before; n != 2 {
		t.Fatalf("%d mappings for an Object and 3 Leases of one arena, want 2 (read-write, read-only)", n)
	}
	if err := o.Abort(ctx); err != nil {
		t.Fatal(err)
	}
	for _, l := range leases {
		if err := l.Release(); err != nil {
			t.Fatal(err)
		}
	}
	if n := cudaipc.ImportCacheStats().Mapped - before; n != 0 {
		t.Fatalf("%d allocations still mapped", n)
	}
}

// A client in a new PID namespace with its own /proc, as in a container,
// reads a GPU object through its arena's descriptor; a daemon sharing by
// legacy IPC refuses it.
func TestGPUFDNewPIDNamespace(t *testing.T) {
	testutil.RequireGPU(t)
	if os.Geteuid() != 0 {
		t.Skip("new PID and mount namespaces need root")
	}
	attr, nsEnv := testutil.NewNamespaces()
	run := func(t *testing.T, share string) string {
		d, _ := startGPUDaemon(t, "GPU_SHARE="+share)
		env := append(gpuEnvs(d.socket, 31, "ns", 3, 3<<20+5), "GPU_SHARE="+share)
		spawn(t, "gpu-producer", nil, env...).expect("sealed 3")
		return spawnAttr(t, os.Args[0], "gpu-fd-reader", attr, append(env, nsEnv)...).line()
	}
	t.Run("fd", func(t *testing.T) {
		if got := run(t, "fd"); got != "ok kind=vmm-fd mapped=1 after=1" {
			t.Fatalf("reader in a new PID namespace: %s", got)
		}
	})
	t.Run("ipc", func(t *testing.T) {
		got := run(t, "ipc")
		if !strings.HasPrefix(got, "err ") || !strings.Contains(got, "--gpu-share fd") {
			t.Fatalf("reader in a new PID namespace, legacy IPC: %s, want an error pointing at --gpu-share fd", got)
		}
		t.Logf("legacy IPC in a new PID namespace: %s", got)
	})
}

// kill -9 of a lease holder releases its lease; closing a client closes
// its imported arenas.
func TestGPUFDKilledLeaseHolderReleases(t *testing.T) {
	d, _ := startFDDaemon(t)
	c := killHolder(t, d.socket, 37, fdShare)

	before := cudaipc.ImportCacheStats().Mapped
	l := leaseOfClosedClient(t, d.socket, "held-0")
	if _, err := l.ReadAt(make([]byte, 1), 0); err == nil || l.Ptr() != 0 || l.CUDADevice() != nil {
		t.Fatalf("lease of a closed client: ReadAt %v, ptr %#x", err, l.Ptr())
	}
	if n := cudaipc.ImportCacheStats().Mapped - before; n != 0 {
		t.Fatalf("%d allocations still mapped after Close", n)
	}
	releaseAndDelete(t, c, l, "held-0")
}
