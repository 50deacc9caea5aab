package client_test

// GPU objects between real processes: a daemon child with the cuda
// backend, producer and reader children, and the test itself as a client.
// They skip without a GPU (and fail with CUDAIPC_REQUIRE_GPU=1).

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// gpuRoles are the children of the GPU tests. Objects are NAME-0 …
// NAME-(COUNT-1), SIZE bytes each, with the content stream(SEED, name).
var gpuRoles = map[string]func(ctx context.Context, c *client.Client, say func(string, ...any)) error{
	// Creates the objects on GPU ordinal DEVICE, writes them with WriteAt
	// and seals them.
	"gpu-producer": func(ctx context.Context, c *client.Client, say func(string, ...any)) error {
		seed, names, size := gpuEnv()
		for _, name := range names {
			o, err := c.Create(ctx, name, size, client.CreateOptions{Device: os.Getenv("DEVICE")})
			if err != nil {
				return err
			}
			// Shared by legacy IPC, an object's Mapping has a cuda-ipc
			// region; by descriptor (GPU_SHARE=fd), a vmm-fd one.
			kind := cudaipc.KindCUDAIPC
			if os.Getenv("GPU_SHARE") == "fd" {
				kind = cudaipc.KindVMMFD
			}
			if o.Bytes() != nil || o.Ptr() == 0 || o.CUDADevice() == nil || o.Mapping() == nil ||
				o.Mapping().Region().Kind != kind || !strings.HasPrefix(o.Device(), "GPU-") {
				return fmt.Errorf("GPU object %s: bytes %v, ptr %#x, device %q, mapping %v, want kind %s", name, o.Bytes() != nil, o.Ptr(), o.Device(), o.Mapping() != nil, kind)
			}
			if _, err := o.WriteAt(stream(seed, name, int(size)), 0); err != nil {
				return err
			}
			if err := o.Seal(ctx); err != nil {
				return err
			}
		}
		say("sealed %d", len(names))
		return nil
	},
	// Leases every object, compares its bytes read through the mapping,
	// and reports the driver opens and cache hits that cost.
	"gpu-reader": func(ctx context.Context, c *client.Client, say func(string, ...any)) error {
		seed, names, size := gpuEnv()
		before := cudaipc.ImportCacheStats()
		var leases []*client.Lease
		for _, name := range names {
			l, err := c.Get(ctx, name)
			if err != nil {
				return err
			}
			got := make([]byte, size)
			if _, err := l.ReadAt(got, 0); err != nil {
				return err
			}
			if !bytes.Equal(got, stream(seed, name, int(size))) {
				say("mismatch %s", name)
				return nil
			}
			leases = append(leases, l)
		}
		after := cudaipc.ImportCacheStats()
		for _, l := range leases {
			if err := l.Release(); err != nil {
				return err
			}
		}
		say("ok opens=%d hits=%d mapped=%d unmapped=%d", after.Opens-before.Opens, after.Hits-before.Hits, after.Mapped, cudaipc.ImportCacheStats().Mapped)
		return nil
	},
	// Leases every object and compares every byte read at the lease's
	// offset in the imported arena, holding all the leases; reports the
	// allocations this process maps meanwhile and after releasing them, and
	// the kind of the leases' regions. A failing Get is reported, not
	// returned, so that a test can expect it.
	"gpu-fd-reader": func(ctx context.Context, c *client.Client, say func(string, ...any)) error {
		seed, names, size := gpuEnv()
		before := cudaipc.ImportCacheStats().Mapped
		var leases []*client.Lease
		var kind cudaipc.Kind
		for _, name := range names {
			l, err := c.Get(ctx, name)
			if err != nil {
				say("err %s", errClass(err))
				return nil
			}
			leases = append(leases, l)
			kind = l.Mapping().Region().Kind
			got := make([]byte, size)
			if _, err := l.ReadAt(got, 0); err != nil {
				return err
			}
			if i := firstDiff(got, stream(seed, name, int(size))); i >= 0 {
				say("mismatch %s at %d", name, i)
				return nil
			}
			if r := l.Info().Region; r == nil || r.Kind != kind || r.Size != size || l.Ptr() == 0 || l.CUDADevice() == nil {
				return fmt.Errorf("%s: region %v, ptr %#x", name, r, l.Ptr())
			}
		}
		held := cudaipc.ImportCacheStats().Mapped - before
		for _, l := range leases {
			if err := l.Release(); err != nil {
				return err
			}
		}
		say("ok kind=%s mapped=%d after=%d", kind, held, cudaipc.ImportCacheStats().Mapped-before)
		return nil
	},
	// Leases NAME-0, reports its hash, and holds it until killed.
	"gpu-holder": func(ctx context.Context, c *client.Client, say func(string, ...any)) error {
		_, names, size := gpuEnv()
		l, err := c.Get(ctx, names[0])
		if err != nil {
			return err
		}
		got := make([]byte, size)
		if _, err := l.ReadAt(got, 0); err != nil {
			return err
		}
		say("leased %s", hash(got))
		select {}
	},
}

func gpuEnv() (seed uint64, names []string, size int64) {
	seed, _ = strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	size, _ = strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
	n, _ := strconv.Atoi(os.Getenv("COUNT"))
	for i := range max(n, 1) {
		names = append(names, fmt.Sprintf("%s-%d", os.Getenv("NAME"), i))
	}
	return seed, names, size
}

func gpuEnvs(sock string, seed uint64, name string, count int, size int64) []string {
	return []string{"CUDAIPC_SOCKET=" + sock, "SEED=" + strconv.FormatUint(seed, 10), "NAME=" + name,
		"COUNT=" + strconv.Itoa(count), "SIZE=" + strconv.FormatInt(size, 10), "DEVICE=0"}
}

// startGPUDaemon runs a daemon child with the cuda backend and, in env,
// more of its settings (GPU_SHARE=fd).
func startGPUDaemon(t *testing.T, env ...string) (*daemon, *cudaipc.Device) {
	t.Helper()
	dev := testutil.RequireGPU(t)
	d := startDaemon(t, socketPath(t), append([]string{"BACKEND=cuda", "CAPACITY=" + strconv.Itoa(4<<30)}, env...)...)
	return d, dev
}

// A GPU object created, written and sealed by one process is read, byte
// for byte, by two others: a reader child and the test.
func TestGPUObjectBetweenProcesses(t *testing.T) {
	d, dev := startGPUDaemon(t)
	c := dial(t, d.socket)
	if got := c.Server().Backend; got != "cuda" {
		t.Fatalf("backend %q, want cuda", got)
	}
	const seed = 7
	for _, size := range []int64{1, 4097, 1 << 20, 80<<20 + 3} { // the last one needs a second, larger arena
		name := fmt.Sprintf("gpu-%d", size)
		env := gpuEnvs(d.socket, seed, name, 1, size)
		spawn(t, "gpu-producer", nil, env...).expect("sealed 1")
		if r := spawn(t, "gpu-reader", nil, env...).expect("ok"); !strings.HasPrefix(r, "opens=1 ") {
			t.Errorf("%s: reader %s, want one driver open", name, r)
		}
		l, err := c.Get(context.Background(), name+"-0")
		if err != nil {
			t.Fatal(err)
		}
		info := l.Info()
		if l.Device() != dev.UUID().String() || info.Device != l.Device() || l.Bytes() != nil || l.Ptr() == 0 || info.Region == nil {
			t.Fatalf("lease: device %q, info %+v, ptr %#x", l.Device(), info, l.Ptr())
		}
		if r := *info.Region; r.Kind != cudaipc.KindCUDAIPC || r.Size != size || r.Device != dev.UUID() {
			t.Fatalf("info region %v", r)
		}
		got := make([]byte, size)
		if _, err := l.ReadAt(got, 0); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, stream(seed, name+"-0", int(size))) {
			t.Fatalf("%s: bytes differ", name)
		}
		// The mapping itself holds the bytes, for device code.
		first := make([]byte, 1)
		if err := l.Mapping().Device().CopyFromDevice(first, l.Ptr()); err != nil || first[0] != got[0] {
			t.Fatalf("reading at Ptr: %v, %d vs %d", err, first[0], got[0])
		}
		if err := l.Release(); err != nil {
			t.Fatal(err)
		}
		if l.Mapping() != nil || l.Ptr() != 0 {
			t.Fatal("mapping still exposed after Release")
		}
	}
}

// Many objects in one arena cost a reader one cuIpcOpenMemHandle; the
// mapping stays (idle, parked by a cache hit) after the reader's last lease
// in the arena goes.
func TestGPUOneOpenPerArena(t *testing.T) {
	d, _ := startGPUDaemon(t)
	env := gpuEnvs(d.socket, 11, "many", 200, 64<<10) // 12.5 MiB: one 64 MiB arena
	spawn(t, "gpu-producer", nil, env...).expect("sealed 200")
	got := spawn(t, "gpu-reader", nil, env...).expect("ok")
	if want := "opens=1 hits=200 mapped=1 unmapped=1"; got != want {
		t.Fatalf("reader: %s, want %s", got, want)
	}
}

// A deleted object stays readable by its lease holder until Release.
func TestGPUDeleteWhileLeased(t *testing.T) {
	d, _ := startGPUDaemon(t)
	env := gpuEnvs(d.socket, 13, "del", 1, 3<<20)
	spawn(t, "gpu-producer", nil, env...).expect("sealed 1")
	c := dial(t, d.socket)
	ctx := context.Background()
	l, err := c.Get(ctx, "del-0")
	if err != nil {
		t.Fatal(err)
	}
	if err := dial(t, d.socket).Delete(ctx, "del-0"); err != nil {
		t.Fatal(err)
	}
	// Another object takes the name and, perhaps, room in the same arena.
	spawn(t, "gpu-producer", nil, gpuEnvs(d.socket, 14, "del", 1, 3<<20)...).expect("sealed 1")
	got := make([]byte, 3<<20)
	if _, err := l.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, stream(13, "del-0", 3<<20)) {
		t.Fatal("a deleted, leased GPU object changed")
	}
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
}

// kill -9 of a GPU lease holder releases its lease.
func TestGPUKilledLeaseHolderReleases(t *testing.T) {
	d, _ := startGPUDaemon(t)
	c := killHolder(t, d.socket, 17)

	// Closing a client closes the GPU mappings of its leases: the daemon
	// may free that memory once the connection is gone.
	l := leaseOfClosedClient(t, d.socket, "held-0")
	if _, err := l.ReadAt(make([]byte, 1), 0); err == nil || l.Ptr() != 0 || l.Mapping() != nil {
		t.Fatalf("lease of a closed client: ReadAt %v, ptr %#x", err, l.Ptr())
	}
	releaseAndDelete(t, c, l, "held-0")
}

// killHolder has a gpu-producer seal held-0 (one MiB from seed), a
// gpu-holder lease and read it, and kills the holder with SIGKILL; it
// checks that the daemon at sock drops the holder's lease and returns a
// client of the daemon. env adds to the helpers' environment.
func killHolder(t *testing.T, sock string, seed uint64, env ...string) *client.Client {
	t.Helper()
	env = append(gpuEnvs(sock, seed, "held", 1, 1<<20), env...)
	spawn(t, "gpu-producer", nil, env...).expect("sealed 1")
	h := spawn(t, "gpu-holder", nil, env...)
	if got := h.expect("leased "); got != hash(stream(seed, "held-0", 1<<20)) {
		t.Fatal("holder read other bytes")
	}
	c := dial(t, sock)
	waitLeases(t, c, "held-0", 1)
	h.kill9()
	waitLeases(t, c, "held-0", 0)
	return c
}

// leaseOfClosedClient leases name on a client of its own and closes that
// client, leaving the lease to the test.
func leaseOfClosedClient(t *testing.T, sock, name string) *client.Lease {
	t.Helper()
	c, err := client.Dial(context.Background(), sock)
	if err != nil {
		t.Fatal(err)
	}
	l, err := c.Get(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	return l
}

// releaseAndDelete releases l, the lease of name of a closed client,
// checks that c sees no lease left on name and deletes it.
func releaseAndDelete(t *testing.T, c *client.Client, l *client.Lease, name string) {
	t.Helper()
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	waitLeases(t, c, name, 0)
	if err := c.Delete(context.Background(), name); err != nil {
		t.Fatal(err)
	}
}

// firstDiff returns the index of the first byte where a and b differ, or -1.
func firstDiff(a, b []byte) int {
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}
