package client_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// registerHostBytes registers size random bytes (seed) of a memfd under
// name through c, returning the bytes.
func registerHostBytes(t *testing.T, c *client.Client, name string, size int, seed uint64) []byte {
	t.Helper()
	fd, err := unix.MemfdCreate("regfast", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "regfast")
	defer f.Close()
	want := testutil.RandomBytes(seed, size)
	if _, err := f.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.RegisterHost(context.Background(), name, f, int64(size), client.RegisterOptions{}); err != nil {
		t.Fatal(err)
	}
	return want
}

// TestRegisteredLeaseFastPath: a lease of registered memory takes the lease
// fast path: released through the table it is taken back by the next get
// of the name it was got by (qualified or not)
// (the same lease, no round trip), and counted as released meanwhile. When
// the exporter's connection ends or it deletes the name, the daemon
// reclaims the idle lease and tells the reader (arenas_freed), which drops
// it: the next get fails, and a lease held across the end keeps its bytes
// until released.
func TestRegisteredLeaseFastPath(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	ctx := context.Background()
	reader := dial(t, d.socket)
	for _, end := range []string{"exporter closes", "exporter deletes", "exporter closes while held"} {
		t.Run(end, func(t *testing.T) {
			exporter, err := client.Dial(ctx, d.socket)
			if err != nil {
				t.Fatal(err)
			}
			defer exporter.Close()
			name := fmt.Sprintf("regfast/%d", len(end))
			want := registerHostBytes(t, exporter, name, 64<<10, uint64(len(end)))
			// Got by its qualified name too (a KV space's regions are): the
			// daemon's info names it without the reader's own uid.
			get := name
			if end != "exporter deletes" {
				get = fmt.Sprintf("%d:%s", os.Getuid(), name)
			}
			var first uint64
			for i := range 3 {
				l, err := reader.Get(ctx, get)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(l.Bytes(), want) {
					t.Fatalf("get %d: not the registered bytes", i)
				}
				if i == 0 {
					first = l.ID()
				} else if l.ID() != first {
					t.Errorf("get %d: lease %d, not the idle lease %d taken back", i, l.ID(), first)
				}
				if info, err := exporter.Stat(ctx, name); err != nil || info.Leases != 1 {
					t.Fatalf("get %d: stat while held: %+v, %v", i, info, err)
				}
				if err := l.Release(); err != nil {
					t.Fatal(err)
				}
				if info, err := exporter.Stat(ctx, name); err != nil || info.Leases != 0 {
					t.Fatalf("get %d: stat after a fast release: %+v, %v", i, info, err)
				}
			}
			if n := client.IdleLeases(reader); n != 1 {
				t.Fatalf("%d idle leases after the releases, want 1", n)
			}
			var held *client.Lease
			if end == "exporter closes while held" {
				if held, err = reader.Get(ctx, get); err != nil {
					t.Fatal(err)
				}
				if l2, err := reader.Get(ctx, get); err != nil {
					t.Fatal(err)
				} else if err := l2.Release(); err != nil {
					t.Fatal(err)
				}
			}
			switch end {
			case "exporter deletes":
				err = exporter.Delete(ctx, name)
			default:
				err = exporter.Close()
			}
			if err != nil {
				t.Fatal(err)
			}
			testutil.Eventually(t, testutil.Wait, func() error {
				if n := client.IdleLeases(reader); n != 0 {
					return fmt.Errorf("%d idle leases kept after the registration ended", n)
				}
				return nil
			})
			if held != nil {
				info, err := reader.Stat(ctx, name)
				if err != nil || !info.Orphaned || info.Leases != 1 {
					t.Fatalf("stat of an orphan with a lease held: %+v, %v", info, err)
				}
				if !bytes.Equal(held.Bytes(), want) {
					t.Fatal("a lease held across its exporter's end lost its bytes")
				}
				if err := held.Release(); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := reader.Get(ctx, get); !errors.Is(err, client.ErrNotFound) {
				t.Fatalf("get after the registration ended: %v, want ErrNotFound", err)
			}
			if _, err := reader.Stat(ctx, name); !errors.Is(err, client.ErrNotFound) {
				t.Fatalf("stat after the registration ended: %v, want ErrNotFound", err)
			}
		})
	}
}
