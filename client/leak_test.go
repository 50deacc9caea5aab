package client_test

import (
	"context"
	"os"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// openFDs counts this process's open file descriptors.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// arenaMappings counts this process's mappings of store arenas.
func arenaMappings(t *testing.T) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "memfd:cudaipc-arena-")
}

func TestCloseLeavesNothingBehind(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	fds, maps := openFDs(t), arenaMappings(t)

	c, err := client.Dial(context.Background(), d.socket)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	events, err := c.Subscribe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i, size := range []int64{100, 5000, 1 << 20, 3 << 20} {
		name := "leak" + string(rune('a'+i))
		put(t, c, name, size)
		l, err := c.Get(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		l.Release()
	}
	l, err := c.Get(ctx, "leaka")
	if err != nil {
		t.Fatal(err)
	}
	if arenaMappings(t) == maps {
		t.Fatal("no arena mapped while a lease is held")
	}
	cancel()
	testutil.Drain(t, events, testutil.Wait) // the subscription ends with its context
	c.Close()
	if arenaMappings(t) == maps {
		t.Fatal("Close unmapped memory a live lease still uses")
	}
	l.Release()
	if got := arenaMappings(t); got != maps {
		t.Errorf("%d arena mappings left after Close and Release", got-maps)
	}
	if got := openFDs(t); got != fds {
		t.Errorf("%d file descriptors left after Close", got-fds)
	}
}
