package client_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// The read role (reader.go) passes between calls, the background reader
// and calls whose context ends. These tests drive every hand-over on one
// connection against a real daemon.

// Events reach a subscriber whose client makes no call at all: the
// background reader reads them.
func TestEventsWhileIdle(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c := dial(t, d.socket)
	events, err := c.Subscribe(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	w := dial(t, d.socket)
	for i := range 3 {
		// Idle for longer than the background reader's delay, and not.
		time.Sleep(time.Duration(i) * time.Millisecond)
		name := fmt.Sprintf("idle-%d", i)
		put(t, w, name, 4096)
		testutil.WaitFor(t, events, testutil.Wait, func(ev client.Event) bool { return ev.Kind == client.EventSealed && ev.Name == name })
	}
}

// Many goroutines share one connection: lone calls, concurrent ones, gets
// that wait and give up (holding the read role or not), and a get that
// waits until another client seals. Every call gets its own reply, no
// lease is left behind, and the connection stays usable.
func TestReadRoleConcurrentCalls(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	ctx := context.Background()
	for _, opts := range []client.Options{{NoFastPath: true}, {}} {
		c, err := client.DialOptions(ctx, d.socket, opts)
		if err != nil {
			t.Fatal(err)
		}
		w := dial(t, d.socket)
		names := make([]string, 4)
		contents := make([][]byte, len(names))
		for i := range names {
			names[i] = fmt.Sprintf("rr-%v-%d", opts.NoFastPath, i)
			contents[i] = put(t, w, names[i], 1000+int64(i)*777)
		}
		later := fmt.Sprintf("rr-later-%v", opts.NoFastPath)
		waited := make(chan error, 1)
		go func() {
			l, err := c.GetWith(ctx, later, client.GetOptions{Wait: true}) // waits for the seal below
			if err == nil {
				if len(l.Bytes()) != 333 {
					err = fmt.Errorf("waiting get: %d bytes", len(l.Bytes()))
				}
				l.Release()
			}
			waited <- err
		}()
		var wg sync.WaitGroup
		errs := make(chan error, 64)
		for g := range 6 {
			wg.Go(func() {
				for i := range 150 {
					name := names[(g+i)%len(names)]
					if g == 5 {
						// Gives up on an object that never comes: at once,
						// or after a while as the reader.
						cctx, cancel := context.WithTimeout(ctx, time.Duration(i%3)*time.Millisecond)
						_, err := c.GetWith(cctx, "rr-never", client.GetOptions{Wait: true})
						cancel()
						if !errors.Is(err, client.ErrTimeout) {
							errs <- fmt.Errorf("get of a missing object: %v", err)
							return
						}
						continue
					}
					if g == 4 && i%2 == 0 {
						info, err := c.Stat(ctx, name)
						if err != nil || info.Size != int64(len(contents[(g+i)%len(names)])) {
							errs <- fmt.Errorf("stat %s: %+v, %v", name, info, err)
							return
						}
						continue
					}
					l, err := c.Get(ctx, name)
					if err != nil {
						errs <- err
						return
					}
					if !bytes.Equal(l.Bytes(), contents[(g+i)%len(names)]) {
						errs <- fmt.Errorf("get %s: wrong bytes", name)
					}
					if err := l.Release(); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		put(t, w, later, 333)
		if err := <-waited; err != nil {
			t.Errorf("waiting get: %v", err)
		}
		for _, n := range names {
			waitLeases(t, w, n, 0)
		}
		if _, err := c.Stat(ctx, names[0]); err != nil {
			t.Errorf("connection after the storm: %v", err)
		}
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	}
}
