package client_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
)

// TestGPUOneOpenForManyCycles: a client that gets, reads and releases one
// GPU object at a time keeps its arena mapped between the cycles: 10,000
// get/release cycles cost one driver open (docs/architecture.md, "Arena
// lifetime"). Deleting the object then frees the arena (the daemon keeps
// no empty arena here: KEEP_ARENAS=-1): the daemon tells the client, which
// unmaps it.
func TestGPUOneOpenForManyCycles(t *testing.T) {
	d, _ := startGPUDaemon(t, "KEEP_ARENAS=-1")
	const size = 4096
	env := gpuEnvs(d.socket, 31, "cyc", 1, size)
	spawn(t, "gpu-producer", nil, env...).expect("sealed 1")
	want := stream(31, "cyc-0", size)
	// Through the socket: with the lease fast path every cycle after the
	// first would be a compare-and-swap that touches no mapping at all.
	c, err := client.DialOptions(context.Background(), d.socket, client.Options{NoFastPath: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	ctx := context.Background()
	before := cudaipc.ImportCacheStats()
	got := make([]byte, size)
	const cycles = 10000
	for i := range cycles {
		l, err := c.Get(ctx, "cyc-0")
		if err != nil {
			t.Fatal(err)
		}
		if i%1000 == 0 {
			if _, err := l.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("cycle %d: wrong bytes", i)
			}
		}
		if err := l.Release(); err != nil {
			t.Fatal(err)
		}
	}
	after := cudaipc.ImportCacheStats()
	opens, closes := after.Opens-before.Opens, after.Closes-before.Closes
	t.Logf("%d get/release cycles: %d driver opens, %d closes, %d cache hits", cycles, opens, closes, after.Hits-before.Hits)
	if opens != 1 || closes != 0 {
		t.Fatalf("%d get/release cycles: %d driver opens and %d closes, want 1 and 0", cycles, opens, closes)
	}
	// The object's deletion empties the arena: the client unmaps it.
	if err := c.Delete(ctx, "cyc-0"); err != nil {
		t.Fatal(err)
	}
	for cudaipc.ImportCacheStats().Closes == after.Closes {
		waitRoundTrip(t, c)
	}
}

// TestFreedHostArenaUnmapped: when the daemon frees an arena (its last
// object deleted), it tells the clients that mapped it, which unmap it.
func TestFreedHostArenaUnmapped(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	w, r := dial(t, d.socket), dial(t, d.socket)
	ctx := context.Background()
	base := arenaMappings(t)
	want := put(t, w, "x", 10000)
	checkGet(t, r, "x", want)
	if n := arenaMappings(t) - base; n != 2 { // the writer's and the reader's
		t.Fatalf("%d arena mappings, want 2", n)
	}
	if err := w.Delete(ctx, "x"); err != nil {
		t.Fatal(err)
	}
	for arenaMappings(t) != base {
		waitRoundTrip(t, r)
	}
}

// waitRoundTrip makes one call on c: the daemon's notices sent before its
// reply have been read by then (they are handled asynchronously, so
// callers loop).
func waitRoundTrip(t *testing.T, c *client.Client) {
	t.Helper()
	if _, err := c.List(context.Background()); err != nil {
		t.Fatal(fmt.Errorf("list: %w", err))
	}
}

// TestGPUPutReusesKeptArena: by legacy IPC and by descriptor, a producer
// that puts a large object, deletes it and puts the next one lands in the
// arena the daemon kept, which it still maps: no driver open or import
// after the first, and each object holds its own random bytes.
func TestGPUPutReusesKeptArena(t *testing.T) {
	for _, share := range []string{"ipc", "fd"} {
		t.Run(share, func(t *testing.T) {
			d, dev := startGPUDaemon(t, "GPU_SHARE="+share)
			if share == "fd" && !dev.VMMFDSupported() {
				t.Skip("the GPU cannot export memory as file descriptors")
			}
			c, err := client.DialOptions(context.Background(), d.socket, client.Options{NoFastPath: true})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { c.Close() })
			ctx := context.Background()
			const size = 96<<20 + 4321 // an arena of its own
			var opens int64
			var arena string
			for i := range 4 {
				name := fmt.Sprintf("put-%d", i)
				before := cudaipc.ImportCacheStats()
				o, err := c.Create(ctx, name, size, client.CreateOptions{Device: dev.UUID().String()})
				if err != nil {
					t.Fatal(err)
				}
				want := stream(uint64(40+i), name, size)
				if _, err := o.WriteAt(want, 0); err != nil {
					t.Fatal(err)
				}
				if err := o.Seal(ctx); err != nil {
					t.Fatal(err)
				}
				opens += cudaipc.ImportCacheStats().Opens - before.Opens
				if !bytes.Equal(getBytes(t, c, name, size), want) {
					t.Fatalf("put %d: the object does not hold its bytes", i)
				}
				in, err := c.Stat(ctx, name)
				if err != nil {
					t.Fatal(err)
				}
				alloc := fmt.Sprint(in.Region.BufferID, in.Region.AllocationID)
				if i == 0 {
					arena = alloc
				} else if alloc != arena {
					t.Fatalf("put %d: allocation %s, want the kept arena's %s", i, alloc, arena)
				}
				if err := c.Delete(ctx, name); err != nil {
					t.Fatal(err)
				}
			}
			if opens != 1 {
				t.Fatalf("4 puts through a kept arena cost %d driver opens, want 1", opens)
			}
		})
	}
}
