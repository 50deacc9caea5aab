package client_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"strconv"
	"testing"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/shm"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// fastRoles are the children of the lease fast path tests.
var fastRoles = map[string]func(ctx context.Context, c *client.Client, say func(string, ...any)) error{
	// Gets and releases NAME (HASH its content) in a loop until killed,
	// holding every third lease across the next cycle, so that a kill
	// finds slots held, idle and in between.
	"cycler": func(ctx context.Context, c *client.Client, say func(string, ...any)) error {
		name, want := os.Getenv("NAME"), os.Getenv("HASH")
		var held *client.Lease
		for i := 0; ; i++ {
			l, err := c.Get(ctx, name)
			if err != nil {
				return err
			}
			if hash(l.Bytes()) != want {
				return fmt.Errorf("cycle %d: wrong bytes", i)
			}
			if held != nil {
				if err := held.Release(); err != nil {
					return err
				}
				held = nil
			}
			if i%3 == 0 {
				held = l
			} else if err := l.Release(); err != nil {
				return err
			}
			if i == 100 {
				say("cycling")
			}
		}
	},
	// A hostile client: speaks the protocol itself, takes leases with
	// slots, writes random words over its whole lease table, then waits to
	// be killed.
	"scribbler": func(ctx context.Context, _ *client.Client, say func(string, ...any)) error {
		conn, err := protocol.Dial(ctx, os.Getenv("CUDAIPC_SOCKET"))
		if err != nil {
			return err
		}
		if _, err := protocol.ClientHello(ctx, conn, "scribbler"); err != nil {
			return err
		}
		call := func(id uint64, req *storev1.Request) (*storev1.Response, []*os.File, error) {
			req.Id = id
			if err := conn.Send(req); err != nil {
				return nil, nil, err
			}
			var resp storev1.Response
			files, err := conn.Recv(&resp)
			return &resp, files, err
		}
		resp, files, err := call(2, &storev1.Request{Body: &storev1.Request_LeaseTable{LeaseTable: &storev1.LeaseTableRequest{}}})
		if err != nil || len(files) != 1 {
			return fmt.Errorf("lease table: %v, %d files", err, len(files))
		}
		n := int(resp.GetLeaseTable().GetSlots())
		w, err := shm.Map(files[0], n)
		if err != nil {
			return err
		}
		for i := range 50 {
			resp, files, err := call(uint64(3+i), &storev1.Request{Body: &storev1.Request_Get{Get: &storev1.GetRequest{Name: os.Getenv("NAME")}}})
			if err != nil || resp.GetGet().GetLeaseSlot() == 0 {
				return fmt.Errorf("get: %v, %v", err, resp)
			}
			protocol.CloseFiles(files)
		}
		for i := range n {
			w.Store(i, mrand.Uint64())
		}
		say("scribbled")
		select {}
	},
}

// TestFastPathProcesses: 6 processes get and release one object through
// the lease fast path while they are killed (-9) and replaced, beside a
// hostile client that scribbles over its lease table. Afterwards no lease
// is left, the object's memory is reusable at once after its deletion, and
// the daemon still serves.
func TestFastPathProcesses(t *testing.T) {
	const big = 40 << 10
	d := startDaemon(t, socketPath(t), "CAPACITY=65536", "NOEVICT=1")
	c := dial(t, d.socket)
	ctx := context.Background()
	want := put(t, c, "obj", big)
	env := []string{"CUDAIPC_SOCKET=" + d.socket, "NAME=obj", "HASH=" + hash(want)}
	spawn(t, "scribbler", nil, env...).expect("scribbled")
	const workers = 6
	procs := make([]*proc, workers)
	for i := range procs {
		procs[i] = spawn(t, "cycler", nil, env...)
		procs[i].expect("cycling")
	}
	rounds := 20
	if testing.Short() {
		rounds = 5
	}
	for r := range rounds {
		i := r % workers
		procs[i].kill9()
		procs[i] = spawn(t, "cycler", nil, env...)
		procs[i].expect("cycling")
		// Meanwhile this process's own fast-path leases stay right.
		checkGet(t, c, "obj", want)
	}
	for _, p := range procs {
		p.kill9()
	}
	for _, p := range procs {
		if p.err != nil && !isKilled(p.err) {
			t.Fatalf("cycler failed: %v\n%s", p.err, p.stderr.String())
		}
	}
	// The scribbler still lives and holds its 50 leases, whatever its
	// table says.
	waitLeases(t, c, "obj", 50)
	if err := c.Delete(ctx, "obj"); err != nil {
		t.Fatal(err)
	}
	o, err := c.Create(ctx, "after", big, client.CreateOptions{})
	if !errors.Is(err, client.ErrStoreFull) {
		t.Fatalf("create while the scribbler holds the deleted object: %v, want ErrStoreFull", err)
	}
	_ = o
}

func isKilled(err error) bool { return err != nil && err.Error() == "signal: killed" }

// TestFastPathDeleteAndReplace: a lease released through the table is not
// taken back once the object was deleted or replaced under its name.
func TestFastPathDeleteAndReplace(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	reader, writer := dial(t, d.socket), dial(t, d.socket)
	ctx := context.Background()
	for i := range 200 {
		name := "r" + strconv.Itoa(i%3)
		want := put(t, writer, name, int64(1000+i))
		for range 3 { // the second and third take the idle lease back
			l, err := reader.Get(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(l.Bytes(), want) {
				t.Fatalf("round %d: %s: stale or wrong bytes", i, name)
			}
			if err := l.Release(); err != nil {
				t.Fatal(err)
			}
			if info, err := writer.Stat(ctx, name); err != nil || info.Leases != 0 {
				t.Fatalf("round %d: stat after a fast release: %+v, %v", i, info, err)
			}
		}
		if err := writer.Delete(ctx, name); err != nil {
			t.Fatal(err)
		}
		if _, err := reader.Get(ctx, name); !errors.Is(err, client.ErrNotFound) {
			t.Fatalf("round %d: a deleted object's idle lease was taken back", i)
		}
	}
}
