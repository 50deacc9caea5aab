package client_test

import (
	"context"
	"errors"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// TestStoppedDaemon checks that no call hangs on a daemon that stopped
// answering (SIGSTOP): Dial, calls with and without a context deadline,
// Release and Close all return, with ErrTimeout where they failed.
func TestStoppedDaemon(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	ctx := context.Background()
	// Without the lease fast path, so that Release needs the daemon (with
	// it, a Release is a store to shared memory and needs nobody).
	opts := client.Options{DialTimeout: 200 * time.Millisecond, CallTimeout: 200 * time.Millisecond, NoFastPath: true}
	c, err := client.DialOptions(ctx, d.socket, opts)
	if err != nil {
		t.Fatal(err)
	}
	put(t, c, "x", 4096)
	l, err := c.Get(ctx, "x")
	if err != nil {
		t.Fatal(err)
	}
	pid := d.cmd.Process.Pid
	testutil.Stop(t, pid)

	isTimeout := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, client.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("%s against a stopped daemon: %v, want ErrTimeout and DeadlineExceeded", what, err)
		}
	}
	// Dial: the kernel accepts the connection, nobody answers the hello.
	_, err = client.DialOptions(ctx, d.socket, opts)
	isTimeout("Dial with DialTimeout", err)
	dctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	_, err = client.Dial(dctx, d.socket)
	cancel()
	isTimeout("Dial with a context deadline", err)

	_, err = c.Stat(ctx, "x") // no deadline: the call timeout applies
	isTimeout("Stat without a deadline", err)
	sctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	_, err = c.List(sctx)
	cancel()
	isTimeout("List with a deadline", err)
	gctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	_, err = c.Get(gctx, "x")
	cancel()
	isTimeout("Get with a deadline", err)
	_, err = c.Get(ctx, "x") // does not wait: the call timeout applies
	isTimeout("Get without a deadline", err)
	isTimeout("Release", l.Release())
	_, err = c.Create(ctx, "y", 10, client.CreateOptions{})
	isTimeout("Create", err)
	if err := c.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}

	// The daemon, woken, still serves, and has cleaned up after c.
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	other := dial(t, d.socket)
	waitLeases(t, other, "x", 0)
}
