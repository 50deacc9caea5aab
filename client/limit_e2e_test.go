package client_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/client"
)

// A limit of the daemon reaches the client as ErrLimit that says which
// limit (Error.Limit) and what to do, in the daemon's words, for the
// connection limit as for a request's.
func TestLimitErrorsSayWhichLimit(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "store.sock")
	startDaemon(t, sock, "MAX_CONNS_PER_UID=2", "MAX_LEASES=1")
	ctx := context.Background()
	c := dial(t, sock)
	o, err := c.Create(ctx, "x", 100, client.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Seal(ctx); err != nil {
		t.Fatal(err)
	}
	l, err := c.Get(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	_, err = c.Get(ctx, "x")
	var ce *client.Error
	if !errors.As(err, &ce) || !errors.Is(err, client.ErrLimit) || ce.Limit != "LEASES_PER_CONNECTION" || !strings.Contains(ce.Message, "max-leases setting") {
		t.Fatalf("a second lease over --max-leases 1: %#v", err)
	}
	dial(t, sock) // the uid's second connection (startDaemon's probe closed, and Close waits for the daemon)
	_, err = client.Dial(ctx, sock)
	if !errors.As(err, &ce) || !errors.Is(err, client.ErrLimit) || ce.Limit != "CONNECTIONS_PER_UID" ||
		!strings.Contains(ce.Message, "max-conns-per-uid setting") || strings.Contains(err.Error(), "admitted") {
		t.Fatalf("a third connection over --max-conns-per-uid 2: %v", err)
	}
}

// A shared host object put by this client is immutable once sealed: the
// client unmaps its draft after the seal, and the daemon's next stat
// seals the memory against writes. A private one stays writable by its
// creator, and stat says so.
func TestSealedSharedObjectImmutable(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "store.sock")
	startDaemon(t, sock)
	ctx := context.Background()
	c := dial(t, sock)
	for _, shared := range []bool{true, false} {
		name := fmt.Sprintf("obj-%t", shared)
		o, err := c.Create(ctx, name, 4096, client.CreateOptions{Shared: shared})
		if err != nil {
			t.Fatal(err)
		}
		rand.Read(o.Bytes())
		if err := o.Seal(ctx); err != nil {
			t.Fatal(err)
		}
		in, err := c.Stat(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if in.CreatorCanWrite == shared {
			t.Errorf("shared %t: stat says the creator can write: %t", shared, in.CreatorCanWrite)
		}
	}
}
