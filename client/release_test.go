package client_test

import (
	"context"
	"crypto/rand"
	"testing"

	"github.com/cudaipc/cudaipc/client"
)

// TestReleaseSeenByOthers checks Release's guarantee from a second
// connection: once Release returns, another connection sees the lease
// gone, and the space of a deleted object it held is free for a Create.
// The daemon runs with eviction off in a store that holds one big object
// only, so a Create that came before the daemon freed the old one fails.
func TestReleaseSeenByOthers(t *testing.T) {
	const big = 40 << 10
	d := startDaemon(t, socketPath(t), "CAPACITY=65536", "NOEVICT=1")
	reader, other := dial(t, d.socket), dial(t, d.socket)
	ctx := context.Background()
	small := put(t, other, "small", 100)
	put(t, other, "big", big)
	n := 10000
	if testing.Short() {
		n = 1000
	}
	for i := range n {
		checkGet(t, reader, "small", small)
		info, err := other.Stat(ctx, "small")
		if err != nil {
			t.Fatal(err)
		}
		if info.Leases != 0 {
			t.Fatalf("cycle %d: another connection sees %d leases after Release returned", i, info.Leases)
		}
		if i%4 != 0 {
			continue
		}
		// The held space of a deleted object is free once Release returns.
		lb, err := reader.Get(ctx, "big")
		if err != nil {
			t.Fatal(err)
		}
		if err := other.Delete(ctx, "big"); err != nil {
			t.Fatal(err)
		}
		if err := lb.Release(); err != nil {
			t.Fatal(err)
		}
		o, err := other.Create(ctx, "big", big, client.CreateOptions{})
		if err != nil {
			t.Fatalf("cycle %d: create after the last lease of a deleted object was released: %v", i, err)
		}
		rand.Read(o.Bytes()[:64])
		if err := o.Seal(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestCloseSeenByOthers checks Close's guarantee: once Close returns,
// another connection sees the closed client's leases gone and its unsealed
// objects aborted.
func TestCloseSeenByOthers(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	other := dial(t, d.socket)
	ctx := context.Background()
	put(t, other, "held", 4096)
	n := 1000
	if testing.Short() {
		n = 100
	}
	for i := range n {
		c, err := client.Dial(ctx, d.socket)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Get(ctx, "held"); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Create(ctx, "draft", 4096, client.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		info, err := other.Stat(ctx, "held")
		if err != nil {
			t.Fatal(err)
		}
		if info.Leases != 0 {
			t.Fatalf("cycle %d: another connection sees %d leases after Close returned", i, info.Leases)
		}
		if _, err := other.Stat(ctx, "draft"); err == nil {
			t.Fatalf("cycle %d: the closed client's draft still exists", i)
		}
		// The name is free again at once.
		o, err := other.Create(ctx, "draft", 10, client.CreateOptions{})
		if err != nil {
			t.Fatalf("cycle %d: create of the closed client's draft name: %v", i, err)
		}
		if err := o.Abort(ctx); err != nil {
			t.Fatal(err)
		}
	}
}
